// Paged attention for query rows against the main KV cache (FP16 or E4M3), dense or over a QSA
// selection: one warp per (row, KV head, split), tensor cores for Q.K and P.V, split-K partials
// merged by log-sum-exp. Host-only header (no CUDA include beyond the stream type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "backend/attention_params.h"
#include "core/status.h"
#include "kv/kv_cache_view.h"

namespace e4kv::cuda {

// How the keys of each row are cut: split s covers key-list entries
// [s * keys_per_split, (s + 1) * keys_per_split); one warp computes one split.
struct DecodeAttentionPlan {
  int64_t keys_per_split = 0;  // a multiple of 8
  int64_t n_splits = 0;        // per row
  // The splits merged inside the decode kernel: per row and KV head a thread-block cluster of CTAs
  // of kDecodeClusterWarps warps (n_splits = CTAs x warps, DecodeClusterMerge::splits) exchanges
  // its partial results through distributed shared memory and writes the output, so there is no
  // merge kernel and no workspace (sm_90+, plan_decode_attention_cluster). The row's last split
  // also takes every key past the others.
  bool merge_in_cluster = false;
};

inline constexpr int64_t kDecodeClusterWarps = 8;
// Longest key lists the planner gives the cluster merge.
inline constexpr int64_t kDecodeClusterMaxKeys = 4096;

// The cluster merge on a device for a shape and config: how many clusters (each one row and KV
// head) run at once, and the splits of one (its CTAs x kDecodeClusterWarps). All 0 where it does
// not run.
struct DecodeClusterMerge {
  int64_t clusters = 0;
  int64_t splits = 0;
};

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

// Picks the split count (a multiple of 4, at least 16 keys per split) that finishes soonest when
// `resident_ctas` CTAs run at once: ceil(CTAs / resident) waves x (keys per split + a fixed cost
// of 64 keys per split) + 1.25 keys per CTA of a row and KV head (its partial result, merged one
// after another), the fewest splits within 2% of the best. max_keys: the most keys any row
// attends (row_pos + 1, or the QSA selection count).
DecodeAttentionPlan plan_decode_attention(int64_t n_rows, int64_t n_kv_heads, int64_t max_keys,
                                          int64_t resident_ctas);

// The cluster merge for this shape and config on `device`; all 0 where it does not run: below
// sm_90, the registers load path, head_dim 64, a GQA group above 8, or cluster_merge_enabled()
// false. Errors name a shape outside the kernel's limits.
Result<DecodeClusterMerge> decode_attention_cluster_merge(const KvCacheGeometry& geo,
                                                          int64_t n_heads,
                                                          const DecodeAttentionConfig& config,
                                                          int device);

// The cluster-merge split of key lists of at most max_keys keys (>= 1) into n_splits splits
// (DecodeClusterMerge::splits) of keys_per_split keys (a multiple of 8), the last also taking the
// rest. When the floor leaves the last split at most a tile of 8 keys more than the others (a QSA
// selection: budget + a causal tail of up to ratio - 1 keys), keys_per_split is that floor;
// otherwise the ceiling.
DecodeAttentionPlan plan_decode_attention_cluster(int64_t max_keys, int64_t n_splits);

// The plan for a launch: the cluster merge when one wave of its clusters holds n_rows *
// n_kv_heads and max_keys <= kDecodeClusterMaxKeys, else plan_decode_attention.
DecodeAttentionPlan choose_decode_attention_plan(int64_t n_rows, int64_t n_kv_heads,
                                                 int64_t max_keys, int64_t resident_ctas,
                                                 const DecodeClusterMerge& cluster);

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

size_t decode_attention_workspace_floats(int64_t max_rows, int64_t max_splits, int64_t n_heads,
                                         int64_t head_dim);

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
