// Main KV cache write (DESIGN.md sections 2 and 3), the CPU reference (the oracle).
//
// Token t goes to slot slot_mapping[t] (block = slot / block_size, row = slot % block_size) of the
// layer's cache [n_blocks, 2, block_size, n_kv_heads, head_dim]; a slot of -1 is padding and is
// skipped. The inputs are the FP16 values the FP16 cache stores (K after its norm and RoPE, V as
// projected):
//   FP16 cache: the FP16 bits are stored unchanged;
//   E4M3 cache: code = e4m3_encode(f16_to_f32(x), k_scale or v_scale)
//               (= e4m3_satfinite_rne(fp32(x) / scale); +-inf saturates to +-448, NaN -> 0x7F).
// Non-finite inputs (inf or NaN) are counted per tensor for either cache dtype; the engine turns a
// non-zero count into an error for the request.
#pragma once

#include <cstdint>

#include "kv/block_allocator.h"
#include "kv/kv_cache_view.h"

namespace e4kv {

struct CacheWriteStats {
  int64_t k_non_finite = 0;
  int64_t v_non_finite = 0;

  CacheWriteStats& operator+=(const CacheWriteStats& other) {
    k_non_finite += other.k_non_finite;
    v_non_finite += other.v_non_finite;
    return *this;
  }
};

// Writes n_tokens K/V rows into one layer's cache.
// k, v: [n_tokens, n_kv_heads, head_dim] FP16 bits; slot_mapping: [n_tokens], -1 = skip.
CacheWriteStats cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                            const int64_t* slot_mapping, int64_t n_tokens);

// Copies whole blocks (K and V, all heads) of one layer's main cache: the copy-on-write pairs
// returned by BlockAllocator::append. copies: [n_copies]
void cache_copy_blocks(const KvCacheView& cache, const BlockCopy* copies, int64_t n_copies);

}  // namespace e4kv
