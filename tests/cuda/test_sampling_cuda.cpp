// Backend::sample_rows on the CUDA backend against the host definition (backend/cpu/sampling.h)
// on the same logits: 64 rows of a 248,320-token vocabulary, greedy (with ties) and seeded
// Gumbel-max draws at several temperatures and min-p values, rows drawn in another order and more
// than once, and non-finite logits counted. A draw may differ from the host's only where the two
// best perturbed logits are within the last-bit difference of the devices' logf: such rows are
// counted and must be rare; every other row must agree exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/sampling.h"
#include "backend/cuda/cuda_backend.h"
#include "core/sampling_noise.h"
#include "require_gpu.h"

namespace e4kv {
namespace {

using Params = Backend::SampleRowParams;

// The gap between the best and second-best perturbed logit of a draw (host arithmetic).
float key_margin(std::span<const float> row, const Params& p) {
  float top = -std::numeric_limits<float>::infinity();
  for (float v : row) {
    if (std::isfinite(v)) top = std::max(top, v);
  }
  if (p.inv_temperature == 0.0f) {
    float second = -std::numeric_limits<float>::infinity();
    bool seen_top = false;
    for (float v : row) {
      if (!std::isfinite(v)) continue;
      if (v == top && !seen_top) {
        seen_top = true;
      } else {
        second = std::max(second, v);
      }
    }
    return top - second;
  }
  const float threshold = top * p.inv_temperature + p.log_min_p;
  const uint64_t key = sampling_draw_key(p.seed, p.counter);
  float a = -std::numeric_limits<float>::infinity(), b = a;
  for (size_t i = 0; i < row.size(); ++i) {
    if (!std::isfinite(row[i])) continue;
    const float s = row[i] * p.inv_temperature;
    if (s < threshold) continue;
    const float k = s - std::log(-std::log(sampling_uniform(key, uint32_t(i))));
    if (k > a) {
      b = a;
      a = k;
    } else {
      b = std::max(b, k);
    }
  }
  return a - b;
}

TEST(SampleRowsCuda, EqualsTheHostDefinition) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  ASSERT_TRUE(backend.ok()) << backend.message();
  Backend& b = **backend;
  const int64_t vocab = 248320, rows = 64;
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(size_t(vocab * rows));
  for (float& v : logits) v = normal(rng);
  // Ties for greedy rows; non-finite values in two rows.
  for (int64_t r = 0; r < 8; ++r) {
    logits[size_t(r * vocab + 1000)] = 50.0f;
    logits[size_t(r * vocab + 200000)] = 50.0f;
  }
  logits[size_t(10 * vocab + 5)] = std::nanf("");
  logits[size_t(11 * vocab + 7)] = std::numeric_limits<float>::infinity();
  logits[size_t(11 * vocab + 8)] = -std::numeric_limits<float>::infinity();

  const float temperatures[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.6f};
  const double min_ps[] = {0.0, 0.01, 0.2};
  std::vector<Params> params;
  for (int64_t j = 0; j < 96; ++j) {
    Params p;
    p.logit_row = int32_t((j * 37) % rows);  // another order, some rows twice
    const float t = j < 8 ? 0.0f : temperatures[j % 5];
    p.inv_temperature = t == 0.0f ? 0.0f : 1.0f / t;
    const double min_p = min_ps[j % 3];
    p.log_min_p = min_p > 0.0 ? float(std::log(min_p)) : -std::numeric_limits<float>::infinity();
    p.seed = 1000 + uint64_t(j);
    p.counter = uint64_t(j % 7);
    params.push_back(p);
  }
  auto dev_logits = b.allocate(logits.size() * sizeof(float));
  auto dev_params = b.allocate(params.size() * sizeof(Params));
  auto dev_out = b.allocate(2 * params.size() * sizeof(int32_t));
  ASSERT_TRUE(dev_logits.ok() && dev_params.ok() && dev_out.ok());
  b.copy_from_host(dev_logits->data(), logits.data(), logits.size() * sizeof(float));
  b.copy_from_host(dev_params->data(), params.data(), params.size() * sizeof(Params));
  const int64_t n = int64_t(params.size());
  int32_t* out = dev_out->as<int32_t>();
  ASSERT_TRUE(b.sample_rows(dev_logits->as<float>(), vocab, dev_params->as<Params>(), n, out,
                            out + n)
                  .ok());
  std::vector<int32_t> got(size_t(2 * n));
  b.copy_to_host(got.data(), out, got.size() * sizeof(int32_t));

  int near_ties = 0;
  for (int64_t j = 0; j < n; ++j) {
    const Params& p = params[size_t(j)];
    const std::span<const float> row(logits.data() + p.logit_row * vocab, size_t(vocab));
    int32_t non_finite = -1;
    const int32_t expected = sample_row(row, p, &non_finite);
    EXPECT_EQ(got[size_t(n + j)], non_finite) << "draw " << j;
    if (got[size_t(j)] == expected) continue;
    // Greedy has exact ties only (the lowest index must win): never a near tie.
    const float margin = key_margin(row, p);
    if (p.inv_temperature != 0.0f && margin < 1e-5f * (1.0f + std::fabs(p.inv_temperature))) {
      ++near_ties;
    } else {
      ADD_FAILURE() << "draw " << j << " (row " << p.logit_row << "): device " << got[size_t(j)]
                    << ", host " << expected << ", margin " << margin;
    }
  }
  EXPECT_LE(near_ties, 2);
}

}  // namespace
}  // namespace e4kv
