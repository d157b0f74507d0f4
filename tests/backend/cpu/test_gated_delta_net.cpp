// GatedDeltaNet CPU reference: each op against a double-precision reference written here from the
// math (docs/qwen4exp_reference.md section 5) or against hand-computed values, plus the properties
// the runtime relies on: chunked == recurrent, a prefill split anywhere equals the one-shot call,
// conv decode after a prefill equals a longer prefill, and value heads map to q/k heads as
// repeat_interleave does.
#include "backend/cpu/gated_delta_net.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "core/half.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

using test::all_close;
using test::compare;

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

// Rows [begin, end) of a row-major [rows, width] array.
std::vector<float> rows_of(const std::vector<float>& x, int64_t width, int64_t begin, int64_t end) {
  return std::vector<float>(x.begin() + begin * width, x.begin() + end * width);
}

void append(std::vector<float>& dst, const std::vector<float>& src) {
  dst.insert(dst.end(), src.begin(), src.end());
}

// ---- causal conv --------------------------------------------------------------------------------

// y_t[c] = silu(sum_i w[c, i] u_{t - W + 1 + i}[c]) over a whole sequence, u_{<0} = 0, in double.
// u: [T, C]; w: [C, W]; result [T, C].
std::vector<double> reference_conv(const std::vector<float>& u, int64_t n_tokens, int64_t channels,
                                   const std::vector<float>& w, int64_t kernel) {
  std::vector<double> y(static_cast<size_t>(n_tokens * channels));
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      double sum = 0.0;
      for (int64_t i = 0; i < kernel; ++i) {
        const int64_t src = t - kernel + 1 + i;
        if (src >= 0) sum += double(w[size_t(c * kernel + i)]) * u[size_t(src * channels + c)];
      }
      y[size_t(t * channels + c)] = silu_d(sum);
    }
  }
  return y;
}

class GatedDeltaNetConvKernel : public ::testing::TestWithParam<int64_t> {};

