// The small FP16 ops of the model runtime on the GPU: row gather, RMSNorm, NeoX RoPE, SiLU-gate,
// residual add, dtype conversion and bias broadcast. fp32 math, FP16 in and out, one launch each on
// the given stream. Host-only header. The contracts are Backend's (backend/backend.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/rms_norm_form.h"

namespace e4kv::cuda {

// out[i] = table[index[i]]. table: [n_table, dim] FP16; index: [n]; out: [n, dim] FP16
void gather_rows_f16(const uint16_t* table, const int32_t* index, int64_t n, int64_t dim,
                     uint16_t* out, cudaStream_t stream);

// x, out: [n_rows, dim] FP16 (may alias); weight: [dim] FP16. Rows of at least
// kRmsNormBlockDim elements take a CTA each, shorter ones (per-head norms) a warp each.
inline constexpr int64_t kRmsNormBlockDim = 1024;
void rms_norm_f16(const uint16_t* x, const uint16_t* weight, int64_t n_rows, int64_t dim, float eps,
                  RmsNormForm form, uint16_t* out, cudaStream_t stream);

// In place. x: [n_rows, n_heads, head_dim] FP16; cos, sin: [n_rows, rotary_dim / 2] fp32
void rope_neox_f16(uint16_t* x, const float* cos, const float* sin, int64_t n_rows,
                   int64_t n_heads, int64_t head_dim, int64_t rotary_dim, cudaStream_t stream);

// out = silu(gate) * up. [n] FP16 each
void silu_mul_f16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n,
                  cudaStream_t stream);

// x += y. [n] FP16 each
void add_f16(uint16_t* x, const uint16_t* y, int64_t n, cudaStream_t stream);

// x += y (rounded to FP16), then out = rms_norm(x): one CTA per row. x, y, out: [n_rows, dim]
// FP16 (out aliasing neither); weight: [dim] FP16
void add_rms_norm_f16(uint16_t* x, const uint16_t* y, const uint16_t* weight, int64_t n_rows,
                      int64_t dim, float eps, RmsNormForm form, uint16_t* out,
                      cudaStream_t stream);

// dst = round_to_f16(src). [n] each
void f32_to_f16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream);

// y[r] = bias for every row r. bias: [cols] FP16; y: [n_rows, cols] FP16 (y_f32 false) or fp32
void broadcast_bias(const uint16_t* bias, int64_t n_rows, int64_t cols, void* y, bool y_f32,
                    cudaStream_t stream);

}  // namespace e4kv::cuda
