// The sampler: greedy tie-break, seeded reproducibility, top-k / top-p / min-p distributions
// computed by hand, draw frequencies, the logit processing (bias, penalties, suppression) on exact
// binary fractions, log-probabilities against log_softmax in double, and validation.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace e4kv {
namespace {

std::vector<float> log_probs(const std::vector<double>& p) {
  std::vector<float> out;
  for (double x : p) out.push_back(static_cast<float>(std::log(x)));
  return out;
}

TEST(Sampler, GreedyIsArgmaxWithLowestIndexTieBreak) {
  const std::vector<float> logits{1.0f, 3.0f, 3.0f, 2.0f, -1.0f};
  EXPECT_EQ(argmax_logit(logits), 1);
  Sampler greedy(SamplingParams{});
  EXPECT_EQ(greedy.sample(logits), 1);
  const std::vector<float> with_nan{std::numeric_limits<float>::quiet_NaN(), 0.5f, 0.25f};
  EXPECT_EQ(argmax_logit(with_nan), 1);
  EXPECT_EQ(argmax_logit(std::vector<float>{}), -1);
}

TEST(Sampler, TopKOneIsGreedy) {
  const std::vector<float> logits{0.1f, 0.7f, 0.7f, 0.3f};
  SamplingParams params;
  params.temperature = 1.5;
  params.top_k = 1;
  params.seed = 42;
  Sampler sampler(params);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sampler.sample(logits), 1);
}

TEST(Sampler, SeededSamplingIsReproducible) {
  const std::vector<float> logits{0.0f, 0.5f, 1.0f, 0.2f, -0.3f, 0.9f};
  SamplingParams params;
  params.temperature = 1.0;
  params.seed = 1234;
  Sampler a(params), b(params);
  params.seed = 1235;
  Sampler c(params);
  std::vector<int32_t> draws_a, draws_b, draws_c;
  for (int i = 0; i < 200; ++i) {
    draws_a.push_back(a.sample(logits));
    draws_b.push_back(b.sample(logits));
    draws_c.push_back(c.sample(logits));
  }
  EXPECT_EQ(draws_a, draws_b);
  EXPECT_NE(draws_a, draws_c);
}

// `want` gives the kept tokens in order with their probabilities as fractions (p = 1/2, 1/4, ...).
// The logits are those fractions' logarithms rounded to float, so the exact expectation is the
// renormalised exp(logit / temperature) of the kept tokens, computed here in double (1e-12); the
// fractions themselves hold to the float rounding of the logits (1e-6).
void expect_distribution(const std::vector<TokenProbability>& got,
                         const std::vector<TokenProbability>& want,
                         const std::vector<float>& logits, double temperature = 1.0) {
  ASSERT_EQ(got.size(), want.size());
  double kept = 0.0;
  for (const TokenProbability& w : want) {
    kept += std::exp(double(logits[size_t(w.token)]) / temperature);
  }
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].token, want[i].token) << i;
    const double exact = std::exp(double(logits[size_t(want[i].token)]) / temperature) / kept;
    EXPECT_NEAR(got[i].probability, exact, 1e-12) << i;
    EXPECT_NEAR(got[i].probability, want[i].probability, 1e-6) << i;
  }
}

TEST(Sampler, TopPKeepsTheSmallestPrefixReachingP) {
  // p = 1/2, 1/4, 1/8, 1/8 (tokens 2 and 3 tie: the lower index comes first).
  const std::vector<float> logits = log_probs({0.5, 0.25, 0.125, 0.125});
  SamplingParams params;
  params.temperature = 1.0;
  params.top_p = 0.7;  // 0.5 < 0.7 <= 0.75: tokens 0, 1
  expect_distribution(sampling_distribution(logits, params), {{0, 2.0 / 3.0}, {1, 1.0 / 3.0}},
                      logits);
  params.top_p = 0.8;  // 0.75 < 0.8 <= 0.875: tokens 0, 1, 2
  expect_distribution(sampling_distribution(logits, params),
                      {{0, 4.0 / 7.0}, {1, 2.0 / 7.0}, {2, 1.0 / 7.0}}, logits);
  params.top_p = 0.3;  // the first token alone reaches it
  expect_distribution(sampling_distribution(logits, params), {{0, 1.0}}, logits);
  params.top_p = 1.0;
  expect_distribution(sampling_distribution(logits, params),
                      {{0, 0.5}, {1, 0.25}, {2, 0.125}, {3, 0.125}}, logits);
}

