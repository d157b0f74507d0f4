// Experimental (bench/experimental/, not in the library): QSA sparse decode in one kernel: each
// row's exact top-k selection (qsa_topk.cuh, DESIGN.md section 4, steps 6-7) and the decode
// attention over the selected keys (paged_decode_attention.cuh) in the same thread-block cluster,
// so the selection never leaves shared memory and the step has no kernel boundary between them
// (sm_90+). Measured slower than the two kernels (bench/notes/qsa_sparse_decode.md), so nothing
// picks it. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/attention_params.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "backend/cuda/qsa_topk.cuh"
#include "core/status.h"
#include "kv/kv_cache_view.h"

namespace e4kv::cuda {

// One QSA decode launch. select: the rows' index scores (and optionally run maxima), ratio and
// budget as for qsa_top_k_select; its sel_tokens and sel_counts receive the selection (see
// qsa_sparse_decode). attention: the cache, block table, rows (rows.sel_* ignored), q, gate and
// out as for paged_decode_attention; its rows must be select.rows.
struct QsaSparseDecodeArgs {
  QsaTopKArgs select;
  PagedAttentionParams attention;
};

// Longest rows (in groups) the sparse decode kernel selects over: 32768 groups = 128K tokens at
// ratio 4.
inline constexpr int64_t kQsaSparseDecodeMaxGroups = 32768;

// The sparse decode kernel on `device` for this attention shape and config: how many clusters
// (each one row and KV head) run at once, and the splits of one. All 0 where it does not run:
// below sm_90 or without sm_90 code in this build, the registers load path, head_dim 64, or a GQA
// group above 8. Errors name a shape outside the decode kernel's limits.
Result<DecodeClusterMerge> qsa_sparse_decode_clusters(const KvCacheGeometry& geo, int64_t n_heads,
                                                      const DecodeAttentionConfig& config,
                                                      int device);

// The attention plan of a sparse decode launch (plan_decode_attention_cluster over the selection
// width budget + ratio - 1), or a plan with n_splits 0 where the kernel does not take the launch:
// no clusters (above), more rows x KV heads than one wave of clusters holds, max_groups above
// kQsaSparseDecodeMaxGroups, or a selection width above kDecodeClusterMaxKeys. Then run
// qsa_top_k_select and paged_decode_attention instead.
DecodeAttentionPlan plan_qsa_sparse_decode(int64_t n_rows, int64_t n_kv_heads, int64_t max_groups,
                                           int64_t budget, int64_t ratio,
                                           const DecodeClusterMerge& clusters);

// Selects each row's keys exactly as qsa_top_k_select does and writes args.attention.out as
// paged_decode_attention does over them, in one kernel. select.sel_counts receives the counts and
// select.sel_tokens the selected tokens with -1 padding; the tokens are the same set as
// qsa_top_k_select's, in increasing group order or, on the fast path (every candidate in shared
// memory), in an unspecified order. `plan` comes from plan_qsa_sparse_decode (n_splits > 0).
// Returns an error for bad arguments; launch failures are fatal.
Status qsa_sparse_decode(const QsaSparseDecodeArgs& args, const DecodeAttentionPlan& plan,
                         const DecodeAttentionConfig& config, cudaStream_t stream);

#ifdef E4KV_TIMELINE
// Attach the timeline buffer (timeline.cuh) to this kernel's probes.
void timeline_attach_sparse_decode(unsigned long long* buffer);
#endif

}  // namespace e4kv::cuda
