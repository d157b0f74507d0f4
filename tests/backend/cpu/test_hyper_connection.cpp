// Hyper-connection CPU reference: each op against a double-precision reference written here from
// the math (docs/qwen4exp_reference.md sections 3.1, 3.2, 3.4) or against hand-computed values;
// the grouped norm against the existing single-row norms (bit for bit); and a whole decoder layer
// of hyper-connection blocks composed from the ops and naive fp32 matmuls against the same layer
// computed in double.
#include "backend/cpu/hyper_connection.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/half.h"
#include "core/norm_rope.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

using test::all_close;
using test::compare;

// Tolerances of fp32 results against the double references below. Every fp32 op rounds with a
// relative error of at most 2^-24 (6e-8); the longest chains are sums of <= 256 terms (the norm's
// sum of squares, the block's projections), whose fp32 error is bounded by about n * 2^-24 of the
// sum of |terms| and is typically sqrt(n) times smaller. Elementwise: atol covers results that
// cancel to near zero, rtol the rest; the relative L2 error over a whole output, where the worst
// cases average out, must stay near 1e-7 (bound 1e-6).
constexpr double kAtol = 1e-6;
constexpr double kRtol = 1e-5;
constexpr double kMaxRelL2 = 1e-6;

std::vector<float> uniform(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(static_cast<size_t>(n));
  for (float& x : out) x = dist(rng);
  return out;
}

double silu_d(double x) {
  return x / (1.0 + std::exp(-x));
}
double sigmoid_d(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// ---- double references from the math ------------------------------------------------------------

// x [rows, groups * dim]: each group normalised over its dim, times w or 1 + w.
template <class T>
std::vector<double> reference_norm(const std::vector<T>& x, const std::vector<T>& weight,
                                   int64_t n_rows, int64_t n_groups, int64_t dim, double eps,
                                   RmsNormForm form) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t g = 0; g < n_groups; ++g) {
      const int64_t offset = (r * n_groups + g) * dim;
      double ss = 0.0;
      for (int64_t i = 0; i < dim; ++i) ss += double(x[size_t(offset + i)]) * x[size_t(offset + i)];
      const double inv = 1.0 / std::sqrt(ss / double(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) {
        const double w = weight[size_t(g * dim + i)];
        const double gain = form == RmsNormForm::kOnePlusWeight ? 1.0 + w : w;
        out[size_t(offset + i)] = double(x[size_t(offset + i)]) * inv * gain;
      }
    }
  }
  return out;
}

template <class T>
std::vector<double> reference_mix(const std::vector<T>& up, const std::vector<T>& xn,
                                  int64_t n_rows, int64_t n_streams, int64_t hidden) {
  std::vector<double> mix(size_t(n_rows * hidden), 0.0);
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t i = 0; i < hidden; ++i) {
      double sum = 0.0;
      for (int64_t s = 0; s < n_streams; ++s) {
        const size_t k = size_t((r * n_streams + s) * hidden + i);
        sum += sigmoid_d(double(up[k])) * double(xn[k]);
      }
      mix[size_t(r * hidden + i)] = sum / double(n_streams);
    }
  }
  return mix;
}

template <class T>
void reference_inject(std::vector<double>& x, const std::vector<T>& y, const std::vector<T>& inj,
                      int64_t n_rows, int64_t n_streams, int64_t hidden) {
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t s = 0; s < n_streams; ++s) {
      const double weight = 2.0 * sigmoid_d(double(inj[size_t(r * n_streams + s)]) / n_streams);
      for (int64_t i = 0; i < hidden; ++i) {
        x[size_t((r * n_streams + s) * hidden + i)] += weight * double(y[size_t(r * hidden + i)]);
      }
    }
  }
}

// y[r, o] = sum_k x[r, k] w[o, k] (a PyTorch linear without bias), accumulated in T.
template <class T>
std::vector<T> linear(const std::vector<T>& x, const std::vector<float>& w, int64_t n_rows,
                      int64_t in, int64_t out) {
  std::vector<T> y(size_t(n_rows * out));
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      T sum = 0;
      for (int64_t k = 0; k < in; ++k) sum += x[size_t(r * in + k)] * T(w[size_t(o * in + k)]);
      y[size_t(r * out + o)] = sum;
    }
  }
  return y;
}

// ---- grouped RMSNorm ----------------------------------------------------------------------------

