// The batched draw (backend/cpu/sampling.h, Backend::sample_rows on the CPU backend) against
// independent definitions: greedy against a plain first-maximum scan; the Gumbel-max draw's
// frequencies against softmax(logits / temperature) computed in double; min-p's kept set against
// p_i >= min_p * max p; the noise as a pure function of (seed, draw, token).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/sampling.h"

namespace e4kv {
namespace {

using Params = Backend::SampleRowParams;

Params draw(float temperature, double min_p, uint64_t seed, uint64_t counter) {
  Params p;
  p.seed = seed;
  p.counter = counter;
  p.inv_temperature = temperature == 0.0f ? 0.0f : 1.0f / temperature;
  p.log_min_p = min_p > 0.0 ? float(std::log(min_p)) : -std::numeric_limits<float>::infinity();
  return p;
}

TEST(SampleRow, GreedyIsTheFirstLargestFiniteLogit) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> level(0, 5);  // few levels: many ties
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> logits(1 + trial * 7);
    for (float& v : logits) v = float(level(rng)) * 0.5f;
    int32_t expected = 0;
    for (size_t i = 1; i < logits.size(); ++i) {
      if (logits[i] > logits[size_t(expected)]) expected = int32_t(i);
    }
    int32_t non_finite = -1;
    EXPECT_EQ(sample_row(logits, draw(0.0f, 0.0, 1, 0), &non_finite), expected);
    EXPECT_EQ(non_finite, 0);
  }
}

TEST(SampleRow, CountsAndSkipsNonFiniteLogits) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits = {std::nanf(""), -inf, 1.0f, inf, 3.0f, 3.0f};
  int32_t non_finite = 0;
  EXPECT_EQ(sample_row(logits, draw(0.0f, 0.0, 1, 0), &non_finite), 4);
  EXPECT_EQ(non_finite, 3);
  const std::vector<float> none = {std::nanf(""), inf};
  EXPECT_EQ(sample_row(none, draw(1.0f, 0.0, 1, 0), &non_finite), -1);
  EXPECT_EQ(non_finite, 2);
}

TEST(SampleRow, DrawFrequenciesFollowTheSoftmax) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f, 0.5f, 1.5f};
  const float temperature = 0.8f;
  std::vector<double> p(logits.size());
  double total = 0.0;
  for (size_t i = 0; i < p.size(); ++i) total += p[i] = std::exp(double(logits[i]) / temperature);
  for (double& v : p) v /= total;
  const int n = 60000;
  std::vector<int> counts(logits.size(), 0);
  int32_t non_finite = 0;
  for (int k = 0; k < n; ++k) {
    ++counts[size_t(sample_row(logits, draw(temperature, 0.0, 1234, uint64_t(k)), &non_finite))];
  }
  for (size_t i = 0; i < p.size(); ++i) {
    const double sd = std::sqrt(n * p[i] * (1.0 - p[i]));
    EXPECT_NEAR(counts[i], n * p[i], 5.0 * sd) << "token " << i;
  }
}

TEST(SampleRow, MinPKeepsTokensAtLeastMinPTimesTheLargestProbability) {
  // p_i / p_max = exp((l_i - l_max) / T): with T = 1 and min_p = 0.3, tokens with
  // l_i - l_max >= log(0.3) = -1.204 are kept: 0 (0.0), 2 (-1.0); not 1 (-1.5) or 3 (-4).
  const std::vector<float> logits = {4.0f, 2.5f, 3.0f, 0.0f};
  std::vector<int> counts(logits.size(), 0);
  int32_t non_finite = 0;
  for (int k = 0; k < 4000; ++k) {
    ++counts[size_t(sample_row(logits, draw(1.0f, 0.3, 99, uint64_t(k)), &non_finite))];
  }
  EXPECT_GT(counts[0], 0);
  EXPECT_GT(counts[2], 0);
  EXPECT_EQ(counts[1], 0);
  EXPECT_EQ(counts[3], 0);
  // Kept ones in the softmax ratio over the kept set: p0 / p2 = e^1.
  EXPECT_NEAR(double(counts[0]) / counts[2], std::exp(1.0), 0.35);
}

TEST(SampleRow, TheDrawIsAPureFunctionOfSeedDrawAndLogits) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(5000);
  for (float& v : logits) v = normal(rng);
  int32_t non_finite = 0;
  int differ_by_counter = 0, differ_by_seed = 0;
  for (uint64_t k = 0; k < 50; ++k) {
    const int32_t a = sample_row(logits, draw(1.0f, 0.0, 42, k), &non_finite);
    EXPECT_EQ(sample_row(logits, draw(1.0f, 0.0, 42, k), &non_finite), a);
    differ_by_counter += sample_row(logits, draw(1.0f, 0.0, 42, k + 1), &non_finite) != a;
    differ_by_seed += sample_row(logits, draw(1.0f, 0.0, 43, k), &non_finite) != a;
  }
  // A flat-ish distribution over 5000 tokens: another draw or seed almost always picks another.
  EXPECT_GT(differ_by_counter, 40);
  EXPECT_GT(differ_by_seed, 40);
}

TEST(SampleRow, TheCpuBackendOpDrawsEachParamsRowFromItsLogitRow) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  const int64_t vocab = 300, rows = 4;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<float> logits(size_t(vocab * rows));
  for (float& v : logits) v = normal(rng);
  // Draw rows 3, 1 and 1 again with other parameters.
  std::vector<Params> params = {draw(0.0f, 0.0, 1, 0), draw(0.7f, 0.05, 5, 9),
                                draw(1.3f, 0.0, 6, 2)};
  params[0].logit_row = 3;
  params[1].logit_row = 1;
  params[2].logit_row = 1;
  auto dev_logits = backend->allocate(logits.size() * sizeof(float));
  auto dev_params = backend->allocate(params.size() * sizeof(Params));
  auto dev_out = backend->allocate(2 * params.size() * sizeof(int32_t));
  ASSERT_TRUE(dev_logits.ok() && dev_params.ok() && dev_out.ok());
  backend->copy_from_host(dev_logits->data(), logits.data(), logits.size() * sizeof(float));
  backend->copy_from_host(dev_params->data(), params.data(), params.size() * sizeof(Params));
  int32_t* out = dev_out->as<int32_t>();
  ASSERT_TRUE(backend
                  ->sample_rows(dev_logits->as<float>(), vocab, dev_params->as<Params>(),
                                int64_t(params.size()), out, out + params.size())
                  .ok());
  std::vector<int32_t> host(2 * params.size());
  backend->copy_to_host(host.data(), out, host.size() * sizeof(int32_t));
  for (size_t j = 0; j < params.size(); ++j) {
    const std::span<const float> row(logits.data() + params[j].logit_row * vocab, size_t(vocab));
    int32_t non_finite = -1;
    EXPECT_EQ(host[j], sample_row(row, params[j], &non_finite)) << j;
    EXPECT_EQ(host[params.size() + j], 0);
  }
}

}  // namespace
}  // namespace e4kv
