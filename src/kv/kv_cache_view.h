// Plain views of the paged KV cache (DESIGN.md section 3), shared by the CPU reference and the CUDA
// kernels: raw pointers plus geometry, no ownership, no CUDA header. Built and validated on the
// host.
#pragma once

#include <cstddef>
#include <cstdint>

namespace e4kv {

enum class KvCacheDtype { kF16, kE4m3 };

inline constexpr size_t kv_cache_elem_bytes(KvCacheDtype dtype) {
  return dtype == KvCacheDtype::kF16 ? 2 : 1;
}

// Geometry of one attention layer's main cache.
struct KvCacheGeometry {
  int64_t n_blocks = 0;
  int64_t block_size = 64;  // tokens per block, a multiple of 16
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  KvCacheDtype dtype = KvCacheDtype::kF16;

  size_t elem_bytes() const { return kv_cache_elem_bytes(dtype); }
  // Elements of one K (or V) token row across heads.
  int64_t row_elems() const { return n_kv_heads * head_dim; }
  // Bytes of one block: [2, block_size, n_kv_heads, head_dim].
  size_t block_bytes() const { return size_t(2 * block_size * row_elems()) * elem_bytes(); }
  size_t total_bytes() const { return size_t(n_blocks) * block_bytes(); }
  // Element offset of (block, kv = 0 for K / 1 for V, slot within block, head, dim 0).
  int64_t elem_offset(int64_t block, int kv, int64_t slot, int64_t head) const {
    return ((block * 2 + kv) * block_size + slot) * row_elems() + head * head_dim;
  }
};

// One layer's main cache. `data` is [n_blocks, 2, block_size, n_kv_heads, head_dim] of FP16 bits
// (uint16_t) or E4M3 codes (uint8_t). For E4M3 the stored value is decode(code) * scale; for FP16
// the scales are 1.
struct KvCacheView {
  void* data = nullptr;
  KvCacheGeometry geometry;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

// Block tables of a batch: row s lists the physical blocks of sequence s in logical order; unused
// entries are -1. [n_seqs, max_blocks_per_seq]
struct BlockTableView {
  const int32_t* blocks = nullptr;
  int64_t n_seqs = 0;
  int64_t max_blocks_per_seq = 0;

  int32_t block(int64_t seq, int64_t logical) const {
    return blocks[seq * max_blocks_per_seq + logical];
  }
};

}  // namespace e4kv

namespace e4kv {

// One QSA layer's compressed indexer cache (FP16, never quantised): one index_dim row per complete
// group of `ratio` tokens, paged with the main block table. Group c of a sequence lives in logical
// block c * ratio / block_size at row (c * ratio % block_size) / ratio.
// `data` is [n_blocks, block_size / ratio, index_dim] of FP16 bits.
struct IndexerCompressedView {
  uint16_t* data = nullptr;
  int64_t n_blocks = 0;
  int64_t block_size = 64;
  int64_t ratio = 4;
  int64_t index_dim = 128;

  int64_t rows_per_block() const { return block_size / ratio; }

  // Row of group c of block-table row `seq`: [index_dim] FP16 bits. The caller has checked that
  // the group's block is mapped.
  uint16_t* row(const BlockTableView& block_table, int64_t seq, int64_t c) const {
    const int64_t block = block_table.block(seq, c * ratio / block_size);
    return data + (block * rows_per_block() + c % rows_per_block()) * index_dim;
  }
};

}  // namespace e4kv

namespace e4kv {

// A batch of attention query rows: prefill chunks and decode rows together, one row per query
// token. Row r belongs to the sequence in block-table row row_seq[r] and sits at position
// row_pos[r]; it attends causally to tokens 0..row_pos[r] of that sequence (dense), or to the
// tokens of its QSA selection row. The K/V of every position up to row_pos[r] (the row's own
// token included) are already in the cache. Used by QSA selection, the CPU attention reference
// and the CUDA attention kernels alike.
struct QueryBatchView {
  int64_t n_rows = 0;
  const int32_t* row_seq = nullptr;   // [n_rows] block-table row (sequence slot) of each query row
  const int32_t* row_pos = nullptr;   // [n_rows] position of each query row, 0-based
  const int32_t* seq_lens = nullptr;  // [n_seqs of the block table] tokens in the cache, > row_pos
  // QSA: each row's selected token indices, ascending, then -1 padding; nullptr for dense.
  const int32_t* sel_tokens = nullptr;  // [n_rows, sel_width]
  const int32_t* sel_counts = nullptr;  // [n_rows] valid entries at the front of each row
  int64_t sel_width = 0;                // budget + ratio - 1 for QSA

  bool qsa() const { return sel_tokens != nullptr; }
};

}  // namespace e4kv
