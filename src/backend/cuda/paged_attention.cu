// The CUDA attention op: route planning on the host, then one prefill launch for every tile of the
// prefill route and one decode launch per run of consecutive decode rows (the decode kernel takes a
// contiguous row range, so a run is addressed by offsetting the row arrays).
#include "backend/cuda/paged_attention.cuh"

#include <algorithm>

#include "backend/cuda/cuda_check.h"

namespace e4kv::cuda {

PagedAttentionRunner::PagedAttentionRunner(int device, bool force_software_e4m3)
    : device_(device),
      decode_config_(decode_attention_config(device, force_software_e4m3)),
      routes_(cuda_attention_routes()) {}

PagedAttentionRunner::~PagedAttentionRunner() {
  cudaFree(d_items_);
  cudaFree(d_workspace_);
}

Result<PagedAttentionRunner::ResidentCtas> PagedAttentionRunner::resident_ctas(
    const KvCacheGeometry& geo, int64_t n_heads) {
  const int64_t group = n_heads / std::max<int64_t>(geo.n_kv_heads, 1);
  for (const ResidentCtas& r : resident_) {
    if (r.head_dim == geo.head_dim && r.group == group && r.dtype == geo.dtype) return r;
  }
  E4KV_ASSIGN_OR_RETURN(const int64_t ctas,
                        decode_attention_resident_ctas(geo, n_heads, decode_config_, device_));
  E4KV_ASSIGN_OR_RETURN(const DecodeClusterMerge cluster,
                        decode_attention_cluster_merge(geo, n_heads, decode_config_, device_));
  resident_.push_back(ResidentCtas{geo.head_dim, group, geo.dtype, ctas, cluster});
  return resident_.back();
}

Status PagedAttentionRunner::run(const PagedAttentionParams& params,
                                 const QueryBatchView& host_rows, cudaStream_t stream) {
  const KvCacheGeometry& geo = params.cache.geometry;
  if (host_rows.n_rows != params.rows.n_rows) {
    return Status::error("attention: host and device row counts differ");
  }
  if (geo.n_kv_heads <= 0 || params.n_heads % geo.n_kv_heads != 0) {
    return Status::error(cat("attention: ", params.n_heads, " query heads are not a multiple of ",
                             geo.n_kv_heads, " KV heads"));
  }
  const int64_t group = params.n_heads / geo.n_kv_heads;
  const AttentionRouteShape shape{geo.head_dim, geo.block_size, geo.dtype, params.rows.qsa(),
                                  group};
  E4KV_ASSIGN_OR_RETURN(plan_, plan_attention_routes(routes_, shape, host_rows));
  if (params.rows.n_rows == 0) return Status();

  // Prefill: every tile of the prefill route, cut into CTA items, in one launch.
  std::vector<RouteTile> prefill_tiles;
  std::vector<RouteTile> decode_tiles;
  for (const RouteLaunch& launch : plan_.launches) {
    auto first = plan_.tiles.begin() + launch.first_tile;
    auto& dst = routes_[launch.route].kernel == AttentionKernel::kPrefillTiles ? prefill_tiles
                                                                               : decode_tiles;
    dst.insert(dst.end(), first, first + launch.n_tiles);
  }
  if (!prefill_tiles.empty()) {
    items_ = plan_prefill_items(prefill_tiles, group);
    if (items_.size() > d_items_capacity_) {
      cudaFree(d_items_);
      d_items_ = nullptr;
      d_items_capacity_ = std::max<size_t>(items_.size(), 2 * d_items_capacity_);
      E4KV_CUDA_CHECK(cudaMalloc(&d_items_, d_items_capacity_ * sizeof(PrefillAttentionItem)));
    }
    E4KV_CUDA_CHECK(cudaMemcpyAsync(d_items_, items_.data(),
                                    items_.size() * sizeof(PrefillAttentionItem),
                                    cudaMemcpyHostToDevice, stream));
    E4KV_RETURN_IF_ERROR(paged_prefill_attention(params, d_items_, int64_t(items_.size()),
                                                 decode_config_.native_e4m3, stream));
  }

  // Decode: runs of consecutive rows (tiles are single rows in row order within the route).
  std::sort(decode_tiles.begin(), decode_tiles.end(),
            [](const RouteTile& a, const RouteTile& b) { return a.first_row < b.first_row; });
  const int64_t row_q = params.n_heads * geo.head_dim;
  for (size_t i = 0; i < decode_tiles.size();) {
    size_t j = i + 1;
    while (j < decode_tiles.size() &&
           decode_tiles[j].first_row == decode_tiles[j - 1].first_row + 1)
      ++j;
    const int64_t first = decode_tiles[i].first_row;
    const int64_t n = int64_t(j - i);
    int64_t max_keys = 1;
    for (int64_t r = first; r < first + n; ++r) {
      const int64_t keys = !params.rows.qsa()                ? int64_t(host_rows.row_pos[r]) + 1
                           : host_rows.sel_counts != nullptr ? int64_t(host_rows.sel_counts[r])
                                                             : params.rows.sel_width;
      max_keys = std::max(max_keys, keys);
    }
    E4KV_ASSIGN_OR_RETURN(const ResidentCtas resident, resident_ctas(geo, params.n_heads));
    const DecodeAttentionPlan plan =
        choose_decode_attention_plan(n, geo.n_kv_heads, max_keys, resident.ctas, resident.cluster);
    const size_t need = plan.merge_in_cluster ? 0
                                              : decode_attention_workspace_floats(
                                                    n, plan.n_splits, params.n_heads, geo.head_dim);
    if (need > d_workspace_floats_) {
      // note: cudaFree waits for the device, so growing the workspace never frees memory a
      // queued launch still uses.
      cudaFree(d_workspace_);
      d_workspace_ = nullptr;
      d_workspace_floats_ = std::max(need, 2 * d_workspace_floats_);
      E4KV_CUDA_CHECK(cudaMalloc(&d_workspace_, d_workspace_floats_ * sizeof(float)));
    }
    DecodeAttentionWorkspace ws;
    ws.m = d_workspace_;
    ws.l = ws.m + n * plan.n_splits * params.n_heads;
    ws.acc = ws.l + n * plan.n_splits * params.n_heads;
    ws.max_rows = n;
    ws.max_splits = plan.n_splits;
    ws.n_heads = params.n_heads;
    ws.head_dim = geo.head_dim;

    PagedAttentionParams sub = params;
    sub.rows.n_rows = n;
    sub.rows.row_seq += first;
    sub.rows.row_pos += first;
    if (params.rows.qsa()) {
      sub.rows.sel_tokens += first * params.rows.sel_width;
      sub.rows.sel_counts += first;
    }
    sub.q += first * row_q;
    if (sub.gate != nullptr) sub.gate += first * row_q;
    sub.out += first * row_q;
    E4KV_RETURN_IF_ERROR(paged_decode_attention(sub, plan, ws, decode_config_, stream));
    i = j;
  }
  return Status();
}

}  // namespace e4kv::cuda
