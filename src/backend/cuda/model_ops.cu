// The small FP16 ops of the model runtime (see model_ops.cuh). All are memory-bound and simple:
// grid-stride elementwise kernels, one warp per row for RMSNorm, one thread per rotated pair for
// RoPE. fp32 math throughout; FP16 results are rounded once (round to nearest even).
#include "backend/cuda/model_ops.cuh"

#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float h2f(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t f2h(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// A grid-stride launch over n elements.
LaunchDims flat(int64_t n) {
  const auto blocks = std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65536);
  return LaunchDims{dim3(static_cast<unsigned>(blocks)), dim3(kThreads)};
}

__global__ void gather_rows_kernel(const uint16_t* table, const int32_t* index, int64_t n,
                                   int64_t dim, uint16_t* out) {
  enter_dependent_grid();
  const int64_t total = n * dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / dim;
    out[i] = table[int64_t(index[row]) * dim + i % dim];
  }
}

// One warp per row: sum of squares in fp32, then x * r * g.
__global__ void rms_norm_kernel(const uint16_t* x, const uint16_t* weight, int64_t n_rows,
                                int64_t dim, float eps, bool one_plus, uint16_t* out) {
  enter_dependent_grid();
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n_rows) return;
  const uint16_t* xr = x + row * dim;
  float ss = 0.0f;
  for (int64_t j = lane; j < dim; j += 32) {
    const float v = h2f(xr[j]);
    ss += v * v;
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, off);
  const float r = 1.0f / sqrtf(ss / float(dim) + eps);
  uint16_t* yr = out + row * dim;
  for (int64_t j = lane; j < dim; j += 32) {
    const float w = h2f(weight[j]);
    yr[j] = f2h(h2f(xr[j]) * r * (one_plus ? 1.0f + w : w));
  }
}

// One CTA per row, for long rows (a warp per row would walk 4096 elements with 32 threads): with
// kAdd, each thread first makes its elements x = fp16(x + y) and writes them back; every thread
// sums the squares of its elements (of the rounded sum), the warps reduce by shuffles and warp 0
// the warps' sums; then each thread writes its elements' x * r * g (reading back what it wrote
// itself, so out may alias x without kAdd).
template <bool kAdd>
__global__ void __launch_bounds__(kThreads)
    row_rms_norm_kernel(uint16_t* x, const uint16_t* y, const uint16_t* weight, int64_t dim,
                        float eps, bool one_plus, uint16_t* out) {
  enter_dependent_grid();
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float inv_rms;
  const int64_t row = blockIdx.x;
  uint16_t* xr = x + row * dim;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < dim; j += kThreads) {
    float v = h2f(xr[j]);
    if constexpr (kAdd) {
      const uint16_t sum = f2h(v + h2f(y[row * dim + j]));
      xr[j] = sum;
      v = h2f(sum);
    }
    ss += v * v;
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float total = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
    for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xFFFFFFFFu, total, off);
    if (threadIdx.x == 0) inv_rms = 1.0f / sqrtf(total / float(dim) + eps);
  }
  __syncthreads();
  const float r = inv_rms;
  uint16_t* yr = out + row * dim;
  for (int64_t j = threadIdx.x; j < dim; j += kThreads) {
    const float w = h2f(weight[j]);
    yr[j] = f2h(h2f(xr[j]) * r * (one_plus ? 1.0f + w : w));
  }
}

__global__ void rope_neox_kernel(uint16_t* x, const float* cos, const float* sin, int64_t n_rows,
                                 int64_t n_heads, int64_t head_dim, int64_t rotary_dim) {
  enter_dependent_grid();
  const int64_t half = rotary_dim / 2;
  const int64_t total = n_rows * n_heads * half;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = i % half;
    const int64_t rh = i / half;  // row * n_heads + head
    const int64_t row = rh / n_heads;
    uint16_t* xh = x + rh * head_dim;
    const float a = h2f(xh[k]);
    const float b = h2f(xh[k + half]);
    const float c = cos[row * half + k];
    const float s = sin[row * half + k];
    xh[k] = f2h(a * c - b * s);
    xh[k + half] = f2h(b * c + a * s);
  }
}