TEST_P(GatedDeltaNetConvKernel, PrefillFromZeroStateMatchesDoubleReference) {
  const int64_t kernel = GetParam();
  const int64_t channels = 5;
  for (const int64_t n_tokens : {1, 2, 3, 9}) {
    std::mt19937 rng(uint32_t(100 + kernel * 10 + n_tokens));
    const std::vector<float> u = uniform(rng, n_tokens * channels, -2.0f, 2.0f);
    const std::vector<float> w = uniform(rng, channels * kernel, -1.0f, 1.0f);
    std::vector<float> state(static_cast<size_t>((kernel - 1) * channels), 0.0f);
    std::vector<float> out(u.size());
    causal_conv1d_silu_prefill(u.data(), n_tokens, channels, w.data(), kernel, state.data(),
                               out.data());
    EXPECT_TRUE(all_close(out, reference_conv(u, n_tokens, channels, w, kernel), 1e-6, 1e-5))
        << "kernel " << kernel << " n_tokens " << n_tokens;
    // The state is the last kernel - 1 inputs, zeros where the sequence is shorter.
    std::vector<float> want_state;
    for (int64_t r = n_tokens - (kernel - 1); r < n_tokens; ++r) {
      if (r < 0) {
        append(want_state, std::vector<float>(size_t(channels), 0.0f));
      } else {
        append(want_state, rows_of(u, channels, r, r + 1));
      }
    }
    EXPECT_TRUE(all_close(state, want_state, 0.0, 0.0)) << "n_tokens " << n_tokens;
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, GatedDeltaNetConvKernel, ::testing::Values(1, 2, 3, 4));

// An impulse at t = 0 reads the weights backwards: pre-activation y_t[c] = w[c, W - 1 - t], so
// w[c, W - 1] multiplies the newest input (conv1d.weight [C, 1, W], cross-correlation).
TEST(GatedDeltaNetConv, WeightLayoutByImpulse) {
  const int64_t channels = 2;
  const int64_t kernel = 3;
  const std::vector<float> w = {0.5f, -1.0f, 2.0f,    // channel 0
                                0.0f, 1.0f,  -0.5f};  // channel 1
  std::vector<float> u(size_t(4 * channels), 0.0f);
  u[0] = 1.0f;
  u[1] = 1.0f;
  std::vector<float> state(size_t((kernel - 1) * channels), 0.0f);
  std::vector<float> out(u.size());
  causal_conv1d_silu_prefill(u.data(), 4, channels, w.data(), kernel, state.data(), out.data());
  // silu(2) = 2 / (1 + e^-2) = 1.76159416, silu(-1) = -0.268941421, silu(0.5) = 0.311229644,
  // silu(-0.5) = -0.188770356, silu(1) = 0.731058579, silu(0) = 0.
  const std::vector<double> want = {1.76159416,   -0.188770356,  // t = 0: w[., 2]
                                    -0.268941421, 0.731058579,   // t = 1: w[., 1]
                                    0.311229644,  0.0,           // t = 2: w[., 0]
                                    0.0,          0.0};          // t = 3: impulse has left
  EXPECT_TRUE(all_close(out, want, 1e-7, 1e-6));
}

TEST(GatedDeltaNetConv, PrefillSplitAnywhereEqualsOneShot) {
  const int64_t channels = 6;
  const int64_t kernel = 4;
  const int64_t n_tokens = 11;
  std::mt19937 rng(7);
  const std::vector<float> u = uniform(rng, n_tokens * channels, -3.0f, 3.0f);
  const std::vector<float> w = uniform(rng, channels * kernel, -1.0f, 1.0f);
  std::vector<float> state_ref(size_t((kernel - 1) * channels), 0.0f);
  std::vector<float> out_ref(u.size());
  causal_conv1d_silu_prefill(u.data(), n_tokens, channels, w.data(), kernel, state_ref.data(),
                             out_ref.data());

  // Every split point, including the kernel boundaries 1, 2, 3 (a piece shorter than the state).
  for (int64_t split = 0; split <= n_tokens; ++split) {
    std::vector<float> state(size_t((kernel - 1) * channels), 0.0f);
    std::vector<float> out(u.size());
    causal_conv1d_silu_prefill(u.data(), split, channels, w.data(), kernel, state.data(),
                               out.data());
    causal_conv1d_silu_prefill(u.data() + split * channels, n_tokens - split, channels, w.data(),
                               kernel, state.data(), out.data() + split * channels);
    EXPECT_TRUE(all_close(out, out_ref, 0.0, 0.0)) << "split " << split;
    EXPECT_TRUE(all_close(state, state_ref, 0.0, 0.0)) << "split " << split;
  }
  // Many short pieces.
  std::vector<float> state(size_t((kernel - 1) * channels), 0.0f);
  std::vector<float> out(u.size());
  int64_t begin = 0;
  for (const int64_t piece : {1, 1, 2, 0, 3, 4}) {
    causal_conv1d_silu_prefill(u.data() + begin * channels, piece, channels, w.data(), kernel,
                               state.data(), out.data() + begin * channels);
    begin += piece;
  }
  ASSERT_EQ(begin, n_tokens);
  EXPECT_TRUE(all_close(out, out_ref, 0.0, 0.0));
  EXPECT_TRUE(all_close(state, state_ref, 0.0, 0.0));
}

TEST(GatedDeltaNetConv, DecodeAfterPrefillEqualsLongerPrefill) {
  const int64_t channels = 7;
  const int64_t kernel = 4;
  const int64_t n_tokens = 10;
  std::mt19937 rng(11);
  const std::vector<float> u = uniform(rng, n_tokens * channels, -3.0f, 3.0f);
  const std::vector<float> w = uniform(rng, channels * kernel, -1.0f, 1.0f);
  std::vector<float> state_ref(size_t((kernel - 1) * channels), 0.0f);
  std::vector<float> out_ref(u.size());
  causal_conv1d_silu_prefill(u.data(), n_tokens, channels, w.data(), kernel, state_ref.data(),
                             out_ref.data());
  for (const int64_t prefill : {0, 1, 2, 3, 4, 6}) {
    std::vector<float> state(size_t((kernel - 1) * channels), 0.0f);
    std::vector<float> out(u.size());
    causal_conv1d_silu_prefill(u.data(), prefill, channels, w.data(), kernel, state.data(),
                               out.data());
    for (int64_t t = prefill; t < n_tokens; ++t) {
      causal_conv1d_silu_decode(u.data() + t * channels, channels, w.data(), kernel, state.data(),
                                out.data() + t * channels);
    }
    EXPECT_TRUE(all_close(out, out_ref, 0.0, 0.0)) << "prefill " << prefill;
    EXPECT_TRUE(all_close(state, state_ref, 0.0, 0.0)) << "prefill " << prefill;
  }
}

// With md = BF16 the conv sum is rounded, then silu, then rounded again (HF runs the conv in md).
TEST(GatedDeltaNetConv, ModelDtypeRoundsTheSumAndTheActivation) {
  auto bf16 = [](double x) { return bf16_to_f32(f32_to_bf16(float(x))); };
  const int64_t channels = 3;
  const int64_t kernel = 2;
  // Inputs and weights are bf16 values whose products and sums are exact in fp32.
  const std::vector<float> w = {1.0f, 1.0f, 0.5f, 1.0f, 1.0f, -0.25f};
  const std::vector<float> u = {1.0f, 0.00390625f, 3.0f, 0.0078125f, 1.0f, 1.5f};
  std::vector<float> state(size_t(channels), 0.0f);
  std::vector<float> out(u.size());
  causal_conv1d_silu_prefill(u.data(), 2, channels, w.data(), kernel, state.data(), out.data(),
                             DType::kBF16);
  for (int64_t t = 0; t < 2; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      const double prev = t == 0 ? 0.0 : u[size_t(c)];
      const double sum =
          w[size_t(c * kernel)] * prev + w[size_t(c * kernel + 1)] * u[size_t(t * channels + c)];
      const float want = bf16(silu_d(bf16(sum)));
      EXPECT_EQ(out[size_t(t * channels + c)], want) << "t " << t << " c " << c;
    }
  }
  // Channel 0 at t = 1: 1 + 0.0078125 = 1.0078125 is a bf16 value; channel 1 at t = 1: 0.5 *
  // 0.00390625 + 1 = 1.001953125 rounds to 1 in bf16 before the silu.
  EXPECT_EQ(out[size_t(channels + 1)], bf16(silu_d(1.0)));
}

