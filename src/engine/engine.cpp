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
    : model_(model),
      scheduler_(scheduler_config(model, config)),
      graphs_(model, scheduler_.config().max_num_seqs, !config.enforce_eager) {}

Engine::~Engine() {
  for (auto& [seq, info] : sequences_) (void)release_slot(seq);
}

Status validate_request_params(const RequestParams& params, int64_t vocab_size) {
  E4KV_RETURN_IF_ERROR(validate_sampling_params(params.sampling, vocab_size));
  if (params.n < 1 || params.n > kMaxCompletions) {
    return Status::option_error("n", cat("must be in [1, ", kMaxCompletions, "], got ", params.n));
  }
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
  if (params.n > scheduler_.config().max_num_seqs) {
    return Status::option_error(
        "n", cat(params.n, " completions cannot run at once: the engine runs at most ",
                 scheduler_.config().max_num_seqs, " sequences (max_num_seqs)"));
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
    if (const std::string problem = model_.input_token_problem(prompt[i]); !problem.empty()) {
      return Status::error(cat("prompt token ", i, ": ", problem));
    }
  }
  // The last sampled token is never fed, and generation ends at the max model length.
  const int64_t total = std::min(n_prompt + std::max<int64_t>(params.max_tokens, 1), max_len);
  const RequestId id = next_id_;
  const SequenceId seq = next_seq_;
  E4KV_RETURN_IF_ERROR(scheduler_.add(seq, std::move(prompt), total));
  ++next_id_;
  ++next_seq_;
  Request request;
  request.params = params;
  for (int64_t i = 0; i < params.n; ++i) {
    SamplingParams sampling = params.sampling;
    sampling.seed = params.sampling.seed + uint64_t(i);  // wraps modulo 2^64
    request.completions.push_back(Completion{Sampler(sampling), -1, 0, false});
  }
  request.prompt_seq = seq;
  request.n_unfinished = params.n;
  request.stop_set = std::move(stop_set);
  requests_.emplace(id, std::move(request));
  sequences_.emplace(seq, SequenceInfo{id, 0, -1});
  return id;
}

Status Engine::release_slot(SequenceId seq) {
  SequenceInfo& info = sequences_.at(seq);
  if (info.model_slot < 0) return ok_status();
  const int32_t slot = std::exchange(info.model_slot, -1);
  return model_.free_sequence(slot);
}

Status Engine::remove_sequence(SequenceId seq) {
  E4KV_ASSERT(scheduler_.remove(seq), "engine: ending a sequence the scheduler does not hold");
  const Status freed = release_slot(seq);
  sequences_.erase(seq);
  return freed;
}

Result<bool> Engine::finish_completion(RequestId id, int32_t index) {
  Request& request = requests_.at(id);
  Completion& completion = request.completions[size_t(index)];
  E4KV_ASSERT(!completion.finished, "engine: ending a completion twice");
  completion.finished = true;
  Status freed = ok_status();
  if (completion.seq >= 0) freed = remove_sequence(std::exchange(completion.seq, -1));
  if (--request.n_unfinished > 0) {
    E4KV_RETURN_IF_ERROR(freed);
    return false;
  }
  // The last completion: before the fork the prompt's sequence is still there.
  if (request.prompt_seq >= 0) {
    const Status st = remove_sequence(std::exchange(request.prompt_seq, -1));
    if (freed.ok()) freed = st;
  }
  requests_.erase(id);
  E4KV_RETURN_IF_ERROR(freed);
  return true;
}

Status Engine::finish_request(RequestId id, const std::string& reason, const std::string& error,
                              std::vector<RequestUpdate>* updates) {
  Request& request = requests_.at(id);
  Status freed = ok_status();
  std::vector<SequenceId> seqs;
  if (request.prompt_seq >= 0) seqs.push_back(request.prompt_seq);
  for (size_t i = 0; i < request.completions.size(); ++i) {
    Completion& c = request.completions[i];
    if (c.seq >= 0) seqs.push_back(c.seq);
    if (!c.finished && updates != nullptr) {
      RequestUpdate& u = update_for(id, int32_t(i), *updates);
      u.finished = true;
      u.finish_reason = reason;
      u.error = error;
    }
  }
  for (const SequenceId seq : seqs) {
    const Status st = remove_sequence(seq);
    if (freed.ok()) freed = st;
  }
  requests_.erase(id);
  if (updates != nullptr) {
    // On the request's last update only: one per request.
    for (auto u = updates->rbegin(); u != updates->rend(); ++u) {
      if (u->id == id) {
        u->request_finished = true;
        break;
      }
    }
  }
  return freed;
}

