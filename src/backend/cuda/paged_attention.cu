// The CUDA attention op: route planning on the host once per step (plan_attention_step for every
// reserved shape), then per layer one prefill launch for every tile of the prefill route and one
// decode launch per run of consecutive decode rows (the decode kernel takes a contiguous row range,
// so a run is addressed by offsetting the row arrays).
#include "backend/cuda/paged_attention.cuh"

#include <algorithm>

#include "backend/cuda/cuda_check.h"

namespace e4kv::cuda {
namespace {

AttentionLayerShape shape_of(const PagedAttentionParams& params) {
  const KvCacheGeometry& geo = params.cache.geometry;
  AttentionLayerShape shape;
  shape.head_dim = geo.head_dim;
  shape.block_size = geo.block_size;
  shape.dtype = geo.dtype;
  shape.n_heads = params.n_heads;
  shape.n_kv_heads = geo.n_kv_heads;
  shape.sel_width = params.rows.qsa() ? params.rows.sel_width : 0;
  return shape;
}

KvCacheGeometry geometry_of(const AttentionLayerShape& shape) {
  KvCacheGeometry geo;
  geo.head_dim = shape.head_dim;
  geo.block_size = shape.block_size;
  geo.dtype = shape.dtype;
  geo.n_kv_heads = shape.n_kv_heads;
  geo.n_blocks = 1;
  return geo;
}

}  // namespace

PagedAttentionRunner::PagedAttentionRunner(int device, bool force_software_e4m3)
    : device_(device),
      decode_config_(decode_attention_config(device, force_software_e4m3)),
      routes_(cuda_attention_routes()) {}

PagedAttentionRunner::~PagedAttentionRunner() {
  cudaFreeHost(h_items_);
  cudaFree(d_items_);
  cudaFree(d_workspace_);
}

Status PagedAttentionRunner::reserve(std::span<const AttentionLayerShape> shapes, int64_t max_rows,
                                     int64_t max_seq_tokens, cudaStream_t stream) {
  // Shapes join those reserved before (several models may share the backend); the limits only
  // grow.
  max_rows = std::max(max_rows, max_rows_);
  max_seq_tokens = std::max(max_seq_tokens, max_seq_tokens_);
  std::vector<AttentionLayerShape> all;
  for (const ShapePlan& plan : shapes_) all.push_back(plan.shape);
  all.insert(all.end(), shapes.begin(), shapes.end());
  std::vector<ShapePlan> plans;
  size_t workspace_floats = 0;
  for (const AttentionLayerShape& shape : all) {
    if (std::any_of(plans.begin(), plans.end(),
                    [&](const ShapePlan& p) { return p.shape == shape; })) {
      continue;
    }
    if (shape.n_kv_heads <= 0 || shape.n_heads % shape.n_kv_heads != 0) {
      return Status::error(cat("attention: ", shape.n_heads, " query heads are not a multiple of ",
                               shape.n_kv_heads, " KV heads"));
    }
    const KvCacheGeometry geo = geometry_of(shape);
    ShapePlan plan;
    plan.shape = shape;
    E4KV_ASSIGN_OR_RETURN(
        plan.device.resident_ctas,
        decode_attention_resident_ctas(geo, shape.n_heads, decode_config_, device_));
    E4KV_ASSIGN_OR_RETURN(plan.device.cluster, decode_attention_cluster_merge(
                                                   geo, shape.n_heads, decode_config_, device_));
    const int64_t max_keys = shape.qsa() ? shape.sel_width : max_seq_tokens;
    workspace_floats = std::max(workspace_floats, decode_workspace_floats_for_limits(
                                                      shape, max_rows, max_keys, plan.device));
    plans.push_back(std::move(plan));
  }
  const size_t items = std::max<size_t>(1, plans.size() * size_t(std::max<int64_t>(1, max_rows)));
  // The buffers of an earlier reserve may still be read by queued launches.
  E4KV_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaFreeHost(h_items_);
  cudaFree(d_items_);
  cudaFree(d_workspace_);
  h_items_ = nullptr;
  d_items_ = nullptr;
  d_workspace_ = nullptr;
  d_workspace_floats_ = 0;
  shapes_.clear();
  const size_t item_bytes = items * sizeof(PrefillAttentionItem);
  if (cudaMallocHost(&h_items_, item_bytes) != cudaSuccess ||
      cudaMalloc(&d_items_, item_bytes) != cudaSuccess ||
      cudaMalloc(&d_workspace_, std::max<size_t>(1, workspace_floats) * sizeof(float)) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return Status::error(cat("cuda:", device_, ": cannot allocate the attention workspace (",
                             workspace_floats * sizeof(float) + item_bytes,
                             " bytes); lower --max-batch-tokens or --max-model-len"));
  }
  d_workspace_floats_ = workspace_floats;
  for (ShapePlan& plan : plans) plan.device.workspace_floats = workspace_floats;
  shapes_ = std::move(plans);
  max_rows_ = max_rows;
  max_seq_tokens_ = max_seq_tokens;
  planned_rows_ = -1;
  return ok_status();
}

Status PagedAttentionRunner::plan(const QueryBatchView& host_rows, cudaStream_t stream) {
  planned_rows_ = -1;
  if (shapes_.empty()) return ok_status();  // a model without attention layers
  if (host_rows.n_rows > max_rows_) {
    return Status::error(
        cat("attention: ", host_rows.n_rows, " rows; the plan buffers were sized for ", max_rows_));
  }
  int64_t n_items = 0;
  for (ShapePlan& plan : shapes_) {
    E4KV_ASSIGN_OR_RETURN(plan.step,
                          plan_attention_step(routes_, plan.shape, host_rows, plan.device));
    plan.first_item = n_items;
    std::copy(plan.step.prefill_items.begin(), plan.step.prefill_items.end(), h_items_ + n_items);
    n_items += int64_t(plan.step.prefill_items.size());
  }
  if (n_items > 0) {
    E4KV_CUDA_CHECK(cudaMemcpyAsync(d_items_, h_items_,
                                    size_t(n_items) * sizeof(PrefillAttentionItem),
                                    cudaMemcpyHostToDevice, stream));
  }
  planned_rows_ = host_rows.n_rows;
  return ok_status();
}

uint64_t PagedAttentionRunner::plan_signature() const {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the values, one at a time
  auto mix = [&](int64_t value) { hash = (hash ^ uint64_t(value)) * 1099511628211ull; };
  mix(planned_rows_);
  // A reserve() moves the buffers a graph's launches point into.
  mix(int64_t(reinterpret_cast<intptr_t>(d_items_)));
  mix(int64_t(reinterpret_cast<intptr_t>(d_workspace_)));
  for (const ShapePlan& plan : shapes_) {
    mix(int64_t(plan.step.prefill_items.size()));
    mix(plan.first_item);
    for (const DecodeRowRun& run : plan.step.decode_runs) {
      mix(run.first_row);
      mix(run.n_rows);
      mix(run.plan.keys_per_split);
      mix(run.plan.n_splits);
      mix(run.plan.merge_in_cluster ? 1 : 0);
    }
  }
  return hash;
}

Status PagedAttentionRunner::run(const PagedAttentionParams& params, cudaStream_t stream) {
  const AttentionLayerShape shape = shape_of(params);
  auto it = std::find_if(shapes_.begin(), shapes_.end(),
                         [&](const ShapePlan& p) { return p.shape == shape; });
  if (it == shapes_.end()) {
    return Status::error(cat("attention: no plan for head_dim ", shape.head_dim, ", ",
                             shape.n_heads, " heads over ", shape.n_kv_heads,
                             " KV heads; reserve the model's attention shapes at load"));
  }
  if (params.rows.n_rows != planned_rows_) {
    return Status::error(cat("attention: ", params.rows.n_rows,
                             " rows but the step was planned for ", planned_rows_));
  }
  const ShapePlan& plan = *it;
  last_plan_ = plan.step.routes;
  if (params.rows.n_rows == 0) return Status();
  const KvCacheGeometry& geo = params.cache.geometry;

  if (!plan.step.prefill_items.empty()) {
    E4KV_RETURN_IF_ERROR(paged_prefill_attention(params, d_items_ + plan.first_item,
                                                 int64_t(plan.step.prefill_items.size()),
                                                 decode_config_.native_e4m3, stream));
  }
  const int64_t row_q = params.n_heads * geo.head_dim;
  for (const DecodeRowRun& run : plan.step.decode_runs) {
    const int64_t first = run.first_row;
    const int64_t n = run.n_rows;
    DecodeAttentionWorkspace ws;
    ws.m = d_workspace_;
    ws.l = ws.m + n * run.plan.n_splits * params.n_heads;
    ws.acc = ws.l + n * run.plan.n_splits * params.n_heads;
    ws.max_rows = n;
    ws.max_splits = run.plan.n_splits;
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
    E4KV_RETURN_IF_ERROR(paged_decode_attention(sub, run.plan, ws, decode_config_, stream));
  }
  return Status();
}

Status PagedAttentionRunner::run(const PagedAttentionParams& params,
                                 const QueryBatchView& host_rows, cudaStream_t stream) {
  if (host_rows.n_rows != params.rows.n_rows) {
    return Status::error("attention: host and device row counts differ");
  }
  const AttentionLayerShape shape = shape_of(params);
  int64_t max_keys = 1;
  for (int64_t r = 0; r < host_rows.n_rows; ++r) {
    max_keys = std::max<int64_t>(max_keys, int64_t(host_rows.row_pos[r]) + 1);
  }
  const bool reserved = std::any_of(shapes_.begin(), shapes_.end(),
                                    [&](const ShapePlan& p) { return p.shape == shape; }) &&
                        host_rows.n_rows <= max_rows_ && max_keys <= max_seq_tokens_;
  if (!reserved) {
    const AttentionLayerShape one[] = {shape};
    E4KV_RETURN_IF_ERROR(reserve(one, host_rows.n_rows, max_keys, stream));
  }
  // The staging may still feed the previous call's copy: calls on their own do not promise the
  // step's synchronisation between plans.
  E4KV_CUDA_CHECK(cudaStreamSynchronize(stream));
  E4KV_RETURN_IF_ERROR(plan(host_rows, stream));
  return run(params, stream);
}

}  // namespace e4kv::cuda
