// Device helpers shared by the attention kernels (paged_decode_attention.cu,
// paged_prefill_attention.cu), the index scores and the MoE GEMM: the cache element types, the
// tensor-core instructions and matrix loads they use (each with its Volta path, arch.cuh), and
// asynchronous global-to-shared copies (cp.async, sm_80+).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/arch.cuh"
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

// The lane's index in its warp.
__device__ __forceinline__ unsigned lane_index() {
  unsigned lane;
  asm("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return lane;
}

#if defined(__CUDA_ARCH__) && E4KV_DEVICE_ARCH < 750
namespace volta {

// D (8 fp32 per lane) += A * B for four independent 8x8x4 products, one per quad pair (lanes
// 4q..4q+3 and 4q+16..4q+19): mma.sync m8n8k4, sm_70. Both operands column-major: lane l holds
// A's column l % 4 (rows 0-3, or 4-7 in the high half-warp) in a0, a1, and B's column
// l % 4 (+4 in the high half) over k = 0..3 in b0, b1.
__device__ __forceinline__ void mma_m8n8k4(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t b0,
                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.col.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

}  // namespace volta
#endif

// D += A * B with A 16x8 (row-major fragments a0, a1), B 8x8 (column fragment b), FP16 inputs and
// fp32 accumulation, in the m16n8k8 fragment layout: lane l (g = l / 4, t = l % 4) holds
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], b = B[2t..2t+1][g], c = D[g][2t..2t+1],
// D[g+8][2t..2t+1]. sm_75+: one mma.sync m16n8k8.
//
// Volta path (E4KV_DEVICE_ARCH < 750): two mma.sync m8n8k4, the first over k = 0, 2, 4, 6 and the
// second over k = 1, 3, 5, 7, so that each lane's A operand is its own a0 / a1 halves (no
// shuffle). Quad pair q computes rows {q, q, q+8, q+8} (low half-warp) or {q+4, q+4, q+12, q+12}
// (high) of D, each row twice, over the columns permuted so that every lane ends up holding its
// own four outputs among its eight accumulators: D[(t & 1) * 4 + j] is c[j]. The other four are
// the neighbouring lane's outputs computed from a don't-care accumulator and dropped. B's columns
// come from the lanes that hold them: four shuffles.
__device__ __forceinline__ void mma_m16n8k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
#if defined(__CUDA_ARCH__) && E4KV_DEVICE_ARCH < 750
  const unsigned lane = lane_index();
  const unsigned r = lane & 3;
  const unsigned n = r + 2 * ((r >> 1) + (lane >> 4));  // the B column this lane feeds
  const uint32_t x0 = __shfl_sync(0xffffffffu, b, int(4 * n + 0));
  const uint32_t x1 = __shfl_sync(0xffffffffu, b, int(4 * n + 1));
  const uint32_t x2 = __shfl_sync(0xffffffffu, b, int(4 * n + 2));
  const uint32_t x3 = __shfl_sync(0xffffffffu, b, int(4 * n + 3));
  float d[8] = {c[0], c[1], c[2], c[3], c[0], c[1], c[2], c[3]};
  // k = 2i: the low halves; k = 2i + 1: the high halves.
  volta::mma_m8n8k4(d, __byte_perm(a0, a0, 0x1010), __byte_perm(a1, a1, 0x1010),
                    __byte_perm(x0, x1, 0x5410), __byte_perm(x2, x3, 0x5410));
  volta::mma_m8n8k4(d, __byte_perm(a0, a0, 0x3232), __byte_perm(a1, a1, 0x3232),
                    __byte_perm(x0, x1, 0x7632), __byte_perm(x2, x3, 0x7632));
  const bool odd = (r & 1) != 0;
  c[0] = odd ? d[4] : d[0];
  c[1] = odd ? d[5] : d[1];
  c[2] = odd ? d[6] : d[2];
  c[3] = odd ? d[7] : d[3];
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b));
#endif
}

// D += A * B with A 16x16 (fragments a0..a3), B 16x8 (b0, b1): mma.sync m16n8k16, sm_80+. Equal
// to m16n8k8 over (a0, a1, b0) then (a2, a3, b1), in one instruction. Trap below sm_80.
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
#if E4KV_DEVICE_ARCH >= 800
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
#if E4KV_DEVICE_ARCH >= 800
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
#if E4KV_DEVICE_ARCH >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if E4KV_DEVICE_ARCH >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Four 8x8 FP16 matrices from shared memory in the m16n8k8 operand layout: lanes 8j..8j+7 pass
// the addresses of matrix j's rows; lane l receives row l / 4, columns 2(l % 4)..+1 of matrix j in
// r[j] (trans: of the transposed matrix). sm_75+: ldmatrix. Volta path: the row addresses by
// shuffle and plain shared loads (4-byte words; two 2-byte loads per word transposed).
__device__ __forceinline__ uint32_t shared_window_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* ptr) {
#if defined(__CUDA_ARCH__) && E4KV_DEVICE_ARCH < 750
  const uint32_t addr = shared_window_address(ptr);
  const unsigned lane = lane_index();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t row = __shfl_sync(0xffffffffu, addr, int(8 * j + (lane >> 2)));
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r[j]) : "r"(row + 4 * (lane & 3)));
  }
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_window_address(ptr)));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* ptr) {
#if defined(__CUDA_ARCH__) && E4KV_DEVICE_ARCH < 750
  const uint32_t addr = shared_window_address(ptr);
  const unsigned lane = lane_index();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t row0 = __shfl_sync(0xffffffffu, addr, int(8 * j + 2 * (lane & 3)));
    const uint32_t row1 = __shfl_sync(0xffffffffu, addr, int(8 * j + 2 * (lane & 3) + 1));
    unsigned short lo, hi;
    asm volatile("ld.shared.b16 %0, [%1];\n" : "=h"(lo) : "r"(row0 + 2 * (lane >> 2)));
    asm volatile("ld.shared.b16 %0, [%1];\n" : "=h"(hi) : "r"(row1 + 2 * (lane >> 2)));
    r[j] = uint32_t(lo) | uint32_t(hi) << 16;
  }
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_window_address(ptr)));
#endif
}

}  // namespace e4kv::cuda
