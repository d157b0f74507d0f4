// The serving engine: many requests over one model and one KV pool, continuously batched.
//
// add_request() queues a request (its own bad input is refused here, never in a step that runs
// other requests); step() runs one forward of whatever the scheduler plans (prefill chunks and
// decode rows of every running request under one token budget, engine/scheduler.h), samples the
// requests whose chunk reached their last token, and reports what each produced; abort() ends a
// request at any point. Preempted requests recompute and continue where they were.
//
// n completions of one prompt (RequestParams::n, vLLM's parallel sampling): the prompt runs once,
// in one sequence. The step whose chunk reaches its last token samples the first token of every
// completion from that one logits row, each with its own Sampler (completion i seeded with
// seed + i, so completion 0 draws what the same request with n = 1 draws), and the sequence forks
// into one sequence per completion still running (engine/scheduler.h: the blocks shared, the
// partly filled last one copied on write; the model's per-sequence state copied into each fork's
// slot, Model::copy_sequence_state). From then on each completion is an ordinary sequence: it
// decodes, stops, is preempted and recomputed (from the prompt and its own tokens) on its own.
// Updates carry the completion's index; a request ends when every completion has.
//
// Threading: one thread owns an Engine and calls every method; other threads hand it work through
// a queue of their own (the server's HTTP threads do).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/status.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/step_graphs.h"
#include "model/model.h"

namespace e4kv {

using RequestId = int64_t;

struct EngineConfig {
  // Rows of one forward; 0: the model's max_batch_tokens (never more).
  int64_t max_num_batched_tokens = 0;
  // Sequences running at once; 0: the model's max_seqs (never more: each holds a state slot).
  int64_t max_num_seqs = 0;
  // Every step op by op: no graphs of the decode step (engine/step_graphs.h), which are on by
  // default where the backend records them (CUDA).
  bool enforce_eager = false;
};

// The most completions one request may ask for (RequestParams::n).
inline constexpr int64_t kMaxCompletions = 64;

// vLLM's request parameters; the logits-shaping ones are in `sampling` (engine/sampler.h).
struct RequestParams {
  // Completions of the prompt (vLLM's n): 1..kMaxCompletions, and at most the engine's
  // max_num_seqs (they run at once). The prompt is computed once for all of them. Completion i
  // samples with seed sampling.seed + i (mod 2^64); the other fields apply to each completion.
  int64_t n = 1;
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

// Errors name the field (n, max_tokens, min_tokens, stop_ids, eos_ids, stop, logprobs,
// prompt_logprobs, and the sampling fields of validate_sampling_params). vocab_size > 0 checks ids.
Status validate_request_params(const RequestParams& params, int64_t vocab_size);

// What one step did for one completion of one request (a request with n = 1 has one, index 0).
struct RequestUpdate {
  RequestId id = 0;
  // The completion, 0..n-1 (vLLM's CompletionOutput.index). Prompt logprobs come with index 0.
  int32_t index = 0;
  std::vector<int32_t> new_tokens;  // sampled this step (at most one today)
  bool finished = false;            // this completion has ended
  // Every completion of the request has ended: the request is gone from the engine. On one update
  // per request, its last (with `finished`; the same as it for n = 1).
  bool request_finished = false;
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

  // Ends a request (waiting or running), every completion of it, and frees what it holds. False
  // for an unknown id.
  bool abort(RequestId id);
  // Ends one completion of a request (a stop string matched in its text); the request ends with
  // its last completion. False for an unknown id or index, or a completion already ended.
  bool abort(RequestId id, int32_t index);

  // One forward. Returns an update for every request that produced a token or finished. A failed
  // forward finishes the requests it ran with "error" (their state may be half-written) and
  // leaves the others queued; only a broken model (freeing a slot fails) is an error here.
  Result<std::vector<RequestUpdate>> step();

  // The requests whose first forward ran since the last call (for their queue time).
  std::vector<RequestId> take_first_runs() { return std::exchange(first_runs_, {}); }

  bool has_unfinished() const { return scheduler_.has_work(); }
  const Scheduler& scheduler() const { return scheduler_; }
  const StepGraphs& step_graphs() const { return graphs_; }
  Model& model() const { return model_; }

 private:
  struct Completion {
    Sampler sampler;
    SequenceId seq = -1;  // its sequence after the fork while it runs; -1 before and once ended
    int64_t n_output = 0;
    bool finished = false;
  };
  struct Request {
    RequestParams params;
    std::vector<Completion> completions;  // [n]
    // Until the prompt's last token is sampled, the one sequence of the prompt; then -1.
    SequenceId prompt_seq = -1;
    int64_t n_unfinished = 0;
    // Prompt positions whose logprobs were reported (1 + the rows done; a preempted request
    // recomputes its rows and reports none twice).
    int64_t n_prompt_logprobs = 1;
    std::vector<int32_t> stop_set;  // stop_ids, and eos_ids unless ignore_eos
    bool ran = false;               // a forward ran rows of it
  };
  // A sequence of the scheduler: whose it is and the model state slot it holds while running.
  struct SequenceInfo {
    RequestId request = 0;
    int32_t completion = 0;  // 0 for the prompt's sequence
    int32_t model_slot = -1;
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
  // top-k or top-p; after the fork) are drawn on the backend (Backend::sample_rows); the others
  // are copied to the host one by one.
  Status use_logits(const StepPlan& plan, std::span<const LogitRow> rows,
                    const DeviceLogits& logits, std::vector<RequestUpdate>& updates,
                    std::vector<std::string>& failed);
  bool draws_on_backend(const Request& request, const Completion& completion) const;
  // The prompt's sample: the first token of every completion from one processed logits row,
  // then the fork.
  Status sample_first(RequestId id, Request& request, std::span<const float> processed,
                      std::span<const float> raw, std::vector<RequestUpdate>& updates);
  // Samples completion `index`'s next token into its update; true when that ends it.
  bool sample_into(Request& request, int32_t index, int64_t n_tokens,
                   std::span<const float> processed, std::span<const float> raw, RequestUpdate& u);
  // Completion `index` takes `token` (drawn already) into its update; true when that ends it.
  // raw: the row's unprocessed logits when the request asked for logprobs.
  bool take_token(Request& request, int32_t index, int64_t n_tokens, int32_t token,
                  std::span<const float> raw, RequestUpdate& u);
  RequestUpdate& update_for(RequestId id, int32_t index, std::vector<RequestUpdate>& updates);
  Status release_slot(SequenceId seq);
  Status remove_sequence(SequenceId seq);
  // Ends completion `index` (its sequence removed); true when that ended the request (then gone).
  Result<bool> finish_completion(RequestId id, int32_t index);
  // Ends the request and every sequence of it; with a reason, every completion still running
  // gets a finished update.
  Status finish_request(RequestId id, const std::string& reason, const std::string& error,
                        std::vector<RequestUpdate>* updates);

  Model& model_;
  Scheduler scheduler_;
  StepGraphs graphs_;
  std::unordered_map<RequestId, Request> requests_;
  std::unordered_map<SequenceId, SequenceInfo> sequences_;
  std::vector<RequestId> first_runs_;  // take_first_runs()
  RequestId next_id_ = 0;
  SequenceId next_seq_ = 0;
  // This step's update of each (request, completion).
  std::map<std::pair<RequestId, int32_t>, size_t> update_index_;
  // Backend memory of the backend draws: [max_logit_rows] SampleRowParams; [2 * max_logit_rows]
  // int32 tokens then non-finite counts. Allocated at the first draw.
  BackendBuffer sample_params_, sample_out_;
};

}  // namespace e4kv
