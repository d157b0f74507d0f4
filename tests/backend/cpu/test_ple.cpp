// PLE block CPU reference (backend/cpu/ple.h): the gate and the dilated conv against double
// references written here from docs/qwen4exp_reference.md section 7.4, the gate's signed square
// root at 0 and below the clamp, the conv's weight layout by an impulse, its state across calls
// (a run split anywhere equals the whole run bit for bit) and, at dilation 1, equality with the
// GatedDeltaNet conv.
#include "backend/cpu/ple.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/gated_delta_net.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

using test::all_close;

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

// ---- gate ---------------------------------------------------------------------------------------

// g = sign(d) sqrt(max(|d|, 1e-6)) with d = kn_s . qn_s / sqrt(H), out = sigmoid(g) val, in double.
std::vector<double> reference_gate(const std::vector<float>& kn, const std::vector<float>& qn,
                                   const std::vector<float>& val, int64_t n_rows, int64_t n_streams,
                                   int64_t hidden) {
  std::vector<double> out(size_t(n_rows * n_streams * hidden));
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t s = 0; s < n_streams; ++s) {
      const size_t base = size_t((r * n_streams + s) * hidden);
      double dot = 0.0;
      for (int64_t i = 0; i < hidden; ++i)
        dot += double(kn[base + size_t(i)]) * qn[base + size_t(i)];
      dot /= std::sqrt(double(hidden));
      const double sign = dot > 0 ? 1.0 : (dot < 0 ? -1.0 : 0.0);
      const double g = sign * std::sqrt(std::max(std::fabs(dot), 1e-6));
      for (int64_t i = 0; i < hidden; ++i) {
        out[base + size_t(i)] = sigmoid_d(g) * val[size_t(r * hidden + i)];
      }
    }
  }
  return out;
}

TEST(PleGate, MatchesDoubleReference) {
  for (const auto& [n_rows, n_streams, hidden] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 2, 8}, {5, 4, 16}, {3, 3, 64}}) {
    std::mt19937 rng(uint32_t(n_rows * 100 + n_streams * 10 + hidden));
    const int64_t width = n_streams * hidden;
    const std::vector<float> kn = uniform(rng, n_rows * width, -2.0f, 2.0f);
    const std::vector<float> qn = uniform(rng, n_rows * width, -2.0f, 2.0f);
    const std::vector<float> val = uniform(rng, n_rows * hidden, -3.0f, 3.0f);
    std::vector<float> out(kn.size());
    ple_gate(kn.data(), qn.data(), val.data(), n_rows, n_streams, hidden, out.data());
    EXPECT_TRUE(all_close(out, reference_gate(kn, qn, val, n_rows, n_streams, hidden), 1e-6, 1e-5))
        << n_rows << " x " << n_streams << " x " << hidden;
    // In place over the keys (each stream's dot product is read before its output is written).
    std::vector<float> in_place = kn;
    ple_gate(in_place.data(), qn.data(), val.data(), n_rows, n_streams, hidden, in_place.data());
    EXPECT_TRUE(all_close(in_place, out, 0.0, 0.0));
  }
}

// sign(0) = 0 gives sigmoid(0) = 1/2 exactly; below the clamp the magnitude is sqrt(1e-6) = 1e-3
// with the dot product's sign; a large dot product is the plain signed square root.
TEST(PleGate, SignedSquareRootAtZeroAndBelowTheClamp) {
  const int64_t hidden = 4;
  const int64_t n_streams = 4;
  // Stream 0: orthogonal (dot 0); stream 1: dot +1e-8; stream 2: dot -1e-8; stream 3: dot 16.
  const std::vector<float> kn = {1, 0, 0, 0, 1e-8f, 0, 0, 0, -1e-8f, 0, 0, 0, 2, 2, 2, 2};
  const std::vector<float> qn = {0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 2, 2, 2, 2};
  const std::vector<float> val = {1.0f, -2.0f, 0.5f, 4.0f};
  std::vector<float> out(16);
  ple_gate(kn.data(), qn.data(), val.data(), 1, n_streams, hidden, out.data());
  const double gates[] = {0.5, sigmoid_d(1e-3), sigmoid_d(-1e-3), sigmoid_d(std::sqrt(8.0))};
  for (int64_t s = 0; s < n_streams; ++s) {
    for (int64_t i = 0; i < hidden; ++i) {
      EXPECT_NEAR(out[size_t(s * hidden + i)], gates[s] * val[size_t(i)], 1e-6)
          << "stream " << s << " i " << i;
    }
  }
  for (int64_t i = 0; i < hidden; ++i) EXPECT_EQ(out[size_t(i)], 0.5f * val[size_t(i)]);
}

