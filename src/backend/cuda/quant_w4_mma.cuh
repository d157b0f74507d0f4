// The W4A16 linear on the tensor cores (AWQ codes, FP16 activations): y = x dequant(W)^T + bias,
// each weight decoded from its nibble straight into an mma.sync operand register, never through
// shared memory, and each weight byte read once per tile of x rows. The kernel behind
// quant_linear for AWQ weights whose shape it takes (w4_mma_supported) at few and middling rows;
// see quant_w4_mma.cu for the layout and the pipeline. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/status.h"
#include "quant/linear_view.h"

namespace e4kv::cuda {

// CTA tiles: x rows x weight rows (4 warps; the weight rows are 16 per warp along the weight, the
// rest of the warps split the reduction and add their sums at the end).
enum class W4MmaTile {
  kAuto,   // by n: 8x16 up to 8 rows, 16x32 up to 16, 32x64 up to 32, then 64x64
  k8x16,   // 1 x-row tile of 8, 16 weight rows, the reduction split over 4 warps
  k8x64,   // 8 x 64, 4 warps along the weight
  k16x32,  // 16 x 32, 2 warps along the weight, the reduction split in 2
  k16x64,  // 16 x 64
  k32x64,  // 32 x 64
  k64x64,  // 64 x 64
};
const char* w4_mma_tile_name(W4MmaTile tile);

// Whether quant_linear (kAuto) and the CUDA backend route AWQ weights to this kernel: off until
// its first GPU round has passed its tests and timed it against the register kernels; the
// environment variable E4KV_W4_MMA=on (read once) or set_w4_mma_auto(true) turns it on. Tests and benchmarks call quant_linear_w4_mma directly either way.
bool w4_mma_auto();
void set_w4_mma_auto(bool enabled);

// Whether the kernel takes w with x: an sm_80+ device (mma.m16n8k16, cp.async), kW4, in a multiple
// of 128, group a multiple of 32 dividing in, the codes and x 16-byte aligned, the scales 2-byte.
bool w4_mma_supported(const LinearView& w, const void* x);

// y[n, w.out] = x[n, w.in] dequant(w)^T + bias: x FP16; bias [w.out] FP16 or nullptr; y FP16 or,
// with y_f32, fp32. Each weight is (q - zero) * scale rounded once to FP16 (the value of the
// dequantized FP16 checkpoint), the products exact, the sums fp32. No allocation, no host wait.
// Errors: a weight or x w4_mma_supported refuses (naming why), n < 0.
Status quant_linear_w4_mma(const uint16_t* x, const LinearView& w, const uint16_t* bias, int64_t n,
                           void* y, bool y_f32, cudaStream_t stream,
                           W4MmaTile tile = W4MmaTile::kAuto);

}  // namespace e4kv::cuda