// ---- l2norm and gates ---------------------------------------------------------------------------

TEST(GatedDeltaNetL2Norm, HandComputedRows) {
  // [3, 4]: 1 / sqrt(25 + 1e-6) = 0.2 * (1 - 2e-8); [0, 0]: stays 0 (eps keeps it finite);
  // [1e-4, 0]: 1e-4 / sqrt(1e-8 + 1e-6) = 0.0995037190 (eps inside the sqrt; x / (|x| + eps)
  // would give 0.990099, x / max(|x|, eps) 1.0).
  const std::vector<float> x = {3.0f, 4.0f, 0.0f, 0.0f, 1e-4f, 0.0f};
  std::vector<float> out(x.size());
  l2norm_rows(x.data(), 3, 2, out.data());
  const std::vector<double> want = {
      0.6 * (1 - 2e-8), 0.8 * (1 - 2e-8), 0.0, 0.0, 0.0995037190, 0.0};
  EXPECT_TRUE(all_close(out, want, 1e-9, 2e-7));
  // In place.
  std::vector<float> y = x;
  l2norm_rows(y.data(), 3, 2, y.data());
  EXPECT_TRUE(all_close(y, out, 0.0, 0.0));
}

TEST(GatedDeltaNetGates, HandComputedValues) {
  // Head 0: exp(A_log) = 2, dt_bias 0.5; head 1: exp(A_log) = 0.25, dt_bias -1.
  const std::vector<float> a_log = {float(std::log(2.0)), float(std::log(0.25))};
  const std::vector<float> dt_bias = {0.5f, -1.0f};
  // Softplus arguments s = a + dt_bias: 0, -3 (token 0); 24.5, 21 (token 1, linear above 20).
  const std::vector<float> a = {-0.5f, -2.0f, 24.0f, 22.0f};
  const std::vector<float> b = {0.0f, 2.0f, -3.0f, 40.0f};
  std::vector<float> g(4);
  std::vector<float> beta(4);
  gated_delta_gates(a.data(), b.data(), a_log.data(), dt_bias.data(), 2, 2, g.data(), beta.data());
  // softplus(0) = ln 2 = 0.693147181, softplus(-3) = ln(1 + e^-3) = 0.0485873516.
  const std::vector<double> want_g = {-2.0 * 0.693147181, -0.25 * 0.0485873516, -2.0 * 24.5,
                                      -0.25 * 21.0};
  // sigmoid(0) = 0.5, sigmoid(2) = 0.880797078, sigmoid(-3) = 0.0474258732, sigmoid(40) = 1.
  const std::vector<double> want_beta = {0.5, 0.880797078, 0.0474258732, 1.0};
  EXPECT_TRUE(all_close(g, want_g, 1e-7, 1e-6));
  EXPECT_TRUE(all_close(beta, want_beta, 1e-8, 1e-6));
  // The double formulas agree over a sweep that crosses the softplus threshold.
  std::vector<float> sweep_a;
  for (int i = -40; i <= 40; ++i) sweep_a.push_back(float(i) * 0.7f);
  const auto n = int64_t(sweep_a.size());
  std::vector<float> g1(sweep_a.size());
  std::vector<float> beta1(sweep_a.size());
  const float one_a_log = 0.3f;
  const float one_dt_bias = 0.2f;
  gated_delta_gates(sweep_a.data(), sweep_a.data(), &one_a_log, &one_dt_bias, n, 1, g1.data(),
                    beta1.data());
  std::vector<double> want_g1;
  std::vector<double> want_beta1;
  for (const float s : sweep_a) {
    want_g1.push_back(-std::exp(0.3) * std::log(1.0 + std::exp(double(s) + 0.2)));
    want_beta1.push_back(sigmoid_d(s));
  }
  EXPECT_TRUE(all_close(g1, want_g1, 1e-7, 2e-6));
  EXPECT_TRUE(all_close(beta1, want_beta1, 1e-8, 1e-6));
}

// ---- the gated delta rule -----------------------------------------------------------------------

struct RuleCase {
  int64_t n_tokens = 0;
  int64_t n_k_heads = 0;
  int64_t n_v_heads = 0;
  int64_t head_k_dim = 0;
  int64_t head_v_dim = 0;
  std::vector<float> q;      // [T, nK, dk]
  std::vector<float> k;      // [T, nK, dk]
  std::vector<float> v;      // [T, nV, dv]
  std::vector<float> g;      // [T, nV]
  std::vector<float> beta;   // [T, nV]
  std::vector<float> state;  // [nV, dk, dv] initial
};

