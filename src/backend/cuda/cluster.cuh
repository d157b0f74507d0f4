// Thread-block cluster helpers (sm_90+): relaxed cluster barrier halves, the CTA's rank, and data
// exchange through distributed shared memory by st.async into the receiver's shared memory,
// counted by the receiver's mbarrier (the sender needs no fence and no barrier: the receiver waits
// for the bytes it expects). Used by the top-k's cluster method and the decode attention's
// cluster merge. Device-only; every function compiles to nothing usable below sm_90, so callers
// guard their use with E4KV_DEVICE_ARCH >= 900 (arch.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/arch.cuh"

namespace e4kv::cuda {

#if !defined(__CUDA_ARCH__) || E4KV_DEVICE_ARCH >= 900
// Cluster barrier halves without a memory fence: the data the CTAs exchange travels by st.async
// into the receiver's shared memory and is tracked by the receiver's mbarrier, so no barrier has
// to publish it (a release arrive costs a GPU-scope MEMBAR: ncu put about 1.5K cycles on each).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
__device__ __forceinline__ uint32_t shared_address(const void* local) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(local));
}
// The shared::cluster address of `local` (a shared-memory variable of this CTA) in CTA `rank`.
__device__ __forceinline__ uint32_t peer_address(const void* local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(shared_address(local)), "r"(rank));
  return remote;
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(shared_address(bar)) : "memory");
}
// The single arrival of the barrier's phase, announcing `bytes` of st.async data (which may have
// landed already: the transaction count may go below zero meanwhile).
__device__ __forceinline__ void mbarrier_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)),
      "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0u;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (done == 0u);
}
// 8 bytes into CTA `rank`'s shared memory at `local`'s place, counted by its `bar`.
__device__ __forceinline__ void send_async(const void* local, uint32_t rank, uint32_t a, uint32_t b,
                                           uint64_t* bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.u32 [%0], {%1, %2}, [%3];\n" ::"r"(
          peer_address(local, rank)),
      "r"(a), "r"(b), "r"(peer_address(bar, rank))
      : "memory");
}
// 16 bytes into CTA `rank`'s shared memory at `local`'s place (16-byte aligned), counted by its
// `bar`.
__device__ __forceinline__ void send_async4(const void* local, uint32_t rank, float a, float b,
                                            float c, float d, uint64_t* bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, "
      "[%5];\n" ::"r"(peer_address(local, rank)),
      "f"(a), "f"(b), "f"(c), "f"(d), "r"(peer_address(bar, rank))
      : "memory");
}
#endif

}  // namespace e4kv::cuda