// Groups [3, 4] and [1, -1]: mean squares 12.5 and 1. weight [0, 1, -0.5, 0.5].
TEST(HcRmsNormGrouped, HandComputed) {
  const std::vector<float> x = {3.0f, 4.0f, 1.0f, -1.0f};
  const std::vector<float> weight = {0.0f, 1.0f, -0.5f, 0.5f};
  const double eps = 1e-6;
  const double r0 = 1.0 / std::sqrt(12.5 + eps);
  const double r1 = 1.0 / std::sqrt(1.0 + eps);
  std::vector<float> out(4);
  rms_norm_grouped(x.data(), weight.data(), 1, 2, 2, float(eps), RmsNormForm::kOnePlusWeight,
                   out.data());
  EXPECT_TRUE(all_close(out, std::vector<double>{3 * r0, 4 * r0 * 2, 1 * r1 * 0.5, -1 * r1 * 1.5},
                        0.0, 1e-6));
  rms_norm_grouped(x.data(), weight.data(), 1, 2, 2, float(eps), RmsNormForm::kWeight, out.data());
  EXPECT_TRUE(
      all_close(out, std::vector<double>{0.0, 4 * r0, 1 * r1 * -0.5, -1 * r1 * 0.5}, 0.0, 1e-6));
}

class HcRmsNormGroupedShapes : public ::testing::TestWithParam<std::tuple<int64_t, RmsNormForm>> {
};  // n_groups, form

TEST_P(HcRmsNormGroupedShapes, MatchesDoubleReferenceAndAliases) {
  const auto [n_groups, form] = GetParam();
  const int64_t n_rows = 5;
  const int64_t dim = 48;
  const float eps = 1e-6f;
  std::mt19937 rng(uint32_t(10 + n_groups * 2 + (form == RmsNormForm::kWeight ? 1 : 0)));
  std::vector<float> x = uniform(rng, n_rows * n_groups * dim, -3.0f, 3.0f);
  // Groups of very different scales: each is normalised on its own.
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t g = 0; g < n_groups; ++g) {
      for (int64_t i = 0; i < dim; ++i) x[size_t((r * n_groups + g) * dim + i)] *= float(1 << g);
    }
  }
  const std::vector<float> weight = form == RmsNormForm::kWeight
                                        ? uniform(rng, n_groups * dim, 0.5f, 1.5f)
                                        : uniform(rng, n_groups * dim, -0.5f, 0.5f);
  std::vector<float> out(x.size());
  rms_norm_grouped(x.data(), weight.data(), n_rows, n_groups, dim, eps, form, out.data());
  const std::vector<double> want = reference_norm(x, weight, n_rows, n_groups, dim, eps, form);
  EXPECT_TRUE(all_close(out, want, kAtol, kRtol));
  EXPECT_LE(compare(out, want, 0.0, 0.0).rel_l2, kMaxRelL2);
  std::vector<float> in_place = x;
  rms_norm_grouped(in_place.data(), weight.data(), n_rows, n_groups, dim, eps, form,
                   in_place.data());
  EXPECT_TRUE(all_close(in_place, out, 0.0, 0.0));
}

std::string groups_and_form_name(
    const ::testing::TestParamInfo<std::tuple<int64_t, RmsNormForm>>& param_info) {
  const int64_t n_groups = std::get<0>(param_info.param);
  const bool plain = std::get<1>(param_info.param) == RmsNormForm::kWeight;
  return "groups" + std::to_string(n_groups) + (plain ? "_weight" : "_one_plus_weight");
}

INSTANTIATE_TEST_SUITE_P(GroupsByForm, HcRmsNormGroupedShapes,
                         ::testing::Combine(::testing::Values(1, 2, 4, 5),
                                            ::testing::Values(RmsNormForm::kWeight,
                                                              RmsNormForm::kOnePlusWeight)),
                         groups_and_form_name);

