// The KV pool's sizing at start-up (--kv-cache-memory-bytes, --gpu-memory-utilization) and its
// start-up summary, against figures worked out by hand at the seed's shapes (12 KV layers, all QSA,
// 2 KV heads of 256, index_dim 128, ratio 4: 1,622,016 bytes per FP16 block of 64, 835,584 per
// E4M3 block, 12,288 bytes of rings per sequence; see test_capacity.cpp) and for a dense model.
#include <gtest/gtest.h>

#include "kv/capacity.h"

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

TEST(KvPool, SummaryOfAnE4m3PoolAtTheSeedShapes) {
  const KvCacheLayout layout = kv_cache_layout(seed_config(), 64).value();
  // 1285 E4M3 blocks (what 1 GiB holds after one sequence's rings).
  const KvPoolSummary pool = *kv_pool_summary(layout, KvCacheDtype::kE4m3, 1285, 4096);
  EXPECT_EQ(pool.n_blocks, 1285);
  EXPECT_EQ(pool.n_tokens, 1285 * 64);  // 82,240
  // 1285 * 835,584 = 1,073,725,440 bytes; as FP16 blocks of 1,622,016: 661 (661.97), 42,304
  // tokens. Not 2x: the FP16 indexer rows take the same bytes in both.
  EXPECT_EQ(pool.pool_bytes, 1073725440);
  EXPECT_EQ(pool.fp16_equivalent_tokens, 661 * 64);
  // 4096 tokens = 64 blocks per sequence: 1285 / 64 = 20.078125 sequences.
  EXPECT_DOUBLE_EQ(pool.max_concurrency, 20.078125);
  // 4097 tokens take a 65th block: 1285 / 65.
  EXPECT_DOUBLE_EQ(kv_pool_summary(layout, KvCacheDtype::kE4m3, 1285, 4097)->max_concurrency,
                   1285.0 / 65.0);
}

TEST(KvPool, FpSixteenPoolIsItsOwnEquivalent) {
  ModelConfig config;
  config.n_layers = 2;
  config.n_heads = 2;
  config.n_kv_heads = 1;
  config.head_dim = 16;
  config.layers.assign(2, LayerKind::kFullAttention);
  const KvCacheLayout layout = kv_cache_layout(config, 16).value();
  // 2 layers * 16 tokens * 2 * 1 * 16 * 2 bytes = 2048 bytes per FP16 block, 1024 for E4M3.
  const KvPoolSummary f16 = *kv_pool_summary(layout, KvCacheDtype::kF16, 10, 64);
  EXPECT_EQ(f16.n_tokens, 160);
  EXPECT_EQ(f16.pool_bytes, 20480);
  EXPECT_EQ(f16.fp16_equivalent_tokens, 160);
  EXPECT_DOUBLE_EQ(f16.max_concurrency, 2.5);  // 10 blocks / 4 per 64-token sequence
  // 10 E4M3 blocks = 10,240 bytes = 5 FP16 blocks = 80 tokens: exactly half, no indexer.
  const KvPoolSummary e4m3 = *kv_pool_summary(layout, KvCacheDtype::kE4m3, 10, 64);
  EXPECT_EQ(e4m3.pool_bytes, 10240);
  EXPECT_EQ(e4m3.fp16_equivalent_tokens, 80);
  // 11 E4M3 blocks = 11,264 bytes: still 5 whole FP16 blocks.
  EXPECT_EQ(kv_pool_summary(layout, KvCacheDtype::kE4m3, 11, 64)->fp16_equivalent_tokens, 80);
}

TEST(KvPool, MustHoldOneSequenceOfTheMaxModelLength) {
  EXPECT_TRUE(check_pool_holds_max_model_len(4, 16, 64, "--flag").ok());
  EXPECT_TRUE(check_pool_holds_max_model_len(5, 16, 65, "--flag").ok());
  const Status short_pool = check_pool_holds_max_model_len(3, 16, 64, "--kv-cache-memory-bytes");
  ASSERT_FALSE(short_pool.ok());
  EXPECT_NE(short_pool.message().find("--kv-cache-memory-bytes"), std::string::npos);
  EXPECT_NE(short_pool.message().find("3 blocks of 16 tokens = 48 tokens"), std::string::npos)
      << short_pool.message();
  EXPECT_NE(short_pool.message().find("max model length of 64"), std::string::npos);
  EXPECT_FALSE(check_pool_holds_max_model_len(4, 16, 65, "--flag").ok());
  EXPECT_FALSE(check_pool_holds_max_model_len(0, 16, 1, "--flag").ok());
}

TEST(KvPool, UtilizationBudgetLeavesWhatTheRestOfTheProcessHolds) {
  // An 80 GiB card at 0.9: 77,309,411,328 bytes. 30 GiB used, of which 10 GiB a provisional pool:
  // 20 GiB (21,474,836,480) of weights and activations stay, 55,834,574,848 bytes are the pool's.
  const int64_t total = 80 * kGib;
  const int64_t budget = *kv_budget_for_utilization(total, 0.9, 30 * kGib, 10 * kGib);
  EXPECT_EQ(budget, 55834574848);
  // The seed's model with 64 sequences' rings (786,432 bytes) reserved: 55,833,788,416 /
  // 835,584 = 66,820.4 -> 66,820 E4M3 blocks, 4,276,480 tokens.
  const KvCacheLayout layout = kv_cache_layout(seed_config(), 64).value();
  const KvCapacity capacity = *kv_capacity(layout, KvCacheDtype::kE4m3, budget, 64);
  EXPECT_EQ(capacity.n_blocks, 66820);
  EXPECT_EQ(capacity.n_tokens, 4276480);
  // At 1.0 the whole card: 85,899,345,920 - 21,474,836,480.
  EXPECT_EQ(*kv_budget_for_utilization(total, 1.0, 30 * kGib, 10 * kGib), 64424509440);

  // 0.25 of the card is exactly what weights and activations take: nothing left, refused with
  // both figures.
  Result<int64_t> none = kv_budget_for_utilization(total, 0.25, 30 * kGib, 10 * kGib);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.message().find("21474836480"), std::string::npos) << none.message();
  EXPECT_NE(none.message().find("raise it"), std::string::npos) << none.message();
  // Out of range and inconsistent figures.
  EXPECT_FALSE(kv_budget_for_utilization(total, 0.0, 30 * kGib, 0).ok());
  EXPECT_FALSE(kv_budget_for_utilization(total, 1.01, 30 * kGib, 0).ok());
  EXPECT_FALSE(kv_budget_for_utilization(total, 0.9, total + 1, 0).ok());
  EXPECT_FALSE(kv_budget_for_utilization(total, 0.9, 10 * kGib, 11 * kGib).ok());
  EXPECT_FALSE(kv_budget_for_utilization(0, 0.9, 0, 0).ok());
}

}  // namespace
}  // namespace e4kv
