// Launch plans of the CUDA attention and top-k kernels: how decode rows are split over warps, how
// prefill tiles are cut into CTA items, how much workspace the top-k needs and which top-k method
// runs. Plain C++ with no CUDA header, so the CPU suite tests every planner without a toolkit; the
// kernels (backend/cuda/) take these plans and check them again at launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "qsa/route_planner.h"

namespace e4kv {

// ---- decode attention (backend/cuda/paged_decode_attention.cuh) --------------------------------

// The decode kernel's shape: warps per CTA and keys per tile (one mma step). The kernel
// static_asserts the same values.
inline constexpr int64_t kDecodeWarpsPerCta = 4;
inline constexpr int64_t kDecodeTileTokens = 8;

// How the keys of each row are cut: split s covers key-list entries
// [s * keys_per_split, (s + 1) * keys_per_split); one warp computes one split.
struct DecodeAttentionPlan {
  int64_t keys_per_split = 0;  // a multiple of kDecodeTileTokens
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

// Picks the split count (a multiple of 4, at least 16 keys per split) that finishes soonest when
// `resident_ctas` CTAs run at once: ceil(CTAs / resident) waves x (keys per split + a fixed cost
// of 64 keys per split) + 1.25 keys per CTA of a row and KV head (its partial result, merged one
// after another), the fewest splits within 2% of the best. max_keys: the most keys any row
// attends (row_pos + 1, or the QSA selection count). The costs were fitted on the H200
// (bench/notes/paged_decode_attention.md).
DecodeAttentionPlan plan_decode_attention(int64_t n_rows, int64_t n_kv_heads, int64_t max_keys,
                                          int64_t resident_ctas);

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

// Floats of the split-K partials (m, l: [rows, splits, heads]; acc: [rows, splits, heads,
// head_dim]).
size_t decode_attention_workspace_floats(int64_t max_rows, int64_t max_splits, int64_t n_heads,
                                         int64_t head_dim);

// ---- prefill attention (backend/cuda/paged_prefill_attention.cuh) ------------------------------

// Query-head slots of one prefill CTA (16 per warp, 4 warps).
inline constexpr int64_t kPrefillQuerySlots = 64;

// One CTA's rows: rows [first_row, first_row + n_rows) of the batch, all of one sequence (the same
// row_seq), n_rows <= prefill_rows_per_item(gqa_group). Positions need not be consecutive.
struct PrefillAttentionItem {
  int32_t first_row = 0;
  int32_t n_rows = 0;
};

// Query rows one CTA takes: 64 query-head slots / the GQA group (64 rows for MHA, 8 for group 8);
// 0 for a group outside 1..64.
int64_t prefill_rows_per_item(int64_t gqa_group);

// Cuts route tiles (rows of one sequence) into CTA items of at most prefill_rows_per_item rows, in
// row order; empty when the group is outside 1..64.
std::vector<PrefillAttentionItem> plan_prefill_items(std::span<const RouteTile> tiles,
                                                     int64_t gqa_group);

// ---- one step's attention launches (planned once per step, run by every layer of a shape) -----

// An attention layer's shape, as far as its launches go. Layers of one shape share one plan.
struct AttentionLayerShape {
  int64_t head_dim = 0;
  int64_t block_size = 0;
  KvCacheDtype dtype = KvCacheDtype::kF16;
  int64_t n_heads = 0;     // query heads
  int64_t n_kv_heads = 0;  // a divisor of n_heads
  // QSA selection rows (sel_width > 0: budget + ratio - 1 keys at most per row) or dense causal
  // attention (0).
  int64_t sel_width = 0;

