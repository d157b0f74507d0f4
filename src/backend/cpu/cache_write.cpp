#include "backend/cpu/cache_write.h"

#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/half.h"
#include "core/status.h"
#include "e4kv/e4m3.h"

namespace e4kv {
namespace {

inline bool f16_is_finite(uint16_t h) {
  return (h & 0x7C00u) != 0x7C00u;
}

// Stores one token row (all heads) of K or V. src: [row_elems] FP16 bits.
int64_t store_row(const KvCacheView& cache, const uint16_t* src, int64_t elem_offset, float scale) {
  const int64_t n = cache.geometry.row_elems();
  int64_t non_finite = 0;
  for (int64_t i = 0; i < n; ++i) non_finite += f16_is_finite(src[i]) ? 0 : 1;
  if (cache.geometry.dtype == KvCacheDtype::kF16) {
    // [n_blocks, 2, block_size, n_kv_heads, head_dim] FP16 bits
    uint16_t* dst = static_cast<uint16_t*>(cache.data) + elem_offset;
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(uint16_t));
  } else {
    // [n_blocks, 2, block_size, n_kv_heads, head_dim] E4M3 codes
    uint8_t* dst = static_cast<uint8_t*>(cache.data) + elem_offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_encode(f16_to_f32(src[i]), scale);
  }
  return non_finite;
}

}  // namespace

CacheWriteStats cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                            const int64_t* slot_mapping, int64_t n_tokens) {
  const KvCacheGeometry& g = cache.geometry;
  E4KV_ASSERT(cache.data != nullptr && g.n_blocks >= 0 && g.block_size > 0 && g.row_elems() > 0,
              "cache_write: empty or malformed cache view");
  if (g.dtype == KvCacheDtype::kE4m3) {
    // The scale gate guarantees this before any forward runs.
    E4KV_ASSERT(
        std::isfinite(cache.k_scale) && cache.k_scale > 0.0f && std::isfinite(cache.v_scale) &&
            cache.v_scale > 0.0f,
        cat("cache_write: invalid scales k_scale=", cache.k_scale, " v_scale=", cache.v_scale));
  }
  const int64_t n_slots = g.n_blocks * g.block_size;
  const int64_t row = g.row_elems();
  CacheWriteStats stats;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot == -1) continue;
    E4KV_ASSERT(slot >= 0 && slot < n_slots,
                cat("cache_write: slot ", slot, " of token ", t, " outside [0, ", n_slots, ")"));
    const int64_t block = slot / g.block_size;
    const int64_t offset = slot % g.block_size;
    stats.k_non_finite +=
        store_row(cache, k + t * row, g.elem_offset(block, 0, offset, 0), cache.k_scale);
    stats.v_non_finite +=
        store_row(cache, v + t * row, g.elem_offset(block, 1, offset, 0), cache.v_scale);
  }
  return stats;
}

void cache_copy_blocks(const KvCacheView& cache, const BlockCopy* copies, int64_t n_copies) {
  const KvCacheGeometry& g = cache.geometry;
  const size_t block_bytes = g.block_bytes();
  // [n_blocks, 2, block_size, n_kv_heads, head_dim] bytes of either dtype
  uint8_t* base = static_cast<uint8_t*>(cache.data);
  for (int64_t i = 0; i < n_copies; ++i) {
    const BlockCopy c = copies[i];
    E4KV_ASSERT(
        c.src >= 0 && c.src < g.n_blocks && c.dst >= 0 && c.dst < g.n_blocks && c.src != c.dst,
        cat("cache_copy_blocks: bad copy ", c.src, " -> ", c.dst));
    std::memcpy(base + size_t(c.dst) * block_bytes, base + size_t(c.src) * block_bytes,
                block_bytes);
  }
}

}  // namespace e4kv
