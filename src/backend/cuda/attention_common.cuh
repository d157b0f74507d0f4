// Device helpers shared by the attention kernels (paged_decode_attention.cu,
// paged_prefill_attention.cu): the cache element types and the tensor-core instruction they use.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/e4m3_vec.cuh"

namespace e4kv::cuda {

// Cache element types: an FP16 page, or an E4M3 page with its decoder (software or native).
struct ElemF16 {
  static constexpr int kBytes = 2;
};

template <E4m3Decode kMode>
struct ElemE4m3 {
  static constexpr int kBytes = 1;
  using Decoder = E4m3Decoder<kMode>;
};

// D += A * B with A 16x8 (row-major fragments a0, a1), B 8x8 (column fragment b), FP16 inputs and
// fp32 accumulation: mma.sync m16n8k8, sm_75+.
__device__ __forceinline__ void mma_m16n8k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b));
}

// Two floats rounded to one FP16x2 word (lo in the low half).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace e4kv::cuda