// n_groups = 1 is the plain RMSNorm of the CPU backend, bit for bit; group g of a grouped norm is
// the plain norm of that group's rows with weight slice g.
TEST(HcRmsNormGrouped, EqualsCpuBackendRmsNormPerGroup) {
  const int64_t n_rows = 6;
  const int64_t n_groups = 4;
  const int64_t dim = 40;
  const float eps = 1e-6f;
  std::mt19937 rng(20);
  const std::vector<float> x = uniform(rng, n_rows * n_groups * dim, -2.0f, 2.0f);
  const std::vector<float> weight = uniform(rng, n_groups * dim, -0.5f, 1.5f);
  const std::unique_ptr<Backend> backend = make_cpu_backend({2});
  for (const RmsNormForm form : {RmsNormForm::kWeight, RmsNormForm::kOnePlusWeight}) {
    std::vector<float> plain(size_t(n_rows * dim));
    std::vector<float> one_group(plain.size());
    ASSERT_TRUE(
        backend->rms_norm(x.data(), weight.data(), n_rows, dim, eps, form, plain.data()).ok());
    rms_norm_grouped(x.data(), weight.data(), n_rows, 1, dim, eps, form, one_group.data());
    EXPECT_TRUE(all_close(one_group, plain, 0.0, 0.0));

    std::vector<float> grouped(x.size());
    rms_norm_grouped(x.data(), weight.data(), n_rows, n_groups, dim, eps, form, grouped.data());
    for (int64_t g = 0; g < n_groups; ++g) {
      std::vector<float> rows;
      std::vector<float> want_rows;
      for (int64_t r = 0; r < n_rows; ++r) {
        const auto begin = x.begin() + (r * n_groups + g) * dim;
        rows.insert(rows.end(), begin, begin + dim);
        const auto got_begin = grouped.begin() + (r * n_groups + g) * dim;
        want_rows.insert(want_rows.end(), got_begin, got_begin + dim);
      }
      std::vector<float> by_backend(rows.size());
      ASSERT_TRUE(backend
                      ->rms_norm(rows.data(), weight.data() + g * dim, n_rows, dim, eps, form,
                                 by_backend.data())
                      .ok());
      EXPECT_TRUE(all_close(want_rows, by_backend, 0.0, 0.0)) << "group " << g;
    }
  }
}

// On FP16 inputs, the grouped norm rounded to FP16 once is core's FP16 row norm, bit for bit (the
// same fp32 arithmetic before the one rounding).
TEST(HcRmsNormGrouped, RoundedToFp16EqualsCoreRowNorm) {
  const int64_t n_groups = 3;
  const int64_t dim = 64;
  std::mt19937 rng(21);
  std::vector<float> x = uniform(rng, n_groups * dim, -4.0f, 4.0f);
  std::vector<float> weight = uniform(rng, n_groups * dim, -0.5f, 0.5f);
  std::vector<uint16_t> x16(x.size());
  std::vector<uint16_t> w16(weight.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x16[i] = f32_to_f16(x[i]);
    x[i] = f16_to_f32(x16[i]);
    w16[i] = f32_to_f16(weight[i]);
    weight[i] = f16_to_f32(w16[i]);
  }
  for (const RmsNormForm form : {RmsNormForm::kWeight, RmsNormForm::kOnePlusWeight}) {
    std::vector<float> out(x.size());
    rms_norm_grouped(x.data(), weight.data(), 1, n_groups, dim, 1e-6f, form, out.data());
    for (int64_t g = 0; g < n_groups; ++g) {
      std::vector<uint16_t> want(static_cast<size_t>(dim));
      rms_norm_row_f16(x16.data() + g * dim, w16.data() + g * dim, dim, 1e-6f, form, want.data());
      for (int64_t i = 0; i < dim; ++i) {
        ASSERT_EQ(f32_to_f16(out[size_t(g * dim + i)]), want[size_t(i)])
            << "group " << g << " index " << i;
      }
    }
  }
}

// ---- elementwise pieces -------------------------------------------------------------------------

// silu(0) = 0; silu(2 * 0.5) = 1 / (1 + e^-1) = 0.731058579; silu(-8 * 0.25) = -2 / (1 + e^2) =
// -0.238405844.
TEST(HcSiluScaled, HandComputedAndRandom) {
  const std::vector<float> x = {0.0f, 2.0f, -4.0f};
  std::vector<float> out(3);
  silu_scaled(x.data(), 3, 0.5f, out.data());
  EXPECT_TRUE(all_close(out, std::vector<double>{0.0, 0.731058579, -0.238405844}, 0.0, 1e-6));

  std::mt19937 rng(30);
  const std::vector<float> v = uniform(rng, 300, -40.0f, 40.0f);
  for (const float scale : {0.25f, 1.0f / 3.0f, 1.0f}) {
    std::vector<double> want(v.size());
    for (size_t i = 0; i < v.size(); ++i) want[i] = silu_d(double(v[i]) * scale);
    std::vector<float> got(v.size());
    silu_scaled(v.data(), int64_t(v.size()), scale, got.data());
    EXPECT_TRUE(all_close(got, want, kAtol, kRtol)) << "scale " << scale;
    EXPECT_LE(compare(got, want, 0.0, 0.0).rel_l2, kMaxRelL2);
    std::vector<float> in_place = v;
    silu_scaled(in_place.data(), int64_t(v.size()), scale, in_place.data());
    EXPECT_TRUE(all_close(in_place, got, 0.0, 0.0));
  }
}

