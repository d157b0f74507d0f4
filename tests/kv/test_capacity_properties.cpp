// Property tests of the capacity and cache-geometry arithmetic over random, often absurd, inputs:
// every figure either matches an exact 128-bit reference or the call returns an error; nothing
// wraps around and nothing aborts.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>

#include "kv/block_allocator.h"
#include "kv/capacity.h"

namespace e4kv {
namespace {

__extension__ typedef __int128 i128;  // exact reference arithmetic (GCC and Clang)
constexpr i128 kInt64Max = std::numeric_limits<int64_t>::max();

// Log-uniform in [1, 2^bits): small and huge values are both common.
int64_t log_uniform(std::mt19937_64& rng, int bits) {
  const int b = std::uniform_int_distribution<int>(0, bits - 1)(rng);
  const uint64_t lo = uint64_t{1} << b;
  const uint64_t hi = b >= 63 ? uint64_t(kInt64Max) : (uint64_t{1} << (b + 1)) - 1;
  return int64_t(std::uniform_int_distribution<uint64_t>(lo, hi)(rng));
}

ModelConfig random_config(std::mt19937_64& rng) {
  ModelConfig config;
  const int64_t n_layers = std::uniform_int_distribution<int64_t>(1, 256)(rng);
  const bool qsa = rng() % 2 == 0;
  config.n_layers = n_layers;
  for (int64_t i = 0; i < n_layers; ++i) {
    config.layers.push_back(!qsa ? LayerKind::kFullAttention
                                 : ((i + 1) % 4 == 0 ? LayerKind::kQsaAttention
                                                     : LayerKind::kLinearAttention));
  }
  if (qsa && n_layers < 4) config.layers.back() = LayerKind::kQsaAttention;
  // The config parser caps each field at 2^31 - 1; products are what overflow.
  config.n_kv_heads = log_uniform(rng, 31);
  config.head_dim = log_uniform(rng, 31);
  config.n_heads = config.n_kv_heads;
  if (qsa) {
    QsaConfig q;
    q.n_index_heads = 4;
    q.n_index_kv_heads = 1;
    q.index_dim = log_uniform(rng, 31);
    q.ratio = int64_t{1} << std::uniform_int_distribution<int>(0, 4)(rng);
    q.budget = q.ratio * 64;
    config.qsa = q;
  }
  return config;
}

TEST(CapacityProperties, ExactOrErrorOverRandomHugeInputs) {
  std::mt19937_64 rng(20261202);
  int layouts = 0, capacities = 0, requests = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const ModelConfig config = random_config(rng);
    const int64_t block_size =
        rng() % 8 == 0 ? log_uniform(rng, 63) : 16 * std::uniform_int_distribution<int64_t>(1, 64)(rng);
    Result<KvCacheLayout> layout_or = kv_cache_layout(config, block_size);

    const i128 n_kv = i128(config.kv_cache_layers().size());
    const i128 n_qsa = config.count_layers(LayerKind::kQsaAttention);
    const bool block_ok = block_size % 16 == 0 && block_size <= kMaxBlockSize;
    const bool ratio_ok = !config.qsa || block_size % config.qsa->ratio == 0;
    // Below 2^8 * 2^10 * 2^2 * 2^62 = 2^82 once the block size is valid: exact in 128 bits.
    const i128 valid_block = block_ok ? block_size : 16;
    const i128 main_f16 = n_kv * valid_block * 2 * config.n_kv_heads * i128(config.head_dim) * 2;
    const i128 index = config.qsa ? n_qsa * (valid_block / config.qsa->ratio) *
                                        i128(config.qsa->index_dim) * 2
                                  : 0;
    const i128 ring = config.qsa ? n_qsa * config.qsa->ratio * i128(config.qsa->index_dim) * 2 : 0;
    const bool fits = main_f16 + index <= kInt64Max && ring <= kInt64Max;
    ASSERT_EQ(layout_or.ok(), block_ok && ratio_ok && fits)
        << "block " << block_size << " kv_heads " << config.n_kv_heads << " head_dim "
        << config.head_dim << ": " << layout_or.message();
    if (!layout_or.ok()) {
      EXPECT_FALSE(layout_or.message().empty());
      continue;
    }
    ++layouts;
    const KvCacheLayout& layout = *layout_or;
    for (KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
      const i128 elem = dtype == KvCacheDtype::kF16 ? 2 : 1;
      const i128 block_bytes = n_kv * block_size * 2 * config.n_kv_heads * i128(config.head_dim) *
                                   elem + index;
      ASSERT_EQ(i128(layout.block_bytes(dtype)), block_bytes);
      ASSERT_EQ(i128(layout.ring_bytes_per_seq()), ring);

      const int64_t budget = log_uniform(rng, 63);
      const int64_t seqs = rng() % 4 == 0 ? 0 : log_uniform(rng, 63);
      Result<KvCapacity> capacity = kv_capacity(layout, dtype, budget, seqs);
      const i128 rings = i128(seqs) * ring;
      ASSERT_EQ(capacity.ok(), rings <= budget) << capacity.message();
      if (capacity.ok()) {
        ++capacities;
        const i128 blocks = (i128(budget) - rings) / block_bytes;
        ASSERT_EQ(i128(capacity->n_blocks), blocks);
        ASSERT_EQ(i128(capacity->n_tokens), blocks * block_size);
        ASSERT_EQ(i128(capacity->pool_bytes), blocks * block_bytes);
      }

      const int64_t request = log_uniform(rng, 63);
      Result<RequestConcurrency> concurrency = request_concurrency(layout, dtype, budget, request);
      const i128 request_blocks = (i128(request) + block_size - 1) / block_size;
      const i128 request_bytes = request_blocks * block_bytes + ring;
      ASSERT_EQ(concurrency.ok(), request_bytes <= kInt64Max) << concurrency.message();
      if (concurrency.ok()) {
        ++requests;
        ASSERT_EQ(i128(concurrency->blocks_per_request), request_blocks);
        ASSERT_EQ(i128(concurrency->bytes_per_request), request_bytes);
        ASSERT_EQ(i128(concurrency->max_requests), i128(budget) / request_bytes);
      }
    }
  }
  // The generator reaches every branch, not only the error paths.
  EXPECT_GT(layouts, 1000);
  EXPECT_GT(capacities, 1000);
  EXPECT_GT(requests, 1000);
}

TEST(CapacityProperties, BlocksForTokensIsExactCeilingUpToInt64Max) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 100000; ++iter) {
    const int64_t n = iter < 4 ? std::numeric_limits<int64_t>::max() - iter : log_uniform(rng, 63);
    const int64_t block = rng() % 2 ? 16 * std::uniform_int_distribution<int64_t>(1, 64)(rng)
                                    : log_uniform(rng, 63);
    ASSERT_EQ(i128(blocks_for_tokens(n, block)), (i128(n) + block - 1) / block) << n << " " << block;
  }
}

TEST(CapacityProperties, BlockSizeValidation) {
  for (int64_t bad : {int64_t{0}, int64_t{-16}, int64_t{8}, int64_t{17}, kMaxBlockSize + 16,
                      int64_t{36028797018963968}, std::numeric_limits<int64_t>::max(),
                      std::numeric_limits<int64_t>::min()}) {
    const Status status = validate_block_size(bad);
    EXPECT_FALSE(status.ok()) << bad;
    EXPECT_NE(status.message().find("block size"), std::string::npos) << status.message();
  }
  for (int64_t good : {int64_t{16}, int64_t{64}, kMaxBlockSize}) {
    EXPECT_TRUE(validate_block_size(good).ok()) << good;
  }
}

}  // namespace
}  // namespace e4kv
