#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <utility>

#include "backend/cpu/sampling.h"
#include "core/sampling_noise.h"

namespace e4kv {

Status validate_sampling_params(const SamplingParams& params, int64_t vocab_size) {
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
  if (!(params.min_p >= 0.0 && params.min_p <= 1.0)) {
    return Status::option_error("min_p", cat("must be in [0, 1] (0 = off), got ", params.min_p));
  }
  if (!(params.presence_penalty >= -2.0 && params.presence_penalty <= 2.0)) {
    return Status::option_error("presence_penalty",
                                cat("must be in [-2, 2] (0 = off), got ", params.presence_penalty));
  }
  if (!(params.frequency_penalty >= -2.0 && params.frequency_penalty <= 2.0)) {
    return Status::option_error(
        "frequency_penalty", cat("must be in [-2, 2] (0 = off), got ", params.frequency_penalty));
  }
  for (const auto& [id, bias] : params.logit_bias) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      return Status::option_error(
          "logit_bias", cat("token id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
    if (!(bias >= -100.0 && bias <= 100.0)) {
      return Status::option_error("logit_bias",
                                  cat("the bias of token id ", id, " must be in [-100, 100], got ",
                                      bias));
    }
  }
  return ok_status();
}

void process_logits(std::span<float> logits, const SamplingParams& params,
                    std::span<const int32_t> prompt, std::span<const int32_t> output,
                    std::span<const int32_t> suppress) {
  const size_t vocab = logits.size();
  auto in_vocab = [vocab](int32_t id) { return id >= 0 && size_t(id) < vocab; };
  for (int32_t id : suppress) {
    if (in_vocab(id)) logits[size_t(id)] = -INFINITY;
  }
  for (const auto& [id, bias] : params.logit_bias) {
    if (in_vocab(id)) logits[size_t(id)] += static_cast<float>(bias);
  }
  if (params.repetition_penalty != 1.0) {
    apply_repetition_penalty(logits, prompt, params.repetition_penalty);
    // Ids of the output not in the prompt: the penalty applies once per distinct id.
    std::vector<int32_t> fresh;
    std::vector<bool> in_prompt(vocab, false);
    for (int32_t id : prompt) {
      if (in_vocab(id)) in_prompt[size_t(id)] = true;
    }
    for (int32_t id : output) {
      if (in_vocab(id) && !in_prompt[size_t(id)]) fresh.push_back(id);
    }
    apply_repetition_penalty(logits, fresh, params.repetition_penalty);
  }
  if (params.presence_penalty != 0.0 || params.frequency_penalty != 0.0) {
    std::vector<int64_t> count(vocab, 0);
    for (int32_t id : output) {
      if (in_vocab(id)) count[size_t(id)] += 1;
    }
    const float presence = static_cast<float>(params.presence_penalty);
    const float frequency = static_cast<float>(params.frequency_penalty);
    for (size_t i = 0; i < vocab; ++i) {
      if (count[i] == 0) continue;
      logits[i] -= frequency * static_cast<float>(count[i]);
      logits[i] -= presence;
    }
  }
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int64_t n) {
  double max_logit = -INFINITY;
  for (float logit : logits) max_logit = std::max(max_logit, double(logit));
  double total = 0.0;
  for (float logit : logits) total += std::exp(double(logit) - max_logit);
  const double log_total = max_logit + std::log(total);
  TokenLogprobs out;
  out.token = token;
  out.logprob = double(logits[size_t(token)]) - log_total;
  out.rank = 1;
  for (float logit : logits) out.rank += logit > logits[size_t(token)] ? 1 : 0;
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t k = std::min(size_t(std::max<int64_t>(n, 0)), order.size());
  std::partial_sort(order.begin(), order.begin() + std::ptrdiff_t(k), order.end(),
                    [&](int32_t a, int32_t b) {
                      return logits[size_t(a)] != logits[size_t(b)]
                                 ? logits[size_t(a)] > logits[size_t(b)]
                                 : a < b;
                    });
  for (size_t i = 0; i < k; ++i) {
    out.top.push_back({order[i], double(logits[size_t(order[i])]) - log_total});
  }
  return out;
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
  // Two passes: the largest value (8 independent running maxima, so the loop is not one long
  // dependency chain; a NaN never compares greater, so it never becomes the maximum), then the
  // first index holding it. Same result as one pass keeping the first strict maximum.
  constexpr size_t kLanes = 8;
  float lane[kLanes];
  std::fill(std::begin(lane), std::end(lane), -std::numeric_limits<float>::infinity());
  const size_t n = logits.size();
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t l = 0; l < kLanes; ++l) lane[l] = logits[i + l] > lane[l] ? logits[i + l] : lane[l];
  }
  float top = -std::numeric_limits<float>::infinity();
  for (; i < n; ++i) top = logits[i] > top ? logits[i] : top;
  for (const float v : lane) top = v > top ? v : top;
  for (size_t j = 0; j < n; ++j) {
    if (logits[j] == top) return static_cast<int32_t>(j);
  }
  return -1;  // empty, or every logit NaN
}

