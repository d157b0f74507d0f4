// QSA token selection (DESIGN.md section 4, steps 5-7): index scores over the compressed indexer
// cache, top-k of complete groups with the deterministic tie-break, and expansion to token indices
// with the causal tail. The CPU reference (the oracle) of the selection kernels.
//
// Numeric contract of a score (fp32 throughout, FP16 inputs widened exactly):
//   dot_h = sum over d = 0..index_dim-1 of q_h[d] * khat_c[d], accumulated in index order, each
//           product rounded to fp32 before the add (ISO C++ mode: no FMA contraction);
//   s[c]  = (sum over h = 0..n_index_heads-1 of fmax(dot_h, 0)) / sqrt(float(index_dim)).
// fmax maps a NaN dot product to 0 (as CUDA's fmaxf does), so scores are never NaN and the order
// below is total. Dividing by the positive constant once at the end cannot reorder two groups; it
// can only merge neighbours into a tie after rounding. A GPU kernel that reduces in another order
// may differ in the last bit of a score, which can move a group across the k-th score: GPU tests
// compare selections with the overlap metrics (calib/quality_metrics.h), and the top-k and
// expansion steps exactly, on the same scores.
//
// Selection of the query at `pos` of a sequence holding `seq_len` tokens:
//   visible = min((pos + 1) / ratio, seq_len / ratio) complete groups, k = budget / ratio;
//   visible <= k: every visible group (scores are not needed: exactly dense attention);
//   otherwise the groups scoring strictly above the k-th score, then the lowest-index groups equal
//   to it, up to k in all; groups are emitted in increasing index. Tokens: ratio*c .. ratio*c +
//   ratio-1 for each selected group, then the causal tail ratio*((pos+1)/ratio) .. pos; padded with
//   -1 to width budget + ratio - 1.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "kv/kv_cache_view.h"

namespace e4kv {

// Width of one selection row: budget + ratio - 1 (k groups of `ratio` tokens plus the tail).
inline int64_t qsa_selection_width(int64_t budget, int64_t ratio) {
  return budget + ratio - 1;
}

// Groups kept by top-k: budget / ratio.
inline int64_t qsa_top_k(int64_t budget, int64_t ratio) {
  return budget / ratio;
}

// Complete groups visible to the query at `pos`: min((pos + 1) / ratio, seq_len / ratio).
inline int64_t qsa_visible_groups(int64_t pos, int64_t seq_len, int64_t ratio) {
  const int64_t causal = (pos + 1) / ratio;
  const int64_t written = seq_len / ratio;
  return causal < written ? causal : written;
}

struct QsaSelectionConfig {
  int64_t budget = 2048;  // tokens; top-k keeps budget / ratio groups (ratio from the indexer)
  int64_t n_index_heads = 4;
};

// s[c] for the groups c = 0..n_groups-1 of block-table row `seq`, per the contract above.
// index_q: [n_index_heads, index_dim] FP16 bits (one query row); scores: [n_groups].
// The caller guarantees the block-table entries of those groups are valid.
void qsa_index_scores(const uint16_t* index_q, int64_t n_index_heads,
                      const IndexerCompressedView& compressed, const BlockTableView& block_table,
                      int64_t seq, int64_t n_groups, float* scores);

// Top-k of `scores` (all of them when scores.size() <= k) with the deterministic tie-break; writes
// the chosen group indices in increasing order to `groups` (room for min(k, scores.size())) and
// returns how many. k >= 0. `scratch` (optional) is reused across calls to avoid an allocation.
int64_t qsa_top_k_groups(std::span<const float> scores, int64_t k, int32_t* groups,
                         std::vector<float>* scratch = nullptr);

// Expands groups (increasing indices) to tokens, appends the causal tail of `pos` and pads `tokens`
// with -1 to its full size; returns the number of valid tokens. tokens.size() must hold them all.
int64_t qsa_expand_tokens(std::span<const int32_t> groups, int64_t pos, int64_t ratio,
                          std::span<int32_t> tokens);

// Selection for every row of a batch (rows.sel_* are ignored: these are the outputs).
// index_q:    [rows.n_rows, config.n_index_heads, compressed.index_dim] FP16 bits
// sel_tokens: [rows.n_rows, qsa_selection_width(config.budget, compressed.ratio)]
// sel_counts: [rows.n_rows]
// Returns an error naming the row or field for an inconsistent batch, geometry or block table.
Status qsa_select(const QsaSelectionConfig& config, const IndexerCompressedView& compressed,
                  const BlockTableView& block_table, const QueryBatchView& rows,
                  const uint16_t* index_q, int32_t* sel_tokens, int32_t* sel_counts);

}  // namespace e4kv
