// The division forms of the E4M3 cache write (backend/cuda/cache_write.cuh), on the host (no
// device needed): for every scale tried, the form that cache_write_division_mode picks gives the
// CPU reference's code (backend/cpu/cache_write.h, through e4m3_encode) for every finite FP16
// input, every cheaper form differs from it somewhere, and the exact form matches everywhere.
// The scales: every power of two that is a float, the limits of what the scale gate accepts
// (finite and > 0: subnormals to FLT_MAX), the neighbours of the scale below which 1 / scale
// overflows, a few fixed ones, and random ones from fixed seeds, log-uniform and calibration-like
// (FP16 absmax / 448).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cache_write.h"
#include "backend/cuda/cache_write.cuh"
#include "core/half.h"
#include "kv/kv_cache_view.h"

namespace e4kv::cuda {
namespace {

constexpr uint16_t kF16Infinity = 0x7C00;  // FP16 magnitudes below are finite

const char* division_name(CacheWriteDivision division) {
  switch (division) {
    case CacheWriteDivision::kReciprocal:
      return "reciprocal";
    case CacheWriteDivision::kCorrected:
      return "corrected";
    case CacheWriteDivision::kExact:
      return "exact";
  }
  return "?";
}

std::string describe_scale(float scale) {
  std::ostringstream out;
  out << "scale " << scale << " (" << std::hexfloat << scale << ")";
  return out.str();
}

// [h] = the CPU reference cache write's E4M3 code of FP16 magnitude h at `scale`, for every finite
// one (one K row of all of them).
std::vector<uint8_t> reference_codes(float scale) {
  std::vector<uint16_t> row(kF16Infinity);
  std::iota(row.begin(), row.end(), uint16_t(0));
  const KvCacheGeometry geo{1, 16, 1, kF16Infinity, KvCacheDtype::kE4m3};
  std::vector<uint8_t> cache(geo.total_bytes());
  const int64_t slot = 0;
  e4kv::cache_write(KvCacheView{cache.data(), geo, scale, scale}, row.data(), row.data(), &slot, 1);
  const auto k_row = cache.begin() + geo.elem_offset(0, 0, 0, 0);
  return std::vector<uint8_t>(k_row, k_row + kF16Infinity);
}

// FP16 magnitudes where the kernel's code with `division` differs from `reference`.
int64_t count_mismatches(const std::vector<uint8_t>& reference, float scale,
                         CacheWriteDivision division, uint16_t* first_bad) {
  int64_t n_bad = 0;
  for (uint16_t h = 0; h < kF16Infinity; ++h) {
    if (cache_write_magnitude_code(h, scale, division) != reference[h] && n_bad++ == 0) {
      *first_bad = h;
    }
  }
  return n_bad;
}

std::vector<float> scales_to_check() {
  std::vector<float> scales;
  for (int e = -149; e <= 127; ++e) scales.push_back(std::ldexp(1.0f, e));
  const float denorm_min = std::numeric_limits<float>::denorm_min();
  const float normal_min = std::numeric_limits<float>::min();
  const float max = std::numeric_limits<float>::max();
  for (float s : {denorm_min, 3.0f * denorm_min, std::nextafter(normal_min, 0.0f), normal_min,
                  std::nextafter(normal_min, 1.0f), std::nextafter(max, 0.0f), max}) {
    scales.push_back(s);
  }
  // 1 / scale is finite from about 2^-128 up; the forms with the reciprocal fail below.
  float edge = 1.0f / max;
  for (int i = 0; i < 3; ++i) edge = std::nextafter(edge, 0.0f);
  for (int i = 0; i < 7; ++i, edge = std::nextafter(edge, 1.0f)) scales.push_back(edge);
  for (float s :
       {1.0f / 3.0f, 0.0123f, 1.0f / 448.0f, 0.0234375f, 0.01f, 0.02f, 7.1f, 1.0e-20f, 1.0e20f}) {
    scales.push_back(s);
  }
  std::mt19937 rng(20261201);
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  for (int i = 0; i < 200; ++i) scales.push_back(std::exp2(exponent(rng)));
  std::uniform_int_distribution<int> absmax(1, kF16Infinity - 1);
  for (int i = 0; i < 200; ++i) scales.push_back(f16_to_f32(uint16_t(absmax(rng))) / 448.0f);
  return scales;
}

TEST(CacheWriteDivision, ChosenFormMatchesTheCpuReferenceOnEveryFiniteFp16) {
  const std::vector<float> scales = scales_to_check();
  int64_t seen[3] = {0, 0, 0};
  for (const float scale : scales) {
    SCOPED_TRACE(describe_scale(scale));
    const std::vector<uint8_t> reference = reference_codes(scale);
    const CacheWriteDivision chosen = cache_write_division_mode(scale);
    ++seen[int(chosen)];
    uint16_t first_bad = 0;
    EXPECT_EQ(count_mismatches(reference, scale, chosen, &first_bad), 0)
        << division_name(chosen) << ": first bad FP16 magnitude 0x" << std::hex << first_bad;
    // The cheapest exact form: each cheaper one differs somewhere.
    for (int d = 0; d < int(chosen); ++d) {
      EXPECT_GT(count_mismatches(reference, scale, CacheWriteDivision(d), &first_bad), 0)
          << division_name(CacheWriteDivision(d)) << " is exact but not chosen";
    }
    // The fallback holds for every scale.
    EXPECT_EQ(count_mismatches(reference, scale, CacheWriteDivision::kExact, &first_bad), 0)
        << "exact: first bad FP16 magnitude 0x" << std::hex << first_bad;
    EXPECT_EQ(cache_write_division_mode(scale), chosen) << "memoised answer differs";
  }
  std::printf("[ info ] %zu scales: %lld reciprocal, %lld corrected, %lld exact\n", scales.size(),
              static_cast<long long>(seen[0]), static_cast<long long>(seen[1]),
              static_cast<long long>(seen[2]));
  // Each form is reached, so none of the checks above is vacuous.
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
}

}  // namespace
}  // namespace e4kv::cuda
