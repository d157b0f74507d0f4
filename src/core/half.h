// IEEE binary16 (FP16) and bfloat16 conversions on the host, bit-exact with the GPU's
// round-to-nearest-even conversions (__float2half_rn, __float2bfloat16_rn). Values are carried as
// their bit patterns (uint16_t) so no header here depends on a compiler's half type.
#pragma once

#include <cstdint>
#include <cstring>

namespace e4kv {

inline uint32_t f32_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float f32_from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// FP16 bits -> float (exact).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return f32_from_bits(sign | 0x7F800000u | (mantissa << 13));  // inf/NaN
  if (exponent == 0) {
    // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = float(mantissa) * 5.9604644775390625e-08f;
    return f32_from_bits(sign | f32_bits(magnitude));
  }
  return f32_from_bits(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

// float -> FP16 bits, round to nearest even; overflow gives +-inf; NaN stays NaN (quiet).
inline uint16_t f32_to_f16(float x) {
  const uint32_t bits = f32_bits(x);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((mag >> 13) & 0x3FFu));  // NaN
  if (mag >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (mag >= 0x38800000u) {                                 // normal FP16 range (>= 2^-14)
    const uint32_t rounded = mag + 0xFFFu + ((mag >> 13) & 1u);
    return uint16_t(sign | ((rounded >> 13) - ((127u - 15u) << 10)));
  }
  // subnormal FP16: round_half_even(|x| * 2^24)
  const int exponent = int(mag >> 23);
  if (exponent < 127 - 26) return sign;  // below 2^-26: rounds to zero
  const uint32_t significand = (mag & 0x7FFFFFu) | 0x800000u;
  const int shift = 127 + 23 - 24 - exponent;  // >= 14
  const uint32_t integer = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return uint16_t(
      sign | (integer + ((remainder > half || (remainder == half && (integer & 1u))) ? 1u : 0u)));
}

// bfloat16 bits -> float (exact).
inline float bf16_to_f32(uint16_t b) {
  return f32_from_bits(uint32_t(b) << 16);
}

// float -> bfloat16 bits, round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float x) {
  const uint32_t bits = f32_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x40u);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace e4kv
