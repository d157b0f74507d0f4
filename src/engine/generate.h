// Single-request generation over a Model: the prompt in one forward (or in chunks), then one
// token per forward, each new token handed to a callback as it comes (the CLI streams its text).
// The continuous-batching engine will replace this loop; it shares the model's forward and the
// sampler.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "engine/sampler.h"
#include "model/model.h"

namespace e4kv {

struct GenerateOptions {
  int64_t max_tokens = 16;  // new tokens at most
  SamplingParams sampling;
  // Generation stops after producing one of these (it is kept in output_ids, as transformers
  // keeps EOS); empty: run to max_tokens or the max model length.
  std::vector<int32_t> stop_ids;
  // Prompt tokens per prefill forward; 0: the whole prompt in one forward. Either way at most the
  // model's max_batch_tokens (a longer prompt is cut into forwards of that many).
  int64_t prefill_chunk = 0;
  bool enforce_eager = false;  // EngineConfig::enforce_eager
};

struct GenerateResult {
  std::vector<int32_t> output_ids;
  std::string finish_reason;  // "stop" (a stop id), "length" (max_tokens or max model length)
};

// Runs one request in a fresh sequence of the model's cache. Errors: an empty prompt, a prompt of
// max_model_len tokens or more, token ids outside the vocabulary, a cache too small for the
// request, non-finite logits, and any forward error.
Result<GenerateResult> generate(Model& model, std::span<const int32_t> prompt,
                                const GenerateOptions& options,
                                const std::function<void(int32_t)>& on_token = {});

}  // namespace e4kv