// ---- dilated conv -------------------------------------------------------------------------------

// y_t[c] = silu(sum_k w[c, k] x_{t - (K - 1 - k) d}[c]), x_{<0} = 0, over a whole sequence in
// double. x: [T, C]; w: [C, K].
std::vector<double> reference_conv(const std::vector<float>& x, int64_t n_tokens, int64_t channels,
                                   const std::vector<float>& w, int64_t kernel, int64_t dilation) {
  std::vector<double> y(size_t(n_tokens * channels));
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      double sum = 0.0;
      for (int64_t k = 0; k < kernel; ++k) {
        const int64_t src = t - (kernel - 1 - k) * dilation;
        if (src >= 0) sum += double(w[size_t(c * kernel + k)]) * x[size_t(src * channels + c)];
      }
      y[size_t(t * channels + c)] = silu_d(sum);
    }
  }
  return y;
}

struct ConvCase {
  int64_t kernel;
  int64_t dilation;
};

class PleConvCase : public ::testing::TestWithParam<ConvCase> {};

TEST_P(PleConvCase, WholeRunMatchesDoubleReference) {
  const auto [kernel, dilation] = GetParam();
  const int64_t channels = 7;
  const int64_t n_state = (kernel - 1) * dilation;
  for (const int64_t n_tokens : {int64_t(1), int64_t(2), n_state, n_state + 1, int64_t(23)}) {
    if (n_tokens == 0) continue;
    std::mt19937 rng(uint32_t(kernel * 1000 + dilation * 100 + n_tokens));
    const std::vector<float> x = uniform(rng, n_tokens * channels, -2.0f, 2.0f);
    const std::vector<float> w = uniform(rng, channels * kernel, -1.0f, 1.0f);
    std::vector<float> state(size_t(n_state * channels), 0.0f);
    std::vector<float> out(x.size());
    dilated_conv1d_silu(x.data(), n_tokens, channels, w.data(), kernel, dilation, state.data(),
                        out.data());
    EXPECT_TRUE(
        all_close(out, reference_conv(x, n_tokens, channels, w, kernel, dilation), 1e-6, 1e-5))
        << "n_tokens " << n_tokens;
    // The state is the last n_state inputs, zeros where the sequence is shorter.
    std::vector<float> want_state;
    for (int64_t r = n_tokens - n_state; r < n_tokens; ++r) {
      for (int64_t c = 0; c < channels; ++c) {
        want_state.push_back(r < 0 ? 0.0f : x[size_t(r * channels + c)]);
      }
    }
    EXPECT_TRUE(all_close(state, want_state, 0.0, 0.0)) << "n_tokens " << n_tokens;
  }
}

// Chunks of 1, 2 and 5 tokens (and every two-piece split) give the whole run bit for bit.
TEST_P(PleConvCase, RunsSplitAnywhereEqualTheWholeRun) {
  const auto [kernel, dilation] = GetParam();
  const int64_t channels = 5;
  const int64_t n_tokens = 29;
  const int64_t n_state = (kernel - 1) * dilation;
  std::mt19937 rng(uint32_t(kernel * 10 + dilation));
  const std::vector<float> x = uniform(rng, n_tokens * channels, -3.0f, 3.0f);
  const std::vector<float> w = uniform(rng, channels * kernel, -1.0f, 1.0f);
  std::vector<float> state_ref(size_t(n_state * channels), 0.0f);
  std::vector<float> out_ref(x.size());
  dilated_conv1d_silu(x.data(), n_tokens, channels, w.data(), kernel, dilation, state_ref.data(),
                      out_ref.data());

  std::vector<std::vector<int64_t>> patterns = {{1}, {2}, {5}, {3, 1, 4, 1, 5}};
  for (int64_t split = 0; split <= n_tokens; ++split) patterns.push_back({split, n_tokens});
  for (const std::vector<int64_t>& pattern : patterns) {
    std::vector<float> state(size_t(n_state * channels), 0.0f);
    std::vector<float> out(x.size(), NAN);
    int64_t begin = 0;
    for (size_t piece = 0; begin < n_tokens; ++piece) {
      const int64_t len = std::min(pattern[piece % pattern.size()], n_tokens - begin);
      dilated_conv1d_silu(x.data() + begin * channels, len, channels, w.data(), kernel, dilation,
                          state.data(), out.data() + begin * channels);
      begin += len;
    }
    EXPECT_TRUE(all_close(out, out_ref, 0.0, 0.0)) << "pattern[0] " << pattern[0];
    EXPECT_TRUE(all_close(state, state_ref, 0.0, 0.0)) << "pattern[0] " << pattern[0];
  }
}