RuleCase random_case(uint32_t seed, int64_t n_tokens, int64_t n_k_heads, int64_t n_v_heads,
                     int64_t head_k_dim, int64_t head_v_dim, float g_min = -1.5f,
                     bool zero_state = false) {
  std::mt19937 rng(seed);
  RuleCase c;
  c.n_tokens = n_tokens;
  c.n_k_heads = n_k_heads;
  c.n_v_heads = n_v_heads;
  c.head_k_dim = head_k_dim;
  c.head_v_dim = head_v_dim;
  c.q = uniform(rng, n_tokens * n_k_heads * head_k_dim, -1.0f, 1.0f);
  c.k = uniform(rng, n_tokens * n_k_heads * head_k_dim, -1.0f, 1.0f);
  c.v = uniform(rng, n_tokens * n_v_heads * head_v_dim, -1.0f, 1.0f);
  c.g = uniform(rng, n_tokens * n_v_heads, g_min, -0.001f);
  c.beta = uniform(rng, n_tokens * n_v_heads, 0.0f, 1.0f);
  c.state = zero_state ? std::vector<float>(size_t(n_v_heads * head_k_dim * head_v_dim), 0.0f)
                       : uniform(rng, n_v_heads * head_k_dim * head_v_dim, -0.5f, 0.5f);
  return c;
}

// Tokens [begin, end) of a case, with the given state.
RuleCase slice(const RuleCase& c, int64_t begin, int64_t end, const std::vector<float>& state) {
  RuleCase s = c;
  s.n_tokens = end - begin;
  s.q = rows_of(c.q, c.n_k_heads * c.head_k_dim, begin, end);
  s.k = rows_of(c.k, c.n_k_heads * c.head_k_dim, begin, end);
  s.v = rows_of(c.v, c.n_v_heads * c.head_v_dim, begin, end);
  s.g = rows_of(c.g, c.n_v_heads, begin, end);
  s.beta = rows_of(c.beta, c.n_v_heads, begin, end);
  s.state = state;
  return s;
}

struct RuleResult {
  std::vector<float> out;    // [T, nV, dv]
  std::vector<float> state;  // [nV, dk, dv]
};

enum class Form { kRecurrent, kChunked };

RuleResult run_rule(const RuleCase& c, Form form, int64_t chunk_size = kGatedDeltaChunkSize,
                    bool qk_l2norm = true) {
  RuleResult r;
  r.out.assign(size_t(c.n_tokens * c.n_v_heads * c.head_v_dim), -99.0f);
  r.state = c.state;
  GatedDeltaRuleParams p;
  p.n_tokens = c.n_tokens;
  p.n_k_heads = c.n_k_heads;
  p.n_v_heads = c.n_v_heads;
  p.head_k_dim = c.head_k_dim;
  p.head_v_dim = c.head_v_dim;
  p.qk_l2norm = qk_l2norm;
  p.q = c.q.data();
  p.k = c.k.data();
  p.v = c.v.data();
  p.g = c.g.data();
  p.beta = c.beta.data();
  p.state = r.state.data();
  p.out = r.out.data();
  if (form == Form::kRecurrent) {
    gated_delta_rule_recurrent(p);
  } else {
    gated_delta_rule_chunked(p, chunk_size);
  }
  return r;
}

// Head h of the result takes source head map(h): [T, n_src, dim] -> [T, n_dst, dim].
template <class Map>
std::vector<float> gather_heads(const std::vector<float>& x, int64_t n_tokens, int64_t n_src,
                                int64_t n_dst, int64_t dim, Map map) {
  std::vector<float> out;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < n_dst; ++h) {
      const int64_t src = (t * n_src + map(h)) * dim;
      out.insert(out.end(), x.begin() + src, x.begin() + src + dim);
    }
  }
  return out;
}

// q/k repeated to n_v_heads heads as torch.repeat_interleave(group, dim=heads) does: head j is
// source head j / group, written out explicitly so the rule runs with n_k_heads == n_v_heads.
RuleCase repeat_interleave_qk(const RuleCase& c) {
  const int64_t group = c.n_v_heads / c.n_k_heads;
  RuleCase r = c;
  auto map = [group](int64_t h) { return h / group; };
  r.q = gather_heads(c.q, c.n_tokens, c.n_k_heads, c.n_v_heads, c.head_k_dim, map);
  r.k = gather_heads(c.k, c.n_tokens, c.n_k_heads, c.n_v_heads, c.head_k_dim, map);
  r.n_k_heads = c.n_v_heads;
  return r;
}

struct DoubleResult {
  std::vector<double> out;
  std::vector<double> state;
};

