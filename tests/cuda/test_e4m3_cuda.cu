// The E4M3 codec on the GPU: the software decoder, the native decoder (sm_89+) and the host codec
// agree on every code and (pair decoder) on every pair of codes at every byte position; the device
// build of e4m3.h encodes like the host build; on sm_89+ the hardware's own
// cvt.rn.satfinite.e4m3x2.f32 agrees with our rounding on all 2^32 fp32 inputs.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/e4m3_vec.cuh"
#include "e4kv/e4m3.h"
#include "cuda/require_gpu.h"

namespace e4kv::cuda {
namespace {

template <E4m3Decode kMode>
__global__ void decode_all_codes_kernel(uint16_t* out) {  // [256] fp16 bits
  const int word = threadIdx.x;                           // 64 threads, 4 codes each
  const uint32_t codes = uint32_t(4 * word) | uint32_t(4 * word + 1) << 8 |
                         uint32_t(4 * word + 2) << 16 | uint32_t(4 * word + 3) << 24;
  uint32_t lo;
  uint32_t hi;
  E4m3Decoder<kMode>::decode4(codes, lo, hi);
  out[4 * word + 0] = uint16_t(lo & 0xFFFFu);
  out[4 * word + 1] = uint16_t(lo >> 16);
  out[4 * word + 2] = uint16_t(hi & 0xFFFFu);
  out[4 * word + 3] = uint16_t(hi >> 16);
}

template <E4m3Decode kMode>
std::vector<uint16_t> decode_all_codes_on_device() {
  uint16_t* d_out = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_out, 256 * sizeof(uint16_t)));
  E4KV_CUDA_CHECK(cudaMemset(d_out, 0xA5, 256 * sizeof(uint16_t)));  // poison
  decode_all_codes_kernel<kMode><<<1, 64>>>(d_out);
  E4KV_CUDA_CHECK_LAUNCH();
  std::vector<uint16_t> out(256);
  E4KV_CUDA_CHECK(
      cudaMemcpy(out.data(), d_out, out.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  E4KV_CUDA_CHECK(cudaFree(d_out));
  return out;
}

float half_bits_to_float(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

bool kernel_has_native_code() {
  cudaFuncAttributes attr{};
  E4KV_CUDA_CHECK(cudaFuncGetAttributes(&attr, decode_all_codes_kernel<E4m3Decode::kNative>));
  return attr.binaryVersion >= 89;
}

TEST(E4m3Cuda, SoftwareDecoderExactOnEveryFiniteCode) {
  E4KV_REQUIRE_GPU();
  const std::vector<uint16_t> out = decode_all_codes_on_device<E4m3Decode::kSoftware>();
  int checked = 0;
  for (int code = 0; code < 256; ++code) {
    if (e4m3_is_nan(uint8_t(code))) continue;
    const float expected = e4m3_decode(uint8_t(code));
    const float got =
        half_bits_to_float(out[code]) * E4m3Decoder<E4m3Decode::kSoftware>::kValueFactor;
    EXPECT_EQ(got, expected) << "code 0x" << std::hex << code;
    EXPECT_EQ(std::signbit(got), std::signbit(expected)) << "code 0x" << std::hex << code;
    ++checked;
  }
  EXPECT_EQ(checked, 254);
}

// decode_pair<kByte>(x, y) -> {code kByte of x, code kByte of y}: one thread per (x code, y code)
// pair, the other bytes of x and y filled with codes that differ from the chosen one.
template <E4m3Decode kMode, int kByte>
__global__ void decode_pairs_kernel(uint32_t* out) {  // [65536] fp16x2 words
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t cx = i & 0xFFu;
  const uint32_t cy = i >> 8;
  uint32_t x = 0x5A3C97E1u ^ (i * 0x9E3779B9u);  // filler bytes
  uint32_t y = 0xC3A5F00Fu ^ (i * 0x85EBCA6Bu);
  x = (x & ~(0xFFu << (8 * kByte))) | cx << (8 * kByte);
  y = (y & ~(0xFFu << (8 * kByte))) | cy << (8 * kByte);
  out[i] = E4m3Decoder<kMode>::template decode_pair<kByte>(x, y);
}

template <E4m3Decode kMode, int kByte>
void expect_pairs_exact() {
  uint32_t* d_out = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_out, 65536 * sizeof(uint32_t)));
  E4KV_CUDA_CHECK(cudaMemset(d_out, 0xA5, 65536 * sizeof(uint32_t)));  // poison
  decode_pairs_kernel<kMode, kByte><<<256, 256>>>(d_out);
  E4KV_CUDA_CHECK_LAUNCH();
  std::vector<uint32_t> out(65536);
  E4KV_CUDA_CHECK(
      cudaMemcpy(out.data(), d_out, out.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  E4KV_CUDA_CHECK(cudaFree(d_out));
  int wrong = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint8_t codes[2] = {uint8_t(i & 0xFFu), uint8_t(i >> 8)};
    for (int half = 0; half < 2; ++half) {
      if (e4m3_is_nan(codes[half])) continue;
      const float expected = e4m3_decode(codes[half]);
      const float got =
          half_bits_to_float(uint16_t(out[i] >> (16 * half))) * E4m3Decoder<kMode>::kValueFactor;
      if ((got != expected || std::signbit(got) != std::signbit(expected)) && ++wrong <= 10) {
        ADD_FAILURE() << "byte " << kByte << " half " << half << " code 0x" << std::hex
                      << int(codes[half]) << ": got " << got << ", expected " << expected;
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "byte " << kByte;
}

TEST(E4m3Cuda, SoftwarePairDecoderExactOnEveryCodePair) {
  E4KV_REQUIRE_GPU();
  expect_pairs_exact<E4m3Decode::kSoftware, 0>();
  expect_pairs_exact<E4m3Decode::kSoftware, 1>();
  expect_pairs_exact<E4m3Decode::kSoftware, 2>();
  expect_pairs_exact<E4m3Decode::kSoftware, 3>();
}

TEST(E4m3Cuda, NativePairDecoderExactOnEveryCodePair) {
  E4KV_REQUIRE_GPU();
  if (!e4m3_native_available(0)) GTEST_SKIP() << "no native E4M3 conversion on this device/build";
  if (!kernel_has_native_code()) GTEST_SKIP() << "binary has no sm_89+ code for this device";
  expect_pairs_exact<E4m3Decode::kNative, 0>();
  expect_pairs_exact<E4m3Decode::kNative, 1>();
  expect_pairs_exact<E4m3Decode::kNative, 2>();
  expect_pairs_exact<E4m3Decode::kNative, 3>();
}

TEST(E4m3Cuda, NativeDecoderMatchesHostAndSoftware) {
  E4KV_REQUIRE_GPU();
  if (!e4m3_native_available(0)) GTEST_SKIP() << "no native E4M3 conversion on this device/build";
  if (!kernel_has_native_code()) GTEST_SKIP() << "binary has no sm_89+ code for this device";
  const std::vector<uint16_t> native = decode_all_codes_on_device<E4m3Decode::kNative>();
  const std::vector<uint16_t> software = decode_all_codes_on_device<E4m3Decode::kSoftware>();
  for (int code = 0; code < 256; ++code) {
    if (e4m3_is_nan(uint8_t(code))) {
      EXPECT_TRUE(std::isnan(half_bits_to_float(native[code]))) << "code 0x" << std::hex << code;
      continue;
    }
    const float expected = e4m3_decode(uint8_t(code));
    EXPECT_EQ(half_bits_to_float(native[code]), expected) << "code 0x" << std::hex << code;
    EXPECT_EQ(std::signbit(half_bits_to_float(native[code])), std::signbit(expected));
    // Bit-level relation: software = native * 2^-8 exactly.
    EXPECT_EQ(half_bits_to_float(software[code]) * 256.0f, half_bits_to_float(native[code]))
        << "code 0x" << std::hex << code;
  }
}

__global__ void encode_kernel(const float* x, const float* scale, uint8_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = e4m3_encode(x[i], scale[i]);
}

TEST(E4m3Cuda, DeviceEncodeMatchesHostEncode) {
  E4KV_REQUIRE_GPU();
  constexpr int kN = 1 << 22;
  std::mt19937_64 rng(20261129);
  std::vector<float> x(kN);
  std::vector<float> scale(kN);
  for (int i = 0; i < kN; ++i) {
    uint32_t bits = uint32_t(rng());
    if (i % 2 == 0) bits = (bits & 0x807FFFFFu) | (uint32_t(100 + rng() % 50) << 23);
    std::memcpy(&x[i], &bits, 4);
    scale[i] = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, int(rng() % 16) - 10);
  }
  float* d_x = nullptr;
  float* d_scale = nullptr;
  uint8_t* d_out = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_x, kN * sizeof(float)));
  E4KV_CUDA_CHECK(cudaMalloc(&d_scale, kN * sizeof(float)));
  E4KV_CUDA_CHECK(cudaMalloc(&d_out, kN));
  E4KV_CUDA_CHECK(cudaMemcpy(d_x, x.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  E4KV_CUDA_CHECK(cudaMemcpy(d_scale, scale.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  E4KV_CUDA_CHECK(cudaMemset(d_out, 0xA5, kN));
  encode_kernel<<<kN / 256, 256>>>(d_x, d_scale, d_out, kN);
  E4KV_CUDA_CHECK_LAUNCH();
  std::vector<uint8_t> out(kN);
  E4KV_CUDA_CHECK(cudaMemcpy(out.data(), d_out, kN, cudaMemcpyDeviceToHost));
  int mismatches = 0;
  for (int i = 0; i < kN; ++i) {
    const uint8_t expected = e4m3_encode(x[i], scale[i]);
    if (out[i] != expected && ++mismatches <= 10) {
      ADD_FAILURE() << "x=" << x[i] << " scale=" << scale[i] << " device 0x" << std::hex
                    << int(out[i]) << " host 0x" << int(expected);
    }
  }
  EXPECT_EQ(mismatches, 0);
  E4KV_CUDA_CHECK(cudaFree(d_x));
  E4KV_CUDA_CHECK(cudaFree(d_scale));
  E4KV_CUDA_CHECK(cudaFree(d_out));
}

// Compares e4m3_from_float_satfinite with the hardware conversion on every fp32 bit pattern.
__global__ void exhaustive_vs_hardware_kernel(uint32_t first, unsigned long long* mismatches,
                                              uint32_t* first_bad, unsigned long long* checked) {
#if E4KV_DEVICE_ARCH >= 890
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long count = 0;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 30);
       i += stride) {
    const uint32_t bits = first + uint32_t(i);
    const float q = __uint_as_float(bits);
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(pair) : "f"(q));
    const uint8_t hardware = uint8_t(pair & 0xFFu);
    const uint8_t ours = e4m3_from_float_satfinite(q);
    const bool same = (hardware == ours) || (e4m3_is_nan(hardware) && e4m3_is_nan(ours));
    if (!same) {
      if (atomicAdd(mismatches, 1ull) == 0) *first_bad = bits;
    }
    ++count;
  }
  atomicAdd(checked, count);  // proves every input was visited
#else
  (void)first;
  (void)mismatches;
  (void)first_bad;
  (void)checked;
#endif
}

TEST(E4m3Cuda, RoundingMatchesHardwareOnAllFloats) {
  E4KV_REQUIRE_GPU();
  if (compute_capability(0) < 89) GTEST_SKIP() << "no hardware E4M3 conversion before sm_89";
  cudaFuncAttributes attr{};
  E4KV_CUDA_CHECK(cudaFuncGetAttributes(&attr, exhaustive_vs_hardware_kernel));
  if (attr.binaryVersion < 89) GTEST_SKIP() << "binary has no sm_89+ code for this device";
  unsigned long long* d_mismatches = nullptr;
  uint32_t* d_first_bad = nullptr;
  unsigned long long* d_checked = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_checked, sizeof(unsigned long long)));
  E4KV_CUDA_CHECK(cudaMemset(d_checked, 0, sizeof(unsigned long long)));
  E4KV_CUDA_CHECK(cudaMalloc(&d_mismatches, sizeof(unsigned long long)));
  E4KV_CUDA_CHECK(cudaMalloc(&d_first_bad, sizeof(uint32_t)));
  E4KV_CUDA_CHECK(cudaMemset(d_mismatches, 0, sizeof(unsigned long long)));
  E4KV_CUDA_CHECK(cudaMemset(d_first_bad, 0, sizeof(uint32_t)));
  for (uint64_t first = 0; first < (uint64_t(1) << 32); first += uint64_t(1) << 30) {
    exhaustive_vs_hardware_kernel<<<4096, 256>>>(uint32_t(first), d_mismatches, d_first_bad,
                                                 d_checked);
    E4KV_CUDA_CHECK_LAUNCH();
  }
  unsigned long long mismatches = 0;
  uint32_t first_bad = 0;
  unsigned long long checked = 0;
  E4KV_CUDA_CHECK(cudaMemcpy(&checked, d_checked, sizeof(checked), cudaMemcpyDeviceToHost));
  EXPECT_EQ(checked, 1ull << 32) << "inputs visited";
  E4KV_CUDA_CHECK(
      cudaMemcpy(&mismatches, d_mismatches, sizeof(mismatches), cudaMemcpyDeviceToHost));
  E4KV_CUDA_CHECK(cudaMemcpy(&first_bad, d_first_bad, sizeof(first_bad), cudaMemcpyDeviceToHost));
  EXPECT_EQ(mismatches, 0ull) << "first mismatching fp32 bits 0x" << std::hex << first_bad;
  std::printf(
      "[ info ] %llu fp32 inputs checked: %llu mismatches against "
      "cvt.rn.satfinite.e4m3x2.f32\n",
      checked, mismatches);
  E4KV_CUDA_CHECK(cudaFree(d_mismatches));
  E4KV_CUDA_CHECK(cudaFree(d_first_bad));
  E4KV_CUDA_CHECK(cudaFree(d_checked));
}

}  // namespace
}  // namespace e4kv::cuda
