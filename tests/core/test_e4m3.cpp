// The host codec against the format definition. The reference below is written independently of
// e4m3.h: it builds the value table from the definition with ldexp, picks the nearest value by an
// exact comparison with the midpoint of the two neighbours (all such midpoints are exact doubles),
// and does the division in double (the double rounding of a quotient to fp32 is harmless, since
// 53 >= 2 * 24 + 2).
#include "e4kv/e4m3.h"  // first: the header must stand on its own

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace e4kv {
namespace {

// Non-negative finite E4M3 values by code 0x00..0x7E.
const std::vector<double>& positive_values() {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int exponent = 0; exponent < 16; ++exponent) {
      for (int mantissa = 0; mantissa < 8; ++mantissa) {
        if (exponent == 15 && mantissa == 7) continue;  // NaN
        v.push_back(exponent == 0 ? std::ldexp(double(mantissa), -9)
                                  : std::ldexp(1.0 + mantissa / 8.0, exponent - 7));
      }
    }
    return v;
  }();
  return values;
}

uint8_t reference_round(float q) {
  if (std::isnan(q)) return 0x7F;
  const uint8_t sign = std::signbit(q) ? 0x80 : 0x00;
  const double a = std::fabs(double(q));
  const auto& v = positive_values();
  if (a >= 448.0) return sign | 0x7E;
  // largest code with value <= a
  size_t lo = 0;
  while (lo + 1 < v.size() && v[lo + 1] <= a) ++lo;
  if (v[lo] == a) return sign | uint8_t(lo);
  const size_t hi = lo + 1;
  const double mid = (v[lo] + v[hi]) / 2;
  size_t pick;
  if (a < mid) {
    pick = lo;
  } else if (a > mid) {
    pick = hi;
  } else {
    pick = (lo % 2 == 0) ? lo : hi;  // tie: even code (even mantissa)
  }
  return sign | uint8_t(pick);
}

uint8_t reference_encode(float x, float scale) {
  const float q = float(double(x) / double(scale));
  return reference_round(q);
}

float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string hex(int code) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02X", code);
  return buf;
}