INSTANTIATE_TEST_SUITE_P(KernelsAndDilations, PleConvCase,
                         ::testing::Values(ConvCase{4, 1}, ConvCase{4, 2}, ConvCase{4, 3},
                                           ConvCase{4, 5}, ConvCase{2, 3}, ConvCase{1, 3},
                                           ConvCase{3, 4}),
                         [](const ::testing::TestParamInfo<ConvCase>& param_info) {
                           return "k" + std::to_string(param_info.param.kernel) + "_d" +
                                  std::to_string(param_info.param.dilation);
                         });

// An impulse at t = 0 reads the weights backwards at the dilated taps: pre-activation
// y_{j d}[c] = w[c, K - 1 - j], zero between taps (w[c, K - 1] multiplies the newest input).
TEST(PleConv, WeightLayoutByImpulse) {
  const int64_t kernel = 4;
  const int64_t dilation = 3;
  const int64_t n_tokens = 13;
  const std::vector<float> w = {0.5f, -1.0f, 2.0f, 0.25f};  // one channel
  std::vector<float> x(size_t(n_tokens), 0.0f);
  x[0] = 1.0f;
  std::vector<float> state(size_t((kernel - 1) * dilation), 0.0f);
  std::vector<float> out(x.size());
  dilated_conv1d_silu(x.data(), n_tokens, 1, w.data(), kernel, dilation, state.data(), out.data());
  for (int64_t t = 0; t < n_tokens; ++t) {
    const bool tap = t % dilation == 0 && t / dilation < kernel;
    const double pre = tap ? w[size_t(kernel - 1 - t / dilation)] : 0.0;
    EXPECT_NEAR(out[size_t(t)], silu_d(pre), 1e-7) << "t " << t;
  }
}

// An empty call leaves the state alone; a call shorter than the state shifts it.
TEST(PleConv, ShortCallsShiftTheState) {
  const int64_t kernel = 4;
  const int64_t dilation = 3;
  const int64_t channels = 2;
  const int64_t n_state = 9;
  std::vector<float> state(size_t(n_state * channels));
  for (size_t i = 0; i < state.size(); ++i) state[i] = float(i + 1);
  const std::vector<float> w(size_t(channels * kernel), 1.0f);
  const std::vector<float> before = state;
  dilated_conv1d_silu(nullptr, 0, channels, w.data(), kernel, dilation, state.data(), nullptr);
  EXPECT_EQ(state, before);

  const std::vector<float> x = {100.0f, 200.0f, 300.0f, 400.0f};  // two tokens
  std::vector<float> out(4);
  dilated_conv1d_silu(x.data(), 2, channels, w.data(), kernel, dilation, state.data(), out.data());
  std::vector<float> want(before.begin() + 2 * channels, before.end());
  want.insert(want.end(), x.begin(), x.end());
  EXPECT_EQ(state, want);
  // Token 0 reads state rows 0, 3, 6 and itself; token 1 rows 1, 4, 7 and itself (channel 0).
  const double t0 = 1 + 7 + 13 + 100;
  const double t1 = 3 + 9 + 15 + 300;
  EXPECT_NEAR(out[0], silu_d(t0), 1e-4);
  EXPECT_NEAR(out[2], silu_d(t1), 1e-4);
}

// With dilation 1 the PLE conv is the GatedDeltaNet conv, bit for bit, state included.
TEST(PleConv, DilationOneIsTheGatedDeltaNetConv) {
  for (const int64_t kernel : {1, 2, 4}) {
    const int64_t channels = 6;
    std::mt19937 rng(static_cast<uint32_t>(kernel));
    const std::vector<float> w = uniform(rng, channels * kernel, -1.0f, 1.0f);
    std::vector<float> state_a(size_t((kernel - 1) * channels), 0.0f);
    std::vector<float> state_b = state_a;
    for (const int64_t n_tokens : {7, 1, 2, 0, 3}) {
      const std::vector<float> x = uniform(rng, n_tokens * channels, -4.0f, 4.0f);
      std::vector<float> out_a(x.size());
      std::vector<float> out_b(x.size());
      dilated_conv1d_silu(x.data(), n_tokens, channels, w.data(), kernel, 1, state_a.data(),
                          out_a.data());
      causal_conv1d_silu_prefill(x.data(), n_tokens, channels, w.data(), kernel, state_b.data(),
                                 out_b.data());
      EXPECT_TRUE(all_close(out_a, out_b, 0.0, 0.0)) << "kernel " << kernel << " n " << n_tokens;
      EXPECT_TRUE(all_close(state_a, state_b, 0.0, 0.0)) << "kernel " << kernel;
    }
  }
}

}  // namespace
}  // namespace e4kv
