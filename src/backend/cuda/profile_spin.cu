#include "backend/cuda/profile_spin.cuh"

#include "backend/cuda/cuda_check.h"

namespace e4kv::cuda {
namespace {

__device__ __forceinline__ unsigned long long global_nanos() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}

__global__ void spin_kernel(unsigned long long nanos) {
  const unsigned long long start = global_nanos();
  while (global_nanos() - start < nanos) __nanosleep(1000);
}

}  // namespace

void profile_spin(int64_t micros, cudaStream_t stream) {
  if (micros <= 0) return;
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(micros) * 1000ull);
  E4KV_CUDA_CHECK_LAUNCH();
}

}  // namespace e4kv::cuda