// The gated delta rule from its definition, in double, for n_k_heads == n_v_heads (callers repeat
// grouped heads explicitly). Per head: q^ = l2norm(q) / sqrt(dk), k^ = l2norm(k) (eps 1e-6 in the
// sqrt); S = e^g S; S += k^ (beta (v - S^T k^))^T; o = S^T q^.
DoubleResult reference_rule(const RuleCase& c, bool qk_l2norm = true) {
  EXPECT_EQ(c.n_k_heads, c.n_v_heads);
  const int64_t nh = c.n_v_heads;
  const int64_t dk = c.head_k_dim;
  const int64_t dv = c.head_v_dim;
  DoubleResult r;
  r.state.assign(c.state.begin(), c.state.end());
  r.out.assign(size_t(c.n_tokens * nh * dv), 0.0);
  auto normalised = [&](const std::vector<float>& x, int64_t t, int64_t h) {
    std::vector<double> y(static_cast<size_t>(dk));
    double ss = 0.0;
    for (int64_t d = 0; d < dk; ++d) {
      y[size_t(d)] = x[size_t((t * nh + h) * dk + d)];
      ss += y[size_t(d)] * y[size_t(d)];
    }
    if (qk_l2norm) {
      for (double& e : y) e /= std::sqrt(ss + 1e-6);
    }
    return y;
  };
  for (int64_t t = 0; t < c.n_tokens; ++t) {
    for (int64_t h = 0; h < nh; ++h) {
      std::vector<double> q = normalised(c.q, t, h);
      for (double& e : q) e /= std::sqrt(double(dk));
      const std::vector<double> k = normalised(c.k, t, h);
      const double decay = std::exp(double(c.g[size_t(t * nh + h)]));
      const double beta = c.beta[size_t(t * nh + h)];
      double* s = r.state.data() + h * dk * dv;
      for (int64_t i = 0; i < dk * dv; ++i) s[i] *= decay;
      for (int64_t e = 0; e < dv; ++e) {
        double read = 0.0;
        for (int64_t d = 0; d < dk; ++d) read += s[d * dv + e] * k[size_t(d)];
        const double write = beta * (c.v[size_t((t * nh + h) * dv + e)] - read);
        for (int64_t d = 0; d < dk; ++d) s[d * dv + e] += k[size_t(d)] * write;
      }
      for (int64_t e = 0; e < dv; ++e) {
        double o = 0.0;
        for (int64_t d = 0; d < dk; ++d) o += s[d * dv + e] * q[size_t(d)];
        r.out[size_t((t * nh + h) * dv + e)] = o;
      }
    }
  }
  return r;
}

// Tolerances, for values of order 1: fp32 against double, and the two fp32 forms (or one form
// split differently) against each other. Observed worst cases are about 5e-7 absolute.
constexpr double kAtolVsDouble = 2e-6;
constexpr double kRtolVsDouble = 1e-5;
constexpr double kAtolForms = 2e-6;
constexpr double kRtolForms = 1e-5;

// One head, dk = 2, dv = 1, worked by hand. State [[2], [0]], g = ln 0.5 -> [[1], [0]];
// k = [1, 0] (l2norm: 1 / sqrt(1 + 1e-6)), v = 5, beta = 0.5: read 1, write 0.5 (5 - 1) = 2 ->
// [[3], [0]]; q = [1, 1] -> l2norm [1, 1] / sqrt(2 + 1e-6) -> / sqrt(2) -> [0.5, 0.5];
// o = 3 * 0.5 = 1.5 (reading before the write would give 0.5). Second token: g = 0, beta = 0,
// q = [0, -2] -> o = 0 (S[1] = 0); third: k = [0, 1], v = 4, beta = 1, g = 0:
// read 0, S = [[3], [4]], q = [3, 4] -> [0.6, 0.8] / sqrt(2) -> o = (1.8 + 3.2) / sqrt(2).
TEST(GatedDeltaRule, HandComputedExample) {
  RuleCase c;
  c.n_tokens = 3;
  c.n_k_heads = c.n_v_heads = 1;
  c.head_k_dim = 2;
  c.head_v_dim = 1;
  c.q = {1.0f, 1.0f, 0.0f, -2.0f, 3.0f, 4.0f};
  c.k = {1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 1.0f};
  c.v = {5.0f, 7.0f, 4.0f};
  c.g = {float(std::log(0.5)), 0.0f, 0.0f};
  c.beta = {0.5f, 0.0f, 1.0f};
  c.state = {2.0f, 0.0f};
  const std::vector<double> want_out = {1.5, 0.0, 5.0 / std::sqrt(2.0)};
  const std::vector<double> want_state = {3.0, 4.0};
  for (const Form form : {Form::kRecurrent, Form::kChunked}) {
    for (const int64_t chunk : {64, 2, 1}) {
      const RuleResult r = run_rule(c, form, chunk);
      // The 1e-6 inside the l2norms moves the results by up to ~5e-7 relative.
      EXPECT_TRUE(all_close(r.out, want_out, 1e-6, 2e-6)) << "chunk " << chunk;
      EXPECT_TRUE(all_close(r.state, want_state, 1e-6, 2e-6)) << "chunk " << chunk;
    }
  }
}

TEST(GatedDeltaRule, RecurrentMatchesDoubleReference) {
  const RuleCase c = random_case(21, 40, 2, 4, 16, 12);
  const RuleResult r = run_rule(c, Form::kRecurrent);
  const DoubleResult ref = reference_rule(repeat_interleave_qk(c));
  EXPECT_TRUE(all_close(r.out, ref.out, kAtolVsDouble, kRtolVsDouble));
  EXPECT_TRUE(all_close(r.state, ref.state, kAtolVsDouble, kRtolVsDouble));
}

