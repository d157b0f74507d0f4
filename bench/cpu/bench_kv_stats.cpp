// Calibration statistics collector (calib/kv_stats.h) throughput: it sits on the cache-write path,
// so it must cost about as little as the write itself. Values are K-like FP16 rows (Gaussian, one
// channel in 16 an outlier) in cache-write sized batches: one decode row of 2 heads x 256, a
// 32-token chunk, and a 4096-token prefill of 8 heads x 128.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "calib/kv_stats.h"
#include "core/half.h"

namespace {

std::vector<float> k_like_values(size_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 0.15f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = dist(rng) * ((i % 128) % 16 == 0 ? 35.0f : 1.0f);
  return x;
}

std::vector<uint16_t> to_fp16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = e4kv::f32_to_f16(x[i]);
  return h;
}

void BM_KvStatsObserveFp16(benchmark::State& state) {
  const std::vector<uint16_t> values = to_fp16(k_like_values(size_t(state.range(0))));
  e4kv::KvTensorStats stats;
  for (auto _ : state) {
    stats.observe(values.data(), int64_t(values.size()));
    benchmark::ClobberMemory();
  }
  benchmark::DoNotOptimize(stats.count());
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(values.size()));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(values.size() * 2));
}
BENCHMARK(BM_KvStatsObserveFp16)->Arg(512)->Arg(32 * 512)->Arg(4096 * 1024);

void BM_KvStatsObserveFp32(benchmark::State& state) {
  const std::vector<float> values = k_like_values(size_t(state.range(0)));
  e4kv::KvTensorStats stats;
  for (auto _ : state) {
    stats.observe(values.data(), int64_t(values.size()));
    benchmark::ClobberMemory();
  }
  benchmark::DoNotOptimize(stats.count());
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(values.size()));
}
BENCHMARK(BM_KvStatsObserveFp32)->Arg(32 * 512);

// The obvious alternative, for comparison: bin = floor(8 * log2|x|) through the math library.
void BM_KvStatsLog2Baseline(benchmark::State& state) {
  const std::vector<uint16_t> values = to_fp16(k_like_values(size_t(state.range(0))));
  std::vector<int64_t> hist(e4kv::kKvHistBins + 2, 0);
  for (auto _ : state) {
    for (uint16_t h : values) {
      const float x = std::fabs(e4kv::f16_to_f32(h));
      if (x == 0.0f || !std::isfinite(x)) {
        ++hist[e4kv::kKvHistBins];
        continue;
      }
      ++hist[size_t(int(std::floor(8.0f * std::log2(x))) + 192)];
    }
    benchmark::ClobberMemory();
  }
  benchmark::DoNotOptimize(hist.data());
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(values.size()));
}
BENCHMARK(BM_KvStatsLog2Baseline)->Arg(32 * 512);

}  // namespace
