#include "engine/output.h"

#include <algorithm>

namespace e4kv {

OutputProcessor::OutputProcessor(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}

void OutputProcessor::add_request(RequestId id, const RequestParams& params) {
  Request request;
  for (int64_t i = 0; i < std::max<int64_t>(params.n, 1); ++i) {
    request.completions.push_back(
        State{.decoder = StreamingDecoder(*tokenizer_, params.skip_special_tokens),
              .stop = params.stop,
              .include_stop_str_in_output = params.include_stop_str_in_output,
              .min_tokens = params.min_tokens});
  }
  request.n_unfinished = int64_t(request.completions.size());
  requests_.insert_or_assign(id, std::move(request));
}

bool OutputProcessor::take_text(State& state, const std::string& text, bool may_stop,
                                RequestOutput& out) {
  const size_t old_size = state.held.size();
  state.held += text;
  const std::string& held = state.held;
  if (may_stop && !text.empty()) {
    // The earliest stop string that ends in the new text: it starts after
    // old_size - stop.size(), so a search from there finds nothing that ended before.
    size_t best = std::string::npos;
    const std::string* which = nullptr;
    for (const std::string& stop : state.stop) {
      if (stop.empty()) continue;
      const size_t from = old_size >= stop.size() ? old_size - stop.size() + 1 : 0;
      const size_t at = held.find(stop, from);
      if (at != std::string::npos && (best == std::string::npos || at < best)) {
        best = at;
        which = &stop;
      }
    }
    if (which != nullptr) {
      out.new_text += held.substr(0, best);
      if (state.include_stop_str_in_output) out.new_text += *which;
      out.stop_string = *which;
      state.held.clear();
      return true;
    }
  }
  // Hold back the longest suffix that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& stop : state.stop) {
    if (stop.empty()) continue;
    for (size_t k = std::min(stop.size() - 1, held.size()); k > hold; --k) {
      if (held.compare(held.size() - k, k, stop, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  out.new_text += held.substr(0, held.size() - hold);
  state.held.erase(0, held.size() - hold);
  return false;
}

RequestOutput output_without_text(const RequestUpdate& update) {
  RequestOutput out;
  out.id = update.id;
  out.index = update.index;
  out.new_tokens = update.new_tokens;
  out.finished = update.finished;
  out.request_finished = update.request_finished;
  out.finish_reason = update.finish_reason;
  out.stop_token = update.stop_token;
  out.error = update.error;
  out.logprobs = update.logprobs;
  out.prompt_logprobs = update.prompt_logprobs;
  out.prompt_logprobs_start = update.prompt_logprobs_start;
  return out;
}

std::vector<RequestOutput> OutputProcessor::process(std::span<const RequestUpdate> updates,
                                                    Engine* engine) {
  std::vector<RequestOutput> outputs;
  outputs.reserve(updates.size());
  for (const RequestUpdate& u : updates) {
    auto it = requests_.find(u.id);
    if (it == requests_.end() || u.index < 0 || size_t(u.index) >= it->second.completions.size() ||
        it->second.completions[size_t(u.index)].finished) {
      outputs.push_back(output_without_text(u));
      continue;
    }
    RequestOutput out;
    out.id = u.id;
    out.index = u.index;
    out.new_tokens = u.new_tokens;
    out.logprobs = u.logprobs;
    out.prompt_logprobs = u.prompt_logprobs;
    out.prompt_logprobs_start = u.prompt_logprobs_start;
    State& state = it->second.completions[size_t(u.index)];
    bool stopped = false;
    for (size_t i = 0; i < u.new_tokens.size() && !stopped; ++i) {
      const int32_t token = u.new_tokens[i];
      state.n_tokens += 1;
      const bool is_stop_token = u.finish_reason == "stop" && u.stop_token == token &&
                                 i + 1 == u.new_tokens.size();
      if (is_stop_token && !state.include_stop_str_in_output) continue;
      stopped = take_text(state, state.decoder.push(token), state.n_tokens > state.min_tokens, out);
    }
    if (!stopped && u.finished) {
      // What the decoder still holds belongs to the last token; then nothing more can come, so
      // no held text can become a stop string. A failed request reports its error, not a stop.
      stopped = take_text(state, state.decoder.finish(),
                          u.finish_reason != "error" && state.n_tokens > state.min_tokens, out);
      if (!stopped) {
        out.new_text += state.held;
        state.held.clear();
      }
    }
    if (stopped) {
      out.finished = true;
      out.finish_reason = "stop";
      // Ends it in the engine unless this step's update finished it already.
      if (engine != nullptr && !u.finished) engine->abort(u.id, u.index);
    } else if (u.finished) {
      out.finished = true;
      out.finish_reason = u.finish_reason;
      out.stop_token = u.stop_token;
      out.error = u.error;
    }
    if (out.finished) {
      state.finished = true;
      if (--it->second.n_unfinished == 0) {
        out.request_finished = true;
        requests_.erase(it);
      }
    }
    outputs.push_back(std::move(out));
  }
  return outputs;
}

std::vector<RequestOutput> OutputProcessor::abort(RequestId id, Engine* engine) {
  if (engine != nullptr) engine->abort(id);
  std::vector<RequestOutput> outputs;
  auto it = requests_.find(id);
  if (it == requests_.end()) return outputs;
  for (size_t i = 0; i < it->second.completions.size(); ++i) {
    if (it->second.completions[i].finished) continue;
    RequestOutput out;
    out.id = id;
    out.index = int32_t(i);
    out.finished = true;
    out.finish_reason = "abort";
    outputs.push_back(std::move(out));
  }
  if (!outputs.empty()) outputs.back().request_finished = true;
  requests_.erase(it);
  return outputs;
}

}  // namespace e4kv