TEST(GatedDeltaRule, WithoutL2NormUsesQkAsGiven) {
  RuleCase c = random_case(22, 9, 1, 2, 8, 4);
  for (float& x : c.q) x *= 0.3f;  // keep the un-normalised keys' updates contractive
  for (float& x : c.k) x *= 0.3f;
  const DoubleResult ref = reference_rule(repeat_interleave_qk(c), /*qk_l2norm=*/false);
  for (const Form form : {Form::kRecurrent, Form::kChunked}) {
    const RuleResult r = run_rule(c, form, 4, /*qk_l2norm=*/false);
    EXPECT_TRUE(all_close(r.out, ref.out, kAtolVsDouble, kRtolVsDouble));
    EXPECT_TRUE(all_close(r.state, ref.state, kAtolVsDouble, kRtolVsDouble));
  }
  // l2norm_rows then qk_l2norm = false is the same computation as qk_l2norm = true.
  RuleCase normed = c;
  l2norm_rows(normed.q.data(), c.n_tokens * c.n_k_heads, c.head_k_dim, normed.q.data());
  l2norm_rows(normed.k.data(), c.n_tokens * c.n_k_heads, c.head_k_dim, normed.k.data());
  for (const Form form : {Form::kRecurrent, Form::kChunked}) {
    const RuleResult inside = run_rule(c, form, 4, true);
    const RuleResult outside = run_rule(normed, form, 4, false);
    EXPECT_TRUE(all_close(outside.out, inside.out, 0.0, 0.0));
    EXPECT_TRUE(all_close(outside.state, inside.state, 0.0, 0.0));
  }
}

class GatedDeltaRuleChunks : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(GatedDeltaRuleChunks, ChunkedMatchesRecurrentAndDoubleReference) {
  const auto [n_tokens, chunk_size] = GetParam();
  for (const bool zero_state : {true, false}) {
    const RuleCase c = random_case(uint32_t(1000 + n_tokens * 7 + chunk_size), n_tokens, 2, 4, 16,
                                   12, -1.5f, zero_state);
    const RuleResult chunked = run_rule(c, Form::kChunked, chunk_size);
    const RuleResult recurrent = run_rule(c, Form::kRecurrent);
    EXPECT_TRUE(all_close(chunked.out, recurrent.out, kAtolForms, kRtolForms));
    EXPECT_TRUE(all_close(chunked.state, recurrent.state, kAtolForms, kRtolForms));
    const DoubleResult ref = reference_rule(repeat_interleave_qk(c));
    EXPECT_TRUE(all_close(chunked.out, ref.out, kAtolVsDouble, kRtolVsDouble));
    EXPECT_TRUE(all_close(chunked.state, ref.state, kAtolVsDouble, kRtolVsDouble));
  }
}

INSTANTIATE_TEST_SUITE_P(TokensByChunk, GatedDeltaRuleChunks,
                         ::testing::Combine(::testing::Values(1, 7, 64, 65, 130),
                                            ::testing::Values(64, 16, 7, 1)));

// A prefill split at any token (inside a chunk, at a chunk boundary, one token before the end)
// continues from the returned state: chunk boundaries move, so results agree to fp32 rounding.
TEST(GatedDeltaRule, ChunkedSplitAnywhereEqualsOneShot) {
  const RuleCase c = random_case(31, 130, 2, 4, 16, 12);
  const RuleResult whole = run_rule(c, Form::kChunked);
  const int64_t row = c.n_v_heads * c.head_v_dim;
  for (const int64_t split : {1, 5, 37, 63, 64, 65, 100, 128, 129}) {
    const RuleResult first = run_rule(slice(c, 0, split, c.state), Form::kChunked);
    const RuleResult second = run_rule(slice(c, split, c.n_tokens, first.state), Form::kChunked);
    std::vector<float> out = first.out;
    append(out, second.out);
    EXPECT_TRUE(all_close(out, whole.out, kAtolForms, kRtolForms)) << "split " << split;
    EXPECT_TRUE(all_close(second.state, whole.state, kAtolForms, kRtolForms)) << "split " << split;
  }
  // Several pieces, including an empty one, with different chunk sizes.
  std::vector<float> state = c.state;
  std::vector<float> out;
  int64_t begin = 0;
  int64_t chunk = 64;
  for (const int64_t piece : {3, 0, 61, 1, 40, 25}) {
    const RuleResult r = run_rule(slice(c, begin, begin + piece, state), Form::kChunked, chunk);
    append(out, r.out);
    state = r.state;
    begin += piece;
    chunk = chunk == 64 ? 16 : 64;
  }
  ASSERT_EQ(begin, c.n_tokens);
  ASSERT_EQ(int64_t(out.size()), c.n_tokens * row);
  EXPECT_TRUE(all_close(out, whole.out, kAtolForms, kRtolForms));
  EXPECT_TRUE(all_close(state, whole.state, kAtolForms, kRtolForms));
}

