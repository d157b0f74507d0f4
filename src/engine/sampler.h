// Next-token sampling: greedy, temperature, top-k, top-p, with a seeded generator so a run is
// reproducible on any machine (the generator and the arithmetic are e4kv's own, not the standard
// library's unspecified distributions).
//
// Defaults (the CLI's): temperature 0 (greedy), top_k 0 (off), top_p 1 (off), repetition penalty 1
// (off), seed 0. The repetition penalty (Hugging Face's and vLLM's definition) first rescales the
// logit of every token id already in the sequence (prompt and output): divided by the penalty when
// positive, multiplied by it otherwise. Greedy picks the largest logit, the lowest index among
// equals. With temperature > 0:
//   1. p_i = softmax(logits / temperature) in double;
//   2. top-k: keep the k most probable tokens (ties broken by lower index);
//   3. top-p: of those, in order of decreasing probability (ties by lower index), keep the shortest
//      prefix whose total probability reaches top_p (at least one token), as vLLM and llama.cpp do;
//   4. renormalise the kept tokens and draw one with a uniform double from the generator.
// top_k 1 is greedy whatever the temperature.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace e4kv {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0 (or -1): no top-k
  double top_p = 1.0;        // 1: no top-p
  double repetition_penalty = 1.0;  // 1: off; > 1 discourages tokens already in the sequence
  uint64_t seed = 0;
};

// Errors name the flag: temperature must be finite and >= 0, top_p in (0, 1], top_k >= -1,
// repetition_penalty finite and > 0.
Status validate_sampling_params(const SamplingParams& params);

// The repetition penalty on `logits` [vocab] in place, once per distinct id of `seen` (ids outside
// the vocabulary ignored); in fp32 as transformers computes it on fp32 logits.
void apply_repetition_penalty(std::span<float> logits, std::span<const int32_t> seen,
                              double penalty);

// Index of the largest logit, the lowest among equals; NaN never wins. -1 for an empty span.
int32_t argmax_logit(std::span<const float> logits);

struct TokenProbability {
  int32_t token = 0;
  double probability = 0.0;
};

// The distribution step 4 draws from (temperature > 0): kept tokens in order of decreasing
// probability (ties by lower index), probabilities renormalised to sum to 1.
std::vector<TokenProbability> sampling_distribution(std::span<const float> logits,
                                                    const SamplingParams& params);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Next token for `logits` [vocab]; advances the generator only when sampling. Logits must be
  // finite (the caller checks).
  int32_t sample(std::span<const float> logits);

 private:
  double next_uniform();  // [0, 1) with 53 random bits

  SamplingParams params_;
  uint64_t state_;
};

}  // namespace e4kv