// Two streams of width 2: sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4.
// mix[0] = (1/2 * 2 + 1/2 * 4) / 2 = 1.5; mix[1] = (3/4 * 8 + 1/2 * -2) / 2 = 2.5.
TEST(HcMix, HandComputed) {
  const float ln3 = float(std::log(3.0));
  const std::vector<float> up = {0.0f, ln3, 0.0f, 0.0f};
  const std::vector<float> xn = {2.0f, 8.0f, 4.0f, -2.0f};
  std::vector<float> mix(2);
  hc_mix(up.data(), xn.data(), 1, 2, 2, mix.data());
  EXPECT_EQ(mix[0], 1.5f);
  EXPECT_NEAR(mix[1], 2.5, 1e-6);
}

class HcStreams : public ::testing::TestWithParam<int64_t> {};  // n_streams

TEST_P(HcStreams, MixMatchesDoubleReference) {
  const int64_t n_streams = GetParam();
  const int64_t n_rows = 4;
  const int64_t hidden = 24;
  std::mt19937 rng(uint32_t(40 + n_streams));
  const std::vector<float> up = uniform(rng, n_rows * n_streams * hidden, -6.0f, 6.0f);
  const std::vector<float> xn = uniform(rng, n_rows * n_streams * hidden, -3.0f, 3.0f);
  std::vector<float> mix(size_t(n_rows * hidden));
  hc_mix(up.data(), xn.data(), n_rows, n_streams, hidden, mix.data());
  const std::vector<double> want = reference_mix(up, xn, n_rows, n_streams, hidden);
  EXPECT_TRUE(all_close(mix, want, kAtol, kRtol));
  EXPECT_LE(compare(mix, want, 0.0, 0.0).rel_l2, kMaxRelL2);
}

TEST_P(HcStreams, InjectMatchesDoubleReference) {
  const int64_t n_streams = GetParam();
  const int64_t n_rows = 4;
  const int64_t hidden = 24;
  std::mt19937 rng(uint32_t(50 + n_streams));
  const std::vector<float> x = uniform(rng, n_rows * n_streams * hidden, -3.0f, 3.0f);
  const std::vector<float> y = uniform(rng, n_rows * hidden, -3.0f, 3.0f);
  const std::vector<float> inj = uniform(rng, n_rows * n_streams, -8.0f, 8.0f);
  std::vector<double> want(x.begin(), x.end());
  reference_inject(want, y, inj, n_rows, n_streams, hidden);
  std::vector<float> got = x;
  hc_inject(got.data(), y.data(), inj.data(), n_rows, n_streams, hidden);
  EXPECT_TRUE(all_close(got, want, kAtol, kRtol));
  EXPECT_LE(compare(got, want, 0.0, 0.0).rel_l2, kMaxRelL2);
}

