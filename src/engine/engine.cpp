#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <utility>

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

Status validate_request_params(const RequestParams& params, int64_t vocab_size) {
  E4KV_RETURN_IF_ERROR(validate_sampling_params(params.sampling, vocab_size));
  if (params.max_tokens < 0) {
    return Status::option_error("max_tokens", cat("must be >= 0, got ", params.max_tokens));
  }
  if (params.min_tokens < 0 || params.min_tokens > params.max_tokens) {
    return Status::option_error("min_tokens", cat("must be in [0, max_tokens = ",
                                                  params.max_tokens, "], got ", params.min_tokens));
  }
  for (const auto& [ids, name] : {std::pair{&params.stop_ids, "stop_ids"},
                                  std::pair{&params.eos_ids, "eos_ids"}}) {
    for (int32_t id : *ids) {
      if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
        return Status::option_error(
            name, cat("token id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
      }
    }
  }
  for (const std::string& stop : params.stop) {
    if (stop.empty()) return Status::option_error("stop", "a stop string is empty");
  }
  for (const auto& [n, name] : {std::pair{params.logprobs, "logprobs"},
                                std::pair{params.prompt_logprobs, "prompt_logprobs"}}) {
    if (n < -1 || n > kMaxLogprobs) {
      return Status::option_error(name, cat("must be in [0, ", kMaxLogprobs,
                                            "] (-1 = none), got ", n));
    }
  }
  return ok_status();
}

Result<RequestId> Engine::add_request(std::vector<int32_t> prompt, const RequestParams& params) {
  const int64_t vocab = model_.vocab_size();
  E4KV_RETURN_IF_ERROR(validate_request_params(params, vocab));
  std::vector<int32_t> stop_set = params.stop_ids;
  if (!params.ignore_eos) {
    stop_set.insert(stop_set.end(), params.eos_ids.begin(), params.eos_ids.end());
  }
  std::sort(stop_set.begin(), stop_set.end());
  stop_set.erase(std::unique(stop_set.begin(), stop_set.end()), stop_set.end());
  if (params.min_tokens > 0 && int64_t(stop_set.size()) >= vocab) {
    return Status::option_error("min_tokens", "every token id is a stop or EOS id; none could be "
                                              "sampled before min_tokens");
  }
  if (prompt.empty()) return Status::error("the prompt is empty; give at least one token");
  const int64_t n_prompt = int64_t(prompt.size());
  const int64_t max_len = model_.max_model_len();
  if (n_prompt >= max_len) {
    return Status::error(cat("the prompt has ", n_prompt, " tokens; the max model length is ",
                             max_len, " (prompt plus generated tokens)"));
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= vocab) {
      return Status::error(cat("prompt token ", i, " is id ", prompt[i],
                               ", outside the model's vocabulary [0, ", vocab, ")"));
    }
  }
  // The last sampled token is never fed, and generation ends at the max model length.
  const int64_t total = std::min(n_prompt + std::max<int64_t>(params.max_tokens, 1), max_len);
  const RequestId id = next_id_;
  E4KV_RETURN_IF_ERROR(scheduler_.add(id, std::move(prompt), total));
  ++next_id_;
  Request request{params, Sampler(params.sampling), 0, -1, 1, std::move(stop_set)};
  requests_.emplace(id, std::move(request));
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

RequestUpdate& Engine::update_for(RequestId id, std::vector<RequestUpdate>& updates) {
  auto [it, added] = update_index_.try_emplace(id, updates.size());
  if (added) {
    updates.emplace_back();
    updates.back().id = id;
  }
  return updates[it->second];
}

Result<std::vector<RequestUpdate>> Engine::step() {
  std::vector<RequestUpdate> updates;
  update_index_.clear();
  // Requests that may finish without a forward: max_tokens 0.
  for (auto it = requests_.begin(); it != requests_.end();) {
    if (it->second.params.max_tokens == 0) {
      const RequestId id = it->first;
      ++it;
      E4KV_RETURN_IF_ERROR(finish(id, requests_.at(id)));
      RequestUpdate& u = update_for(id, updates);
      u.finished = true;
      u.finish_reason = "length";
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

  for (const ScheduledChunk& chunk : plan.chunks) {
    Request& request = requests_.at(chunk.id);
    if (chunk.fresh_state) {
      E4KV_RETURN_IF_ERROR(release_slot(request));
      E4KV_RETURN_IF_ERROR(model_.begin_sequence(chunk.state_slot));
      request.model_slot = chunk.state_slot;
    }
  }

  // The rows in plan order, cut into forwards of at most max_logit_rows logit rows. A chunk cut
  // across forwards gets, in the earlier ones, a copy of its block table that ends at its last row
  // there, so each forward looks like a scheduler step of shorter chunks.
  const int64_t max_logit_rows = model_.limits().max_logit_rows;
  std::vector<int32_t> ids, row_seq, row_pos, logit_rows, seq_slots;
  std::vector<const BlockTable*> tables;
  std::vector<size_t> piece_chunk;  // [seqs of the forward] the plan chunk of each
  std::vector<int64_t> piece_end;   // [seqs of the forward] one past its last row's position
  std::vector<LogitRow> logit_meta;
  std::deque<BlockTable> trimmed;
  std::vector<bool> ran(plan.chunks.size(), false);  // every row through a successful forward
  std::vector<std::string> failed(plan.chunks.size());
  Status forward_error = ok_status();

  // Runs the rows gathered so far. Returns only a broken model's error; a failed forward is kept
  // in forward_error.
  auto flush = [&]() -> Status {
    if (ids.empty()) return ok_status();
    tables.clear();
    for (size_t k = 0; k < piece_chunk.size(); ++k) {
      const BlockTable& table = scheduler_.find(plan.chunks[piece_chunk[k]].id)->table;
      if (piece_end[k] < table.n_tokens) {
        trimmed.push_back(table);
        trimmed.back().n_tokens = piece_end[k];
        tables.push_back(&trimmed.back());
      } else {
        tables.push_back(&table);
      }
    }
    ForwardBatch batch;
    batch.token_ids = ids;
    batch.row_seq = row_seq;
    batch.row_pos = row_pos;
    batch.seqs = tables;
    batch.logit_rows = logit_rows;
    batch.seq_slots = seq_slots;
    Result<DeviceLogits> logits = model_.forward_device(batch);
    if (!logits.ok()) {
      forward_error = logits.status();
      return ok_status();
    }
    for (size_t k = 0; k < piece_chunk.size(); ++k) {
      const ScheduledChunk& chunk = plan.chunks[piece_chunk[k]];
      if (piece_end[k] == chunk.start + chunk.n_tokens) ran[piece_chunk[k]] = true;
    }
    E4KV_RETURN_IF_ERROR(use_logits(plan, logit_meta, *logits, updates, failed));
    for (auto* v : {&ids, &row_seq, &row_pos, &logit_rows, &seq_slots}) v->clear();
    piece_chunk.clear();
    piece_end.clear();
    logit_meta.clear();
    return ok_status();
  };

  for (size_t s = 0; s < plan.chunks.size() && forward_error.ok(); ++s) {
    const ScheduledChunk& chunk = plan.chunks[s];
    const Request& request = requests_.at(chunk.id);
    const Sequence* seq = scheduler_.find(chunk.id);
    const int64_t end = chunk.start + chunk.n_tokens;
    // Prompt rows whose logits give prompt logprobs: row p scores prompt token p + 1.
    const int64_t prompt_first =
        request.params.prompt_logprobs >= 0 ? request.n_prompt_logprobs - 1 : seq->n_prompt;
    for (int64_t p = chunk.start; p < end && forward_error.ok(); ++p) {
      const bool samples = chunk.samples && p == end - 1;
      const bool scores_prompt = p >= prompt_first && p + 1 < seq->n_prompt;
      if ((samples || scores_prompt) && int64_t(logit_rows.size()) == max_logit_rows) {
        E4KV_RETURN_IF_ERROR(flush());
        if (!forward_error.ok()) break;
      }
      if (piece_chunk.empty() || piece_chunk.back() != s) {
        piece_chunk.push_back(s);
        piece_end.push_back(p + 1);
        seq_slots.push_back(request.model_slot);
      }
      piece_end.back() = p + 1;
      ids.push_back(seq->tokens[size_t(p)]);
      row_seq.push_back(int32_t(piece_chunk.size()) - 1);
      row_pos.push_back(int32_t(p));
      if (samples || scores_prompt) {
        logit_rows.push_back(int32_t(ids.size()) - 1);
        logit_meta.push_back({s, p, samples});
      }
    }
  }
  if (forward_error.ok()) E4KV_RETURN_IF_ERROR(flush());

  // A failed forward finishes every request whose rows had not all run; non-finite logits finish
  // theirs. Their state may be half-written: nothing of them is kept.
  for (size_t s = 0; s < plan.chunks.size(); ++s) {
    const RequestId id = plan.chunks[s].id;
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    std::string error = failed[s];
    if (error.empty() && !ran[s] && !forward_error.ok()) error = forward_error.message();
    if (error.empty()) continue;
    E4KV_RETURN_IF_ERROR(finish(id, it->second));
    RequestUpdate& u = update_for(id, updates);
    u.finished = true;
    u.finish_reason = "error";
    u.error = error;
  }
  return updates;
}

bool Engine::draws_on_backend(const Request& request) const {
  const RequestParams& params = request.params;
  const SamplingParams& sampling = params.sampling;
  // process_logits would change nothing, and no logprobs need the row on the host.
  return params.logprobs < 0 && request.sampler.draws_on_backend() &&
         sampling.repetition_penalty == 1.0 && sampling.presence_penalty == 0.0 &&
         sampling.frequency_penalty == 0.0 && sampling.logit_bias.empty() &&
         (request.n_output >= params.min_tokens || request.stop_set.empty());
}

Status Engine::use_logits(const StepPlan& plan, std::span<const LogitRow> rows,
                          const DeviceLogits& logits, std::vector<RequestUpdate>& updates,
                          std::vector<std::string>& failed) {
  Backend& backend = model_.backend();
  const size_t vocab = size_t(model_.vocab_size());
  E4KV_ASSERT(logits.rows == int64_t(rows.size()) && logits.vocab == int64_t(vocab),
              "engine: the forward returned other logit rows than asked");

  // The draws that run on the backend, next to the logits: only the tokens (and each row's
  // non-finite count) come back.
  std::vector<Backend::SampleRowParams> draws;
  std::vector<int32_t> draw_of_row(rows.size(), -1);
  for (size_t r = 0; r < rows.size(); ++r) {
    if (!rows[r].samples || !failed[rows[r].chunk].empty()) continue;
    Request& request = requests_.at(plan.chunks[rows[r].chunk].id);
    if (!draws_on_backend(request)) continue;
    draw_of_row[r] = int32_t(draws.size());
    draws.push_back(request.sampler.next_backend_draw(int32_t(r)));
  }
  std::vector<int32_t> drawn(2 * draws.size());  // tokens, then non-finite counts
  if (!draws.empty()) {
    const int64_t max_rows = model_.limits().max_logit_rows;
    if (sample_params_.empty()) {
      E4KV_ASSIGN_OR_RETURN(sample_params_,
                            backend.allocate(size_t(max_rows) * sizeof(Backend::SampleRowParams)));
      E4KV_ASSIGN_OR_RETURN(sample_out_, backend.allocate(size_t(2 * max_rows) * sizeof(int32_t)));
    }
    const int64_t n = int64_t(draws.size());
    backend.copy_from_host(sample_params_.data(), draws.data(),
                           draws.size() * sizeof(Backend::SampleRowParams));
    int32_t* out = sample_out_.as<int32_t>();
    const Status st = backend.sample_rows(logits.data, int64_t(vocab),
                                          sample_params_.as<Backend::SampleRowParams>(), n, out,
                                          out + n);
    if (!st.ok()) {
      for (size_t r = 0; r < rows.size(); ++r) {
        if (draw_of_row[r] >= 0) failed[rows[r].chunk] = st.message();
      }
    } else {
      backend.copy_to_host(drawn.data(), out, drawn.size() * sizeof(int32_t));
    }
  }

  std::vector<float> host;  // one row's logits on the host
  for (size_t r = 0; r < rows.size(); ++r) {
    const LogitRow& row = rows[r];
    if (!failed[row.chunk].empty()) continue;
    const ScheduledChunk& chunk = plan.chunks[row.chunk];
    Request& request = requests_.at(chunk.id);
    const Sequence* seq = scheduler_.find(chunk.id);
    const RequestParams& params = request.params;
    auto non_finite_error = [&] {
      return cat("the model produced non-finite logits at position ", row.position, " of ",
                 seq->tokens.size(), " tokens");
    };
    int32_t token = -1;
    RequestUpdate* u = nullptr;
    const bool may_stop = request.n_output >= params.min_tokens;
    if (draw_of_row[r] >= 0) {
      const size_t j = size_t(draw_of_row[r]);
      if (drawn[draws.size() + j] != 0) {
        failed[row.chunk] = non_finite_error();
        continue;
      }
      token = drawn[j];
      u = &update_for(chunk.id, updates);
    } else {
      host.resize(vocab);
      backend.copy_to_host(host.data(), logits.data + r * vocab, vocab * sizeof(float));
      const std::span<float> out(host);
      if (std::any_of(out.begin(), out.end(), [](float v) { return !std::isfinite(v); })) {
        failed[row.chunk] = non_finite_error();
        continue;
      }
      if (!row.samples) {
        const int64_t scored = row.position + 1;
        if (scored < request.n_prompt_logprobs) continue;  // reported before a preemption
        RequestUpdate& pu = update_for(chunk.id, updates);
        if (pu.prompt_logprobs.empty()) pu.prompt_logprobs_start = scored;
        pu.prompt_logprobs.push_back(
            token_logprobs(out, seq->tokens[size_t(scored)], params.prompt_logprobs));
        request.n_prompt_logprobs = scored + 1;
        continue;
      }
      // Raw logprobs (vLLM's default): of the logits before any processing.
      std::vector<float> raw;
      if (params.logprobs >= 0) raw.assign(out.begin(), out.end());
      const std::span<const int32_t> all(seq->tokens);
      const std::span<const int32_t> suppress =
          may_stop ? std::span<const int32_t>() : std::span<const int32_t>(request.stop_set);
      process_logits(out, params.sampling, all.first(size_t(seq->n_prompt)),
                     all.subspan(size_t(seq->n_prompt)), suppress);
      token = request.sampler.sample(out);
      u = &update_for(chunk.id, updates);
      if (params.logprobs >= 0) u->logprobs.push_back(token_logprobs(raw, token, params.logprobs));
    }
    u->new_tokens.push_back(token);
    request.n_output += 1;
    if (may_stop && std::binary_search(request.stop_set.begin(), request.stop_set.end(), token)) {
      u->finish_reason = "stop";
      u->stop_token = token;
    } else if (request.n_output >= params.max_tokens ||
               int64_t(seq->tokens.size()) + 1 >= model_.max_model_len()) {
      u->finish_reason = "length";
    }
    if (!u->finish_reason.empty()) {
      u->finished = true;
      E4KV_RETURN_IF_ERROR(finish(chunk.id, request));
    } else {
      scheduler_.append_token(chunk.id, token);
    }
  }
  return ok_status();
}

}  // namespace e4kv