TEST(Sampler, TopKThenTopP) {
  const std::vector<float> logits = log_probs({0.125, 0.5, 0.125, 0.25});
  SamplingParams params;
  params.temperature = 1.0;
  params.top_k = 3;  // tokens 1, 3 and the lower-index of the tie (0)
  expect_distribution(sampling_distribution(logits, params),
                      {{1, 4.0 / 7.0}, {3, 2.0 / 7.0}, {0, 1.0 / 7.0}}, logits);
  params.top_p = 0.6;  // of the renormalised three: 4/7 < 0.6 <= 6/7
  expect_distribution(sampling_distribution(logits, params), {{1, 2.0 / 3.0}, {3, 1.0 / 3.0}},
                      logits);
}

TEST(Sampler, TemperatureSharpensTheDistribution) {
  const std::vector<float> logits = log_probs({0.5, 0.25, 0.25});
  SamplingParams params;
  params.temperature = 0.5;  // p^2 renormalised: 1/4, 1/16, 1/16 -> 4/6, 1/6, 1/6
  expect_distribution(sampling_distribution(logits, params),
                      {{0, 4.0 / 6.0}, {1, 1.0 / 6.0}, {2, 1.0 / 6.0}}, logits, 0.5);
}

TEST(Sampler, DrawFrequenciesFollowTheDistribution) {
  const std::vector<float> logits = log_probs({0.5, 0.25, 0.125, 0.125});
  SamplingParams params;
  params.temperature = 1.0;
  params.seed = 7;
  Sampler sampler(params);
  std::vector<int> counts(4, 0);
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++counts[size_t(sampler.sample(logits))];
  const double want[] = {0.5, 0.25, 0.125, 0.125};
  for (int t = 0; t < 4; ++t) {
    // Binomial standard deviation at n = 40000 is at most 0.0025; allow 4 of them.
    EXPECT_NEAR(double(counts[size_t(t)]) / n, want[t], 0.01) << "token " << t;
  }
}

TEST(Sampler, ValidatesParameters) {
  SamplingParams params;
  params.temperature = -1.0;
  // Each error names the field as the library does (the CLI spells it --temperature).
  EXPECT_EQ(validate_sampling_params(params).option(), "temperature");
  EXPECT_EQ(validate_sampling_params(params).message().rfind("temperature: must be", 0), 0u);
  EXPECT_EQ(validate_sampling_params(params).message().find("--"), std::string::npos);
  params = {};
  params.top_p = 0.0;
  EXPECT_EQ(validate_sampling_params(params).option(), "top_p");
  params = {};
  params.top_k = -2;
  EXPECT_EQ(validate_sampling_params(params).option(), "top_k");
  params = {};
  params.top_k = -1;  // off, as vLLM spells it
  EXPECT_TRUE(validate_sampling_params(params).ok());
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    params = {};
    params.repetition_penalty = bad;
    EXPECT_EQ(validate_sampling_params(params).option(), "repetition_penalty") << bad;
  }
}

