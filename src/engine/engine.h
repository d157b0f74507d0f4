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

struct RequestParams {
  SamplingParams sampling;
  int64_t max_tokens = 16;  // new tokens at most (also cut at the max model length)
  // Generation stops after producing one of these (kept in the output, as transformers keeps EOS).
  std::vector<int32_t> stop_ids;
};

// What one step did for one request.
struct RequestUpdate {
  RequestId id = 0;
  std::vector<int32_t> new_tokens;  // sampled this step (at most one today)
  bool finished = false;
  // "stop" (a stop id), "length" (max_tokens or the max model length), "abort", "error".
  std::string finish_reason;
  std::string error;  // why, when finish_reason is "error"
};

class Engine {
 public:
  Engine(Model& model, const EngineConfig& config);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  // Queues a request. Refused, naming what is wrong: bad sampling parameters, an empty prompt,
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
  };
  Status release_slot(Request& request);
  Status finish(RequestId id, Request& request);

  Model& model_;
  Scheduler scheduler_;
  std::unordered_map<RequestId, Request> requests_;
  RequestId next_id_ = 0;
};

}  // namespace e4kv