TEST_P(HcStreams, ExpandCopiesEveryStream) {
  const int64_t n_streams = GetParam();
  const int64_t n_rows = 3;
  const int64_t hidden = 5;
  std::mt19937 rng(uint32_t(60 + n_streams));
  const std::vector<float> e = uniform(rng, n_rows * hidden, -3.0f, 3.0f);
  std::vector<float> x(size_t(n_rows * n_streams * hidden), NAN);
  hc_expand(e.data(), n_rows, n_streams, hidden, x.data());
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t s = 0; s < n_streams; ++s) {
      for (int64_t i = 0; i < hidden; ++i) {
        EXPECT_EQ(x[size_t((r * n_streams + s) * hidden + i)], e[size_t(r * hidden + i)]);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Streams, HcStreams, ::testing::Values(1, 2, 3, 4));

// Injection logits 0 give weight 2 * sigmoid(0) = 1 exactly: x_s += y; a logit of -S * ln 3 gives
// 2 * sigmoid(-ln 3) = 1/2 (up to the fp32 value of ln 3).
TEST(HcInject, HandComputed) {
  std::vector<float> x = {1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<float> y = {10.0f, 20.0f};
  const std::vector<float> inj = {0.0f, float(-2.0 * std::log(3.0))};
  hc_inject(x.data(), y.data(), inj.data(), 1, 2, 2);
  EXPECT_EQ(x[0], 11.0f);
  EXPECT_EQ(x[1], 22.0f);
  EXPECT_NEAR(x[2], 8.0, 1e-5);
  EXPECT_NEAR(x[3], 14.0, 1e-5);
}

// ---- a decoder layer of hyper-connection blocks (section 3.3) -----------------------------------

// One GatedResidual block's weights (section 2.2).
struct BlockWeights {
  std::vector<float> norm;  // hc_norm.weight [S * H]
  std::vector<float> down;  // input_mix_weight_down [r, S * H]
  std::vector<float> up;    // input_mix_weight_up [S * H, r]
  std::vector<float> inj;   // block_inject_weight [S, S * H]
};

BlockWeights random_block(std::mt19937& rng, int64_t n_streams, int64_t hidden, int64_t rank) {
  const int64_t width = n_streams * hidden;
  BlockWeights w;
  w.norm = uniform(rng, width, -0.3f, 0.3f);
  const float down_scale = 2.0f / std::sqrt(float(width));
  w.down = uniform(rng, rank * width, -down_scale, down_scale);
  const float up_scale = 4.0f / std::sqrt(float(rank));
  w.up = uniform(rng, width * rank, -up_scale, up_scale);
  w.inj = uniform(rng, n_streams * width, -down_scale, down_scale);
  return w;
}

struct Shape {
  int64_t n_rows;
  int64_t n_streams;
  int64_t hidden;
  int64_t rank;
  float eps;
};

// The block in fp32 from the ops under test: returns mix; with inject, also applies
// x_s += 2 sigmoid(l_s / S) * mixer(mix) to x.
std::vector<float> block_f32(std::vector<float>& x, const BlockWeights& w,
                             const std::vector<float>& mixer, const Shape& sh, bool inject) {
  const int64_t width = sh.n_streams * sh.hidden;
  std::vector<float> xn(x.size());
  rms_norm_grouped(x.data(), w.norm.data(), sh.n_rows, sh.n_streams, sh.hidden, sh.eps,
                   RmsNormForm::kOnePlusWeight, xn.data());
  std::vector<float> a = linear(xn, w.down, sh.n_rows, width, sh.rank);
  silu_scaled(a.data(), int64_t(a.size()), 1.0f / float(sh.n_streams), a.data());
  const std::vector<float> u = linear(a, w.up, sh.n_rows, sh.rank, width);
  std::vector<float> mix(size_t(sh.n_rows * sh.hidden));
  hc_mix(u.data(), xn.data(), sh.n_rows, sh.n_streams, sh.hidden, mix.data());
  if (inject) {
    const std::vector<float> l = linear(xn, w.inj, sh.n_rows, width, sh.n_streams);
    const std::vector<float> y = linear(mix, mixer, sh.n_rows, sh.hidden, sh.hidden);
    hc_inject(x.data(), y.data(), l.data(), sh.n_rows, sh.n_streams, sh.hidden);
  }
  return mix;
}

// The same block in double straight from section 3.2.
std::vector<double> block_f64(std::vector<double>& x, const BlockWeights& w,
                              const std::vector<float>& mixer, const Shape& sh, bool inject) {
  const int64_t width = sh.n_streams * sh.hidden;
  const std::vector<double> norm_w(w.norm.begin(), w.norm.end());
  const std::vector<double> xn = reference_norm(x, norm_w, sh.n_rows, sh.n_streams, sh.hidden,
                                                double(sh.eps), RmsNormForm::kOnePlusWeight);
  std::vector<double> a = linear(xn, w.down, sh.n_rows, width, sh.rank);
  for (double& v : a) v = silu_d(v / double(sh.n_streams));
  const std::vector<double> u = linear(a, w.up, sh.n_rows, sh.rank, width);
  const std::vector<double> mix = reference_mix(u, xn, sh.n_rows, sh.n_streams, sh.hidden);
  if (inject) {
    const std::vector<double> l = linear(xn, w.inj, sh.n_rows, width, sh.n_streams);
    const std::vector<double> y = linear(mix, mixer, sh.n_rows, sh.hidden, sh.hidden);
    reference_inject(x, y, l, sh.n_rows, sh.n_streams, sh.hidden);
  }
  return mix;
}

class HyperConnectionLayer : public ::testing::TestWithParam<int64_t> {};  // n_streams

// expand -> attention block (a linear stand-in for the mixer) -> MLP block (a linear stand-in for
// the MoE) -> the final mixer, in fp32 from the ops against double.
TEST_P(HyperConnectionLayer, ComposedBlocksMatchDoubleReference) {
  const Shape sh{5, GetParam(), 32, 12, 1e-6f};
  const int64_t width = sh.n_streams * sh.hidden;
  std::mt19937 rng(uint32_t(70 + sh.n_streams));
  const std::vector<float> embedding = uniform(rng, sh.n_rows * sh.hidden, -1.0f, 1.0f);
  const BlockWeights attn = random_block(rng, sh.n_streams, sh.hidden, sh.rank);
  const BlockWeights mlp = random_block(rng, sh.n_streams, sh.hidden, sh.rank);
  const BlockWeights final_mixer = random_block(rng, sh.n_streams, sh.hidden, sh.rank);
  const float mixer_scale = 1.5f / std::sqrt(float(sh.hidden));
  const std::vector<float> attn_mixer =
      uniform(rng, sh.hidden * sh.hidden, -mixer_scale, mixer_scale);
  const std::vector<float> mlp_mixer =
      uniform(rng, sh.hidden * sh.hidden, -mixer_scale, mixer_scale);

  std::vector<float> x(size_t(sh.n_rows * width));
  hc_expand(embedding.data(), sh.n_rows, sh.n_streams, sh.hidden, x.data());
  std::vector<double> x_ref(x.size());
  for (int64_t r = 0; r < sh.n_rows; ++r) {
    for (int64_t s = 0; s < sh.n_streams; ++s) {
      for (int64_t i = 0; i < sh.hidden; ++i) {
        x_ref[size_t(r * width + s * sh.hidden + i)] = embedding[size_t(r * sh.hidden + i)];
      }
    }
  }
  EXPECT_TRUE(all_close(x, x_ref, 0.0, 0.0));

  const std::vector<float> mix_attn = block_f32(x, attn, attn_mixer, sh, true);
  const std::vector<double> mix_attn_ref = block_f64(x_ref, attn, attn_mixer, sh, true);
  EXPECT_TRUE(all_close(mix_attn, mix_attn_ref, kAtol, kRtol));
  EXPECT_LE(compare(mix_attn, mix_attn_ref, 0.0, 0.0).rel_l2, kMaxRelL2);
  EXPECT_TRUE(all_close(x, x_ref, kAtol, kRtol));

  const std::vector<float> mix_mlp = block_f32(x, mlp, mlp_mixer, sh, true);
  const std::vector<double> mix_mlp_ref = block_f64(x_ref, mlp, mlp_mixer, sh, true);
  EXPECT_TRUE(all_close(mix_mlp, mix_mlp_ref, kAtol, kRtol));
  EXPECT_LE(compare(mix_mlp, mix_mlp_ref, 0.0, 0.0).rel_l2, kMaxRelL2);
  EXPECT_TRUE(all_close(x, x_ref, kAtol, kRtol));
  EXPECT_LE(compare(x, x_ref, 0.0, 0.0).rel_l2, kMaxRelL2);

  const std::vector<float> h = block_f32(x, final_mixer, {}, sh, false);
  const std::vector<double> h_ref = block_f64(x_ref, final_mixer, {}, sh, false);
  EXPECT_TRUE(all_close(h, h_ref, kAtol, kRtol));
  EXPECT_LE(compare(h, h_ref, 0.0, 0.0).rel_l2, kMaxRelL2);

  // The injections moved the streams apart (they started as copies of the embedding).
  const std::vector<float> stream0(x.begin(), x.begin() + sh.hidden);
  const std::vector<float> stream1(x.begin() + sh.hidden, x.begin() + 2 * sh.hidden);
  EXPECT_GT(compare(stream0, stream1, 0.0, 0.0).rel_l2, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Streams, HyperConnectionLayer, ::testing::Values(2, 3, 4));

}  // namespace
}  // namespace e4kv