  bool qsa() const { return sel_width > 0; }
  int64_t gqa_group() const { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }
  AttentionRouteShape route_shape() const {
    return AttentionRouteShape{head_dim, block_size, dtype, qsa(), gqa_group()};
  }
  bool operator==(const AttentionLayerShape&) const = default;
};

// What the decode planner needs to know of the device: the decode kernel's resident CTAs (its wave
// size), the cluster merge there, and the split-K workspace reserved at load (floats).
struct DecodeDeviceLimits {
  int64_t resident_ctas = 0;
  DecodeClusterMerge cluster;
  size_t workspace_floats = 0;
};

// A run of consecutive decode rows [first_row, first_row + n_rows) in one decode launch.
struct DecodeRowRun {
  int64_t first_row = 0;
  int64_t n_rows = 0;
  int64_t max_keys = 0;  // the most keys a row of the run attends
  DecodeAttentionPlan plan;
};

// Every launch of one shape in one step: the prefill items (one launch, items in row order) and
// the decode runs (one launch each).
struct AttentionStepPlan {
  RoutePlan routes;
  std::vector<PrefillAttentionItem> prefill_items;
  std::vector<DecodeRowRun> decode_runs;
};

// Plans one step's rows for one shape: the routes (plan_attention_routes), the prefill route's
// tiles cut into CTA items, and the decode route's rows cut into runs of consecutive rows, each
// with choose_decode_attention_plan over its longest key list (row_pos + 1, or sel_width for QSA).
// A run whose split-K partials would not fit device.workspace_floats is cut into shorter runs that
// do (never when the workspace was sized by decode_workspace_floats_for_limits). rows: host arrays
// (row_seq, row_pos). Errors: no route for the shape, bad rows, a single row that does not fit
// the workspace.
Result<AttentionStepPlan> plan_attention_step(std::span<const AttentionRouteLimits> routes,
                                              const AttentionLayerShape& shape,
                                              const QueryBatchView& rows,
                                              const DecodeDeviceLimits& device);

// The split-K workspace (floats) that every decode run of at most max_rows rows with key lists of
// at most max_keys keys fits: the largest plan choose_decode_attention_plan makes for 1..max_rows
// rows at max_keys keys.
size_t decode_workspace_floats_for_limits(const AttentionLayerShape& shape, int64_t max_rows,
                                          int64_t max_keys, const DecodeDeviceLimits& device);

// ---- QSA top-k (backend/cuda/qsa_topk.cuh) ------------------------------------------------------

// How qsa_top_k_select finds each row's top-k; every method gives identical results.
enum class QsaTopKMethod {
  kAuto,      // choose_qsa_top_k_method
  kFiltered,  // one CTA per row: a lower bound from the run maxima (per warp, then the block
              // minimum), a select among the keys above it in shared memory, ordered emission from
              // bitmaps (max_groups <= kQsaTopKFilteredMaxGroups)
  kCluster,   // the filtered steps spread over a cluster of 8 CTAs per row that share candidates
              // through distributed shared memory (sm_90+; max_groups <= the filtered limit)
  kTwoPhase,  // chunk candidates with many CTAs per row, then one CTA per row (needs workspace)
  kScan,      // one CTA per row, radix passes over the whole row
};

// Groups per run for the run maxima that qsa_index_scores can write and kFiltered reads.
inline constexpr int64_t kQsaRunGroups = 8;
// Longest rows (in groups) the filtered and cluster methods take: 131072 groups = 512K tokens at
// ratio 4 (the filter's bitmaps of 4096 words).
inline constexpr int64_t kQsaTopKFilteredMaxGroups = 4096 * 32;
// Groups per CTA in the two-phase method's chunk phase.
inline constexpr int64_t kQsaTopKChunkGroups = 4096;
// Rows the cluster method takes in one launch (8 CTAs per row in a 1-D grid).
inline constexpr int64_t kQsaTopKClusterMaxRows = int64_t(1) << 28;

// Bytes of the two-phase method's candidate workspace for these sizes; 0 when the two-phase path
// would not shrink the rows (short contexts) or a size is invalid, so no workspace is needed.
size_t qsa_top_k_workspace_bytes(int64_t n_rows, int64_t max_groups, int64_t budget, int64_t ratio);

// The method kAuto runs: kCluster where the rows fit the filter and the cluster method is
// available (`cluster_available`: an sm_90+ device and sm_90 code in the build), else kFiltered
// where they fit; longer rows take kTwoPhase when a workspace is given, else kScan.
QsaTopKMethod choose_qsa_top_k_method(int64_t n_rows, int64_t max_groups, bool cluster_available,
                                      bool has_workspace);

}  // namespace e4kv