// HF's runtime path: a chunked prefill, then one recurrent step per decoded token.
TEST(GatedDeltaRule, ChunkedPrefillThenRecurrentDecodeEqualsOneShot) {
  const RuleCase c = random_case(32, 80, 1, 2, 16, 8, -1.5f, /*zero_state=*/true);
  const RuleResult whole = run_rule(c, Form::kChunked);
  const int64_t prefill = 70;
  RuleResult step = run_rule(slice(c, 0, prefill, c.state), Form::kChunked);
  std::vector<float> out = step.out;
  for (int64_t t = prefill; t < c.n_tokens; ++t) {
    step = run_rule(slice(c, t, t + 1, step.state), Form::kRecurrent);
    append(out, step.out);
  }
  EXPECT_TRUE(all_close(out, whole.out, kAtolForms, kRtolForms));
  EXPECT_TRUE(all_close(step.state, whole.state, kAtolForms, kRtolForms));
}

// n_v_heads = 2 * n_k_heads: value head j reads q/k head j / 2 (repeat_interleave), exactly as
// if q/k had been repeated explicitly; a tiled mapping (j % n_k_heads) gives something else.
TEST(GatedDeltaRule, GroupedValueHeadsFollowRepeatInterleave) {
  const RuleCase c = random_case(41, 70, 2, 4, 8, 6);
  const RuleCase repeated = repeat_interleave_qk(c);
  RuleCase tiled = c;
  auto tile = [&](int64_t h) { return h % c.n_k_heads; };
  tiled.q = gather_heads(c.q, c.n_tokens, c.n_k_heads, c.n_v_heads, c.head_k_dim, tile);
  tiled.k = gather_heads(c.k, c.n_tokens, c.n_k_heads, c.n_v_heads, c.head_k_dim, tile);
  tiled.n_k_heads = c.n_v_heads;
  const DoubleResult ref = reference_rule(repeated);
  for (const Form form : {Form::kRecurrent, Form::kChunked}) {
    const RuleResult grouped = run_rule(c, form);
    const RuleResult explicit_heads = run_rule(repeated, form);
    EXPECT_TRUE(all_close(grouped.out, explicit_heads.out, 0.0, 0.0));
    EXPECT_TRUE(all_close(grouped.state, explicit_heads.state, 0.0, 0.0));
    EXPECT_TRUE(all_close(grouped.out, ref.out, kAtolVsDouble, kRtolVsDouble));
    EXPECT_TRUE(all_close(grouped.state, ref.state, kAtolVsDouble, kRtolVsDouble));
    EXPECT_GT(compare(run_rule(tiled, form).out, grouped.out, 0.0, 0.0).rel_l2, 0.1);
  }
}

// Strong decay (exp(gamma) underflows to 0 inside a chunk) stays finite and agrees. The chunked
// form loses precision here, as HF's does: gamma reaches about -1300 inside a chunk, so the fp32
// difference gamma_i - gamma_j carries an absolute error of up to ~1e-4 (one ulp of gamma), and
// the pairwise decays exp(gamma_i - gamma_j) a relative one of the same size (observed: 4e-6
// absolute, 1e-5 relative L2).
TEST(GatedDeltaRule, StrongDecayStaysFinite) {
  RuleCase c = random_case(51, 100, 1, 2, 8, 8);
  for (size_t i = 0; i < c.g.size(); ++i) c.g[i] = i % 3 == 0 ? -60.0f : -0.01f;
  const RuleResult chunked = run_rule(c, Form::kChunked);
  const RuleResult recurrent = run_rule(c, Form::kRecurrent);
  const DoubleResult ref = reference_rule(repeat_interleave_qk(c));
  EXPECT_EQ(compare(chunked.out, recurrent.out, 0.0, 0.0).n_nan, 0);
  EXPECT_EQ(compare(chunked.state, recurrent.state, 0.0, 0.0).n_nan, 0);
  EXPECT_TRUE(all_close(recurrent.out, ref.out, kAtolVsDouble, kRtolVsDouble));
  EXPECT_TRUE(all_close(recurrent.state, ref.state, kAtolVsDouble, kRtolVsDouble));
  EXPECT_TRUE(all_close(chunked.out, ref.out, 2e-5, 2e-4));
  EXPECT_TRUE(all_close(chunked.state, ref.state, 2e-5, 2e-4));
}

TEST(GatedDeltaRule, EmptyCallKeepsTheState) {
  const RuleCase c = random_case(52, 0, 1, 1, 4, 4);
  for (const Form form : {Form::kRecurrent, Form::kChunked}) {
    const RuleResult r = run_rule(c, form);
    EXPECT_TRUE(r.out.empty());
    EXPECT_TRUE(all_close(r.state, c.state, 0.0, 0.0));
  }
}

// ---- gated RMSNorm ------------------------------------------------------------------------------

// x = [3, 4]: mean square 12.5, 1 / sqrt(12.5 + 1e-6) = 0.282842701; normed [0.848528, 1.131371];
// weight [2, 0.5] -> [1.697056, 0.565685]; z = [1, -2]: silu = [0.731058579, -0.238405844],
// sigmoid = [0.731058579, 0.119202922].
TEST(GatedDeltaNetNorm, HandComputedRow) {
  const std::vector<float> x = {3.0f, 4.0f};
  const std::vector<float> z = {1.0f, -2.0f};
  const std::vector<float> weight = {2.0f, 0.5f};
  const double r = 1.0 / std::sqrt(12.5 + 1e-6);
  std::vector<float> out(2);
  gated_rms_norm(x.data(), z.data(), weight.data(), 1, 2, 1e-6f, GateActivation::kSilu, out.data());
  EXPECT_TRUE(all_close(
      out, std::vector<double>{2 * 3 * r * 0.731058579, 0.5 * 4 * r * -0.238405844}, 1e-7, 1e-6));
  gated_rms_norm(x.data(), z.data(), weight.data(), 1, 2, 1e-6f, GateActivation::kSigmoid,
                 out.data());
  EXPECT_TRUE(all_close(
      out, std::vector<double>{2 * 3 * r * 0.731058579, 0.5 * 4 * r * 0.119202922}, 1e-7, 1e-6));
}

