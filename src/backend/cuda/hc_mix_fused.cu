#include "backend/cuda/hc_mix_fused.cuh"

#include <cuda_fp16.h>

#include "backend/cuda/launch.cuh"
#include "core/check.h"
#include "core/status.h"

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStreams = 8;
constexpr int kMaxRankChunks = 4;  // rank <= 4 * 32 lanes * 8 values
constexpr int kColumnsPerWarp = 4;
constexpr size_t kMaxRowBytes = 48 * 1024;

struct HcMixParams {
  const uint16_t* x;
  const uint16_t* norm_weight;
  const uint16_t* down;
  const uint16_t* up;
  const uint16_t* inject;
  uint16_t* mix;
  uint16_t* inj;
  float* act;  // [n_rows, rank] silu(down / S), each value FP16-rounded
  float* inv;  // [n_rows, streams] the streams' 1 / rms
  int n_rows;
  int streams;
  int hidden;
  int rank;
  float eps;
};

__device__ __forceinline__ float h2f(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t f2h(float x) {
  return __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ float round_h(float x) {
  return h2f(f2h(x));
}

struct alignas(16) Half8 {
  uint16_t h[8];
};

__device__ __forceinline__ void load8(const uint16_t* p, float (&v)[8]) {
  const Half8 raw = *reinterpret_cast<const Half8*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = h2f(raw.h[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  return v;
}

// Sum over the CTA; every thread gets it. `partials`: [kWarps] shared; the caller synchronises
// before the next call writes it again.
__device__ __forceinline__ float block_sum(float v, float* partials) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) partials[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += partials[w];
  return total;
}

__global__ void __launch_bounds__(kThreads) hc_down_kernel(const __grid_constant__ HcMixParams p) {
  enter_dependent_grid();
  extern __shared__ __align__(16) uint16_t xn[];  // [streams * hidden] one normalised row
  __shared__ float partials[kWarps];
  __shared__ float inv_s[kMaxStreams];
  const int width = p.streams * p.hidden;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int down_blocks = (p.rank + kWarps - 1) / kWarps;
  const bool is_inject = int(blockIdx.x) >= down_blocks;
  const int out = (is_inject ? int(blockIdx.x) - down_blocks : int(blockIdx.x)) * kWarps + warp;
  const int n_out = is_inject ? p.streams : p.rank;
  const uint16_t* w_row = (is_inject ? p.inject : p.down) + int64_t(out) * width;
  for (int r = 0; r < p.n_rows; ++r) {
    const uint16_t* xr = p.x + int64_t(r) * width;
    for (int s = 0; s < p.streams; ++s) {
      float ss = 0.0f;
      for (int j = threadIdx.x * 8; j < p.hidden; j += kThreads * 8) {
        float v[8];
        load8(xr + s * p.hidden + j, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += v[i] * v[i];
      }
      ss = block_sum(ss, partials);
      if (threadIdx.x == 0) inv_s[s] = 1.0f / sqrtf(ss / float(p.hidden) + p.eps);
      __syncthreads();
    }
    for (int j = threadIdx.x * 8; j < width; j += kThreads * 8) {
      float v[8];
      float w[8];
      load8(xr + j, v);
      load8(p.norm_weight + j, w);
      const float inv = inv_s[j / p.hidden];  // hidden % 8 == 0: the 8 values share a stream
      Half8 packed;
#pragma unroll
      for (int i = 0; i < 8; ++i) packed.h[i] = f2h((v[i] * inv) * (1.0f + w[i]));
      *reinterpret_cast<Half8*>(xn + j) = packed;
    }
    if (blockIdx.x == 0 && threadIdx.x < p.streams) {
      p.inv[r * p.streams + int(threadIdx.x)] = inv_s[threadIdx.x];
    }
    __syncthreads();
    if (out < n_out) {
      float dot = 0.0f;
      for (int j = lane * 8; j < width; j += 32 * 8) {
        float a[8];
        float b[8];
        load8(xn + j, a);
        load8(w_row + j, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += a[i] * b[i];
      }
      dot = warp_sum(dot);
      if (lane == 0) {
        if (is_inject) {
          p.inj[r * p.streams + out] = f2h(dot);
        } else {
          const float scaled = round_h(dot) * (1.0f / float(p.streams));
          p.act[r * p.rank + out] = round_h(scaled / (1.0f + expf(-scaled)));
        }
      }
    }
    __syncthreads();  // the next row overwrites xn
  }
}

__global__ void __launch_bounds__(kThreads)
    hc_up_mix_kernel(const __grid_constant__ HcMixParams p) {
  enter_dependent_grid();
  extern __shared__ __align__(16) float act_s[];  // [n_rows, rank]
  for (int i = threadIdx.x; i < p.n_rows * p.rank; i += kThreads) act_s[i] = p.act[i];
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int width = p.streams * p.hidden;
  const int first = (int(blockIdx.x) * kWarps + warp) * kColumnsPerWarp;
  for (int c = 0; c < kColumnsPerWarp; ++c) {
    const int j = first + c;
    if (j >= p.hidden) break;
    float mix[kHcFusedMaxRows];
#pragma unroll
    for (int r = 0; r < kHcFusedMaxRows; ++r) mix[r] = 0.0f;
    for (int s = 0; s < p.streams; ++s) {
      const int col = s * p.hidden + j;
      const uint16_t* u_row = p.up + int64_t(col) * p.rank;
      float w[kMaxRankChunks][8];
#pragma unroll
      for (int k = 0; k < kMaxRankChunks; ++k) {
        const int at = (k * 32 + lane) * 8;
        if (at < p.rank) {
          load8(u_row + at, w[k]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) w[k][i] = 0.0f;
        }
      }
      const float gain = 1.0f + h2f(p.norm_weight[col]);
#pragma unroll
      for (int r = 0; r < kHcFusedMaxRows; ++r) {
        if (r >= p.n_rows) break;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < kMaxRankChunks; ++k) {
          const int at = (k * 32 + lane) * 8;
          if (at < p.rank) {
#pragma unroll
            for (int i = 0; i < 8; ++i) dot += act_s[r * p.rank + at + i] * w[k][i];
          }
        }
        dot = warp_sum(dot);
        const float u = round_h(dot);
        const float xn =
            round_h((h2f(p.x[int64_t(r) * width + col]) * p.inv[r * p.streams + s]) * gain);
        const float weighted = (1.0f / (1.0f + expf(-u))) * xn;
        mix[r] = s == 0 ? weighted : mix[r] + weighted;
      }
    }
    if (lane == 0) {
      for (int r = 0; r < p.n_rows; ++r) {
        p.mix[int64_t(r) * p.hidden + j] = f2h(mix[r] / float(p.streams));
      }
    }
  }
}

}  // namespace

bool hc_mix_fused_supported(int64_t n_rows, int64_t streams, int64_t hidden, int64_t rank) {
  return n_rows >= 1 && n_rows <= kHcFusedMaxRows && streams >= 1 && streams <= kMaxStreams &&
         hidden > 0 && hidden % 8 == 0 && rank > 0 && rank % 8 == 0 &&
         rank <= kMaxRankChunks * 32 * 8 && size_t(streams * hidden) * 2 <= kMaxRowBytes &&
         size_t(n_rows * rank) * 4 <= kMaxRowBytes;
}

size_t hc_mix_fused_scratch_bytes(int64_t n_rows, int64_t streams, int64_t rank) {
  return size_t(n_rows * (rank + streams)) * sizeof(float);
}

void hc_mix_fused_f16(const uint16_t* x, const uint16_t* norm_weight, const uint16_t* down,
                      const uint16_t* up, const uint16_t* inject, int64_t n_rows, int64_t streams,
                      int64_t hidden, int64_t rank, float eps, uint16_t* mix, uint16_t* inj,
                      void* scratch, cudaStream_t stream) {
  E4KV_ASSERT(hc_mix_fused_supported(n_rows, streams, hidden, rank),
              cat("hc_mix_fused_f16: unsupported shape: ", n_rows, " rows, ", streams,
                  " streams, hidden ", hidden, ", rank ", rank));
  E4KV_ASSERT((inject == nullptr) == (inj == nullptr),
              "hc_mix_fused_f16: inject and inj go together");
  HcMixParams p{};
  p.x = x;
  p.norm_weight = norm_weight;
  p.down = down;
  p.up = up;
  p.inject = inject;
  p.mix = mix;
  p.inj = inj;
  p.act = static_cast<float*>(scratch);
  p.inv = p.act + n_rows * rank;
  p.n_rows = int(n_rows);
  p.streams = int(streams);
  p.hidden = int(hidden);
  p.rank = int(rank);
  p.eps = eps;
  const int down_blocks = int((rank + kWarps - 1) / kWarps);
  const int inject_blocks = inject != nullptr ? int((streams + kWarps - 1) / kWarps) : 0;
  launch_kernel(hc_down_kernel,
                LaunchDims{dim3(unsigned(down_blocks + inject_blocks)), dim3(kThreads),
                           size_t(streams * hidden) * 2},
                stream, p);
  const int64_t columns_per_block = int64_t(kWarps) * kColumnsPerWarp;
  launch_kernel(hc_up_mix_kernel,
                LaunchDims{dim3(unsigned((hidden + columns_per_block - 1) / columns_per_block)),
                           dim3(kThreads), size_t(n_rows * rank) * sizeof(float)},
                stream, p);
}

}  // namespace e4kv::cuda
