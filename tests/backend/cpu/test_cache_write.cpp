// Main KV cache write: every byte of the cache equals what e4m3_encode / the FP16 bits give for the
// element that belongs there, padding slots (-1) and untouched slots keep their old bytes, and
// non-finite inputs are counted per tensor.
#include "backend/cpu/cache_write.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "core/half.h"
#include "e4kv/e4m3.h"

namespace e4kv {
namespace {

constexpr uint8_t kSentinel = 0xA5;

class CacheWriteTest
    : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, KvCacheDtype>> {};

// FP16 bits of a random value spread over many binades (tiny, normal and > 448 after scaling),
// with a few inf / NaN.
uint16_t random_input(std::mt19937& rng, int64_t& non_finite) {
  const uint32_t pick = rng() % 200;
  if (pick == 0) {
    ++non_finite;
    return 0x7C00;  // +inf
  }
  if (pick == 1) {
    ++non_finite;
    return 0xFC00;  // -inf
  }
  if (pick == 2) {
    ++non_finite;
    return uint16_t(0x7E00 | (rng() & 0x1FF) | (rng() & 1 ? 0x8000 : 0));  // NaN
  }
  const float magnitude = std::ldexp(1.0f + float(rng() % 1024) / 1024.0f, int(rng() % 30) - 20);
  return f32_to_f16(rng() & 1 ? -magnitude : magnitude);
}

TEST_P(CacheWriteTest, EveryByteIsTheEncodedElementAtItsSlot) {
  const auto [block_size, n_kv_heads, head_dim, dtype] = GetParam();
  KvCacheGeometry g;
  g.n_blocks = 5;
  g.block_size = block_size;
  g.n_kv_heads = n_kv_heads;
  g.head_dim = head_dim;
  g.dtype = dtype;
  std::vector<uint8_t> storage(g.total_bytes(), kSentinel);  // [5, 2, block_size, heads, dim]
  KvCacheView cache;
  cache.data = storage.data();
  cache.geometry = g;
  cache.k_scale = dtype == KvCacheDtype::kE4m3 ? 0.0171247218f : 1.0f;
  cache.v_scale = dtype == KvCacheDtype::kE4m3 ? 0.0841238871f : 1.0f;

  // Tokens go to distinct random slots; every 5th token is padding.
  std::mt19937 rng(static_cast<uint32_t>(block_size * 131 + n_kv_heads * 17 + head_dim));
  const int64_t n_slots = g.n_blocks * block_size;
  std::vector<int64_t> all_slots(static_cast<size_t>(n_slots));
  for (int64_t i = 0; i < n_slots; ++i) all_slots[size_t(i)] = i;
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  const int64_t n_tokens = n_slots / 2 + 3;
  std::vector<int64_t> slot_mapping(static_cast<size_t>(n_tokens));
  for (int64_t t = 0; t < n_tokens; ++t)
    slot_mapping[size_t(t)] = t % 5 == 4 ? -1 : all_slots[size_t(t)];

  const int64_t row = n_kv_heads * head_dim;
  std::vector<uint16_t> k(static_cast<size_t>(n_tokens * row));  // [n_tokens, heads, dim]
  std::vector<uint16_t> v(k.size());
  int64_t k_non_finite = 0;
  int64_t v_non_finite = 0;
  for (int64_t t = 0; t < n_tokens; ++t) {
    int64_t k_bad = 0;
    int64_t v_bad = 0;
    for (int64_t i = 0; i < row; ++i) {
      k[size_t(t * row + i)] = random_input(rng, k_bad);
      v[size_t(t * row + i)] = random_input(rng, v_bad);
    }
    if (slot_mapping[size_t(t)] != -1) {  // padding rows are not written, so not counted
      k_non_finite += k_bad;
      v_non_finite += v_bad;
    }
  }

  const CacheWriteStats stats =
      cache_write(cache, k.data(), v.data(), slot_mapping.data(), n_tokens);
  EXPECT_EQ(stats.k_non_finite, k_non_finite);
  EXPECT_EQ(stats.v_non_finite, v_non_finite);
  EXPECT_GT(k_non_finite + v_non_finite, 0);

  // The expected cache, built element by element from the definition.
  std::vector<uint8_t> expected(storage.size(), kSentinel);
  const size_t elem = g.elem_bytes();
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t slot = slot_mapping[size_t(t)];
    if (slot < 0) continue;
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<uint16_t>& src = kv == 0 ? k : v;
      const float scale = kv == 0 ? cache.k_scale : cache.v_scale;
      for (int64_t h = 0; h < n_kv_heads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          // [n_blocks, 2, block_size, n_kv_heads, head_dim]
          const int64_t index =
              (((slot / block_size) * 2 + kv) * block_size + slot % block_size) * row +
              h * head_dim + d;
          const uint16_t x = src[size_t(t * row + h * head_dim + d)];
          if (dtype == KvCacheDtype::kF16) {
            std::memcpy(&expected[size_t(index) * elem], &x, 2);
          } else {
            expected[size_t(index)] = e4m3_encode(f16_to_f32(x), scale);
          }
        }
      }
    }
  }
  size_t mismatches = 0;
  for (size_t i = 0; i < storage.size(); ++i) {
    if (storage[i] != expected[i] && ++mismatches <= 5) {
      ADD_FAILURE() << "byte " << i << ": got 0x" << std::hex << int(storage[i]) << ", want 0x"
                    << int(expected[i]);
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CacheWriteTest,
    ::testing::Combine(::testing::Values<int64_t>(16, 64), ::testing::Values<int64_t>(1, 2, 4),
                       ::testing::Values<int64_t>(64, 128, 256),
                       ::testing::Values(KvCacheDtype::kF16, KvCacheDtype::kE4m3)));

TEST(CacheWrite, E4m3KnownCodes) {
  KvCacheGeometry g;
  g.n_blocks = 1;
  g.block_size = 16;
  g.n_kv_heads = 1;
  g.head_dim = 8;
  g.dtype = KvCacheDtype::kE4m3;
  std::vector<uint8_t> storage(g.total_bytes(), 0);
  KvCacheView cache{storage.data(), g, 0.5f, 2.0f};
  // K / 0.5: 1 -> 2 (0x40), -1 -> -2 (0xC0), 300 -> 600 saturates (0x7E), +inf -> 0x7E,
  //          -inf -> 0xFE, NaN -> 0x7F, 2^-12 -> 2^-11 rounds to 0, 0 -> 0.
  const std::vector<uint16_t> k = {f32_to_f16(1.0f),
                                   f32_to_f16(-1.0f),
                                   f32_to_f16(300.0f),
                                   0x7C00,
                                   0xFC00,
                                   0x7E00,
                                   f32_to_f16(0x1p-12f),
                                   0x0000};
  // V / 2: 1 -> 0.5 (0x30), 896 -> 448 (0x7E), 2^-9 -> 2^-10 is a tie between 0 and 2^-9: even 0,
  //        3 * 2^-10 -> 3 * 2^-11 rounds up to 2^-9 (0x01), 0.1 -> 0.05 (0x15: 1.625 * 2^-5 =
  //        0.0508), -0 -> 0x80, 448 -> 224 (0x76), 2.0 -> 1.0 (0x38).
  const std::vector<uint16_t> v = {f32_to_f16(1.0f),     f32_to_f16(896.0f), f32_to_f16(0x1p-9f),
                                   f32_to_f16(0x3p-10f), f32_to_f16(0.1f),   0x8000,
                                   f32_to_f16(448.0f),   f32_to_f16(2.0f)};
  const int64_t slot = 3;
  const CacheWriteStats stats = cache_write(cache, k.data(), v.data(), &slot, 1);
  EXPECT_EQ(stats.k_non_finite, 3);
  EXPECT_EQ(stats.v_non_finite, 0);
  const uint8_t* k_row = storage.data() + g.elem_offset(0, 0, 3, 0);
  const uint8_t* v_row = storage.data() + g.elem_offset(0, 1, 3, 0);
  EXPECT_EQ(std::vector<uint8_t>(k_row, k_row + 8),
            (std::vector<uint8_t>{0x40, 0xC0, 0x7E, 0x7E, 0xFE, 0x7F, 0x00, 0x00}));
  EXPECT_EQ(std::vector<uint8_t>(v_row, v_row + 8),
            (std::vector<uint8_t>{0x30, 0x7E, 0x00, 0x01, 0x15, 0x80, 0x76, 0x38}));
}

TEST(CacheWrite, CopyBlocksCopiesKAndVOfWholeBlocks) {
  KvCacheGeometry g;
  g.n_blocks = 3;
  g.block_size = 16;
  g.n_kv_heads = 2;
  g.head_dim = 4;
  g.dtype = KvCacheDtype::kF16;
  std::vector<uint16_t> storage(g.total_bytes() / 2);  // [3, 2, 16, 2, 4]
  for (size_t i = 0; i < storage.size(); ++i) storage[i] = uint16_t(i);
  const std::vector<uint16_t> before = storage;
  KvCacheView cache{storage.data(), g, 1.0f, 1.0f};
  const BlockCopy copy{2, 0};
  cache_copy_blocks(cache, &copy, 1);
  const size_t block_elems = g.block_bytes() / 2;
  for (size_t i = 0; i < block_elems; ++i) {
    ASSERT_EQ(storage[i], before[2 * block_elems + i]);
    ASSERT_EQ(storage[block_elems + i], before[block_elems + i]);
    ASSERT_EQ(storage[2 * block_elems + i], before[2 * block_elems + i]);
  }
}

}  // namespace
}  // namespace e4kv