__global__ void silu_mul_kernel(const uint16_t* gate, const uint16_t* up, uint16_t* out,
                                int64_t n) {
  enter_dependent_grid();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = h2f(gate[i]);
    out[i] = f2h(g / (1.0f + expf(-g)) * h2f(up[i]));
  }
}

__global__ void add_kernel(uint16_t* x, const uint16_t* y, int64_t n) {
  enter_dependent_grid();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = f2h(h2f(x[i]) + h2f(y[i]));
  }
}

__global__ void f32_to_f16_kernel(const float* src, uint16_t* dst, int64_t n) {
  enter_dependent_grid();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = f2h(src[i]);
  }
}

__global__ void broadcast_bias_kernel(const uint16_t* bias, int64_t n_rows, int64_t cols, void* y,
                                      bool y_f32) {
  enter_dependent_grid();
  const int64_t total = n_rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint16_t b = bias[i % cols];
    if (y_f32) {
      static_cast<float*>(y)[i] = h2f(b);
    } else {
      static_cast<uint16_t*>(y)[i] = b;
    }
  }
}

}  // namespace

void gather_rows_f16(const uint16_t* table, const int32_t* index, int64_t n, int64_t dim,
                     uint16_t* out, cudaStream_t stream) {
  if (n * dim == 0) return;
  launch_kernel(gather_rows_kernel, flat(n * dim), stream, table, index, n, dim, out);
}

void rms_norm_f16(const uint16_t* x, const uint16_t* weight, int64_t n_rows, int64_t dim, float eps,
                  RmsNormForm form, uint16_t* out, cudaStream_t stream) {
  if (n_rows == 0) return;
  if (dim >= kRmsNormBlockDim) {
    launch_kernel(row_rms_norm_kernel<false>,
                  LaunchDims{dim3(static_cast<unsigned>(n_rows)), dim3(kThreads)}, stream,
                  const_cast<uint16_t*>(x), static_cast<const uint16_t*>(nullptr), weight, dim,
                  eps, form == RmsNormForm::kOnePlusWeight, out);
    return;
  }
  constexpr int kRowsPerBlock = kThreads / 32;
  const unsigned grid = static_cast<unsigned>((n_rows + kRowsPerBlock - 1) / kRowsPerBlock);
  launch_kernel(rms_norm_kernel, LaunchDims{dim3(grid), dim3(kThreads)}, stream, x, weight, n_rows,
                dim, eps, form == RmsNormForm::kOnePlusWeight, out);
}

void rope_neox_f16(uint16_t* x, const float* cos, const float* sin, int64_t n_rows, int64_t n_heads,
                   int64_t head_dim, int64_t rotary_dim, cudaStream_t stream) {
  const int64_t total = n_rows * n_heads * (rotary_dim / 2);
  if (total == 0) return;
  launch_kernel(rope_neox_kernel, flat(total), stream, x, cos, sin, n_rows, n_heads, head_dim,
                rotary_dim);
}

void silu_mul_f16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n,
                  cudaStream_t stream) {
  if (n == 0) return;
  launch_kernel(silu_mul_kernel, flat(n), stream, gate, up, out, n);
}

void add_f16(uint16_t* x, const uint16_t* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  launch_kernel(add_kernel, flat(n), stream, x, y, n);
}

void f32_to_f16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  launch_kernel(f32_to_f16_kernel, flat(n), stream, src, dst, n);
}

void broadcast_bias(const uint16_t* bias, int64_t n_rows, int64_t cols, void* y, bool y_f32,
                    cudaStream_t stream) {
  if (n_rows * cols == 0) return;
  launch_kernel(broadcast_bias_kernel, flat(n_rows * cols), stream, bias, n_rows, cols, y, y_f32);
}

void add_rms_norm_f16(uint16_t* x, const uint16_t* y, const uint16_t* weight, int64_t n_rows,
                      int64_t dim, float eps, RmsNormForm form, uint16_t* out,
                      cudaStream_t stream) {
  if (n_rows == 0) return;
  launch_kernel(row_rms_norm_kernel<true>,
                LaunchDims{dim3(static_cast<unsigned>(n_rows)), dim3(kThreads)}, stream, x, y,
                weight, dim, eps, form == RmsNormForm::kOnePlusWeight, out);
}

}  // namespace e4kv::cuda
