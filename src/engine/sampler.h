// Next-token sampling with vLLM's parameters (their names and meanings), with a seeded generator
// so a run is reproducible on any machine (the generator and the arithmetic are e4kv's own, not the
// standard library's unspecified distributions). Each request has its own Sampler, hence its own
// generator state: a seeded request draws the same tokens whatever else is in the batch.
//
// The logits of one row go through, in vLLM's order (process_logits, then Sampler::sample):
//   1. suppression: the ids the caller names (stop and EOS ids before min_tokens) become -inf;
//   2. logit_bias: bias[id] is added to the logit of id;
//   3. repetition_penalty over every distinct id of the prompt and the output: the logit is
//      divided by the penalty when > 0, multiplied by it otherwise (after the bias, as vLLM);
//   4. frequency_penalty * count(id in output) and presence_penalty * [id in output] are
//      subtracted (output tokens only, the OpenAI definition vLLM follows).
// Greedy (temperature 0, or top_k 1) picks the largest processed logit, the lowest index among
// equals; min_p, top_k and top_p do not apply. With temperature > 0:
//   5. p_i = softmax(logits / temperature) in double;
//   6. min_p: keep the tokens with p_i >= min_p * max_j p_j;
//   7. top-k: of those, keep the k most probable (ties broken by lower index);
//   8. top-p: of those, in order of decreasing probability (ties by lower index), keep the
//      shortest prefix whose total probability (renormalised over the kept ones) reaches top_p (at
//      least one token), as vLLM and llama.cpp do;
//   9. draw one of the kept tokens by the Gumbel-max rule of core/sampling_noise.h: the token
//      maximising log p_i + G(seed, k, i), k = the request's draw number (0 for its first token).
//      That samples exactly from the kept tokens' renormalised distribution; the noise is a pure
//      function of (seed, k, token), so a request draws the same tokens alone or in a batch,
//      after a preemption, and on any backend.
// min_p and top-k both keep a prefix of the sorted order, so their order does not matter; top-p
// renormalises over what they kept, as vLLM's sampler does. Without top-k and top-p no sort is
// needed: the draw is Backend::sample_rows's (backend/cpu/sampling.h), in fp32 on the logits
// scaled by 1 / temperature, min-p as s_i >= max s + log(min_p); the engine runs those rows on
// the backend, next to the logits.
//
// Log-probabilities (token_logprobs) are those of the raw model: log_softmax of the logits before
// any of the steps above. That is vLLM's default (logprobs_mode "raw_logprobs"): a logprob then
// measures the model, and does not change with a request's penalties, bias or temperature, so two
// requests that score the same text get the same numbers.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"

namespace e4kv {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0 (or -1): no top-k
  double top_p = 1.0;        // 1: no top-p
  double min_p = 0.0;        // 0: no min-p
  double repetition_penalty = 1.0;  // 1: off; > 1 discourages tokens of the prompt and output
  double presence_penalty = 0.0;    // 0: off; > 0 discourages tokens already in the output
  double frequency_penalty = 0.0;   // 0: off; > 0 discourages them by how often they occur
  std::map<int32_t, double> logit_bias;  // token id -> added to its logit
  uint64_t seed = 0;
};

// Largest top-n of log-probabilities a request may ask for (vLLM's default max_logprobs).
inline constexpr int64_t kMaxLogprobs = 20;

// Errors name the field: temperature finite and >= 0, top_p in (0, 1], top_k >= -1, min_p in
// [0, 1], repetition_penalty finite and > 0, presence_penalty and frequency_penalty in [-2, 2],
// logit_bias values finite and in [-100, 100] (the OpenAI range), its ids in [0, vocab_size) when
// vocab_size > 0.
Status validate_sampling_params(const SamplingParams& params, int64_t vocab_size = 0);

// Steps 1-4 on `logits` [vocab] in place: `suppress` ids set to -inf, then logit_bias, the
// repetition penalty over `prompt` and `output`, and the presence and frequency penalties over
// `output`. Ids outside the vocabulary are ignored. In fp32, as vLLM computes on fp32 logits.
void process_logits(std::span<float> logits, const SamplingParams& params,
                    std::span<const int32_t> prompt, std::span<const int32_t> output,
                    std::span<const int32_t> suppress = {});

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

// Sorts by decreasing probability, lower token id first among equal probabilities (the order the
// draw walks). Exposed for its test.
void sort_by_decreasing_probability(std::vector<TokenProbability>& dist);

// The distribution step 9 draws from (temperature > 0): kept tokens in order of decreasing
// probability (ties by lower index), probabilities renormalised to sum to 1. -inf logits (steps 1
// and 2) have probability 0 and are never kept; at least one logit must be finite.
std::vector<TokenProbability> sampling_distribution(std::span<const float> logits,
                                                    const SamplingParams& params);

struct TokenLogprob {
  int32_t token = 0;
  double logprob = 0.0;
};

// One position's log-probabilities: the chosen (sampled, or prompt) token's, its rank in the
// distribution (1 = the most probable; 1 + the number of tokens strictly more probable), and the
// n most probable tokens in order of decreasing log-probability (ties by lower index).
struct TokenLogprobs {
  int32_t token = 0;
  double logprob = 0.0;
  int64_t rank = 0;
  std::vector<TokenLogprob> top;
};

// log_softmax of `logits` [vocab] in double, for `token` and the top n (0 <= n <= vocab).
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int64_t n);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Next token for processed `logits` [vocab] (steps 5-9); every call is one draw (the draw
  // number advances, greedy included). Logits must be finite or -inf, at least one finite (the
  // caller checks).
  int32_t sample(std::span<const float> logits);

  // Whether a draw is Backend::sample_rows's (no top-k above 1, no top-p below 1).
  bool draws_on_backend() const;
  // The next draw as a Backend::sample_rows row reading `logit_row`; advances the draw number as
  // sample() does. Only when draws_on_backend().
  Backend::SampleRowParams next_backend_draw(int32_t logit_row);
  // Draws made so far.
  uint64_t draws() const { return draws_; }

 private:
  SamplingParams params_;
  uint64_t draws_ = 0;
};

}  // namespace e4kv
