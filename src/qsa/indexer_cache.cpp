#include "qsa/indexer_cache.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "core/norm_rope.h"
#include "core/status.h"

namespace e4kv {
namespace {

void check_geometry(const IndexerCompressedView& compressed, const IndexerRingView& rings) {
  E4KV_ASSERT(compressed.ratio > 0 && compressed.block_size % compressed.ratio == 0,
              cat("indexer: block_size ", compressed.block_size, " is not a multiple of ratio ",
                  compressed.ratio));
  E4KV_ASSERT(rings.cap >= compressed.ratio,
              cat("indexer: ring capacity ", rings.cap, " is below ratio ", compressed.ratio));
  E4KV_ASSERT(rings.index_dim == compressed.index_dim && compressed.index_dim > 0,
              "indexer: ring and compressed cache disagree on index_dim");
}

uint16_t* compressed_row_mut(const IndexerCompressedView& compressed,
                             const BlockTableView& block_tables, int64_t seq, int64_t c) {
  const int64_t logical = c * compressed.ratio / compressed.block_size;
  E4KV_ASSERT(seq >= 0 && seq < block_tables.n_seqs && logical < block_tables.max_blocks_per_seq,
              cat("indexer: group ", c, " of sequence ", seq, " is outside its block table"));
  const int32_t block = block_tables.block(seq, logical);
  E4KV_ASSERT(block >= 0 && block < compressed.n_blocks,
              cat("indexer: group ", c, " of sequence ", seq, " maps to block ", block));
  return compressed.row(block_tables, seq, c);
}

}  // namespace

void indexer_cache_write(const IndexerCompressedView& compressed, const IndexerRingView& rings,
                         const IndexerWriteBatch& batch, const IndexerKeyNormRope& norm_rope) {
  check_geometry(compressed, rings);
  const int64_t dim = compressed.index_dim;
  const int64_t ratio = compressed.ratio;
  E4KV_ASSERT(norm_rope.norm_weight != nullptr && norm_rope.inv_freq != nullptr,
              "indexer: missing norm weight or RoPE table");
  E4KV_ASSERT(
      norm_rope.rotary_dim > 0 && norm_rope.rotary_dim % 2 == 0 && norm_rope.rotary_dim <= dim,
      cat("indexer: rotary_dim ", norm_rope.rotary_dim, " must be even and <= ", dim));

  std::vector<float> sum(static_cast<size_t>(dim));
  std::vector<uint16_t> pooled(static_cast<size_t>(dim));  // [index_dim] FP16 bits
  std::vector<uint16_t> normed(static_cast<size_t>(dim));  // [index_dim] FP16 bits
  std::vector<float> cos(static_cast<size_t>(norm_rope.rotary_dim / 2));
  std::vector<float> sin(cos.size());

  for (int64_t s = 0; s < batch.n_seqs; ++s) {
    const int64_t first_row = batch.token_offsets[s];
    const int64_t n = batch.token_offsets[s + 1] - first_row;
    const int64_t start = batch.start_pos[s];
    const int64_t r = batch.ring_index[s];
    E4KV_ASSERT(n >= 0 && start >= 0, cat("indexer: sequence ", s, " has a bad token range"));
    E4KV_ASSERT(r >= 0 && r < rings.n_rings, cat("indexer: ring index ", r, " out of range"));
    uint16_t* ring = rings.ring(r);  // [cap, index_dim]
    if (start == 0 && n > 0) {
      std::fill(ring, ring + rings.cap * dim, uint16_t{0});
    }
    // Raw key of position p (p >= pos - ratio + 1 >= start - ratio + 1): from this batch when p is
    // one of its rows, else from the ring, which still holds the up to ratio - 1 earlier positions.
    auto raw_key = [&](int64_t p) -> const uint16_t* {
      if (p >= start) return batch.index_k + (first_row + p - start) * dim;
      return ring + (p % rings.cap) * dim;
    };

    // Complete groups first: the ring update below overwrites slots they may read.
    for (int64_t pos = start; pos < start + n; ++pos) {
      if ((pos + 1) % ratio != 0) continue;
      const int64_t group_start = pos + 1 - ratio;
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t p = group_start; p <= pos; ++p) {
        const uint16_t* key = raw_key(p);  // [index_dim]
        for (int64_t j = 0; j < dim; ++j) sum[size_t(j)] += f16_to_f32(key[j]);
      }
      for (int64_t j = 0; j < dim; ++j) {
        pooled[size_t(j)] = f32_to_f16(sum[size_t(j)] / static_cast<float>(ratio));
      }
      rms_norm_row_f16(pooled.data(), norm_rope.norm_weight, dim, norm_rope.eps,
                       RmsNormForm::kOnePlusWeight, normed.data());
      rope_cos_sin(group_start, norm_rope.inv_freq, norm_rope.rotary_dim / 2, cos.data(),
                   sin.data());
      uint16_t* out = compressed_row_mut(compressed, batch.block_tables, s, pos / ratio);
      rope_neox_row_f16(normed.data(), dim, norm_rope.rotary_dim, cos.data(), sin.data(), out);
    }

    // Ring: only the last cap positions of the batch survive, exactly as if written one by one.
    for (int64_t pos = std::max(start, start + n - rings.cap); pos < start + n; ++pos) {
      std::memcpy(ring + (pos % rings.cap) * dim, batch.index_k + (first_row + pos - start) * dim,
                  static_cast<size_t>(dim) * sizeof(uint16_t));
    }
  }
}

const uint16_t* indexer_compressed_row(const IndexerCompressedView& compressed,
                                       const BlockTableView& block_tables, int64_t seq, int64_t c) {
  return compressed_row_mut(compressed, block_tables, seq, c);
}

void indexer_copy_blocks(const IndexerCompressedView& compressed, const BlockCopy* copies,
                         int64_t n_copies) {
  const int64_t block_elems = compressed.rows_per_block() * compressed.index_dim;
  for (int64_t i = 0; i < n_copies; ++i) {
    const BlockCopy c = copies[i];
    E4KV_ASSERT(c.src >= 0 && c.src < compressed.n_blocks && c.dst >= 0 &&
                    c.dst < compressed.n_blocks && c.src != c.dst,
                cat("indexer_copy_blocks: bad copy ", c.src, " -> ", c.dst));
    std::memcpy(compressed.data + c.dst * block_elems, compressed.data + c.src * block_elems,
                static_cast<size_t>(block_elems) * sizeof(uint16_t));
  }
}

void indexer_ring_copy(const IndexerRingView& rings, int64_t src, int64_t dst) {
  E4KV_ASSERT(src >= 0 && src < rings.n_rings && dst >= 0 && dst < rings.n_rings,
              cat("indexer_ring_copy: bad rings ", src, " -> ", dst));
  if (src == dst) return;
  std::memcpy(rings.ring(dst), rings.ring(src),
              static_cast<size_t>(rings.cap * rings.index_dim) * sizeof(uint16_t));
}

}  // namespace e4kv