void sort_by_decreasing_probability(std::vector<TokenProbability>& dist) {
  // Small lists: a comparison sort. Large ones (a vocabulary of 10^5 tokens): a stable LSD radix
  // sort on the probability's bits, 16 bits per pass (a pass whose digit all keys share is
  // skipped). Positive doubles order like their bit patterns, so sorting the complemented bits
  // ascending gives decreasing probability, and stability keeps equal probabilities in their
  // incoming order: exactly the comparison sort's order when the input is in token order (it is:
  // built by index), which the tests check. About 3x faster than std::sort at 128K tokens
  // (bench/cpu/bench_engine_host.cpp).
  auto by_probability = [](const TokenProbability& a, const TokenProbability& b) {
    return a.probability != b.probability ? a.probability > b.probability : a.token < b.token;
  };
  const bool by_token = std::is_sorted(dist.begin(), dist.end(),
                                       [](const TokenProbability& a, const TokenProbability& b) {
                                         return a.token < b.token;
                                       });
  const bool positive = std::all_of(dist.begin(), dist.end(),
                                    [](const TokenProbability& t) { return t.probability > 0.0; });
  if (dist.size() < 4096 || !by_token || !positive) {
    std::sort(dist.begin(), dist.end(), by_probability);
    return;
  }
  auto key = [](const TokenProbability& t) {
    uint64_t bits = 0;
    std::memcpy(&bits, &t.probability, sizeof(bits));
    return ~bits;
  };
  std::vector<TokenProbability> scratch(dist.size());
  constexpr int kBits = 16;
  constexpr uint64_t kMask = (uint64_t(1) << kBits) - 1;
  std::vector<uint32_t> counts(size_t(1) << kBits);
  for (int shift = 0; shift < 64; shift += kBits) {
    std::fill(counts.begin(), counts.end(), 0u);
    for (const TokenProbability& t : dist) ++counts[(key(t) >> shift) & kMask];
    // A digit all keys share reorders nothing: skip the pass.
    if (counts[(key(dist.front()) >> shift) & kMask] == dist.size()) continue;
    uint32_t offset = 0;
    for (uint32_t& c : counts) offset += std::exchange(c, offset);
    for (const TokenProbability& t : dist) scratch[counts[(key(t) >> shift) & kMask]++] = t;
    dist.swap(scratch);
  }
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
  // -inf logits (suppressed ids) have probability 0 and are never drawn.
  std::erase_if(dist, [](const TokenProbability& t) { return !(t.probability > 0.0); });
  // Decreasing probability, lower index first among equals: a total order, so the result does
  // not depend on the sort algorithm.
  sort_by_decreasing_probability(dist);
  if (params.min_p > 0.0 && !dist.empty()) {
    const double threshold = params.min_p * dist.front().probability;
    std::erase_if(dist, [&](const TokenProbability& t) { return t.probability < threshold; });
  }
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

Sampler::Sampler(const SamplingParams& params) : params_(params) {}

bool Sampler::draws_on_backend() const {
  return params_.temperature == 0.0 || params_.top_k == 1 ||
         (params_.top_k <= 0 && params_.top_p >= 1.0);
}

Backend::SampleRowParams Sampler::next_backend_draw(int32_t logit_row) {
  Backend::SampleRowParams row;
  row.seed = params_.seed;
  row.counter = draws_++;
  const bool greedy = params_.temperature == 0.0 || params_.top_k == 1;
  row.inv_temperature = greedy ? 0.0f : static_cast<float>(1.0 / params_.temperature);
  row.log_min_p = params_.min_p > 0.0 ? static_cast<float>(std::log(params_.min_p))
                                      : -std::numeric_limits<float>::infinity();
  row.logit_row = logit_row;
  return row;
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (draws_on_backend()) {
    int32_t non_finite = 0;
    return sample_row(logits, next_backend_draw(0), &non_finite);
  }
  // top-k / top-p: the kept set needs the sorted distribution; the draw is the same rule.
  const std::vector<TokenProbability> dist = sampling_distribution(logits, params_);
  const uint64_t key = sampling_draw_key(params_.seed, draws_++);
  int32_t best_token = dist.front().token;
  float best = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (const TokenProbability& t : dist) {
    if (t.probability <= 0.0) continue;
    const float k = static_cast<float>(std::log(t.probability)) -
                    std::log(-std::log(sampling_uniform(key, uint32_t(t.token))));
    if (!any || k > best || (k == best && t.token < best_token)) {
      best = k;
      best_token = t.token;
      any = true;
    }
  }
  return best_token;
}

}  // namespace e4kv
