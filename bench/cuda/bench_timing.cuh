// Timing shared by the CUDA benchmarks: median over 7 samples of (time of 10 back-to-back launches)
// / 10 after 3 warm-up launches, so host launch overhead overlaps device work as in a serving loop;
// the same for calls replayed from a CUDA graph; and the device-to-device copy bandwidth (bytes
// read + written) measured like the launches.
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

// Median over 7 samples of (time of `sample()` on `stream`) / per, after `warm_up()`.
template <class W, class F>
float sample_median_ms(cudaStream_t stream, int per, W&& warm_up, F&& sample) {
  constexpr int kSamples = 7;
  cudaEvent_t start, stop;
  E4KV_CUDA_CHECK(cudaEventCreate(&start));
  E4KV_CUDA_CHECK(cudaEventCreate(&stop));
  warm_up();
  std::vector<float> times;
  for (int i = 0; i < kSamples; ++i) {
    E4KV_CUDA_CHECK(cudaEventRecord(start, stream));
    sample();
    E4KV_CUDA_CHECK(cudaEventRecord(stop, stream));
    E4KV_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    E4KV_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / float(per));
  }
  E4KV_CUDA_CHECK(cudaEventDestroy(start));
  E4KV_CUDA_CHECK(cudaEventDestroy(stop));
  return median(times);
}

// One launch on the default stream, 10 per sample, 3 warm-up launches before.
template <class F>
float time_ms(F&& launch) {
  constexpr int kLaunches = 10;
  return sample_median_ms(
      cudaStream_t(nullptr), kLaunches,
      [&] {
        for (int j = 0; j < 3; ++j) launch();
      },
      [&] {
        for (int j = 0; j < kLaunches; ++j) launch();
      });
}

// One call of `enqueue(stream, i)`, replayed from a CUDA graph that holds the calls i = 0 ..
// calls - 1, captured once on a non-default stream; 2 warm-up replays, one replay per sample.
template <class F>
float graph_ms(F&& enqueue, int calls) {
  cudaStream_t stream;
  E4KV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  E4KV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) enqueue(stream, i);
  E4KV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  E4KV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const auto replay = [&] { E4KV_CUDA_CHECK(cudaGraphLaunch(exec, stream)); };
  const float ms = sample_median_ms(
      stream, calls, [&] { replay(), replay(); }, replay);
  E4KV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  E4KV_CUDA_CHECK(cudaGraphDestroy(graph));
  E4KV_CUDA_CHECK(cudaStreamDestroy(stream));
  return ms;
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
