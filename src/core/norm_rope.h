// RMSNorm and partial NeoX RoPE over one FP16 row: the CPU reference (the oracle) shared by the QSA
// indexer (compressed keys, index_q) and the model runtime (q, k per head).
//
// Numeric contract (a CUDA kernel must follow it to agree bit for bit, up to the reduction order
// noted below):
//   - Inputs and outputs are FP16 bit patterns; every step is computed in fp32 from the FP16 input
//     and the result is rounded to FP16 once (round to nearest even).
//   - RMSNorm: ss = sum_j x_j^2 accumulated in fp32 in index order j = 0..dim-1; ms = ss / dim;
//     r = 1 / sqrt(ms + eps) (fp32 sqrt and division, both correctly rounded);
//     out_j = fl16((x_j * r) * g_j) with g_j = 1 + w_j (kOnePlusWeight, Qwen3-Next / Qwen4Exp) or
//     g_j = w_j (kWeight, Llama), w_j the FP16 weight widened to fp32. Each product is an fp32 op.
//     A GPU tree reduction of ss may differ in the last fp32 bit, which can flip an FP16 rounding;
//     cross-backend tests allow 1 FP16 ulp.
//   - RoPE (NeoX, partial): dims [0, rotary_dim) rotate in pairs (i, i + rotary_dim / 2); dims
//     [rotary_dim, dim) pass through unchanged. inv_freq_i = theta^(-2i / rotary_dim) and the angle
//     pos * inv_freq_i are computed in double; cos and sin are computed in double and rounded to
//     fp32 (a GPU takes the same fp32 table from the host). Then, in fp32 without FMA:
//       out_i     = fl16(fl32(x_i * cos_i) - fl32(x_{i+h} * sin_i))
//       out_{i+h} = fl16(fl32(x_{i+h} * cos_i) + fl32(x_i * sin_i))
//     Each product is rounded to fp32 before the sum (the CPU code keeps them in separate
//     statements and the build uses ISO C++ mode, so the compiler does not contract them into an
//     FMA; CUDA code uses __fmul_rn / __fadd_rn / __fsub_rn).
#pragma once

#include <cstdint>
#include <vector>

#include "core/rms_norm_form.h"

namespace e4kv {

// out = RMSNorm(x). x, out: [dim] FP16 bits (out may alias x); weight: [dim] FP16 bits.
void rms_norm_row_f16(const uint16_t* x, const uint16_t* weight, int64_t dim, float eps,
                      RmsNormForm form, uint16_t* out);

// inv_freq_i = theta^(-2i / rotary_dim) for i in [0, rotary_dim / 2), in double (the "default"
// RoPE type; scaled RoPE variants supply their own table).
std::vector<double> rope_inv_freq(double theta, int64_t rotary_dim);

// cos_i, sin_i of pos * inv_freq_i, computed in double and rounded to fp32.
// inv_freq, cos, sin: [n_freq]
void rope_cos_sin(int64_t pos, const double* inv_freq, int64_t n_freq, float* cos, float* sin);

// Partial NeoX RoPE of one head row. x, out: [dim] FP16 bits (out may alias x);
// cos, sin: [rotary_dim / 2] fp32 from rope_cos_sin.
void rope_neox_row_f16(const uint16_t* x, int64_t dim, int64_t rotary_dim, const float* cos,
                       const float* sin, uint16_t* out);

}  // namespace e4kv
