// `e4kv generate MODEL --prompts FILE.jsonl --out FILE.jsonl`: offline batch inference. Every
// prompt of the file is submitted at once and run by the engine with continuous batching; one
// output line per request, in input order. A line with n > 1 (completions of one prompt, computed
// once) gets vLLM's shape: its completions in an "outputs" array, each with index, output_ids,
// text, finish_reason, stop_reason (and logprobs); a line with n = 1 keeps those fields at the top.
#pragma once

#include <string>

#include "core/status.h"
#include "engine/sampler.h"
#include "model_setup.h"

namespace e4kv::cli {

// The fields a prompts line may carry besides its document (vLLM's names).
inline constexpr const char* kBatchFieldsHelp =
    "a line takes text, token_ids or messages, an id, and n, max_tokens, min_tokens, temperature, "
    "top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, "
    "seed, ignore_eos, stop, stop_token_ids, include_stop_str_in_output, skip_special_tokens, "
    "logprobs, prompt_logprobs";

struct BatchGenerateArgs {
  ModelFlags model;
  std::string prompts;  // JSON lines in calibrate's corpus formats, each with optional fields
  std::string out;
  bool force = false;
  bool special_tokens_in_content = false;
  bool progress = true;
  // The defaults of every request (a line's own fields override them).
  int64_t max_tokens = 16;
  SamplingParams sampling;
  bool ignore_eos = false;
};

Status run_generate_batch(const BatchGenerateArgs& args);

}  // namespace e4kv::cli