// Exact values: a positive logit is divided, a negative one multiplied, zero stays, each seen id
// once however often it was seen, ids outside the vocabulary ignored, unseen logits untouched.
TEST(Sampler, RepetitionPenaltyRescalesSeenLogitsOnce) {
  std::vector<float> logits{3.0f, -2.0f, 0.0f, 1.5f, -0.5f};
  const std::vector<int32_t> seen{0, 1, 2, 0, 0, 1, -3, 5, 99};
  apply_repetition_penalty(logits, seen, 2.0);
  EXPECT_EQ(logits, (std::vector<float>{1.5f, -4.0f, 0.0f, 1.5f, -0.5f}));
  std::vector<float> same{3.0f, -2.0f};
  apply_repetition_penalty(same, seen, 1.0);
  EXPECT_EQ(same, (std::vector<float>{3.0f, -2.0f}));
  // fp32 division as transformers does it on fp32 logits.
  std::vector<float> third{1.0f};
  apply_repetition_penalty(third, std::vector<int32_t>{0}, 3.0);
  EXPECT_EQ(third[0], 1.0f / 3.0f);
}

// Every step on values exact in binary: suppression, then the bias, then the repetition penalty
// (so a logit the bias made positive is divided), then the output-only penalties.
TEST(Sampler, ProcessLogitsAppliesBiasPenaltiesAndSuppressionInVllmOrder) {
  std::vector<float> logits{2.0f, -1.0f, 0.5f, 3.0f, 0.0f, -0.75f};
  SamplingParams params;
  params.logit_bias = {{1, 2.0}, {4, -0.5}};
  params.repetition_penalty = 2.0;
  params.frequency_penalty = 0.25;
  params.presence_penalty = 0.5;
  const std::vector<int32_t> prompt{0, 1, 0};
  const std::vector<int32_t> output{3, 3, 2, 99};
  const std::vector<int32_t> suppress{2, -1};
  process_logits(logits, params, prompt, output, suppress);
  // 0: prompt only -> 2 / 2, no presence or frequency penalty (output tokens only).
  // 1: -1 + 2 = 1 (bias first) -> 1 / 2.
  // 2: suppressed -> -inf whatever follows.
  // 3: 3 / 2 (repetition, once though seen twice) - 0.25 * 2 (frequency) - 0.5 (presence).
  // 4: bias only. 5: untouched.
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(logits, (std::vector<float>{1.0f, 0.5f, -inf, 0.5f, -0.5f, -0.75f}));

  // Negative penalties encourage repetition: + 0.5 per occurrence + 1.
  std::vector<float> more{0.0f, 0.0f};
  params = {};
  params.frequency_penalty = -0.5;
  params.presence_penalty = -1.0;
  process_logits(more, params, std::vector<int32_t>{0}, std::vector<int32_t>{1, 1, 1});
  EXPECT_EQ(more, (std::vector<float>{0.0f, 2.5f}));
}

TEST(Sampler, MinPKeepsTokensAboveAFractionOfTheLargestAfterTemperature) {
  const std::vector<float> logits = log_probs({0.5, 0.25, 0.125, 0.0625, 0.0625});
  SamplingParams params;
  params.temperature = 1.0;
  params.min_p = 0.2;  // threshold 0.1: 0.5, 0.25, 0.125 stay
  expect_distribution(sampling_distribution(logits, params),
                      {{0, 4.0 / 7.0}, {1, 2.0 / 7.0}, {2, 1.0 / 7.0}}, logits);
  params.min_p = 0.3;  // threshold 0.15
  expect_distribution(sampling_distribution(logits, params), {{0, 2.0 / 3.0}, {1, 1.0 / 3.0}},
                      logits);
  // After temperature 0.5 the probabilities are p^2 / 0.3359375: 0.744, 0.186, 0.0465, ...; the
  // threshold 0.2 * 0.744 keeps two tokens (0.25 : 0.0625 -> 0.8, 0.2).
  params.temperature = 0.5;
  params.min_p = 0.2;
  expect_distribution(sampling_distribution(logits, params), {{0, 0.8}, {1, 0.2}}, logits, 0.5);
  // min_p before top-p: top-p renormalises over the three min_p kept (4/7 < 0.6 <= 6/7).
  params.temperature = 1.0;
  params.top_p = 0.6;
  expect_distribution(sampling_distribution(logits, params), {{0, 2.0 / 3.0}, {1, 1.0 / 3.0}},
                      logits);
  params.min_p = 1.0;  // only the most probable
  params.top_p = 1.0;
  expect_distribution(sampling_distribution(logits, params), {{0, 1.0}}, logits);
}