TEST(GatedDeltaNetNorm, RowsMatchDoubleReference) {
  const int64_t n_rows = 6;
  const int64_t dim = 16;
  std::mt19937 rng(61);
  const std::vector<float> x = uniform(rng, n_rows * dim, -3.0f, 3.0f);
  const std::vector<float> z = uniform(rng, n_rows * dim, -4.0f, 4.0f);
  const std::vector<float> weight = uniform(rng, dim, 0.5f, 1.5f);
  const float eps = 1e-6f;
  std::vector<double> want(x.size());
  for (int64_t r = 0; r < n_rows; ++r) {
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += double(x[size_t(r * dim + i)]) * x[size_t(r * dim + i)];
    const double inv = 1.0 / std::sqrt(ss / double(dim) + double(eps));
    for (int64_t i = 0; i < dim; ++i) {
      const size_t j = size_t(r * dim + i);
      want[j] = double(weight[size_t(i)]) * (x[j] * inv) * silu_d(z[j]);
    }
  }
  std::vector<float> out(x.size());
  gated_rms_norm(x.data(), z.data(), weight.data(), n_rows, dim, eps, GateActivation::kSilu,
                 out.data());
  EXPECT_TRUE(all_close(out, want, 1e-6, 1e-5));
  // Output aliasing x, then z.
  std::vector<float> in_x = x;
  gated_rms_norm(in_x.data(), z.data(), weight.data(), n_rows, dim, eps, GateActivation::kSilu,
                 in_x.data());
  EXPECT_TRUE(all_close(in_x, out, 0.0, 0.0));
  std::vector<float> in_z = z;
  gated_rms_norm(x.data(), in_z.data(), weight.data(), n_rows, dim, eps, GateActivation::kSilu,
                 in_z.data());
  EXPECT_TRUE(all_close(in_z, out, 0.0, 0.0));
}

// HF's rounding points in md: rnd(x * r), rnd(w * .), fp32 product with act(z), rnd.
TEST(GatedDeltaNetNorm, ModelDtypeRoundsWhereHfRounds) {
  for (const DType md : {DType::kF16, DType::kBF16}) {
    auto rnd = [md](float v) {
      return md == DType::kF16 ? f16_to_f32(f32_to_f16(v)) : bf16_to_f32(f32_to_bf16(v));
    };
    const int64_t dim = 32;
    std::mt19937 rng(md == DType::kF16 ? 71u : 72u);
    std::vector<float> x = uniform(rng, 2 * dim, -3.0f, 3.0f);
    std::vector<float> z = uniform(rng, 2 * dim, -4.0f, 4.0f);
    std::vector<float> weight = uniform(rng, dim, 0.5f, 1.5f);
    for (float& e : x) e = rnd(e);
    for (float& e : z) e = rnd(e);
    for (float& e : weight) e = rnd(e);
    std::vector<float> want(x.size());
    for (int64_t r = 0; r < 2; ++r) {
      double ss = 0.0;
      for (int64_t i = 0; i < dim; ++i)
        ss += double(x[size_t(r * dim + i)]) * x[size_t(r * dim + i)];
      const float inv = float(1.0 / std::sqrt(ss / dim + 1e-6));
      for (int64_t i = 0; i < dim; ++i) {
        const size_t j = size_t(r * dim + i);
        const float weighted = rnd(weight[size_t(i)] * rnd(x[j] * inv));
        want[j] = rnd(weighted * float(silu_d(z[j])));
      }
    }
    std::vector<float> out(x.size());
    gated_rms_norm(x.data(), z.data(), weight.data(), 2, dim, 1e-6f, GateActivation::kSilu,
                   out.data(), md);
    // fp32 inv_rms and silu may differ from the double-derived ones in the last fp32 bit, which
    // can flip a rounding: allow one md ulp (2^-10 or 2^-7 relative).
    const double ulp = md == DType::kF16 ? 1.0 / 1024 : 1.0 / 128;
    EXPECT_TRUE(all_close(out, want, 1e-6, ulp)) << dtype_name(md);
    int64_t same = 0;
    for (size_t j = 0; j < out.size(); ++j) {
      EXPECT_EQ(rnd(out[j]), out[j]) << "output not representable in " << dtype_name(md);
      same += out[j] == want[j] ? 1 : 0;
    }
    EXPECT_GE(same, int64_t(out.size()) * 9 / 10) << dtype_name(md);
  }
}

}  // namespace
}  // namespace e4kv