bool Engine::abort(RequestId id) {
  if (!requests_.contains(id)) return false;
  (void)finish_request(id, "", "", nullptr);
  return true;
}

bool Engine::abort(RequestId id, int32_t index) {
  auto it = requests_.find(id);
  if (it == requests_.end() || index < 0 || size_t(index) >= it->second.completions.size() ||
      it->second.completions[size_t(index)].finished) {
    return false;
  }
  (void)finish_completion(id, index);
  return true;
}

RequestUpdate& Engine::update_for(RequestId id, int32_t index,
                                  std::vector<RequestUpdate>& updates) {
  auto [it, added] = update_index_.try_emplace({id, index}, updates.size());
  if (added) {
    updates.emplace_back();
    updates.back().id = id;
    updates.back().index = index;
  }
  return updates[it->second];
}

Result<std::vector<RequestUpdate>> Engine::step() {
  std::vector<RequestUpdate> updates;
  update_index_.clear();
  // Requests that may finish without a forward: max_tokens 0.
  std::vector<RequestId> empty;
  for (const auto& [id, request] : requests_) {
    if (request.params.max_tokens == 0) empty.push_back(id);
  }
  std::sort(empty.begin(), empty.end());
  for (const RequestId id : empty) E4KV_RETURN_IF_ERROR(finish_request(id, "length", "", &updates));

  const StepPlan plan = scheduler_.schedule();
  for (const SequenceId seq : plan.preempted) E4KV_RETURN_IF_ERROR(release_slot(seq));
  if (plan.empty()) return updates;
  // Copies on write before any row of the step writes into the copies.
  E4KV_RETURN_IF_ERROR(model_.copy_blocks(plan.block_copies));

  for (const ScheduledChunk& chunk : plan.chunks) {
    Request& request = requests_.at(sequences_.at(chunk.id).request);
    if (!request.ran) {
      request.ran = true;
      first_runs_.push_back(sequences_.at(chunk.id).request);
    }
    if (chunk.fresh_state) {
      E4KV_RETURN_IF_ERROR(release_slot(chunk.id));
      E4KV_RETURN_IF_ERROR(model_.begin_sequence(chunk.state_slot));
      sequences_.at(chunk.id).model_slot = chunk.state_slot;
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
    Result<DeviceLogits> logits = graphs_.forward(batch);
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
    const SequenceInfo& info = sequences_.at(chunk.id);
    const Request& request = requests_.at(info.request);
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
        seq_slots.push_back(info.model_slot);
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
  // The whole request ends: its other completions share the failed one's prompt.
  for (size_t s = 0; s < plan.chunks.size(); ++s) {
    auto info = sequences_.find(plan.chunks[s].id);
    if (info == sequences_.end()) continue;
    std::string error = failed[s];
    if (error.empty() && !ran[s] && !forward_error.ok()) error = forward_error.message();
    if (error.empty()) continue;
    E4KV_RETURN_IF_ERROR(finish_request(info->second.request, "error", error, &updates));
  }
  return updates;
}

bool Engine::draws_on_backend(const Request& request, const Completion& completion) const {
  const RequestParams& params = request.params;
  const SamplingParams& sampling = params.sampling;
  // process_logits would change nothing, and no logprobs need the row on the host.
  return params.logprobs < 0 && completion.sampler.draws_on_backend() &&
         sampling.repetition_penalty == 1.0 && sampling.presence_penalty == 0.0 &&
         sampling.frequency_penalty == 0.0 && sampling.logit_bias.empty() &&
         (completion.n_output >= params.min_tokens || request.stop_set.empty());
}

Status Engine::use_logits(const StepPlan& plan, std::span<const LogitRow> rows,
                          const DeviceLogits& logits, std::vector<RequestUpdate>& updates,
                          std::vector<std::string>& failed) {
  Backend& backend = model_.backend();
  const size_t vocab = size_t(model_.vocab_size());
  E4KV_ASSERT(logits.rows == int64_t(rows.size()) && logits.vocab == int64_t(vocab),
              "engine: the forward returned other logit rows than asked");

  // The draws that run on the backend, next to the logits (one completion's next token, after the
  // fork): only the tokens and each row's non-finite count come back. The prompt's own sample
  // (every completion's first token from one row) is drawn on the host by the same rule.
  std::vector<Backend::SampleRowParams> draws;
  std::vector<int32_t> draw_of_row(rows.size(), -1);
  for (size_t r = 0; r < rows.size(); ++r) {
    if (!rows[r].samples || !failed[rows[r].chunk].empty()) continue;
    auto info_it = sequences_.find(plan.chunks[rows[r].chunk].id);
    if (info_it == sequences_.end()) continue;
    Request& request = requests_.at(info_it->second.request);
    if (request.prompt_seq >= 0) continue;
    Completion& completion = request.completions[size_t(info_it->second.completion)];
    if (!draws_on_backend(request, completion)) continue;
    draw_of_row[r] = int32_t(draws.size());
    draws.push_back(completion.sampler.next_backend_draw(int32_t(r)));
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
    auto info_it = sequences_.find(chunk.id);
    if (info_it == sequences_.end()) continue;  // its request ended in an earlier forward
    const SequenceInfo info = info_it->second;
    Request& request = requests_.at(info.request);
    const Sequence* seq = scheduler_.find(chunk.id);
    auto non_finite_error = [&] {
      return cat("the model produced non-finite logits at position ", row.position, " of ",
                 seq->tokens.size(), " tokens");
    };
    if (draw_of_row[r] >= 0) {
      const size_t j = size_t(draw_of_row[r]);
      if (drawn[draws.size() + j] != 0) {
        failed[row.chunk] = non_finite_error();
        continue;
      }
      RequestUpdate& u = update_for(info.request, info.completion, updates);
      if (take_token(request, info.completion, int64_t(seq->tokens.size()), drawn[j], {}, u)) {
        E4KV_ASSIGN_OR_RETURN(u.request_finished, finish_completion(info.request, info.completion));
      } else {
        scheduler_.append_token(chunk.id, u.new_tokens.back());
      }
      continue;
    }
    host.resize(vocab);
    backend.copy_to_host(host.data(), logits.data + r * vocab, vocab * sizeof(float));
    std::span<float> out(host);
    if (std::any_of(out.begin(), out.end(), [](float v) { return !std::isfinite(v); })) {
      failed[row.chunk] = non_finite_error();
      continue;
    }
    if (!row.samples) {
      const int64_t scored = row.position + 1;
      if (scored < request.n_prompt_logprobs) continue;  // reported before a preemption
      RequestUpdate& u = update_for(info.request, 0, updates);
      if (u.prompt_logprobs.empty()) u.prompt_logprobs_start = scored;
      u.prompt_logprobs.push_back(
          token_logprobs(out, seq->tokens[size_t(scored)], request.params.prompt_logprobs));
      request.n_prompt_logprobs = scored + 1;
      continue;
    }
    const RequestParams& params = request.params;
    // Raw logprobs (vLLM's default): of the logits before any processing.
    std::vector<float> raw;
    if (params.logprobs >= 0) raw.assign(out.begin(), out.end());
    const std::span<const int32_t> all(seq->tokens);
    // Before the fork every completion has no output yet: one processing serves them all.
    const int64_t n_output =
        request.prompt_seq >= 0 ? 0 : request.completions[size_t(info.completion)].n_output;
    const bool may_stop = n_output >= params.min_tokens;
    const std::span<const int32_t> suppress =
        may_stop ? std::span<const int32_t>() : std::span<const int32_t>(request.stop_set);
    process_logits(out, params.sampling, all.first(size_t(seq->n_prompt)),
                   all.subspan(size_t(seq->n_prompt)), suppress);
    if (request.prompt_seq >= 0) {
      E4KV_RETURN_IF_ERROR(sample_first(info.request, request, out, raw, updates));
      continue;
    }
    RequestUpdate& u = update_for(info.request, info.completion, updates);
    if (sample_into(request, info.completion, int64_t(seq->tokens.size()), out, raw, u)) {
      E4KV_ASSIGN_OR_RETURN(u.request_finished, finish_completion(info.request, info.completion));
    } else {
      scheduler_.append_token(chunk.id, u.new_tokens.back());
    }
  }
  return ok_status();
}

bool Engine::sample_into(Request& request, int32_t index, int64_t n_tokens,
                         std::span<const float> processed, std::span<const float> raw,
                         RequestUpdate& u) {
  const int32_t token = request.completions[size_t(index)].sampler.sample(processed);
  return take_token(request, index, n_tokens, token, raw, u);
}

bool Engine::take_token(Request& request, int32_t index, int64_t n_tokens, int32_t token,
                        std::span<const float> raw, RequestUpdate& u) {
  const RequestParams& params = request.params;
  Completion& completion = request.completions[size_t(index)];
  const bool may_stop = completion.n_output >= params.min_tokens;
  u.new_tokens.push_back(token);
  if (params.logprobs >= 0) u.logprobs.push_back(token_logprobs(raw, token, params.logprobs));
  completion.n_output += 1;
  if (may_stop && std::binary_search(request.stop_set.begin(), request.stop_set.end(), token)) {
    u.finish_reason = "stop";
    u.stop_token = token;
  } else if (completion.n_output >= params.max_tokens || n_tokens + 1 >= model_.max_model_len()) {
    u.finish_reason = "length";
  } else if (const std::string problem = model_.input_token_problem(token); !problem.empty()) {
    // A token the model cannot take back as input ends this completion here, before a forward
    // that runs others would meet it.
    u.finish_reason = "error";
    u.error = cat("the model sampled token ", problem);
  }
  u.finished = !u.finish_reason.empty();
  return u.finished;
}

Status Engine::sample_first(RequestId id, Request& request, std::span<const float> processed,
                            std::span<const float> raw, std::vector<RequestUpdate>& updates) {
  const SequenceId parent = request.prompt_seq;
  const int64_t n_tokens = int64_t(scheduler_.find(parent)->tokens.size());
  // Every completion still wanted draws its first token; those that go on get a sequence: the
  // first of them takes over the prompt's, the others fork from it.
  std::vector<int32_t> going, tokens;
  std::vector<size_t> ended;  // positions in `updates` (which may grow meanwhile)
  for (size_t i = 0; i < request.completions.size(); ++i) {
    if (request.completions[i].finished) continue;  // aborted before its first token
    RequestUpdate& u = update_for(id, int32_t(i), updates);
    if (sample_into(request, int32_t(i), n_tokens, processed, raw, u)) {
      request.completions[i].finished = true;
      request.n_unfinished -= 1;
      ended.push_back(size_t(&u - updates.data()));
    } else {
      going.push_back(int32_t(i));
      tokens.push_back(u.new_tokens.back());
    }
  }
  if (going.empty()) {
    E4KV_ASSERT(request.n_unfinished == 0, "engine: a completion outlived its request");
    updates[ended.back()].request_finished = true;  // the request's last update
    requests_.erase(id);
    return remove_sequence(parent);
  }
  request.prompt_seq = -1;
  SequenceInfo& parent_info = sequences_.at(parent);
  const int32_t parent_slot = parent_info.model_slot;
  parent_info.completion = going[0];
  request.completions[size_t(going[0])].seq = parent;
  std::vector<SequenceId> children;
  for (size_t k = 1; k < going.size(); ++k) children.push_back(next_seq_++);
  scheduler_.fork(parent, children, std::span<const int32_t>(tokens).subspan(1));
  for (size_t k = 1; k < going.size(); ++k) {
    const SequenceId child = children[k - 1];
    request.completions[size_t(going[k])].seq = child;
    SequenceInfo& info = sequences_.emplace(child, SequenceInfo{id, going[k], -1}).first->second;
    const int32_t slot = scheduler_.find(child)->state_slot;
    if (scheduler_.find(child)->n_computed == 0) continue;  // waits to recompute
    E4KV_RETURN_IF_ERROR(model_.begin_sequence(slot));
    info.model_slot = slot;
    E4KV_RETURN_IF_ERROR(model_.copy_sequence_state(parent_slot, slot));
  }
  scheduler_.append_token(parent, tokens[0]);
  return ok_status();
}

}  // namespace e4kv
