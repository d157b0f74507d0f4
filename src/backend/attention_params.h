// Parameters of one paged attention launch, shared by the CPU reference (backend/cpu/attention.h)
// and the CUDA kernels (backend/cuda/): plain pointers and sizes, no CUDA header. On the GPU every
// pointer is a device pointer.
#pragma once

#include <cstdint>

#include "kv/kv_cache_view.h"

namespace e4kv {

// Everything one attention launch reads: a plain struct a CUDA kernel can take by value.
struct PagedAttentionParams {
  KvCacheView cache;  // data: [n_blocks, 2, block_size, n_kv_heads, head_dim], FP16 bits or E4M3
  BlockTableView block_table;      // blocks: [n_seqs, max_blocks_per_seq]
  QueryBatchView rows;             // query rows (and QSA selection rows when rows.qsa())
  int64_t n_heads = 0;             // query heads, a multiple of cache.geometry.n_kv_heads
  const uint16_t* q = nullptr;     // [n_rows, n_heads, head_dim] FP16 bits, after norm and RoPE
  const uint16_t* gate = nullptr;  // [n_rows, n_heads, head_dim] FP16 bits, or nullptr: no gate
  float* out = nullptr;            // [n_rows, n_heads, head_dim] fp32
};

// Split-K partial results. Split s of a row covers key-list entries
// [s * keys_per_split, min(n_keys, (s + 1) * keys_per_split)); splits past the row's keys are
// empty: m = -inf, l = 0, acc = 0. acc holds unnormalised sums of stored values (no v_scale).
struct AttentionPartialsView {
  int64_t keys_per_split = 0;
  int64_t max_splits = 0;  // >= the splits any row needs (attention_splits_needed)
  float* m = nullptr;      // [n_rows, max_splits, n_heads] max logit of the split
  float* l = nullptr;      // [n_rows, max_splits, n_heads] sum of exp(logit - m)
  float* acc = nullptr;    // [n_rows, max_splits, n_heads, head_dim] sum of exp(logit - m) * v
};

}  // namespace e4kv
