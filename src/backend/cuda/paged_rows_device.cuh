// The paged-cache fields every attention-like kernel reads, as one pair of plain structs inside
// the kernels' parameter structs: the query rows with their block-table rows and QSA selection
// (decode, prefill, index scores) and the main KV cache (decode, prefill). Built on the host from
// the views of kv/kv_cache_view.h.
#pragma once

#include <cstdint>

#include "kv/kv_cache_view.h"

namespace e4kv::cuda {

// Query rows of a launch and where their keys live. Device pointers.
struct PagedRowsDevice {
  const int32_t* block_table;  // [n_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const int32_t* row_seq;     // [n_rows] block-table row of each query row
  const int32_t* row_pos;     // [n_rows] position of each query row
  const int32_t* sel_tokens;  // [n_rows, sel_width] QSA selection, or nullptr (dense)
  const int32_t* sel_counts;  // [n_rows]
  int64_t sel_width;
};

// The main paged KV cache. Device pointer.
struct PagedKvDevice {
  const uint8_t* cache;  // [n_blocks, 2, block_size, n_kv_heads, head_dim] FP16 or E4M3 bytes
  int32_t block_size;
  int32_t block_shift;  // log2(block_size) when a power of two, else -1
  int32_t n_kv_heads;
};

inline PagedRowsDevice paged_rows_device(const BlockTableView& table, const QueryBatchView& rows) {
  return PagedRowsDevice{table.blocks,    table.max_blocks_per_seq, rows.row_seq,  rows.row_pos,
                         rows.sel_tokens, rows.sel_counts,          rows.sel_width};
}

// The caller has checked the geometry (block_size and n_kv_heads fit in int32).
inline PagedKvDevice paged_kv_device(const KvCacheView& cache) {
  const KvCacheGeometry& geo = cache.geometry;
  int32_t shift = -1;
  for (int32_t s = 0; s < 31; ++s) {
    if ((int64_t(1) << s) == geo.block_size) shift = s;
  }
  return PagedKvDevice{static_cast<const uint8_t*>(cache.data), int32_t(geo.block_size), shift,
                       int32_t(geo.n_kv_heads)};
}

}  // namespace e4kv::cuda