TEST(Sampler, SuppressedTokensAreNeverDrawn) {
  std::vector<float> logits{0.0f, 0.0f, 0.0f, 0.0f};
  process_logits(logits, SamplingParams{}, {}, {}, std::vector<int32_t>{1, 2});
  SamplingParams params;
  params.temperature = 1.0;
  expect_distribution(sampling_distribution(logits, params), {{0, 0.5}, {3, 0.5}}, logits);
  Sampler sampler(params);
  std::vector<int> counts(4, 0);
  for (int i = 0; i < 2000; ++i) ++counts[size_t(sampler.sample(logits))];
  EXPECT_EQ(counts[1] + counts[2], 0);
  EXPECT_GT(counts[0], 800);
  EXPECT_GT(counts[3], 800);
}

// log_softmax computed here directly in double: log(exp(l_t) / sum_j exp(l_j)).
TEST(Sampler, TokenLogprobsAreLogSoftmaxWithRankAndTopN) {
  const std::vector<float> logits{1.0f, 3.0f, 3.0f, -2.0f, 0.5f};
  double total = 0.0;
  for (float l : logits) total += std::exp(double(l));
  auto want = [&](int32_t t) { return std::log(std::exp(double(logits[size_t(t)])) / total); };
  const TokenLogprobs a = token_logprobs(logits, 0, 3);
  EXPECT_EQ(a.token, 0);
  EXPECT_NEAR(a.logprob, want(0), 1e-12);
  EXPECT_EQ(a.rank, 3);  // two tokens are more probable
  ASSERT_EQ(a.top.size(), 3u);
  EXPECT_EQ(a.top[0].token, 1);  // the tie: lower index first
  EXPECT_EQ(a.top[1].token, 2);
  EXPECT_EQ(a.top[2].token, 0);
  for (const TokenLogprob& t : a.top) EXPECT_NEAR(t.logprob, want(t.token), 1e-12);
  const TokenLogprobs b = token_logprobs(logits, 2, 0);
  EXPECT_EQ(b.rank, 1);
  EXPECT_TRUE(b.top.empty());
  EXPECT_NEAR(b.logprob, want(2), 1e-12);
  // Large logits do not overflow: shifted by their maximum.
  const std::vector<float> big{1000.0f, 1000.0f};
  EXPECT_NEAR(token_logprobs(big, 1, 2).logprob, std::log(0.5), 1e-12);
  EXPECT_EQ(token_logprobs(big, 1, 5).top.size(), 2u);
}

