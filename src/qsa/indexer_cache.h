// QSA indexer caches of one QSA layer (DESIGN.md sections 3 and 4, step 4), the CPU reference (the
// oracle). Both caches stay FP16, never quantised.
//
//   raw ring    per sequence, [cap, index_dim]: raw index key of position p lives in slot p % cap.
//               Its contents are a pure function of the token stream: after positions 0..P-1 have
//               been processed, slot j holds the raw key of the largest p < P with p % cap == j,
//               and zeros when there is none (the ring is cleared when a sequence starts at
//               position 0). cap >= ratio (4, or 8 with speculative tokens).
//   compressed  [n_blocks, block_size / ratio, index_dim], paged with the main block table: group c
//               (positions 4c .. 4c+3) lives in logical block c * ratio / block_size, row
//               c % (block_size / ratio).
//
// When position pos with (pos + 1) % ratio == 0 is processed, group c = pos / ratio completes and
// its compressed row is written. Numerics (the contract; a CUDA kernel must follow it):
//   1. pool:  sum the ratio raw FP16 keys of positions pos-ratio+1 .. pos in fp32, in increasing
//             position order; divide by fp32(ratio) (exact for ratio 4); round to FP16.
//   2. norm:  k_layernorm as RMSNorm x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 from the FP16
//             pooled key, rounded to FP16 (rms_norm_row_f16, kOnePlusWeight).
//   3. rope:  partial NeoX RoPE at position pos - ratio + 1 (= 4c) over the first rotary_dim dims,
//             cos/sin computed in double and rounded to fp32, the rotation in fp32 from the FP16
//             normed key, rounded to FP16 (rope_neox_row_f16).
// A group's keys may all come from one prefill chunk or partly from the ring (a group that
// straddles a chunk boundary or completes in a decode step): the row does not depend on how the
// stream was cut.
#pragma once

#include <cstdint>

#include "kv/block_allocator.h"
#include "kv/kv_cache_view.h"

namespace e4kv {

// Raw rings of one QSA layer for n_rings sequence slots. data: [n_rings, cap, index_dim] FP16 bits.
struct IndexerRingView {
  uint16_t* data = nullptr;
  int64_t n_rings = 0;
  int64_t cap = 4;
  int64_t index_dim = 128;

  // [cap, index_dim] FP16 bits of ring r.
  uint16_t* ring(int64_t r) const { return data + r * cap * index_dim; }
};

// The k_layernorm weight and the RoPE of step 4.
struct IndexerKeyNormRope {
  const uint16_t* norm_weight = nullptr;  // [index_dim] FP16 bits, applied as (1 + w)
  float eps = 1e-6f;                      // rms_norm_eps rounded to fp32
  int64_t rotary_dim = 0;                 // head_dim * partial_rotary_factor, <= index_dim
  const double* inv_freq = nullptr;       // [rotary_dim / 2], rope_inv_freq(theta, rotary_dim)
};

// One batch of raw index keys. Sequence s contributes rows [token_offsets[s], token_offsets[s + 1])
// at consecutive positions from start_pos[s] (its tokens processed so far: every earlier position
// went through this function for this sequence, in order).
struct IndexerWriteBatch {
  const uint16_t* index_k = nullptr;       // [n_tokens, index_dim] raw FP16 index keys
  const int32_t* token_offsets = nullptr;  // [n_seqs + 1]
  const int64_t* start_pos = nullptr;      // [n_seqs]
  const int32_t* ring_index = nullptr;     // [n_seqs], distinct within a batch
  int64_t n_seqs = 0;
  BlockTableView block_tables;  // row s: sequence s; covers every group completed in this batch
};

// Pushes the batch's raw keys through the rings and writes the compressed row of every group that
// completes.
void indexer_cache_write(const IndexerCompressedView& compressed, const IndexerRingView& rings,
                         const IndexerWriteBatch& batch, const IndexerKeyNormRope& norm_rope);

// The compressed row of group c of sequence `seq`: [index_dim] FP16 bits.
const uint16_t* indexer_compressed_row(const IndexerCompressedView& compressed,
                                       const BlockTableView& block_tables, int64_t seq, int64_t c);

// Copies whole blocks of the compressed cache (the copy-on-write pairs of BlockAllocator::append).
// copies: [n_copies]
void indexer_copy_blocks(const IndexerCompressedView& compressed, const BlockCopy* copies,
                         int64_t n_copies);

// Ring dst becomes a copy of ring src (a forked sequence continues the same partial group).
void indexer_ring_copy(const IndexerRingView& rings, int64_t src, int64_t dst);

}  // namespace e4kv
