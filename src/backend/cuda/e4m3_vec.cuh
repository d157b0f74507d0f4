// Device helpers that turn packed E4M3 codes into FP16 for the attention kernels.
//
// Four codes arrive in one 32-bit word (code i in byte i) and leave as two FP16x2 words:
// lo = {code0, code1}, hi = {code2, code3} (first element in the low half).
//
// Software path (any GPU, sm_70+ instructions only): each byte is spread into the high byte of a
// 16-bit lane with one byte permute, then the 7 exponent/mantissa bits move down by one so the
// 4-bit E4M3 exponent sits in the low 4 bits of the 5-bit FP16 exponent, and the sign stays on top.
// The FP16 pattern then holds value * 2^-8 exactly for every finite code (normal and subnormal: the
// bias difference 15 - 7 = 8 is the same for both). Kernels fold kValueFactor = 2^8 into k_scale
// and v_scale instead of touching every element. NaN codes decode to finite garbage (the write path
// never stores NaN; DESIGN.md section 2).
//
// Native path (sm_89+): cvt.rn.f16x2.e4m3x2 gives the value itself (kValueFactor = 1).
//
// Kernels are templates over E4m3Decode; the host picks the instance with e4m3_native_available()
// (backend/cuda/device.h), so the software path stays selectable on every GPU for tests and
// benchmarks, and building with E4KV_FORCE_SOFTWARE_E4M3 removes the native path entirely.
#pragma once

#include <cstdint>

namespace e4kv::cuda {

enum class E4m3Decode { kSoftware, kNative };

template <E4m3Decode kMode>
struct E4m3Decoder;

template <>
struct E4m3Decoder<E4m3Decode::kSoftware> {
  // true value = decoded FP16 value * kValueFactor
  static constexpr float kValueFactor = 256.0f;

  __device__ __forceinline__ static void decode4(uint32_t codes, uint32_t& lo, uint32_t& hi) {
    const uint32_t a = __byte_perm(codes, 0u, 0x1404u);  // code1 << 24 | code0 << 8
    const uint32_t b = __byte_perm(codes, 0u, 0x3424u);  // code3 << 24 | code2 << 8
    lo = spread_to_f16(a);
    hi = spread_to_f16(b);
  }

  // {code kByte of x, code kByte of y} as one FP16x2 word (first element in the low half): the
  // operand pairs of P*V, whose two elements come from two tokens.
  template <int kByte>
  __device__ __forceinline__ static uint32_t decode_pair(uint32_t x, uint32_t y) {
    // High byte of lane 0 <- x.kByte, of lane 1 <- y.kByte; the low bytes are shifted out below.
    return spread_to_f16(__byte_perm(x, y, uint32_t((4 + kByte) << 12 | kByte << 4)));
  }

 private:
  // Two 16-bit lanes holding a code in their high byte -> FP16 patterns of value * 2^-8.
  __device__ __forceinline__ static uint32_t spread_to_f16(uint32_t lanes) {
    return (lanes & 0x80008000u) | ((lanes >> 1) & 0x3F803F80u);
  }
};

template <>
struct E4m3Decoder<E4m3Decode::kNative> {
  static constexpr float kValueFactor = 1.0f;

  __device__ __forceinline__ static void decode4(uint32_t codes, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(E4KV_FORCE_SOFTWARE_E4M3)
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(E4KV_FORCE_SOFTWARE_E4M3)
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