TEST(Sampler, ValidatesEveryNewFieldByName) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double bad : {-0.1, 1.5, nan}) {
    SamplingParams params;
    params.min_p = bad;
    EXPECT_EQ(validate_sampling_params(params).option(), "min_p") << bad;
  }
  for (double bad : {2.5, -2.01, nan}) {
    SamplingParams params;
    params.presence_penalty = bad;
    EXPECT_EQ(validate_sampling_params(params).option(), "presence_penalty") << bad;
    params = {};
    params.frequency_penalty = bad;
    EXPECT_EQ(validate_sampling_params(params).option(), "frequency_penalty") << bad;
  }
  SamplingParams params;
  params.presence_penalty = -2.0;
  params.frequency_penalty = 2.0;
  params.min_p = 1.0;
  params.logit_bias = {{4, 100.0}, {0, -100.0}};
  EXPECT_TRUE(validate_sampling_params(params, 5).ok());
  params.logit_bias = {{5, 1.0}};
  EXPECT_EQ(validate_sampling_params(params, 5).option(), "logit_bias");
  EXPECT_NE(validate_sampling_params(params, 5).message().find("token id 5"), std::string::npos);
  params.logit_bias = {{-1, 1.0}};
  EXPECT_EQ(validate_sampling_params(params).option(), "logit_bias");
  for (double bad : {100.5, -101.0, nan}) {
    params.logit_bias = {{1, bad}};
    EXPECT_EQ(validate_sampling_params(params, 5).option(), "logit_bias") << bad;
  }

  RequestParams request;
  EXPECT_TRUE(validate_request_params(request, 10).ok());
  request.max_tokens = 4;
  request.min_tokens = 5;
  EXPECT_EQ(validate_request_params(request, 10).option(), "min_tokens");
  request.min_tokens = -1;
  EXPECT_EQ(validate_request_params(request, 10).option(), "min_tokens");
  request = {};
  request.stop_ids = {3, 10};
  EXPECT_EQ(validate_request_params(request, 10).option(), "stop_ids");
  request = {};
  request.eos_ids = {-1};
  EXPECT_EQ(validate_request_params(request, 10).option(), "eos_ids");
  request = {};
  request.stop = {"ok", ""};
  EXPECT_EQ(validate_request_params(request, 10).option(), "stop");
  request = {};
  request.logprobs = 21;
  EXPECT_EQ(validate_request_params(request, 10).option(), "logprobs");
  request.logprobs = 20;
  request.prompt_logprobs = -2;
  EXPECT_EQ(validate_request_params(request, 10).option(), "prompt_logprobs");
  request.prompt_logprobs = 0;
  EXPECT_TRUE(validate_request_params(request, 10).ok());
  request.sampling.min_p = 2.0;
  EXPECT_EQ(validate_request_params(request, 10).option(), "min_p");
}

}  // namespace
}  // namespace e4kv

namespace e4kv {
namespace {

// The large-list sort (a radix sort on the probability bits) gives exactly the comparison sort's
// order, ties by lower token first, on a vocabulary-sized list with many equal probabilities.
TEST(Sampler, LargeListsSortExactlyAsTheComparisonSort) {
  for (const size_t n : {4095u, 4096u, 128256u}) {
    std::vector<TokenProbability> dist(n);
    uint64_t x = 12345 + n;
    for (size_t i = 0; i < n; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      // About 300 distinct values, so most probabilities tie; a few tiny and a few large ones.
      dist[i] = {int32_t(i), double(x % 300 + 1) * (i % 97 == 0 ? 1e-300 : 1e-6)};
    }
    std::vector<TokenProbability> want = dist;
    std::sort(want.begin(), want.end(), [](const TokenProbability& a, const TokenProbability& b) {
      return a.probability != b.probability ? a.probability > b.probability : a.token < b.token;
    });
    sort_by_decreasing_probability(dist);
    ASSERT_EQ(dist.size(), want.size());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(dist[i].token, want[i].token) << "n " << n << " at " << i;
      ASSERT_EQ(dist[i].probability, want[i].probability);
    }
  }
}

}  // namespace
}  // namespace e4kv

namespace e4kv {
namespace {

// argmax_logit against the plain one-pass definition (first strict maximum, NaN skipped) on random
// rows with ties, NaNs, infinities and lengths that are not a multiple of its 8 lanes.
TEST(Sampler, ArgmaxEqualsTheOnePassDefinition) {
  uint64_t x = 7;
  auto next = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x;
  };
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<float> row(size_t(next() % 70));
    for (float& v : row) {
      const uint64_t r = next() % 100;
      v = r < 5    ? std::numeric_limits<float>::quiet_NaN()
          : r < 10 ? -std::numeric_limits<float>::infinity()
          : r < 12 ? std::numeric_limits<float>::infinity()
          : r < 15 ? (r % 2 ? 0.0f : -0.0f)
                   : float(int(next() % 9) - 4);
    }
    int32_t want = -1;
    for (size_t i = 0; i < row.size(); ++i) {
      if (std::isnan(row[i])) continue;
      if (want < 0 || row[i] > row[size_t(want)]) want = int32_t(i);
    }
    ASSERT_EQ(argmax_logit(row), want) << "trial " << trial;
  }
}

}  // namespace
}  // namespace e4kv
