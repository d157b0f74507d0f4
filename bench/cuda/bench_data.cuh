// Inputs shared by the CUDA benchmarks: deterministic pseudo-random cache bytes (FP16 values in a
// modest range, or E4M3 codes without NaN) and FP16 tensors filled on the device, host-to-device
// uploads, and the exit on a failed launcher.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cstdio>
#include <cstdlib>

#include "backend/cuda/cuda_check.h"
#include "core/status.h"

namespace e4kv::bench {

// A 32-bit hash of (i, seed): the benchmarks' deterministic pseudo-random source.
__device__ __forceinline__ uint32_t mix_hash(size_t i, uint32_t seed) {
  uint32_t x = uint32_t(i) * 2654435761u ^ seed;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return x;
}

// data[i] for i < n: E4M3 codes (never NaN) when e4m3, else bytes of FP16 values with exponents
// 2^-15..2^-4 times a random mantissa and sign (finite, no overflow in attention).
__global__ void fill_cache_bytes_kernel(uint8_t* data, size_t n, uint32_t seed, bool e4m3) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t x = mix_hash(i, seed);
    if (e4m3) {
      uint8_t code = uint8_t(x);
      if ((code & 0x7F) == 0x7F) code = 0x3F;  // no NaN codes
      data[i] = code;
    } else if (i % 2 == 1) {
      // high byte of an FP16 value: sign + exponent in a modest range
      data[i] = uint8_t((x & 0x80) | (0x30 + (x >> 8) % 12));
    } else {
      data[i] = uint8_t(x);
    }
  }
}

inline void fill_cache_bytes(void* data, size_t n, uint32_t seed, bool e4m3) {
  fill_cache_bytes_kernel<<<4096, 256>>>(static_cast<uint8_t*>(data), n, seed, e4m3);
  E4KV_CUDA_CHECK_LAUNCH();
}

// data[i] for i < n: FP16 values with a random sign and mantissa and an exponent field in
// [min_exponent, min_exponent + n_exponents) (15 is 2^0), finite.
__global__ void fill_f16_kernel(uint16_t* data, size_t n, uint32_t seed, uint32_t min_exponent,
                                uint32_t n_exponents) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t x = mix_hash(i, seed);
    data[i] = uint16_t((x & 0x83FFu) | ((min_exponent + (x >> 16) % n_exponents) << 10));
  }
}

inline void fill_f16(uint16_t* data, size_t n, uint32_t seed, uint32_t min_exponent,
                     uint32_t n_exponents) {
  fill_f16_kernel<<<4096, 256>>>(data, n, seed, min_exponent, n_exponents);
  E4KV_CUDA_CHECK_LAUNCH();
}

// Exits with the message when a launcher refuses its arguments.
inline void check(const Status& st) {
  if (!st.ok()) std::fprintf(stderr, "%s\n", st.message().c_str()), std::exit(1);
}

// A device copy of `v` (cudaFree it).
template <class T>
T* upload(const std::vector<T>& v) {
  T* d = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));
  E4KV_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace e4kv::bench
