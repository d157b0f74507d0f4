#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace e4kv {

Status validate_sampling_params(const SamplingParams& params) {
  if (!std::isfinite(params.temperature) || params.temperature < 0.0) {
    return Status::option_error(
        "temperature", cat("must be a finite number >= 0 (0 = greedy), got ", params.temperature));
  }
  if (!(params.top_p > 0.0 && params.top_p <= 1.0)) {
    return Status::option_error("top_p", cat("must be in (0, 1] (1 = off), got ", params.top_p));
  }
  if (params.top_k < -1) {
    return Status::option_error("top_k", cat("must be >= 0 (0 or -1 = off), got ", params.top_k));
  }
  if (!std::isfinite(params.repetition_penalty) || params.repetition_penalty <= 0.0) {
    return Status::option_error("repetition_penalty",
                                cat("must be a finite number > 0 (1 = off), got ",
                                    params.repetition_penalty));
  }
  return ok_status();
}

void apply_repetition_penalty(std::span<float> logits, std::span<const int32_t> seen,
                              double penalty) {
  if (penalty == 1.0) return;
  const float p = static_cast<float>(penalty);
  std::vector<bool> done(logits.size(), false);
  for (int32_t id : seen) {
    if (id < 0 || static_cast<size_t>(id) >= logits.size() || done[size_t(id)]) continue;
    done[size_t(id)] = true;
    float& l = logits[size_t(id)];
    l = l > 0.0f ? l / p : l * p;
  }
}

int32_t argmax_logit(std::span<const float> logits) {
  int32_t best = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (best < 0 || logits[i] > logits[size_t(best)]) best = static_cast<int32_t>(i);
  }
  return best;
}

std::vector<TokenProbability> sampling_distribution(std::span<const float> logits,
                                                    const SamplingParams& params) {
  std::vector<TokenProbability> dist;
  if (logits.empty()) return dist;
  const double temperature = params.temperature > 0.0 ? params.temperature : 1.0;
  double max_scaled = -INFINITY;
  for (float logit : logits) max_scaled = std::max(max_scaled, double(logit) / temperature);
  dist.resize(logits.size());
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double p = std::exp(double(logits[i]) / temperature - max_scaled);
    dist[i] = {static_cast<int32_t>(i), p};
    total += p;
  }
  for (TokenProbability& t : dist) t.probability /= total;
  // Decreasing probability, lower index first among equals: a total order, so the result does
  // not depend on the sort algorithm.
  std::sort(dist.begin(), dist.end(), [](const TokenProbability& a, const TokenProbability& b) {
    return a.probability != b.probability ? a.probability > b.probability : a.token < b.token;
  });
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < dist.size()) {
    dist.resize(static_cast<size_t>(params.top_k));
  }
  if (params.top_p < 1.0) {
    double kept_total = 0.0;
    for (const TokenProbability& t : dist) kept_total += t.probability;
    double cumulative = 0.0;
    size_t keep = 0;
    while (keep < dist.size()) {
      cumulative += dist[keep].probability / kept_total;
      ++keep;
      if (cumulative >= params.top_p) break;
    }
    dist.resize(std::max<size_t>(1, keep));
  }
  double kept_total = 0.0;
  for (const TokenProbability& t : dist) kept_total += t.probability;
  for (TokenProbability& t : dist) t.probability /= kept_total;
  return dist;
}

Sampler::Sampler(const SamplingParams& params) : params_(params), state_(params.seed) {}

double Sampler::next_uniform() {
  // splitmix64
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (params_.temperature == 0.0 || params_.top_k == 1) return argmax_logit(logits);
  const std::vector<TokenProbability> dist = sampling_distribution(logits, params_);
  const double u = next_uniform();
  double cumulative = 0.0;
  for (const TokenProbability& t : dist) {
    cumulative += t.probability;
    if (u < cumulative) return t.token;
  }
  return dist.back().token;  // u within rounding of 1
}

}  // namespace e4kv