TEST(E4m3Codec, EveryCodeDecodesToItsExactValue) {
  const auto& v = positive_values();
  ASSERT_EQ(v.size(), 127u);
  for (int code = 0; code < 256; ++code) {
    const float got = e4m3_decode(uint8_t(code));
    const int magnitude = code & 0x7F;
    if (magnitude == 0x7F) {
      EXPECT_TRUE(std::isnan(got)) << hex(code);
      EXPECT_TRUE(e4m3_is_nan(uint8_t(code)));
      continue;
    }
    EXPECT_FALSE(e4m3_is_nan(uint8_t(code)));
    const double expected = (code & 0x80) ? -v[magnitude] : v[magnitude];
    EXPECT_EQ(double(got), expected) << hex(code);
    EXPECT_EQ(std::signbit(got), bool(code & 0x80)) << hex(code);
  }
  EXPECT_EQ(e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(e4m3_decode(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_decode(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_decode(0x38), 1.0f);
}

TEST(E4m3Codec, ReferenceAgreesWithDefinitionOnKnownPoints) {
  // Guards the reference itself with hand-computed cases.
  EXPECT_EQ(reference_round(1.0f), 0x38);
  EXPECT_EQ(reference_round(1.0625f), 0x38);  // tie between 1 and 1.125 -> even mantissa 0
  EXPECT_EQ(reference_round(1.1875f), 0x3A);  // tie between 1.125 (m=1) and 1.25 (m=2) -> m=2
  EXPECT_EQ(reference_round(-448.0f), 0xFE);
  EXPECT_EQ(reference_round(std::ldexp(3.0f, -10)), 0x02);  // tie between 2^-9 and 2^-8 -> code 2
}

TEST(E4m3Codec, EveryValueAndItsNeighboursEncodeToItsCode) {
  const auto& v = positive_values();
  for (size_t code = 0; code < v.size(); ++code) {
    const float value = float(v[code]);
    for (float sign : {1.0f, -1.0f}) {
      const uint8_t expected = uint8_t(code) | (sign < 0 ? 0x80 : 0x00);
      EXPECT_EQ(e4m3_encode(sign * value, 1.0f), expected) << value;
      if (code > 0) {
        EXPECT_EQ(e4m3_encode(sign * std::nextafter(value, 0.0f), 1.0f), expected) << value;
      }
      if (code < v.size() - 1 || value < 448.0f) {
        EXPECT_EQ(e4m3_encode(sign * std::nextafter(value, 1e9f), 1.0f), expected) << value;
      }
    }
  }
}

TEST(E4m3Codec, EveryMidpointTiesToEvenAndBothSidesRoundToTheNearer) {
  const auto& v = positive_values();
  int ties = 0;
  for (size_t lo = 0; lo + 1 < v.size(); ++lo) {
    const double mid_d = (v[lo] + v[lo + 1]) / 2;
    const float mid = float(mid_d);
    ASSERT_EQ(double(mid), mid_d) << "midpoints are exact in fp32";
    const uint8_t even = uint8_t(lo % 2 == 0 ? lo : lo + 1);
    for (float sign : {1.0f, -1.0f}) {
      const uint8_t s = sign < 0 ? 0x80 : 0x00;
      EXPECT_EQ(e4m3_encode(sign * mid, 1.0f), s | even) << "tie at " << mid;
      EXPECT_EQ(e4m3_encode(sign * std::nextafter(mid, 0.0f), 1.0f), s | uint8_t(lo))
          << "below " << mid;
      EXPECT_EQ(e4m3_encode(sign * std::nextafter(mid, 1e9f), 1.0f), s | uint8_t(lo + 1))
          << "above " << mid;
      ++ties;
    }
  }
  EXPECT_EQ(ties, 2 * 126);
}

TEST(E4m3Codec, SaturationInfinityAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float x :
       {448.0f, std::nextafter(448.0f, 1e9f), 456.0f, 463.99f, 464.0f, std::nextafter(464.0f, 1e9f),
        480.0f, 481.0f, 512.0f, 1e6f, 1e30f, std::numeric_limits<float>::max(), inf}) {
    EXPECT_EQ(e4m3_encode(x, 1.0f), 0x7E) << x;
    EXPECT_EQ(e4m3_encode(-x, 1.0f), 0xFE) << -x;
  }
  // Just below 448 rounds to 448 as well (the midpoint with 416 is 432).
  EXPECT_EQ(e4m3_encode(440.0f, 1.0f), 0x7E);
  EXPECT_EQ(e4m3_encode(432.0f, 1.0f), 0x7E);  // tie 416 (m=5) vs 448 (m=6): even
  EXPECT_EQ(e4m3_encode(std::nextafter(432.0f, 0.0f), 1.0f), 0x7D);
  EXPECT_EQ(e4m3_encode(nan, 1.0f), 0x7F);
  EXPECT_EQ(e4m3_encode(-nan, 1.0f), 0x7F);
  EXPECT_EQ(e4m3_encode(bits_to_float(0x7F800001u), 1.0f), 0x7F);  // signalling NaN
  EXPECT_EQ(e4m3_encode(bits_to_float(0xFFC00000u), 1.0f), 0x7F);
  EXPECT_EQ(e4m3_encode(1.0f, nan), 0x7F);
  // Overflow through the division saturates too.
  EXPECT_EQ(e4m3_encode(1.0f, 1e-30f), 0x7E);
  EXPECT_EQ(e4m3_encode(-1.0f, 1e-30f), 0xFE);
  EXPECT_EQ(e4m3_encode(std::numeric_limits<float>::max(), 0.5f), 0x7E);  // fp32 overflow to inf
}

TEST(E4m3Codec, ZerosAndSubnormals) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(e4m3_encode(0.0f, 1.0f), 0x00);
  EXPECT_EQ(e4m3_encode(-0.0f, 1.0f), 0x80);
  EXPECT_EQ(e4m3_encode(tiny, 1.0f), 0x00);
  EXPECT_EQ(e4m3_encode(-tiny, 1.0f), 0x80);
  EXPECT_EQ(e4m3_encode(std::ldexp(1.0f, -11), 1.0f), 0x00);
  EXPECT_EQ(e4m3_encode(std::ldexp(1.0f, -10), 1.0f), 0x00);  // tie between 0 and 2^-9 -> 0
  EXPECT_EQ(e4m3_encode(std::nextafter(std::ldexp(1.0f, -10), 1.0f), 1.0f), 0x01);
  EXPECT_EQ(e4m3_encode(-std::nextafter(std::ldexp(1.0f, -10), 1.0f), 1.0f), 0x81);
  EXPECT_EQ(e4m3_encode(std::ldexp(1.0f, -9), 1.0f), 0x01);
  EXPECT_EQ(e4m3_encode(std::ldexp(3.0f, -10), 1.0f), 0x02);   // tie 1 vs 2 -> 2
  EXPECT_EQ(e4m3_encode(std::ldexp(5.0f, -10), 1.0f), 0x02);   // tie 2 vs 3 -> 2
  EXPECT_EQ(e4m3_encode(std::ldexp(15.0f, -10), 1.0f), 0x08);  // tie 7 vs 8 (2^-6) -> 8
  EXPECT_EQ(e4m3_encode(std::nextafter(std::ldexp(1.0f, -6), 0.0f), 1.0f), 0x08);
  for (int m = 0; m < 8; ++m) {
    EXPECT_EQ(e4m3_encode(std::ldexp(float(m), -9), 1.0f), m) << "subnormal m=" << m;
    EXPECT_EQ(e4m3_decode(uint8_t(m)), std::ldexp(float(m), -9));
  }
  // fp32 subnormal inputs and fp32 subnormal quotients
  EXPECT_EQ(e4m3_encode(bits_to_float(0x00400000u), 1.0f), 0x00);
  EXPECT_EQ(e4m3_encode(1e-30f, 1e10f), 0x00);
  EXPECT_EQ(e4m3_encode(-1e-30f, 1e10f), 0x80);
}

TEST(E4m3Codec, DivisionByTheScaleIsIeeeFp32) {
  // Cases where dividing and rounding in fp32 matters: x / scale lands near a rounding boundary.
  const float scale = 0.0171247218f;  // the seed's smallest calibrated scale
  const auto& v = positive_values();
  for (size_t lo = 0; lo + 1 < v.size(); ++lo) {
    const float mid = float((v[lo] + v[lo + 1]) / 2);
    const float x = mid * scale;  // rounded product: x / scale lands at, above or below mid
    const float down = std::nextafter(x, 0.0f);
    const float up = std::nextafter(x, 1e9f);
    for (float xs : {std::nextafter(down, 0.0f), down, x, up, std::nextafter(up, 1e9f)}) {
      EXPECT_EQ(e4m3_encode(xs, scale), reference_encode(xs, scale)) << xs;
      EXPECT_EQ(e4m3_encode(-xs, scale), reference_encode(-xs, scale)) << -xs;
    }
  }
}

TEST(E4m3Codec, MillionRandomValuesMatchTheReference) {
  std::mt19937_64 rng(0xE4A3);
  int mismatches = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    uint32_t bits = uint32_t(rng());
    if (i % 4 != 0) {
      // Most draws in the interesting range 2^-14 .. 2^10 around the E4M3 window.
      bits = (bits & 0x807FFFFFu) | (uint32_t(127 - 14 + rng() % 24) << 23);
    }
    const float x = bits_to_float(bits);
    const float scale =
        (i % 3 == 0) ? 1.0f : std::ldexp(1.0f + float(rng() % 4096) / 4096.0f, int(rng() % 12) - 8);
    const uint8_t got = e4m3_encode(x, scale);
    const uint8_t want = reference_encode(x, scale);
    if (got != want && ++mismatches <= 10) {
      ADD_FAILURE() << "x bits " << std::hex << bits << " scale " << scale << ": got " << hex(got)
                    << " want " << hex(want);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(E4m3Codec, EncodeThenDecodeRoundTripsEveryFiniteCode) {
  for (float scale : {1.0f, 0.0171247218f, 0.0841238871f, 0.5f, 3.0f, 1.0f / 256.0f}) {
    for (int code = 0; code < 256; ++code) {
      if (e4m3_is_nan(uint8_t(code))) continue;
      const float x = e4m3_decode(uint8_t(code)) * scale;
      const uint8_t back = e4m3_encode(x, scale);
      if (code == 0x80) {
        EXPECT_EQ(back, 0x80);
      } else {
        EXPECT_EQ(back, code) << "scale " << scale << " code " << hex(code);
      }
    }
  }
}

}  // namespace
}  // namespace e4kv
