// Device helpers that turn packed E4M3 codes into FP16 for the attention kernels.
//
// Four codes arrive in one 32-bit word (code i in byte i) and leave as two FP16x2 words:
// lo = {code0, code1}, hi = {code2, code3} (first element in the low half).
//
// Software path (any GPU, sm_70+ instructions only), three instructions per pair of codes: one
// byte permute puts each code in the low byte of a 16-bit lane and its sign, replicated (prmt's
// sign mode), in the high byte; a shift left by 7 moves the 7 exponent/mantissa bits to FP16 bits
// 13..7 (the 4-bit E4M3 exponent in the low 4 bits of the 5-bit FP16 exponent) and a replicated
// sign bit to bit 15; one mask clears bit 14 (where the code's own sign bit lands), bits 6..0 and
// what the shift carried into the upper lane. The FP16 pattern then holds value * 2^-8 exactly for
// every finite code (normal and subnormal: the bias difference 15 - 7 = 8 is the same for both).
// Kernels fold kValueFactor = 2^8 into k_scale and v_scale instead of touching every element. NaN
// codes decode to finite garbage (the write path never stores NaN; DESIGN.md section 2).
//
// Native path (sm_89+): cvt.rn.f16x2.e4m3x2 gives the value itself (kValueFactor = 1).
//
// Kernels are templates over E4m3Decode; the host picks the instance with e4m3_native_available()
// (backend/cuda/device.h), so the software path stays selectable on every GPU for tests and
// benchmarks, and building with E4KV_FORCE_SOFTWARE_E4M3 removes the native path entirely.
#pragma once

#include <cstdint>

#include "backend/cuda/arch.cuh"

namespace e4kv::cuda {

enum class E4m3Decode { kSoftware, kNative };

template <E4m3Decode kMode>
struct E4m3Decoder;

template <>
struct E4m3Decoder<E4m3Decode::kSoftware> {
  // true value = decoded FP16 value * kValueFactor
  static constexpr float kValueFactor = 256.0f;

  __device__ __forceinline__ static void decode4(uint32_t codes, uint32_t& lo, uint32_t& hi) {
    lo = to_f16(sign_spread(codes, 0u, 0x9180u));  // lanes {code0, code1}
    hi = to_f16(sign_spread(codes, 0u, 0xB3A2u));  // lanes {code2, code3}
  }

  // {code kByte of x, code kByte of y} as one FP16x2 word (first element in the low half): the
  // operand pairs of P*V, whose two elements come from two tokens.
  template <int kByte>
  __device__ __forceinline__ static uint32_t decode_pair(uint32_t x, uint32_t y) {
    constexpr uint32_t kSelector =
        uint32_t(kByte | (8 | kByte) << 4 | (4 + kByte) << 8 | (8 | (4 + kByte)) << 12);
    return to_f16(sign_spread(x, y, kSelector));
  }

 private:
  // prmt.b32 in its generic mode: a selector nibble with bit 3 set replicates the sign bit of the
  // chosen byte (of the 8 bytes of {y, x}) over its output byte.
  __device__ __forceinline__ static uint32_t sign_spread(uint32_t x, uint32_t y,
                                                         uint32_t selector) {
    uint32_t out;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(x), "r"(y), "r"(selector));
    return out;
  }

  // Two 16-bit lanes {code, sign replicated} -> FP16 patterns of value * 2^-8.
  __device__ __forceinline__ static uint32_t to_f16(uint32_t lanes) {
    return (lanes << 7) & 0xBF80BF80u;
  }
};

template <>
struct E4m3Decoder<E4m3Decode::kNative> {
  static constexpr float kValueFactor = 1.0f;

  __device__ __forceinline__ static void decode4(uint32_t codes, uint32_t& lo, uint32_t& hi) {
#if E4KV_DEVICE_ARCH >= 890 && !defined(E4KV_FORCE_SOFTWARE_E4M3)
    asm("{\n\t"
        ".reg .b16 l, h;\n\t"
        "mov.b32 {l, h}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, l;\n\t"
        "cvt.rn.f16x2.e4m3x2 %1, h;\n\t"
        "}"
        : "=r"(lo), "=r"(hi)
        : "r"(codes));
#else
    // Never launched: the host selects this instance only where e4m3_native_available() is true.
    (void)codes;
    lo = hi = 0;
    __trap();
#endif
  }

  template <int kByte>
  __device__ __forceinline__ static uint32_t decode_pair(uint32_t x, uint32_t y) {
#if E4KV_DEVICE_ARCH >= 890 && !defined(E4KV_FORCE_SOFTWARE_E4M3)
    const uint32_t pair = __byte_perm(x, y, uint32_t((4 + kByte) << 4 | kByte));
    uint32_t out;
    asm("{\n\t"
        ".reg .b16 l, h;\n\t"
        "mov.b32 {l, h}, %1;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, l;\n\t"
        "}"
        : "=r"(out)
        : "r"(pair));
    return out;
#else
    (void)x;
    (void)y;
    __trap();
    return 0;
#endif
  }
};

}  // namespace e4kv::cuda
