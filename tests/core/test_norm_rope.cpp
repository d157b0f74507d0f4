// RMSNorm and partial NeoX RoPE rows against plain double-precision formulas, and exact cases.
#include "core/norm_rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/half.h"

namespace e4kv {
namespace {

// Double -> FP16 bits with one rounding (the compiler's _Float16 conversion).
uint16_t f16_from_double(double x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

// Spacing of FP16 numbers at magnitude |x| (2^-24 in the subnormal range).
double ulp16(double x) {
  int exponent = 0;
  std::frexp(std::fabs(x), &exponent);  // |x| = m * 2^exponent, m in [0.5, 1)
  return std::ldexp(1.0, std::max(exponent - 11, -24));
}

std::vector<uint16_t> random_row(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint16_t> row(static_cast<size_t>(n));
  for (auto& x : row) x = f32_to_f16(dist(rng));
  return row;
}

TEST(RmsNorm, MatchesDoubleWithinOneUlp) {
  std::mt19937 rng(11);
  int64_t exact = 0;
  int64_t total = 0;
  for (const RmsNormForm form : {RmsNormForm::kOnePlusWeight, RmsNormForm::kWeight}) {
    for (const int64_t dim : {64, 128, 256}) {
      for (int trial = 0; trial < 200; ++trial) {
        const float range = std::ldexp(1.0f, trial % 12 - 6);
        const std::vector<uint16_t> x = random_row(rng, dim, -range, range);
        const std::vector<uint16_t> w = random_row(rng, dim, -0.9f, 0.9f);
        const float eps = 1e-6f;
        std::vector<uint16_t> out(static_cast<size_t>(dim));
        rms_norm_row_f16(x.data(), w.data(), dim, eps, form, out.data());
        double sum_squares = 0.0;
        for (uint16_t h : x) sum_squares += double(f16_to_f32(h)) * double(f16_to_f32(h));
        const double inv_rms = 1.0 / std::sqrt(sum_squares / double(dim) + double(eps));
        for (int64_t j = 0; j < dim; ++j) {
          const double wj = f16_to_f32(w[size_t(j)]);
          const double gain = form == RmsNormForm::kOnePlusWeight ? 1.0 + wj : wj;
          const double want = double(f16_to_f32(x[size_t(j)])) * inv_rms * gain;
          const double got = f16_to_f32(out[size_t(j)]);
          // Rounding to FP16 costs half an ulp; the fp32 arithmetic a few 2^-24 relative, which can
          // move a value sitting near a rounding boundary to the other side: at most one ulp.
          ASSERT_LE(std::fabs(got - want), ulp16(want)) << "dim " << dim << " j " << j;
          exact += out[size_t(j)] == f16_from_double(want) ? 1 : 0;
          ++total;
        }
      }
    }
  }
  EXPECT_GE(double(exact), 0.995 * double(total)) << exact << " of " << total;
  std::printf("[ norm ] %lld of %lld elements equal the correctly rounded double result\n",
              static_cast<long long>(exact), static_cast<long long>(total));
}

TEST(RmsNorm, ZeroRowStaysZeroAndAliasingWorks) {
  std::vector<uint16_t> x(128, 0);
  const std::vector<uint16_t> w(128, f32_to_f16(0.5f));
  rms_norm_row_f16(x.data(), w.data(), 128, 1e-6f, RmsNormForm::kOnePlusWeight, x.data());
  for (uint16_t h : x) EXPECT_EQ(h, 0);
  // A constant row of 3: rms = 3, so every element becomes 1 * (1 + 0.5) = 1.5 (eps negligible).
  std::vector<uint16_t> y(128, f32_to_f16(3.0f));
  rms_norm_row_f16(y.data(), w.data(), 128, 0.0f, RmsNormForm::kOnePlusWeight, y.data());
  for (uint16_t h : y) EXPECT_EQ(h, f32_to_f16(1.5f));
}

TEST(Rope, InvFreqAndCosSin) {
  const std::vector<double> inv_freq = rope_inv_freq(10000.0, 4);
  ASSERT_EQ(inv_freq.size(), 2u);
  EXPECT_EQ(inv_freq[0], 1.0);
  EXPECT_EQ(inv_freq[1], std::pow(10000.0, -0.5));  // 0.01
  const std::vector<double> big = rope_inv_freq(1.0e7, 64);
  for (size_t i = 0; i < big.size(); ++i) {
    EXPECT_EQ(big[i], std::pow(1.0e7, -double(2 * i) / 64.0)) << i;
  }
  float cos[32];
  float sin[32];
  rope_cos_sin(0, big.data(), 32, cos, sin);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(cos[i], 1.0f);
    EXPECT_EQ(sin[i], 0.0f);
  }
  // Large positions: the angle is formed in double, then cos/sin rounded once to fp32.
  rope_cos_sin(131071, big.data(), 32, cos, sin);
  for (int i = 0; i < 32; ++i) {
    const double angle = 131071.0 * big[size_t(i)];
    EXPECT_EQ(cos[i], static_cast<float>(std::cos(angle))) << i;
    EXPECT_EQ(sin[i], static_cast<float>(std::sin(angle))) << i;
  }
}

TEST(Rope, PositionZeroIsIdentityAndTailPassesThrough) {
  std::mt19937 rng(5);
  const std::vector<uint16_t> x = random_row(rng, 128, 0.25f, 4.0f);
  const std::vector<double> inv_freq = rope_inv_freq(1.0e7, 64);
  float cos[32];
  float sin[32];
  rope_cos_sin(0, inv_freq.data(), 32, cos, sin);
  std::vector<uint16_t> out(128);
  rope_neox_row_f16(x.data(), 128, 64, cos, sin, out.data());
  EXPECT_EQ(out, x);
  // A quarter turn: cos 0, sin 1 sends (a, b) to (-b, a); dims 64.. unchanged.
  float zeros[32];
  float ones[32];
  for (int i = 0; i < 32; ++i) {
    zeros[i] = 0.0f;
    ones[i] = 1.0f;
  }
  rope_neox_row_f16(x.data(), 128, 64, zeros, ones, out.data());
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(out[size_t(i)], x[size_t(i + 32)] ^ 0x8000) << i;
    EXPECT_EQ(out[size_t(i + 32)], x[size_t(i)]) << i;
  }
  for (int j = 64; j < 128; ++j) EXPECT_EQ(out[size_t(j)], x[size_t(j)]) << j;
}

TEST(Rope, MatchesDoubleWithinOneUlpOfThePair) {
  std::mt19937 rng(17);
  int64_t exact = 0;
  int64_t total = 0;
  for (const int64_t rotary_dim : {32, 64, 128}) {
    const int64_t dim = 128;
    const std::vector<double> inv_freq = rope_inv_freq(1.0e7, rotary_dim);
    const int64_t half = rotary_dim / 2;
    std::vector<float> cos(static_cast<size_t>(half));
    std::vector<float> sin(cos.size());
    for (int trial = 0; trial < 300; ++trial) {
      const int64_t pos = static_cast<int64_t>(rng() % 200000);
      rope_cos_sin(pos, inv_freq.data(), half, cos.data(), sin.data());
      const std::vector<uint16_t> x = random_row(rng, dim, -8.0f, 8.0f);
      std::vector<uint16_t> out = x;
      rope_neox_row_f16(out.data(), dim, rotary_dim, cos.data(), sin.data(),
                        out.data());  // aliased
      for (int64_t i = 0; i < half; ++i) {
        const double a = f16_to_f32(x[size_t(i)]);
        const double b = f16_to_f32(x[size_t(i + half)]);
        const double angle = double(pos) * std::pow(1.0e7, -double(2 * i) / double(rotary_dim));
        const double want_lo = a * std::cos(angle) - b * std::sin(angle);
        const double want_hi = b * std::cos(angle) + a * std::sin(angle);
        // fp32 cos/sin and products err by a few 2^-24 of |a| + |b|, far below an FP16 ulp there;
        // the result's own rounding can then land one ulp (at the pair's magnitude) away.
        const double tol = ulp16(std::fabs(a) + std::fabs(b));
        ASSERT_LE(std::fabs(f16_to_f32(out[size_t(i)]) - want_lo), tol)
            << "pos " << pos << " i " << i;
        ASSERT_LE(std::fabs(f16_to_f32(out[size_t(i + half)]) - want_hi), tol);
        exact += out[size_t(i)] == f16_from_double(want_lo) ? 1 : 0;
        exact += out[size_t(i + half)] == f16_from_double(want_hi) ? 1 : 0;
        total += 2;
      }
      for (int64_t j = rotary_dim; j < dim; ++j) ASSERT_EQ(out[size_t(j)], x[size_t(j)]);
    }
  }
  EXPECT_GE(double(exact), 0.99 * double(total)) << exact << " of " << total;
  std::printf("[ rope ] %lld of %lld elements equal the correctly rounded double result\n",
              static_cast<long long>(exact), static_cast<long long>(total));
}

}  // namespace
}  // namespace e4kv
