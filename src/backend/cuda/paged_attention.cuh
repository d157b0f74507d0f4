// The CUDA attention op: plans one batch's query rows over the CUDA routes (qsa/route_planner.h:
// tensor-core prefill tiles for runs of rows of one sequence, the split-K decode kernel for single
// rows) and launches each route. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "backend/attention_params.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "backend/cuda/paged_prefill_attention.cuh"
#include "core/status.h"
#include "qsa/route_planner.h"

namespace e4kv::cuda {

// Owns the decode workspace and the prefill item list, grown on demand. Not copyable; one per
// stream (launches reuse the buffers).
class PagedAttentionRunner {
 public:
  // device: the CUDA device the launches run on. E4M3 caches use the native conversion where
  // decode_attention_native_e4m3_usable(device), unless force_software_e4m3.
  explicit PagedAttentionRunner(int device, bool force_software_e4m3 = false);
  ~PagedAttentionRunner();
  PagedAttentionRunner(const PagedAttentionRunner&) = delete;
  PagedAttentionRunner& operator=(const PagedAttentionRunner&) = delete;

  bool native_e4m3() const { return decode_config_.native_e4m3; }

  // out = attention of every row, as paged_attention (CPU) computes it. params: device pointers.
  // host_rows: the same rows on the host: n_rows, row_seq and row_pos are read; sel_counts when
  // given (QSA), else sel_width bounds each row's keys. Errors: shapes outside the routes' limits.
  Status run(const PagedAttentionParams& params, const QueryBatchView& host_rows,
             cudaStream_t stream);

  // The plan of the last run(), for tests and logs.
  const RoutePlan& last_plan() const { return plan_; }

 private:
  // The decode kernel's resident CTAs (the planner's wave size) and the cluster merge's resident
  // clusters (decode_attention_cluster_merge) for a cache geometry and group.
  struct ResidentCtas {
    int64_t head_dim, group;
    KvCacheDtype dtype;
    int64_t ctas;
    DecodeClusterMerge cluster;
  };
  Result<ResidentCtas> resident_ctas(const KvCacheGeometry& geo, int64_t n_heads);

  int device_ = 0;
  DecodeAttentionConfig decode_config_;
  std::vector<ResidentCtas> resident_;  // memo of resident_ctas()
  std::vector<AttentionRouteLimits> routes_;
  RoutePlan plan_;
  std::vector<PrefillAttentionItem> items_;
  PrefillAttentionItem* d_items_ = nullptr;
  size_t d_items_capacity_ = 0;
  float* d_workspace_ = nullptr;
  size_t d_workspace_floats_ = 0;
};

}  // namespace e4kv::cuda
