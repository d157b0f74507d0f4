#include "engine/engine.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace e4kv {
namespace {

SchedulerConfig scheduler_config(const Model& model, const EngineConfig& config) {
  const ModelLimits& limits = model.limits();
  SchedulerConfig c;
  c.max_num_batched_tokens = config.max_num_batched_tokens > 0
                                 ? std::min(config.max_num_batched_tokens, limits.max_batch_tokens)
                                 : limits.max_batch_tokens;
  c.max_num_seqs = config.max_num_seqs > 0 ? std::min(config.max_num_seqs, limits.max_seqs)
                                           : limits.max_seqs;
  // Every sequence samples at most one row per step: the logit rows bound the sequences too.
  c.max_num_seqs = std::min(c.max_num_seqs, limits.max_logit_rows);
  c.n_blocks = model.n_blocks();
  c.block_size = model.block_size();
  c.n_state_slots = limits.max_seqs;
  c.max_model_len = limits.max_model_len;
  return c;
}

}  // namespace

Engine::Engine(Model& model, const EngineConfig& config)
    : model_(model), scheduler_(scheduler_config(model, config)) {}

Engine::~Engine() {
  for (auto& [id, request] : requests_) (void)release_slot(request);
}

Result<RequestId> Engine::add_request(std::vector<int32_t> prompt, const RequestParams& params) {
  E4KV_RETURN_IF_ERROR(validate_sampling_params(params.sampling));
  if (params.max_tokens < 0) {
    return Status::option_error("max_tokens", cat("must be >= 0, got ", params.max_tokens));
  }
  if (prompt.empty()) return Status::error("the prompt is empty; give at least one token");
  const int64_t n_prompt = int64_t(prompt.size());
  const int64_t max_len = model_.max_model_len();
  if (n_prompt >= max_len) {
    return Status::error(cat("the prompt has ", n_prompt, " tokens; the max model length is ",
                             max_len, " (prompt plus generated tokens)"));
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model_.vocab_size()) {
      return Status::error(cat("prompt token ", i, " is id ", prompt[i],
                               ", outside the model's vocabulary [0, ", model_.vocab_size(), ")"));
    }
  }
  // The last sampled token is never fed, and generation ends at the max model length.
  const int64_t total = std::min(n_prompt + std::max<int64_t>(params.max_tokens, 1), max_len);
  const RequestId id = next_id_;
  E4KV_RETURN_IF_ERROR(scheduler_.add(id, std::move(prompt), total));
  ++next_id_;
  requests_.emplace(id, Request{params, Sampler(params.sampling), 0, -1});
  return id;
}

Status Engine::release_slot(Request& request) {
  if (request.model_slot < 0) return ok_status();
  const int32_t slot = std::exchange(request.model_slot, -1);
  return model_.free_sequence(slot);
}

Status Engine::finish(RequestId id, Request& request) {
  E4KV_ASSERT(scheduler_.remove(id), "engine: finishing a request the scheduler does not hold");
  const Status freed = release_slot(request);
  requests_.erase(id);
  return freed;
}

bool Engine::abort(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  (void)finish(id, it->second);
  return true;
}

Result<std::vector<RequestUpdate>> Engine::step() {
  std::vector<RequestUpdate> updates;
  // Requests that may finish without a forward: max_tokens 0.
  for (auto it = requests_.begin(); it != requests_.end();) {
    if (it->second.params.max_tokens == 0) {
      RequestUpdate u{it->first, {}, true, "length", {}};
      const RequestId id = it->first;
      ++it;
      E4KV_RETURN_IF_ERROR(finish(id, requests_.at(id)));
      updates.push_back(std::move(u));
    } else {
      ++it;
    }
  }
  const StepPlan plan = scheduler_.schedule();
  for (const SequenceId id : plan.preempted) {
    E4KV_RETURN_IF_ERROR(release_slot(requests_.at(id)));
  }
  if (plan.empty()) return updates;
  E4KV_ASSERT(plan.block_copies.empty(), "engine: block copies are not performed yet");

  std::vector<int32_t> ids, row_seq, row_pos, logit_rows, seq_slots;
  ForwardBatch batch;
  for (size_t s = 0; s < plan.chunks.size(); ++s) {
    const ScheduledChunk& chunk = plan.chunks[s];
    Request& request = requests_.at(chunk.id);
    if (chunk.fresh_state) {
      E4KV_RETURN_IF_ERROR(release_slot(request));
      E4KV_RETURN_IF_ERROR(model_.begin_sequence(chunk.state_slot));
      request.model_slot = chunk.state_slot;
    }
    const Sequence* seq = scheduler_.find(chunk.id);
    for (int64_t p = chunk.start; p < chunk.start + chunk.n_tokens; ++p) {
      ids.push_back(seq->tokens[size_t(p)]);
      row_seq.push_back(int32_t(s));
      row_pos.push_back(int32_t(p));
    }
    if (chunk.samples) logit_rows.push_back(int32_t(ids.size()) - 1);
    batch.seqs.push_back(&seq->table);
    seq_slots.push_back(request.model_slot);
  }
  batch.token_ids = ids;
  batch.row_seq = row_seq;
  batch.row_pos = row_pos;
  batch.logit_rows = logit_rows;
  batch.seq_slots = seq_slots;
  Result<std::vector<float>> logits = model_.forward(batch);
  if (!logits.ok()) {
    for (const ScheduledChunk& chunk : plan.chunks) {
      E4KV_RETURN_IF_ERROR(finish(chunk.id, requests_.at(chunk.id)));
      updates.push_back({chunk.id, {}, true, "error", logits.message()});
    }
    return updates;
  }

  const int64_t vocab = model_.vocab_size();
  size_t row = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.samples) continue;
    Request& request = requests_.at(chunk.id);
    std::span<float> out = std::span<float>(*logits).subspan(row * size_t(vocab), size_t(vocab));
    ++row;
    const Sequence* seq = scheduler_.find(chunk.id);
    RequestUpdate u;
    u.id = chunk.id;
    if (std::any_of(out.begin(), out.end(), [](float v) { return !std::isfinite(v); })) {
      u.finished = true;
      u.finish_reason = "error";
      u.error = cat("the model produced non-finite logits after ", seq->tokens.size(), " tokens");
      E4KV_RETURN_IF_ERROR(finish(chunk.id, request));
      updates.push_back(std::move(u));
      continue;
    }
    if (request.params.sampling.repetition_penalty != 1.0) {
      apply_repetition_penalty(out, seq->tokens, request.params.sampling.repetition_penalty);
    }
    const int32_t token = request.sampler.sample(out);
    u.new_tokens.push_back(token);
    request.n_output += 1;
    const std::vector<int32_t>& stops = request.params.stop_ids;
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
      u.finish_reason = "stop";
    } else if (request.n_output >= request.params.max_tokens ||
               int64_t(seq->tokens.size()) + 1 >= model_.max_model_len()) {
      u.finish_reason = "length";
    }
    if (!u.finish_reason.empty()) {
      u.finished = true;
      E4KV_RETURN_IF_ERROR(finish(chunk.id, request));
    } else {
      scheduler_.append_token(chunk.id, token);
    }
    updates.push_back(std::move(u));
  }
  return updates;
}

}  // namespace e4kv
