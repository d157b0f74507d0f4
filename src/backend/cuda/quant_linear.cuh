// Linear layers over quantized weights (quant/linear_weight.h: AWQ W4A16, NVFP4, FP8 with block
// scales) on the GPU: y = x dequant(W)^T (+ bias), FP16 x, fp32 products and sums, the weight
// dequantized in registers (quant/dequantize.h is the contract; backend/cpu's linear_quantized the
// oracle of tests/cuda/test_quant_linear_cuda.cpp). No allocation, no host synchronisation: the
// launch can be captured in a CUDA graph. Host-only header (no CUDA include beyond the stream
// type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string_view>

#include "core/status.h"
#include "quant/linear_view.h"

namespace e4kv::cuda {

// Whether the quantized kernels (this file and quant_moe.cuh) take `w` as the weight of `op`:
// ok, or an error naming op, the format and the shape, and what it needs: in a multiple of 4,
// out and in below 2^31, a group dividing in (kW4, kNvfp4), the planes of the format present;
// kDense (MoE experts only) with FP16 elements.
Status quant_weight_supported(const LinearView& w, std::string_view op);
// Whether `w` takes the 16-byte load paths (quant_gemv.cuh's Format): data 16-byte aligned and
//   kW4        in and group multiples of 32;
//   kNvfp4     in a multiple of 32, group 16;
//   kFp8Block  in and group multiples of 16 (the last block may be partial);
//   kDense     in a multiple of 8.
// Other supported weights take the per-element fallback (Exact: correct, several times slower).
bool quant_weight_fast_path(const LinearView& w);

// y[n, w.out] = x[n, w.in] dequant(w)^T + bias. x: FP16, 8-byte aligned; bias: [w.out] FP16 or
// nullptr; y: FP16 or, with y_f32, fp32. w: kW4, kNvfp4 or kFp8Block in device memory.
// Errors: a weight quant_weight_supported refuses, a misaligned x, n < 0.
// Which kernels quant_linear runs: kAuto takes quant_w4_mma.cuh's for an AWQ weight it supports
// (where w4_mma_auto()) and the kernels of this file otherwise; kRegisters always this file's (the
// GEMV up to 16 rows, the shared-memory tensor-core tiles above), kW4Mma always the
// fragment-decoding kernel (an error where it does not take the weight). The choice exists for the
// benchmark and the tests.
enum class QuantLinearPath { kAuto, kRegisters, kW4Mma };

Status quant_linear(const uint16_t* x, const LinearView& w, const uint16_t* bias, int64_t n,
                    void* y, bool y_f32, cudaStream_t stream,
                    QuantLinearPath path = QuantLinearPath::kAuto);

// Rows from which the CUDA backend's linear dequantizes the weight to FP16 (in slices of output
// rows through a fixed scratch) and multiplies with cuBLAS, as vLLM's AWQ layer does for long
// inputs: the GEMV is ALU-bound past a few rows (2.5 + n operations per weight) and the
// tensor-core tiles above dequantize each fragment once per 64-row tile; dequantizing once costs
// 2 bytes written and read per weight beside cuBLAS's own FP16 read (bench/RESULTS.md measures
// both against cuBLAS FP16).
inline constexpr int64_t kQuantDequantMinRows = 32;
// An AWQ weight that quant_w4_mma.cuh's kernel takes (and w4_mma_auto()) stays on it below this
// many rows (it reads
// each weight once per 64 x rows and feeds the tensor cores without a dequantized copy).
inline constexpr int64_t kW4MmaMaxRows = 128;

// FP16 rows [row0, row0 + rows) of dequant(w) into out [rows, w.in] (8-byte aligned): each
// element quant/dequantize.h's fp32 value rounded once to FP16. w: kW4, kNvfp4 or kFp8Block.
Status quant_dequantize_rows(const LinearView& w, int64_t row0, int64_t rows, uint16_t* out,
                             cudaStream_t stream);

}  // namespace e4kv::cuda
