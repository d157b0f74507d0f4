// MoE CPU reference: the router, the routed experts and the shared-expert gate, each against a
// double-precision reference written here from the math (docs/qwen4exp_reference.md section 6) or
// against hand-computed values, plus the properties the runtime relies on: ties go to the lower
// expert id, the renormalisation sums in selection order, the k terms of a token are added in slot
// order whatever the expert grouping, and chunking the tokens changes nothing.
#include "backend/cpu/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "testing/compare.h"

namespace e4kv {
namespace {

using test::all_close;
using test::compare;

// Tolerances of fp32 results against the double references below. Every fp32 op rounds with a
// relative error of at most 2^-24 (6e-8); the longest chains here are dot products of <= 64 terms
// (expert projections) and softmax sums over <= 64 experts, whose fp32 error is bounded by about
// n * 2^-24 of the sum of |terms| (4e-6 at n = 64) and is typically sqrt(n) times smaller.
// Elementwise: atol covers results that cancel to near zero, rtol the rest; the relative L2 error
// over a whole output, where the worst cases average out, must stay near 1e-7 (bound 1e-6).
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

// ---- router -------------------------------------------------------------------------------------

struct Route {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Route route(const std::vector<float>& logits, int64_t n_experts, int64_t top_k, bool norm) {
  const int64_t n_tokens = int64_t(logits.size()) / n_experts;
  Route r;
  r.ids.assign(size_t(n_tokens * top_k), -1);
  r.weights.assign(size_t(n_tokens * top_k), NAN);
  moe_route(logits.data(), n_tokens, n_experts, top_k, norm, r.ids.data(), r.weights.data());
  return r;
}

struct DoubleRoute {
  std::vector<int32_t> ids;
  std::vector<double> weights;
};

// softmax over all experts in double, experts ordered by p descending then id ascending, the first
// top_k kept, optionally divided by their sum.
DoubleRoute reference_route(const std::vector<float>& logits, int64_t n_experts, int64_t top_k,
                            bool norm) {
  const int64_t n_tokens = int64_t(logits.size()) / n_experts;
  DoubleRoute r;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* row = logits.data() + t * n_experts;
    const double row_max = *std::max_element(row, row + n_experts);
    std::vector<double> p(static_cast<size_t>(n_experts));
    double sum = 0.0;
    for (int64_t e = 0; e < n_experts; ++e) sum += p[size_t(e)] = std::exp(row[e] - row_max);
    for (double& v : p) v /= sum;
    std::vector<int32_t> order(static_cast<size_t>(n_experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return p[size_t(a)] > p[size_t(b)]; });
    double chosen = 0.0;
    for (int64_t j = 0; j < top_k; ++j) chosen += p[size_t(order[size_t(j)])];
    for (int64_t j = 0; j < top_k; ++j) {
      r.ids.push_back(order[size_t(j)]);
      r.weights.push_back(p[size_t(order[size_t(j)])] / (norm ? chosen : 1.0));
    }
  }
  return r;
}

// logits [1, 2, 3, 0]: p = e^l / (1 + e + e^2 + e^3); top 2 = experts 2 then 1; renormalised
// weights e / (1 + e) = 0.731058579 and 1 / (1 + e) = 0.268941421. logits all 0: p = 1/4 exactly,
// top 2 = experts 0, 1 (ties), renormalised 1/2 exactly.
TEST(MoeRoute, HandComputed) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const double e = std::exp(1.0);
  const double s = 1.0 + e + e * e + e * e * e;
  const Route raw = route(logits, 4, 2, false);
  EXPECT_EQ(raw.ids, (std::vector<int32_t>{2, 1, 0, 1}));
  EXPECT_TRUE(
      all_close(raw.weights, std::vector<double>{e * e * e / s, e * e / s, 0.25, 0.25}, 0.0, 1e-6));
  EXPECT_EQ(raw.weights[2], 0.25f);
  const Route norm = route(logits, 4, 2, true);
  EXPECT_EQ(norm.ids, raw.ids);
  EXPECT_TRUE(
      all_close(norm.weights, std::vector<double>{0.731058579, 0.268941421, 0.5, 0.5}, 0.0, 1e-6));
  EXPECT_EQ(norm.weights[2], 0.5f);
  EXPECT_EQ(norm.weights[3], 0.5f);
}

// Equal logits give bit-equal p; the lower expert id is chosen first.
TEST(MoeRoute, TiesGoToTheLowerExpertId) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, 1.0f, 2.0f, -1.0f};
  EXPECT_EQ(route(logits, 6, 1, true).ids, (std::vector<int32_t>{1}));
  EXPECT_EQ(route(logits, 6, 2, true).ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(route(logits, 6, 3, true).ids, (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(route(logits, 6, 4, true).ids, (std::vector<int32_t>{1, 2, 4, 3}));
  const Route r = route(logits, 6, 3, true);
  EXPECT_EQ(r.weights[0], r.weights[1]);
  EXPECT_EQ(r.weights[1], r.weights[2]);
  // A tie below a larger value, and a row of equal logits.
  EXPECT_EQ(route({0.0f, 1.0f, 3.0f, 1.0f, 1.0f}, 5, 3, false).ids,
            (std::vector<int32_t>{2, 1, 3}));
  EXPECT_EQ(route({7.0f, 7.0f, 7.0f, 7.0f, 7.0f}, 5, 3, false).ids,
            (std::vector<int32_t>{0, 1, 2}));
}

class MoeRouteShapes : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, bool>> {
};  // E, top_k, norm

TEST_P(MoeRouteShapes, MatchesDoubleReference) {
  const auto [n_experts, top_k, norm] = GetParam();
  const int64_t n_tokens = 23;
  std::mt19937 rng(uint32_t(100 + n_experts * 8 + top_k));
  const std::vector<float> logits = uniform(rng, n_tokens * n_experts, -4.0f, 4.0f);
  const Route got = route(logits, n_experts, top_k, norm);
  const DoubleRoute want = reference_route(logits, n_experts, top_k, norm);
  EXPECT_EQ(got.ids, want.ids);
  EXPECT_TRUE(all_close(got.weights, want.weights, 1e-9, kRtol));
  EXPECT_LE(compare(got.weights, want.weights, 0.0, 0.0).rel_l2, kMaxRelL2);
  if (norm) {
    for (int64_t t = 0; t < n_tokens; ++t) {
      double sum = 0.0;
      for (int64_t j = 0; j < top_k; ++j) sum += got.weights[size_t(t * top_k + j)];
      EXPECT_NEAR(sum, 1.0, 1e-6) << "token " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ExpertsTopKNorm, MoeRouteShapes,
                         ::testing::Combine(::testing::Values(4, 16, 64),
                                            ::testing::Values(1, 3, 4), ::testing::Bool()));

// top_k == n_experts: every expert, in p order; renormalised weights are p divided by a sum of
// ~1, so they stay within fp32 rounding of p.
TEST(MoeRoute, TopKEqualsNumberOfExperts) {
  const int64_t n_experts = 10;
  std::mt19937 rng(7);
  const std::vector<float> logits = uniform(rng, 5 * n_experts, -3.0f, 3.0f);
  for (const bool norm : {false, true}) {
    const Route got = route(logits, n_experts, n_experts, norm);
    const DoubleRoute want = reference_route(logits, n_experts, n_experts, norm);
    EXPECT_EQ(got.ids, want.ids);
    EXPECT_TRUE(all_close(got.weights, want.weights, 1e-9, kRtol));
    for (int64_t t = 0; t < 5; ++t) {
      std::vector<int32_t> ids(got.ids.begin() + t * n_experts,
                               got.ids.begin() + (t + 1) * n_experts);
      std::sort(ids.begin(), ids.end());
      for (int32_t e = 0; e < int32_t(n_experts); ++e) EXPECT_EQ(ids[size_t(e)], e);
      for (int64_t j = 1; j < n_experts; ++j) {
        EXPECT_GE(got.weights[size_t(t * n_experts + j - 1)],
                  got.weights[size_t(t * n_experts + j)]);
      }
    }
  }
}

// The renormalised weights are the raw ones divided by their fp32 sum in selection order, to the
// bit, and norm_topk_prob = false returns the softmax probabilities themselves.
TEST(MoeRoute, RenormalisationDividesBySumInSelectionOrder) {
  const int64_t n_experts = 32;
  const int64_t top_k = 6;
  std::mt19937 rng(8);
  const std::vector<float> logits = uniform(rng, 9 * n_experts, -5.0f, 5.0f);
  const Route raw = route(logits, n_experts, top_k, false);
  const Route norm = route(logits, n_experts, top_k, true);
  EXPECT_EQ(raw.ids, norm.ids);
  for (int64_t t = 0; t < 9; ++t) {
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) sum += raw.weights[size_t(t * top_k + j)];
    for (int64_t j = 0; j < top_k; ++j) {
      EXPECT_EQ(norm.weights[size_t(t * top_k + j)], raw.weights[size_t(t * top_k + j)] / sum);
    }
  }
}

// Subtracting the row max keeps huge logits finite.
TEST(MoeRoute, LargeLogitsStayFinite) {
  const std::vector<float> logits = {1000.0f, 999.0f, -1000.0f, 998.0f, 1e30f, -1e30f, 0.0f, 1e30f};
  for (const bool norm : {false, true}) {
    const Route got = route(logits, 4, 2, norm);
    const DoubleRoute want = reference_route(logits, 4, 2, norm);
    EXPECT_EQ(got.ids, want.ids);
    EXPECT_TRUE(all_close(got.weights, want.weights, 1e-9, kRtol));
    EXPECT_EQ(compare(got.weights, want.weights, 0.0, 0.0).n_nan, 0);
  }
}

// ---- routed experts -----------------------------------------------------------------------------

struct Experts {
  int64_t n_experts = 0;
  int64_t hidden = 0;
  int64_t inter = 0;
  std::vector<float> gate_up;  // [E, 2I, H]
  std::vector<float> down;     // [E, H, I]

  MoeExpertsView view() const {
    MoeExpertsView v;
    v.gate_up = gate_up.data();
    v.down = down.data();
    v.n_experts = n_experts;
    v.hidden = hidden;
    v.inter = inter;
    return v;
  }
};

Experts random_experts(std::mt19937& rng, int64_t n_experts, int64_t hidden, int64_t inter) {
  Experts x;
  x.n_experts = n_experts;
  x.hidden = hidden;
  x.inter = inter;
  // Scaled so that the projections are O(1): the activation sees both signs and its curved part.
  const float in_scale = 2.0f / std::sqrt(float(hidden));
  const float out_scale = 1.0f / std::sqrt(float(inter));
  x.gate_up = uniform(rng, n_experts * 2 * inter * hidden, -in_scale, in_scale);
  x.down = uniform(rng, n_experts * hidden * inter, -out_scale, out_scale);
  return x;
}

// out[t] = sum_j w[t, j] down_e(silu(gate_e x_t) up_e x_t), everything in double.
std::vector<double> reference_experts(const Experts& ex, const std::vector<float>& x,
                                      const std::vector<int32_t>& ids,
                                      const std::vector<float>& weights, int64_t top_k) {
  const int64_t hidden = ex.hidden;
  const int64_t inter = ex.inter;
  const int64_t n_tokens = int64_t(x.size()) / hidden;
  std::vector<double> out(size_t(n_tokens * hidden), 0.0);
  std::vector<double> act(static_cast<size_t>(inter));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* xt = x.data() + t * hidden;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = ids[size_t(t * top_k + j)];
      const float* gate_w = ex.gate_up.data() + e * 2 * inter * hidden;
      const float* up_w = gate_w + inter * hidden;
      const float* down_w = ex.down.data() + e * hidden * inter;
      for (int64_t i = 0; i < inter; ++i) {
        double gate = 0.0;
        double up = 0.0;
        for (int64_t h = 0; h < hidden; ++h) {
          gate += double(gate_w[i * hidden + h]) * xt[h];
          up += double(up_w[i * hidden + h]) * xt[h];
        }
        act[size_t(i)] = silu_d(gate) * up;
      }
      const double w = weights[size_t(t * top_k + j)];
      for (int64_t h = 0; h < hidden; ++h) {
        double sum = 0.0;
        for (int64_t i = 0; i < inter; ++i) sum += double(down_w[h * inter + i]) * act[size_t(i)];
        out[size_t(t * hidden + h)] += w * sum;
      }
    }
  }
  return out;
}

std::vector<float> run_experts(const Experts& ex, const std::vector<float>& x,
                               const std::vector<int32_t>& ids, const std::vector<float>& weights,
                               int64_t top_k) {
  const int64_t n_tokens = int64_t(x.size()) / ex.hidden;
  std::vector<float> out(x.size(), NAN);  // overwritten
  moe_experts(ex.view(), x.data(), n_tokens, ids.data(), weights.data(), top_k, out.data());
  return out;
}

// Uneven routing: token t's top_k distinct experts drawn from {0, 2, 3, 5} with expert 0 three
// times as likely as the others, so experts 1 and 4 get no token and expert 0 the most.
std::vector<int32_t> uneven_ids(std::mt19937& rng, int64_t n_tokens, int64_t top_k) {
  const std::vector<int32_t> pool = {0, 0, 0, 2, 3, 5};
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < n_tokens; ++t) {
    std::vector<int32_t> row;
    while (int64_t(row.size()) < top_k) {
      const int32_t e = pool[pick(rng)];
      if (std::find(row.begin(), row.end(), e) == row.end()) row.push_back(e);
    }
    ids.insert(ids.end(), row.begin(), row.end());
  }
  return ids;
}

