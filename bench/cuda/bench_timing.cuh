// Timing shared by the CUDA benchmarks: median over 7 samples of (time of 10 back-to-back launches)
// / 10 after 3 warm-up launches, so host launch overhead overlaps device work as in a serving loop;
// and the device-to-device copy bandwidth (bytes read + written) measured the same way.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_check.h"

namespace e4kv::bench {

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
float time_ms(F&& launch) {
  constexpr int kSamples = 7;
  constexpr int kLaunches = 10;
  cudaEvent_t start, stop;
  E4KV_CUDA_CHECK(cudaEventCreate(&start));
  E4KV_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> times;
  for (int i = 0; i < kSamples; ++i) {
    E4KV_CUDA_CHECK(cudaEventRecord(start));
    for (int j = 0; j < kLaunches; ++j) launch();
    E4KV_CUDA_CHECK(cudaEventRecord(stop));
    E4KV_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    E4KV_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / kLaunches);
  }
  E4KV_CUDA_CHECK(cudaEventDestroy(start));
  E4KV_CUDA_CHECK(cudaEventDestroy(stop));
  return median(times);
}

inline double copy_bandwidth_tbs() {
  const size_t bytes = size_t(2) << 30;
  void* a = nullptr;
  void* b = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&a, bytes));
  E4KV_CUDA_CHECK(cudaMalloc(&b, bytes));
  E4KV_CUDA_CHECK(cudaMemset(a, 1, bytes));
  const float ms =
      time_ms([&] { E4KV_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
  E4KV_CUDA_CHECK(cudaFree(a));
  E4KV_CUDA_CHECK(cudaFree(b));
  return 2.0 * double(bytes) / (ms * 1e-3) / 1e12;
}

}  // namespace e4kv::bench
