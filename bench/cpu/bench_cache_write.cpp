// CPU reference cache write (one layer, seed shapes: 2 KV heads x 256) FP16 vs E4M3, and the QSA
// indexer write in prefill and decode. The reference is the oracle, not the fast path; these
// numbers say how long tests and the CPU backend wait on it.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "backend/cpu/cache_write.h"
#include "core/half.h"
#include "core/norm_rope.h"
#include "qsa/indexer_cache.h"

namespace {

using namespace e4kv;

void BM_CacheWrite(benchmark::State& state) {
  const KvCacheDtype dtype = state.range(0) == 0 ? KvCacheDtype::kF16 : KvCacheDtype::kE4m3;
  const int64_t n_tokens = state.range(1);
  KvCacheGeometry g;
  g.block_size = 64;
  g.n_kv_heads = 2;
  g.head_dim = 256;
  g.dtype = dtype;
  g.n_blocks = (n_tokens + 63) / 64;
  std::vector<uint8_t> storage(g.total_bytes());  // [n_blocks, 2, 64, 2, 256]
  KvCacheView cache{storage.data(), g, 0.0171247218f, 0.0841238871f};
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<uint16_t> k(static_cast<size_t>(n_tokens * g.row_elems()));  // [n_tokens, 2, 256]
  std::vector<uint16_t> v(k.size());
  for (auto& x : k) x = f32_to_f16(dist(rng));
  for (auto& x : v) x = f32_to_f16(dist(rng));
  std::vector<int64_t> slots(static_cast<size_t>(n_tokens));
  for (int64_t t = 0; t < n_tokens; ++t) slots[size_t(t)] = t;
  for (auto _ : state) {
    benchmark::DoNotOptimize(cache_write(cache, k.data(), v.data(), slots.data(), n_tokens));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * n_tokens);
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(k.size() + v.size()) * 2);
}
BENCHMARK(BM_CacheWrite)->ArgsProduct({{0, 1}, {1, 4096}})->ArgNames({"e4m3", "tokens"});

void BM_IndexerWrite(benchmark::State& state) {
  const int64_t n_tokens = state.range(0);  // 1: a decode step (one group in four completes)
  const int64_t dim = 128;
  const int64_t block_size = 64;
  const int64_t n_blocks = (n_tokens + 4 + block_size - 1) / block_size;
  std::vector<uint16_t> compressed(static_cast<size_t>(n_blocks * (block_size / 4) * dim));
  std::vector<uint16_t> ring(static_cast<size_t>(4 * dim));
  const IndexerCompressedView cview{compressed.data(), n_blocks, block_size, 4, dim};
  const IndexerRingView rview{ring.data(), 1, 4, dim};
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  for (int64_t b = 0; b < n_blocks; ++b) table[size_t(b)] = static_cast<int32_t>(b);
  std::mt19937 rng(2);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> keys(static_cast<size_t>(n_tokens * dim));  // [n_tokens, 128]
  for (auto& x : keys) x = f32_to_f16(dist(rng));
  std::vector<uint16_t> weight(static_cast<size_t>(dim), f32_to_f16(0.1f));
  const std::vector<double> inv_freq = rope_inv_freq(1.0e7, 64);
  const IndexerKeyNormRope norm_rope{weight.data(), 1e-6f, 64, inv_freq.data()};
  const int32_t offsets[2] = {0, static_cast<int32_t>(n_tokens)};
  // Decode: position 3 completes a group; prefill starts at 0.
  const int64_t start = n_tokens == 1 ? 3 : 0;
  const int32_t ring_index = 0;
  IndexerWriteBatch batch;
  batch.index_k = keys.data();
  batch.token_offsets = offsets;
  batch.start_pos = &start;
  batch.ring_index = &ring_index;
  batch.n_seqs = 1;
  batch.block_tables = {table.data(), 1, n_blocks};
  for (auto _ : state) {
    indexer_cache_write(cview, rview, batch, norm_rope);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * n_tokens);
}
BENCHMARK(BM_IndexerWrite)->Arg(1)->Arg(4096);

}  // namespace
