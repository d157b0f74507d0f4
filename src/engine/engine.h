// The serving engine: many requests over one model and one KV pool, continuously batched.
//
// add_request() queues a request (its own bad input is refused here, never in a step that runs
// other requests); step() runs one forward of whatever the scheduler plans (prefill chunks and
// decode rows of every running request under one token budget, engine/scheduler.h), samples the
// requests whose chunk reached their last token, and reports what each produced; abort() ends a
// request at any point. Preempted requests recompute and continue where they were.
//
// Threading: one thread owns an Engine and calls every method; other threads hand it work through
// a queue of their own (the server's HTTP threads do).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "model/model.h"

namespace e4kv {

using RequestId = int64_t;

struct EngineConfig {
  // Rows of one forward; 0: the model's max_batch_tokens (never more).
  int64_t max_num_batched_tokens = 0;
  // Sequences running at once; 0: the model's max_seqs (never more: each holds a state slot).
  int64_t max_num_seqs = 0;
};

// vLLM's request parameters; the logits-shaping ones are in `sampling` (engine/sampler.h).
struct RequestParams {
  SamplingParams sampling;
  int64_t max_tokens = 16;  // new tokens at most (also cut at the max model length)
  // Stop and EOS ids and stop strings do not end the request before it has this many tokens:
  // until then the stop and EOS ids are suppressed (their logits -inf), as vLLM does.
  int64_t min_tokens = 0;
  // Generation stops after producing one of these (stop_token_ids), whatever ignore_eos says. The
  // token is in the output ids; its text is not in the output text unless
  // include_stop_str_in_output.
  std::vector<int32_t> stop_ids;
  // The model's end-of-sequence ids (tokenizer / generation config): they stop generation as
  // stop_ids do, unless ignore_eos.
  std::vector<int32_t> eos_ids;
  bool ignore_eos = false;
  // Text that ends generation (the OutputProcessor's; the engine ignores them). The matched text is
  // cut from the output unless include_stop_str_in_output.
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;  // in the output text
  // Log-probabilities of each sampled token and of the top n (0..kMaxLogprobs); -1: none.
  int64_t logprobs = -1;
  // The same for every prompt token after the first; -1: none. (max_tokens 0 finishes without a
  // forward, so with no prompt logprobs: ask for max_tokens 1 to score a prompt.)
  int64_t prompt_logprobs = -1;
};

// Errors name the field (max_tokens, min_tokens, stop_ids, eos_ids, stop, logprobs,
// prompt_logprobs, and the sampling fields of validate_sampling_params). vocab_size > 0 checks ids.
Status validate_request_params(const RequestParams& params, int64_t vocab_size);

// What one step did for one request.
struct RequestUpdate {
  RequestId id = 0;
  std::vector<int32_t> new_tokens;  // sampled this step (at most one today)
  bool finished = false;
  // "stop" (a stop or EOS id), "length" (max_tokens or the max model length), "abort", "error".
  std::string finish_reason;
  std::string error;  // why, when finish_reason is "error"
  int32_t stop_token = -1;  // the id that matched, when finish_reason is "stop"
  // [new_tokens.size()] when the request asked for logprobs.
  std::vector<TokenLogprobs> logprobs;
  // Prompt tokens prompt_logprobs_start, prompt_logprobs_start + 1, ... (position 0 has none),
  // as the rows come through the forwards; empty when none came this step.
  std::vector<TokenLogprobs> prompt_logprobs;
  int64_t prompt_logprobs_start = 0;
};

class Engine {
 public:
  Engine(Model& model, const EngineConfig& config);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  // Queues a request. Refused, naming what is wrong: bad request parameters
  // (validate_request_params; min_tokens > 0 when every id is a stop or EOS id), an empty prompt,
  // token ids outside the vocabulary, a prompt of max_model_len tokens or more, a request the
  // whole pool could not hold.
  Result<RequestId> add_request(std::vector<int32_t> prompt, const RequestParams& params);

  // Ends a request (waiting or running) and frees what it holds. False for an unknown id.
  bool abort(RequestId id);

  // One forward. Returns an update for every request that produced a token or finished. A failed
  // forward finishes the requests it ran with "error" (their state may be half-written) and
  // leaves the others queued; only a broken model (freeing a slot fails) is an error here.
  Result<std::vector<RequestUpdate>> step();

  bool has_unfinished() const { return scheduler_.has_work(); }
  const Scheduler& scheduler() const { return scheduler_; }
  Model& model() const { return model_; }

 private:
  struct Request {
    RequestParams params;
    Sampler sampler;
    int64_t n_output = 0;
    int32_t model_slot = -1;  // the model's state slot while running
    // Prompt positions whose logprobs were reported (1 + the rows done; a preempted request
    // recomputes its rows and reports none twice).
    int64_t n_prompt_logprobs = 1;
    std::vector<int32_t> stop_set;  // stop_ids, and eos_ids unless ignore_eos
  };
  // One row's logits: what they are for.
  struct LogitRow {
    size_t chunk = 0;     // index in the step's plan
    int64_t position = 0;  // in the sequence
    bool samples = false;  // the chunk's last row (else a prompt row for prompt_logprobs)
  };
  // Uses one forward's logits [rows.size(), vocab]. A request with non-finite logits gets
  // `failed` (finished after the step's forwards, which may still hold its rows).
  // Rows whose draw needs nothing but the logits (no penalties, bias, suppression, logprobs,
  // top-k or top-p) are drawn on the backend (Backend::sample_rows); the others are copied to
  // the host one by one.
  Status use_logits(const StepPlan& plan, std::span<const LogitRow> rows,
                    const DeviceLogits& logits, std::vector<RequestUpdate>& updates,
                    std::vector<std::string>& failed);
  bool draws_on_backend(const Request& request) const;
  RequestUpdate& update_for(RequestId id, std::vector<RequestUpdate>& updates);
  Status release_slot(Request& request);
  Status finish(RequestId id, Request& request);

  Model& model_;
  Scheduler scheduler_;
  std::unordered_map<RequestId, Request> requests_;
  RequestId next_id_ = 0;
  std::unordered_map<RequestId, size_t> update_index_;  // this step's update of each request
  // Backend memory of the backend draws: [max_logit_rows] SampleRowParams; [2 * max_logit_rows]
  // int32 tokens then non-finite counts. Allocated at the first draw.
  BackendBuffer sample_params_, sample_out_;
};

}  // namespace e4kv
