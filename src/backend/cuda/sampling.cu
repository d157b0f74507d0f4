#include "backend/cuda/sampling.cuh"

#include <climits>

#include "backend/cuda/launch.cuh"
#include "core/sampling_noise.h"

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// The larger of two (value, index) candidates; the lower index among equal values.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

// Block-wide: every thread returns the best (value, index) of the block and the sum of `count`.
__device__ void reduce_best(float& v, int& i, int& count, float* sv, int* si, int* sc) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, v, offset);
    const int oi = __shfl_down_sync(0xffffffffu, i, offset);
    count += __shfl_down_sync(0xffffffffu, count, offset);
    better(v, i, ov, oi);
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
    sc[warp] = count;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? sv[lane] : -INFINITY;
    i = lane < kWarps ? si[lane] : INT_MAX;
    count = lane < kWarps ? sc[lane] : 0;
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ov = __shfl_down_sync(0xffffffffu, v, offset);
      const int oi = __shfl_down_sync(0xffffffffu, i, offset);
      count += __shfl_down_sync(0xffffffffu, count, offset);
      better(v, i, ov, oi);
    }
    if (lane == 0) {
      sv[0] = v;
      si[0] = i;
      sc[0] = count;
    }
  }
  __syncthreads();
  v = sv[0];
  i = si[0];
  count = sc[0];
  __syncthreads();  // the shared slots are reused by the next reduction
}

__global__ void __launch_bounds__(kThreads)
    sample_rows_kernel(const float* logits, int64_t vocab, const Backend::SampleRowParams* params,
                       int32_t* tokens, int32_t* non_finite) {
  enter_dependent_grid();
  __shared__ float sv[kWarps];
  __shared__ int si[kWarps];
  __shared__ int sc[kWarps];
  const Backend::SampleRowParams p = params[blockIdx.x];
  const float* row = logits + int64_t(p.logit_row) * vocab;
  const int n = int(vocab);

  float top = -INFINITY;
  int top_index = INT_MAX;
  int count = 0;
  for (int t = threadIdx.x; t < n; t += kThreads) {
    const float v = row[t];
    if (!isfinite(v)) {
      ++count;
    } else if (top_index == INT_MAX || v > top) {  // increasing t: the first of equals stays
      top = v;
      top_index = t;
    }
  }
  reduce_best(top, top_index, count, sv, si, sc);
  if (threadIdx.x == 0) non_finite[blockIdx.x] = count;
  if (top_index == INT_MAX) {  // no finite logit
    if (threadIdx.x == 0) tokens[blockIdx.x] = -1;
    return;
  }
  if (p.inv_temperature == 0.0f) {
    if (threadIdx.x == 0) tokens[blockIdx.x] = top_index;
    return;
  }
  const float threshold = top * p.inv_temperature + p.log_min_p;
  const uint64_t key = sampling_draw_key(p.seed, p.counter);
  float best = -INFINITY;
  int best_index = INT_MAX;
  int unused = 0;
  for (int t = threadIdx.x; t < n; t += kThreads) {
    const float v = row[t];
    if (!isfinite(v)) continue;
    const float s = v * p.inv_temperature;
    if (s < threshold) continue;
    const float k = s - logf(-logf(sampling_uniform(key, uint32_t(t))));
    if (best_index == INT_MAX || k > best) {
      best = k;
      best_index = t;
    }
  }
  reduce_best(best, best_index, unused, sv, si, sc);
  if (threadIdx.x == 0) tokens[blockIdx.x] = best_index == INT_MAX ? top_index : best_index;
}

}  // namespace

void sample_rows_f32(const float* logits, int64_t vocab, const Backend::SampleRowParams* params,
                     int64_t n, int32_t* tokens, int32_t* non_finite, cudaStream_t stream) {
  if (n == 0) return;
  launch_kernel(sample_rows_kernel, LaunchDims{dim3(unsigned(n)), dim3(kThreads)}, stream, logits,
                vocab, params, tokens, non_finite);
}

}  // namespace e4kv::cuda
