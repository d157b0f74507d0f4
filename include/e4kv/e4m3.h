// The E4M3 storage codec of DESIGN.md section 2, for host and device code.
//
// Format: OCP FP8 E4M3 "fn": 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities;
// S.1111.111 is NaN; largest finite magnitude 448 (0x7E); smallest subnormal 2^-9.
//
//   encode: code = e4m3_satfinite_rne(fp32(x) / scale)   IEEE division, round to nearest even,
//           finite overflow and +-inf saturate to +-448, NaN becomes 0x7F.
//   decode: value = e4m3_decode(code) * scale            (exact; every finite code is also an FP16)
//
// This header compiles with a plain C++20 compiler (no CUDA needed) and under nvcc, where the same
// functions are available in device code. Rounding uses integer arithmetic only, so the result does
// not depend on the floating-point rounding mode or on fast-math flags.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define E4KV_HOST_DEVICE __host__ __device__
#else
#define E4KV_HOST_DEVICE
#endif

namespace e4kv {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3MaxCode = 0x7E;  // +448
inline constexpr uint8_t kE4m3NanCode = 0x7F;

namespace e4m3_detail {

E4KV_HOST_DEVICE inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

E4KV_HOST_DEVICE inline float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

// IEEE fp32 division, correctly rounded, also under nvcc's fast-math options.
E4KV_HOST_DEVICE inline float divide_rn(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(x, y);
#else
  return x / y;
#endif
}

}  // namespace e4m3_detail

// Rounds an fp32 value (already divided by the scale) to E4M3: round to nearest even, saturating.
E4KV_HOST_DEVICE inline uint8_t e4m3_from_float_satfinite(float q) {
  const uint32_t bits = e4m3_detail::float_bits(q);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return kE4m3NanCode;                   // NaN
  if (mag >= 0x43E00000u) return uint8_t(sign | kE4m3MaxCode);  // >= 448 (also +-inf): saturate
  if (mag >= 0x3C800000u) {
    // Normal E4M3 range [2^-6, 448): keep 3 of the 23 mantissa bits, round half to even. A carry
    // out of the mantissa correctly bumps the exponent; nothing here rounds past 448.
    const uint32_t rounded = mag + 0x7FFFFu + ((mag >> 20) & 1u);
    return uint8_t(sign | ((rounded >> 20) - ((127u - 7u) << 3)));
  }
  // Subnormal range (|q| < 2^-6): the code is round_half_even(|q| * 2^9), an integer in 0..8
  // (8 is the smallest normal, code 0x08). Work on the 24-bit significand as an integer.
  const int exponent = int(mag >> 23);  // biased; 0 for fp32 subnormals
  if (exponent < 127 - 11)
    return uint8_t(sign);  // |q| < 2^-11: below a quarter of 2^-9, rounds to 0
  const uint32_t significand = (mag & 0x7FFFFFu) | 0x800000u;
  // |q| * 2^9 = significand * 2^(exponent - 127 - 23 + 9); shift >= 21 here.
  const int shift = 127 + 23 - 9 - exponent;
  const uint32_t integer = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t code =
      integer + ((remainder > half || (remainder == half && (integer & 1u))) ? 1u : 0u);
  return uint8_t(sign | code);
}

// code = e4m3_satfinite_rne(fp32(x) / scale).
E4KV_HOST_DEVICE inline uint8_t e4m3_encode(float x, float scale) {
  return e4m3_from_float_satfinite(e4m3_detail::divide_rn(x, scale));
}

// The exact value of a code as fp32; NaN for 0x7F and 0xFF.
E4KV_HOST_DEVICE inline float e4m3_decode(uint8_t code) {
  const uint32_t sign = uint32_t(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xFu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xFu && mantissa == 0x7u) return e4m3_detail::bits_float(sign | 0x7FC00000u);
  if (exponent == 0) {
    // Subnormal: mantissa * 2^-9, exact in fp32.
    return e4m3_detail::bits_float(sign | e4m3_detail::float_bits(float(mantissa) * 0.001953125f));
  }
  return e4m3_detail::bits_float(sign | ((exponent + 127u - 7u) << 23) | (mantissa << 20));
}

E4KV_HOST_DEVICE constexpr bool e4m3_is_nan(uint8_t code) {
  return (code & 0x7Fu) == 0x7Fu;
}

}  // namespace e4kv
