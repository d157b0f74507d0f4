// Capacity arithmetic with exact integers worked out by hand, at the seed's shapes (48 layers, a
// QSA layer every 4th, 2 KV heads, head_dim 256, index_dim 128, ratio 4) and for a dense model.
#include "kv/capacity.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace e4kv {
namespace {

constexpr int64_t kGib = int64_t{1} << 30;

ModelConfig seed_config() {
  ModelConfig config;
  config.model_type = "qwen4_exp";
  config.n_layers = 48;
  config.n_heads = 16;
  config.n_kv_heads = 2;
  config.head_dim = 256;
  config.rotary_dim = 64;
  for (int64_t i = 0; i < 48; ++i) {
    config.layers.push_back((i + 1) % 4 == 0 ? LayerKind::kQsaAttention
                                             : LayerKind::kLinearAttention);
  }
  QsaConfig qsa;
  qsa.n_index_heads = 4;
  qsa.n_index_kv_heads = 1;
  qsa.index_dim = 128;
  qsa.budget = 2048;
  qsa.ratio = 4;
  config.qsa = qsa;
  return config;
}

TEST(Capacity, SeedShapesByteSizes) {
  const KvCacheLayout layout = kv_cache_layout(seed_config(), 64).value();
  EXPECT_EQ(layout.n_kv_layers, 12);
  EXPECT_EQ(layout.n_qsa_layers, 12);
  // main: 2 (K, V) * 2 heads * 256 dims * 2 bytes = 2048 per token per layer; E4M3 half of it.
  EXPECT_EQ(layout.main_bytes_per_token_per_layer(KvCacheDtype::kF16), 2048);
  EXPECT_EQ(layout.main_bytes_per_token_per_layer(KvCacheDtype::kE4m3), 1024);
  // compressed: 64 / 4 = 16 rows * 128 dims * 2 bytes = 4096 per block per QSA layer (64 B/token).
  EXPECT_EQ(layout.index_bytes_per_block_per_layer(), 4096);
  // block: 12 layers * (64 tokens * 2048 + 4096) = 12 * 135168 = 1,622,016 bytes (FP16)
  //        12 layers * (64 tokens * 1024 + 4096) = 12 *  69632 =   835,584 bytes (E4M3)
  EXPECT_EQ(layout.block_bytes(KvCacheDtype::kF16), 1622016);
  EXPECT_EQ(layout.block_bytes(KvCacheDtype::kE4m3), 835584);
  // per token: 1622016 / 64 = 25344 = 12 * 2112; 835584 / 64 = 13056 = 12 * 1088.
  EXPECT_DOUBLE_EQ(layout.bytes_per_token(KvCacheDtype::kF16), 25344.0);
  EXPECT_DOUBLE_EQ(layout.bytes_per_token(KvCacheDtype::kE4m3), 13056.0);
  // raw ring: 12 QSA layers * 4 keys * 128 dims * 2 bytes = 12,288 bytes per sequence.
  EXPECT_EQ(layout.ring_bytes_per_seq(), 12288);
}

TEST(Capacity, SeedShapesTokensForOneGib) {
  const KvCacheLayout layout = kv_cache_layout(seed_config(), 64).value();
  // pool = 1,073,741,824 - 12,288 (one sequence's rings) = 1,073,729,536 bytes.
  // FP16: 661 * 1,622,016 = 1,072,152,576 <= pool < 662 * 1,622,016 -> 661 blocks, 42,304 tokens.
  const KvCapacity f16 = *kv_capacity(layout, KvCacheDtype::kF16, kGib);
  EXPECT_EQ(f16.n_blocks, 661);
  EXPECT_EQ(f16.n_tokens, 42304);
  EXPECT_EQ(f16.pool_bytes, 1072152576);
  // E4M3: 1285 * 835,584 = 1,073,725,440 <= pool (4,096 bytes to spare) -> 1285 blocks, 82,240.
  const KvCapacity e4m3 = *kv_capacity(layout, KvCacheDtype::kE4m3, kGib);
  EXPECT_EQ(e4m3.n_blocks, 1285);
  EXPECT_EQ(e4m3.n_tokens, 82240);
  // Two sequences' rings (24,576 bytes) leave 1,073,717,248 < 1,073,725,440: one block fewer.
  EXPECT_EQ(kv_capacity(layout, KvCacheDtype::kE4m3, kGib, 2)->n_blocks, 1284);
  // No reservation: 1,073,741,824 / 835,584 -> still 1285 (16,384 to spare).
  EXPECT_EQ(kv_capacity(layout, KvCacheDtype::kE4m3, kGib, 0)->n_blocks, 1285);

  const double ratio = double(e4m3.n_tokens) / double(f16.n_tokens);
  // Asymptotically 2112 / 1088 = 33 / 17 = 1.941176...; whole blocks at 1 GiB give 1.944.
  EXPECT_GT(ratio, 1.83);
  EXPECT_NEAR(ratio, 82240.0 / 42304.0, 1e-12);
  const double asymptotic =
      layout.bytes_per_token(KvCacheDtype::kF16) / layout.bytes_per_token(KvCacheDtype::kE4m3);
  EXPECT_NEAR(asymptotic, 33.0 / 17.0, 1e-12);
  std::printf(
      "[ capacity ] seed shapes, block 64, 1 GiB: FP16 %lld tokens, E4M3 %lld tokens -> %.4fx "
      "(bytes/token 25344 vs 13056 -> %.4fx asymptotic; the seed's engine reported 1.83x)\n",
      static_cast<long long>(f16.n_tokens), static_cast<long long>(e4m3.n_tokens), ratio,
      asymptotic);
}

TEST(Capacity, SeedShapesConcurrencyFor128kRequests) {
  const KvCacheLayout layout = kv_cache_layout(seed_config(), 64).value();
  const int64_t budget = 40 * kGib;  // 42,949,672,960 bytes
  // ceil(128001 / 64) = 2001 blocks per request.
  // FP16: 2001 * 1,622,016 + 12,288 = 3,245,666,304 bytes; 42,949,672,960 / that = 13.23 -> 13.
  const RequestConcurrency f16 = *request_concurrency(layout, KvCacheDtype::kF16, budget, 128001);
  EXPECT_EQ(f16.blocks_per_request, 2001);
  EXPECT_EQ(f16.bytes_per_request, 3245666304);
  EXPECT_EQ(f16.max_requests, 13);
  EXPECT_NEAR(f16.max_concurrency, 42949672960.0 / 3245666304.0, 1e-9);
  // E4M3: 2001 * 835,584 + 12,288 = 1,672,015,872 bytes -> 25.69 -> 25 requests.
  const RequestConcurrency e4m3 = *request_concurrency(layout, KvCacheDtype::kE4m3, budget, 128001);
  EXPECT_EQ(e4m3.bytes_per_request, 1672015872);
  EXPECT_EQ(e4m3.max_requests, 25);
  EXPECT_NEAR(e4m3.max_concurrency, 42949672960.0 / 1672015872.0, 1e-9);
  std::printf("[ capacity ] seed shapes, 40 GiB, 128001-token requests: %.2fx FP16, %.2fx E4M3\n",
              f16.max_concurrency, e4m3.max_concurrency);
}

TEST(Capacity, SmallerBlocksCountTheSameBytesPerToken) {
  const KvCacheLayout layout = kv_cache_layout(seed_config(), 16).value();
  // 12 * (16 * 2048 + 4 rows * 256) = 12 * 33792 = 405,504; E4M3 12 * (16 * 1024 + 1024) = 208,896.
  EXPECT_EQ(layout.block_bytes(KvCacheDtype::kF16), 405504);
  EXPECT_EQ(layout.block_bytes(KvCacheDtype::kE4m3), 208896);
  // (1,073,741,824 - 12,288) / 405,504 = 2647.9 -> 2647 blocks, 42,352 tokens.
  EXPECT_EQ(kv_capacity(layout, KvCacheDtype::kF16, kGib)->n_tokens, 42352);
  // (1,073,741,824 - 12,288) / 208,896 = 5140.0 (5140 * 208,896 = 1,073,725,440) -> 82,240 tokens.
  EXPECT_EQ(kv_capacity(layout, KvCacheDtype::kE4m3, kGib)->n_tokens, 82240);
}

TEST(Capacity, DenseModelHasNoIndexerOverhead) {
  ModelConfig config;
  config.n_layers = 4;
  config.n_heads = 32;
  config.n_kv_heads = 8;
  config.head_dim = 128;
  config.layers.assign(4, LayerKind::kFullAttention);
  const KvCacheLayout layout = kv_cache_layout(config, 16).value();
  // 4 layers * 16 tokens * 2 * 8 * 128 * 2 bytes = 262,144 bytes per FP16 block, half for E4M3.
  EXPECT_EQ(layout.block_bytes(KvCacheDtype::kF16), 262144);
  EXPECT_EQ(layout.block_bytes(KvCacheDtype::kE4m3), 131072);
  EXPECT_EQ(layout.ring_bytes_per_seq(), 0);
  // 1 MiB: 4 FP16 blocks (64 tokens), 8 E4M3 blocks (128 tokens): exactly 2x.
  EXPECT_EQ(kv_capacity(layout, KvCacheDtype::kF16, 1 << 20)->n_tokens, 64);
  EXPECT_EQ(kv_capacity(layout, KvCacheDtype::kE4m3, 1 << 20)->n_tokens, 128);
  // 100-token requests: 7 blocks; 1 MiB / (7 * 131,072) = 1.14 -> 1 request.
  const RequestConcurrency c = *request_concurrency(layout, KvCacheDtype::kE4m3, 1 << 20, 100);
  EXPECT_EQ(c.blocks_per_request, 7);
  EXPECT_EQ(c.max_requests, 1);
  // A budget below one block holds nothing.
  EXPECT_EQ(kv_capacity(layout, KvCacheDtype::kF16, 262143)->n_blocks, 0);
}

TEST(Capacity, RejectsBadBlockSizesAndModelsWithoutKvCache) {
  const ModelConfig seed = seed_config();
  EXPECT_FALSE(kv_cache_layout(seed, 24).ok());
  EXPECT_FALSE(kv_cache_layout(seed, 0).ok());
  EXPECT_NE(kv_cache_layout(seed, 24).message().find("multiple of 16"), std::string::npos);
  ModelConfig coarse = seed;
  coarse.qsa->ratio = 32;
  EXPECT_NE(kv_cache_layout(coarse, 16).message().find("compress ratio 32"), std::string::npos);
  ASSERT_TRUE(kv_cache_layout(coarse, 64).ok());
  // One ring slot per key of a group: 12 layers * 32 keys * 128 dims * 2 bytes = 98,304 bytes.
  EXPECT_EQ(kv_cache_layout(coarse, 64)->ring_bytes_per_seq(), 98304);
  // With speculative tokens the ring holds 2 * ratio keys; fewer than ratio cannot form a group.
  EXPECT_EQ(kv_cache_layout(seed, 64, 8)->ring_bytes_per_seq(), 24576);
  EXPECT_NE(kv_cache_layout(seed, 64, 3).message().find("below the QSA compress ratio"),
            std::string::npos);
  ModelConfig linear = seed;
  linear.layers.assign(48, LayerKind::kLinearAttention);
  EXPECT_NE(kv_cache_layout(linear, 64).message().find("no layer with a KV cache"),
            std::string::npos);
}

TEST(Capacity, HybridStatesPerSequence) {
  // The seed's shapes with the Qwen4Exp family fields at their class defaults: 36 GatedDeltaNet
  // layers (16 key / 32 value heads of 128, conv 4) and PLE on one layer (hc 4, hidden 2048).
  ModelConfig config = seed_config();
  config.hidden_size = 2048;
  Qwen4ExpConfig q;
  q.ple_layers = {0};
  config.qwen4exp = q;
  const KvCacheLayout layout = kv_cache_layout(config, 64).value();
  // DeltaNet: conv (4 - 1) * (2 * 16 * 128 + 32 * 128 = 8192) * 2 = 49,152; recurrent
  // 32 * 128 * 128 * 4 = 2,097,152; 36 layers * 2,146,304 = 77,266,944. PLE: (4 - 1) * 3 * 4 *
  // 2048 * 2 = 147,456. Total 77,414,400 bytes per sequence.
  EXPECT_EQ(layout.state_bytes_per_seq, 77414400);
  EXPECT_EQ(layout.bytes_per_seq(), 77414400 + 12288);
  // They come off the budget with the rings: 1 GiB - 77,426,688 = 996,315,136 bytes of blocks;
  // E4M3 blocks of 835,584 bytes: 1192 (996,016,128).
  EXPECT_EQ(kv_capacity(layout, KvCacheDtype::kE4m3, kGib)->n_blocks, 1192);
  // 14 sequences' states fit in 1 GiB (1,083,973,632 > 1 GiB for 14; 13: 1,006,546,944).
  EXPECT_TRUE(kv_capacity(layout, KvCacheDtype::kE4m3, kGib, 13).ok());
  EXPECT_NE(kv_capacity(layout, KvCacheDtype::kE4m3, kGib, 14).message().find("per-sequence"),
            std::string::npos);
  // A request adds its blocks to one sequence's bytes.
  const RequestConcurrency c = *request_concurrency(layout, KvCacheDtype::kE4m3, kGib, 64);
  EXPECT_EQ(c.bytes_per_request, 835584 + 77426688);
}

}  // namespace
}  // namespace e4kv