class MoeExpertsTopK : public ::testing::TestWithParam<int64_t> {};

TEST_P(MoeExpertsTopK, UnevenRoutingMatchesDoubleReference) {
  const int64_t top_k = GetParam();
  const int64_t n_experts = 6;
  const int64_t hidden = 32;
  const int64_t inter = 24;
  const int64_t n_tokens = 13;
  std::mt19937 rng(uint32_t(200 + top_k));
  const Experts ex = random_experts(rng, n_experts, hidden, inter);
  const std::vector<float> x = uniform(rng, n_tokens * hidden, -1.0f, 1.0f);
  const std::vector<int32_t> ids = uneven_ids(rng, n_tokens, top_k);
  const std::vector<float> weights = uniform(rng, n_tokens * top_k, 0.05f, 1.0f);
  std::vector<int64_t> count(size_t(n_experts), 0);
  for (const int32_t e : ids) ++count[size_t(e)];
  ASSERT_EQ(count[1], 0);
  ASSERT_EQ(count[4], 0);
  ASSERT_GT(count[0], count[2]);

  const std::vector<float> got = run_experts(ex, x, ids, weights, top_k);
  const std::vector<double> want = reference_experts(ex, x, ids, weights, top_k);
  EXPECT_TRUE(all_close(got, want, kAtol, kRtol));
  EXPECT_LE(compare(got, want, 0.0, 0.0).rel_l2, kMaxRelL2);

  // Each token alone (other groupings of the same terms) gives the same result up to the fp32
  // rounding of the projections.
  for (int64_t t = 0; t < n_tokens; ++t) {
    const std::vector<float> xt(x.begin() + t * hidden, x.begin() + (t + 1) * hidden);
    const std::vector<int32_t> it(ids.begin() + t * top_k, ids.begin() + (t + 1) * top_k);
    const std::vector<float> wt(weights.begin() + t * top_k, weights.begin() + (t + 1) * top_k);
    const std::vector<float> single = run_experts(ex, xt, it, wt, top_k);
    const std::vector<float> row(got.begin() + t * hidden, got.begin() + (t + 1) * hidden);
    EXPECT_TRUE(all_close(single, row, kAtol, kRtol)) << "token " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(TopK, MoeExpertsTopK, ::testing::Values(1, 3));

// The k weighted terms of a token are added in slot order j from zero, whatever the expert ids.
// hidden = inter = 1, x = 1, gate weight 128 (silu(128) = 128 in fp32: exp(-128) underflows), up
// weight 1, so term = 128 * down exactly. Experts: 0 -> 6, 1 -> -2^27, 2 -> 2^27 (fp32 spacing
// 16 there). Slots [2, 0, 1]: (2^27 + 6 -> 2^27) - 2^27 = 0. Slots [1, 0, 2]: (-2^27 + 6 ->
// -2^27 + 8) + 2^27 = 8. An expert-id order would give 8 for both.
TEST(MoeExperts, TermsAreAddedInSlotOrder) {
  Experts ex;
  ex.n_experts = 3;
  ex.hidden = 1;
  ex.inter = 1;
  ex.gate_up = {128.0f, 1.0f, 128.0f, 1.0f, 128.0f, 1.0f};
  ex.down = {6.0f / 128.0f, -1048576.0f, 1048576.0f};  // 3/64, -2^20, 2^20
  const std::vector<float> x = {1.0f, 1.0f, 1.0f};
  const std::vector<int32_t> ids = {2, 0, 1, 1, 0, 2, 0, 1, 2};
  const std::vector<float> weights(9, 1.0f);
  const std::vector<float> got = run_experts(ex, x, ids, weights, 3);
  EXPECT_EQ(got[0], 0.0f);
  EXPECT_EQ(got[1], 8.0f);
  EXPECT_EQ(got[2], 8.0f);
}

// More tokens than one chunk of kMoeTermBufferFloats: the chunk boundary changes nothing.
TEST(MoeExperts, TokensBeyondOneChunkMatchDoubleReference) {
  const int64_t top_k = 8;
  const int64_t hidden = 2048;
  const int64_t inter = 2;
  const int64_t n_experts = 4;
  const int64_t chunk = kMoeTermBufferFloats / (top_k * hidden);
  ASSERT_GE(chunk, 1);
  const int64_t n_tokens = chunk + 3;
  std::mt19937 rng(300);
  const Experts ex = random_experts(rng, n_experts, hidden, inter);
  const std::vector<float> x = uniform(rng, n_tokens * hidden, -1.0f, 1.0f);
  std::vector<int32_t> ids(size_t(n_tokens * top_k));
  std::uniform_int_distribution<int32_t> pick(0, int32_t(n_experts - 1));
  for (int32_t& e : ids) e = pick(rng);  // repeated ids in a row: one term per occurrence
  const std::vector<float> weights = uniform(rng, n_tokens * top_k, 0.0f, 0.25f);
  const std::vector<float> got = run_experts(ex, x, ids, weights, top_k);
  const std::vector<double> want = reference_experts(ex, x, ids, weights, top_k);
  // Dot products over hidden = 2048: the error bound grows with the length (see kAtol), observed
  // rel L2 stays at a few 1e-7.
  EXPECT_TRUE(all_close(got, want, 1e-5, 1e-4));
  EXPECT_LE(compare(got, want, 0.0, 0.0).rel_l2, kMaxRelL2);
}

TEST(MoeExperts, NoTokensWritesNothing) {
  std::mt19937 rng(301);
  const Experts ex = random_experts(rng, 2, 4, 3);
  float out = 42.0f;
  moe_experts(ex.view(), nullptr, 0, nullptr, nullptr, 2, &out);
  EXPECT_EQ(out, 42.0f);
}

// ---- shared expert gate -------------------------------------------------------------------------

// sigmoid(0) = 1/2 exactly; sigmoid(100) = 1 in fp32 (exp(-100) is below half an ulp of 1);
// sigmoid(-100) = 0 (exp(100) overflows fp32).
TEST(MoeSharedGate, HandComputed) {
  std::vector<float> out = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f};
  const std::vector<float> y = {2.0f, -4.0f, 0.5f, 0.25f, 7.0f, 8.0f};
  const std::vector<float> gate = {0.0f, 100.0f, -100.0f};
  sigmoid_gated_add(out.data(), y.data(), gate.data(), 3, 2);
  EXPECT_EQ(out, (std::vector<float>{2.0f, 0.0f, 3.5f, 4.25f, 5.0f, 6.0f}));
}

TEST(MoeSharedGate, MatchesDoubleReference) {
  const int64_t n_tokens = 7;
  const int64_t dim = 40;
  std::mt19937 rng(400);
  const std::vector<float> base = uniform(rng, n_tokens * dim, -2.0f, 2.0f);
  const std::vector<float> y = uniform(rng, n_tokens * dim, -2.0f, 2.0f);
  const std::vector<float> gate = uniform(rng, n_tokens, -6.0f, 6.0f);
  std::vector<double> want(base.size());
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t i = 0; i < dim; ++i) {
      const size_t k = size_t(t * dim + i);
      want[k] = double(base[k]) + sigmoid_d(gate[size_t(t)]) * y[k];
    }
  }
  std::vector<float> out = base;
  sigmoid_gated_add(out.data(), y.data(), gate.data(), n_tokens, dim);
  EXPECT_TRUE(all_close(out, want, kAtol, kRtol));
  EXPECT_LE(compare(out, want, 0.0, 0.0).rel_l2, kMaxRelL2);
}

}  // namespace
}  // namespace e4kv
