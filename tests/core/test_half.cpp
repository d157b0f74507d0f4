// FP16/BF16 conversions against the compiler's own _Float16 (an independent implementation) on
// every FP16 pattern and on a dense sweep of fp32 inputs, and against exact arithmetic for BF16.
#include "core/half.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

namespace e4kv {
namespace {

TEST(Half, EveryF16PatternDecodesLikeTheCompiler) {
  for (uint32_t h = 0; h < 65536; ++h) {
    _Float16 ref;
    const uint16_t bits = uint16_t(h);
    std::memcpy(&ref, &bits, 2);
    const float want = float(ref);
    const float got = f16_to_f32(bits);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      EXPECT_EQ(f32_bits(got), f32_bits(want)) << h;
      EXPECT_EQ(f32_to_f16(got), bits) << "round trip " << h;
    }
  }
}

TEST(Half, F32ToF16MatchesTheCompilerOnASweep) {
  std::mt19937 rng(7);
  int mismatches = 0;
  for (int i = 0; i < 4'000'000; ++i) {
    uint32_t bits = rng();
    if (i % 2) bits = (bits & 0x807FFFFFu) | (uint32_t(127 - 30 + rng() % 50) << 23);
    const float x = f32_from_bits(bits);
    const _Float16 ref = _Float16(x);
    uint16_t want;
    std::memcpy(&want, &ref, 2);
    const uint16_t got = f32_to_f16(x);
    const bool both_nan = std::isnan(x) && (got & 0x7C00u) == 0x7C00u && (got & 0x3FFu) != 0;
    if (got != want && !both_nan && ++mismatches < 10) {
      ADD_FAILURE() << "x bits " << std::hex << bits << " got " << got << " want " << want;
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xFC00);
}

TEST(Half, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  // 1 + 2^-8 is the tie between 1 and 1 + 2^-7: even (1.0)
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(f32_to_bf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3F81);
  for (uint32_t b = 0; b < 65536; ++b) {
    const float x = bf16_to_f32(uint16_t(b));
    if (std::isnan(x)) continue;
    EXPECT_EQ(f32_to_bf16(x), b);
  }
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

}  // namespace
}  // namespace e4kv
