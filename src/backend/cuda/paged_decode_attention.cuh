// Paged attention for query rows against the main KV cache (FP16 or E4M3), dense or over a QSA
// selection: one warp per (row, KV head, split), tensor cores for Q.K and P.V, split-K partials
// merged by log-sum-exp. Host-only header (no CUDA include beyond the stream type). The plans
// (split counts, the cluster merge, workspace sizes) are in backend/attention_plan.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "backend/attention_params.h"
#include "backend/attention_plan.h"
#include "core/status.h"
#include "kv/kv_cache_view.h"

namespace e4kv::cuda {

// How the decode kernel moves K/V bytes from global memory.
enum class DecodeLoadPath {
  kRegisters,  // straight into registers, one iteration at a time (sm_75+)
  kAsyncCopy,  // cp.async into a per-warp shared-memory ring, iterations ahead (sm_80+ only)
};

struct DecodeAttentionConfig {
  bool native_e4m3 = false;  // cvt.e4m3x2 (decode_attention_native_e4m3_usable), else software
  DecodeLoadPath load = DecodeLoadPath::kRegisters;
};

// The fastest configuration `device` runs: native E4M3 where usable and not forced to software,
// the async-copy path on sm_80+.
DecodeAttentionConfig decode_attention_config(int device, bool force_software_e4m3);

// How many CTAs of the kernel instance for this shape and config fit on `device` at once (SMs x
// CTAs per SM at its registers and shared memory): the planner's wave size. Errors name a shape
// outside the kernel's limits.
Result<int64_t> decode_attention_resident_ctas(const KvCacheGeometry& geo, int64_t n_heads,
                                               const DecodeAttentionConfig& config, int device);

// The cluster merge for this shape and config on `device`; all 0 where it does not run: below
// sm_90, the registers load path, head_dim 64, a GQA group above 8, or cluster_merge_enabled()
// false. Errors name a shape outside the kernel's limits.
Result<DecodeClusterMerge> decode_attention_cluster_merge(const KvCacheGeometry& geo,
                                                          int64_t n_heads,
                                                          const DecodeAttentionConfig& config,
                                                          int device);

// Partial results between the two kernels (device memory, fp32):
//   m, l: [n_rows, n_splits, n_heads]; acc: [n_rows, n_splits, n_heads, head_dim]
struct DecodeAttentionWorkspace {
  float* m = nullptr;
  float* l = nullptr;
  float* acc = nullptr;
  int64_t max_rows = 0;
  int64_t max_splits = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;
};

// OK when the decode kernels take this cache geometry and head count: head_dim 64/128/256, a whole
// GQA group of at most 16, block_size a multiple of 8; else an error naming what is not.
Status check_decode_attention_shape(const KvCacheGeometry& geo, int64_t n_heads);

// True when `device` can run the native-E4M3 instance: sm_89+, not forced to software
// (e4m3_native_available), and this binary holds sm_89+ code for it (not only older PTX).
bool decode_attention_native_e4m3_usable(int device);

// out = attention of every row of params.rows (device pointers throughout; params.out fp32).
// A plan with merge_in_cluster needs no workspace (it may be empty) and the cluster-merge kernel
// for this shape (decode_attention_cluster_merge, whose splits it must have).
// Limits: head_dim 64, 128 or 256; GQA group (n_heads / n_kv_heads) <= 16; block_size a multiple
// of 8; params.q 16-byte aligned. E4M3 caches use the native conversion when config.native_e4m3 and
// the software decoder otherwise; config.load kAsyncCopy needs sm_80+ (decode_attention_config
// picks it only there). Returns an error for shapes outside the limits; launch failures are fatal.
Status paged_decode_attention(const PagedAttentionParams& params, const DecodeAttentionPlan& plan,
                              const DecodeAttentionWorkspace& workspace,
                              const DecodeAttentionConfig& config, cudaStream_t stream);

}  // namespace e4kv::cuda
