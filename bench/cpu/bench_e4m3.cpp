// Host E4M3 codec throughput: the encode sits on the CPU cache-write path.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "e4kv/e4m3.h"

namespace {

void BM_E4m3Encode(benchmark::State& state) {
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> x(1 << 16);
  for (float& v : x) v = dist(rng);
  std::vector<uint8_t> out(x.size());
  const float scale = 0.0171247218f;
  for (auto _ : state) {
    for (size_t i = 0; i < x.size(); ++i) out[i] = e4kv::e4m3_encode(x[i], scale);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(x.size()));
}
BENCHMARK(BM_E4m3Encode);

void BM_E4m3Decode(benchmark::State& state) {
  std::vector<uint8_t> codes(1 << 16);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t((i * 37) & 0x7E);
  std::vector<float> out(codes.size());
  for (auto _ : state) {
    for (size_t i = 0; i < codes.size(); ++i) out[i] = e4kv::e4m3_decode(codes[i]);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(codes.size()));
}
BENCHMARK(BM_E4m3Decode);

}  // namespace
