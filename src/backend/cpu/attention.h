// Paged attention over the main KV cache, dense or over a QSA selection, FP16 or E4M3 cache: the
// CPU reference (the oracle) of the CUDA attention kernels (DESIGN.md sections 2-4, step 8).
//
// For query row r (sequence row_seq[r], position row_pos[r]) and query head h, with key list
// T = 0..row_pos[r] (dense) or sel_tokens[r][0..sel_counts[r]) (QSA), KV head h / (n_heads /
// n_kv_heads) (consecutive query heads share a KV head), and stored values k, v (the E4M3 code's
// exact value decode(code), or the FP16 value):
//   logit_t = fl32(sum_d q[d] * k_t[d]) * softmax_scale,  softmax_scale = k_scale / sqrt(head_dim)
//   out[d]  = (sum_t exp(logit_t - max) * v_t[d]) * v_scale / (sum_t exp(logit_t - max))
//   out[d] *= sigmoid(gate[d])                              when a gate is given
// Numeric contract: fp32 everywhere; dot products accumulate in index order with each product
// rounded to fp32 (ISO C++ mode: no FMA contraction); FP32 online softmax, one key at a time in
// key- list order (m = running max, l = running sum, acc = running sum of p * v, all rescaled by
// exp(m_old - m_new) when the max grows). k_scale and v_scale are applied to every dtype (the
// engine passes 1.0 for an FP16 cache); they are folded into the softmax scale and the final output
// scale, never multiplied into elements. An empty key list gives a zero output.
//
// Split-K: paged_attention_partial cuts each row's key list into consecutive splits of
// keys_per_split keys and stores (m, l, acc) per split; paged_attention_merge combines them by
// log-sum-exp. paged_attention is the same computation with one split per row: with max_splits = 1
// partial + merge reproduce it bit for bit, and any other split agrees to fp32 rounding.
//
// The CPU reference accepts any positive head_dim and block_size and any GQA group; the CUDA routes
// state their own limits (qsa/route_planner.h). Output is fp32; a kernel writing FP16 is compared
// with this output rounded.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "backend/attention_params.h"
#include "kv/kv_cache_view.h"

namespace e4kv {

// Keys attended by row r: row_pos[r] + 1 (dense) or sel_counts[r] (QSA).
int64_t attention_row_keys(const QueryBatchView& rows, int64_t row);

// Largest number of splits of keys_per_split keys any row needs (at least 1).
int64_t attention_splits_needed(const QueryBatchView& rows, int64_t keys_per_split);

// Checks geometry, scales, pointers, rows, block-table entries and selection rows. `need_out`: the
// call writes params.out.
Status validate_paged_attention(const PagedAttentionParams& params, bool need_out);

// out = attention of every row (one split per row).
Status paged_attention(const PagedAttentionParams& params);

// Split-K, first half: partial results of every (row, split, head); params.out is not used.
Status paged_attention_partial(const PagedAttentionParams& params,
                               const AttentionPartialsView& partials);

// Split-K, second half: out = merge of the partials (log-sum-exp), * v_scale / l, * sigmoid(gate).
// Reads rows.n_rows, cache.geometry (head_dim, n_kv_heads), cache.v_scale, n_heads, gate and out
// from params; not the cache data, the block table or the key lists.
Status paged_attention_merge(const PagedAttentionParams& params,
                             const AttentionPartialsView& partials);

// Dense attention probabilities of one row, for the attention-mass recall of a selection:
// probs[h][t] = softmax over t = 0..row_pos of logit_t, fp32 (max-subtracted, two passes).
// probs: [n_heads, row_pos + 1]. The selection rows of params.rows, if any, are ignored.
Status dense_attention_probs(const PagedAttentionParams& params, int64_t row, float* probs);

}  // namespace e4kv
