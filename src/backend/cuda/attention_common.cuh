// Device helpers shared by the attention kernels (paged_decode_attention.cu,
// paged_prefill_attention.cu): the cache element types, the tensor-core instruction they use, and
// asynchronous global-to-shared copies (cp.async, sm_80+).
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

// D += A * B with A 16x16 (fragments a0..a3), B 16x8 (b0, b1): mma.sync m16n8k16, sm_80+. Equal
// to m16n8k8 over (a0, a1, b0) then (a2, a3, b1), in one instruction. Trap below sm_80.
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  (void)c, (void)a0, (void)a1, (void)a2, (void)a3, (void)b0, (void)b1;
  __trap();
#endif
}

// Two floats rounded to one FP16x2 word (lo in the low half).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Asynchronous 16-byte copy global -> shared, bypassing L1 (cp.async.cg, sm_80+). Kernels that
// use it are launched only on sm_80+; on older targets the instance compiles to a trap.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
#else
  (void)smem;
  (void)gmem;
  __trap();
#endif
}

// Closes the group of copies issued by this thread since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace e4kv::cuda
