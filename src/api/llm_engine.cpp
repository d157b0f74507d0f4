// The public engine (include/e4kv/engine.h) over the internal one (engine/engine.h): a loop thread
// owns the Engine and the OutputProcessor; callers validate and encode on their own threads and
// hand requests to the loop through an inbox under a mutex.
#include "e4kv/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

#include "api/model_setup.h"
#include "chat/chat_template.h"
#include "core/utf8.h"
#include "engine/engine.h"
#include "engine/output.h"
#include "io/generation_config.h"
#include "io/tokenizer.h"
#include "kv/block_allocator.h"

namespace e4kv::api {
namespace {

namespace fs = std::filesystem;

// The public name of an internal option, where the two differ.
std::string public_field(std::string_view internal) {
  if (internal == "stop_ids") return "stop_token_ids";
  if (internal == "kv_scales") return "kv_scales_mode";
  if (internal == "max_seqs") return "max_num_seqs";
  if (internal == "max_batch_tokens") return "max_num_batched_tokens";
  if (internal == "model_dir") return "model";
  return std::string(internal);
}

std::string config_option_name(std::string_view field) {
  return public_field(field);
}

// An internal error as a public one; an option error is renamed to the public field.
Status to_public(const e4kv::Status& status) {
  if (status.option().empty()) return Status::error(status.message());
  const std::string field = public_field(status.option());
  return Status::error(field + ": " + status.detail(), field);
}

Status field_error(const std::string& field, const std::string& detail) {
  return Status::error(field + ": " + detail, field);
}

void merge(Completion& into, const CompletionOutput& out) {
  into.request_id = out.request_id;
  into.index = out.index;
  into.text += out.text;
  into.token_ids.insert(into.token_ids.end(), out.token_ids.begin(), out.token_ids.end());
  into.logprobs.insert(into.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
  into.prompt_logprobs.insert(into.prompt_logprobs.end(), out.prompt_logprobs.begin(),
                              out.prompt_logprobs.end());
  into.usage = out.usage;
  if (out.finished) {
    into.finish_reason = out.finish_reason;
    into.stop_string = out.stop_string;
    into.stop_token_id = out.stop_token_id;
    into.error = out.error;
  }
}

// A stream's queue: the loop thread pushes, the reader pops.
struct StreamState {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<CompletionOutput> queue;
  bool final_returned = false;
};

class StreamImpl final : public RequestStream {
 public:
  StreamImpl(RequestId id, std::shared_ptr<StreamState> state)
      : id_(id), state_(std::move(state)) {}
  RequestId id() const override { return id_; }
  std::optional<CompletionOutput> next() override {
    std::unique_lock lock(state_->mu);
    if (state_->final_returned) return std::nullopt;
    state_->cv.wait(lock, [&] { return !state_->queue.empty(); });
    CompletionOutput out = std::move(state_->queue.front());
    state_->queue.pop_front();
    if (out.request_finished) state_->final_returned = true;
    return out;
  }
  Completion collect() override {
    std::vector<Completion> all = collect_all();
    return std::move(all.front());
  }
  std::vector<Completion> collect_all() override {
    std::map<int32_t, Completion> by_index;
    by_index[0].request_id = id_;
    while (std::optional<CompletionOutput> out = next()) merge(by_index[out->index], *out);
    std::vector<Completion> all;
    for (auto& [index, completion] : by_index) {
      completion.request_id = id_;
      completion.index = index;
      all.push_back(std::move(completion));
    }
    return all;
  }

 private:
  RequestId id_;
  std::shared_ptr<StreamState> state_;
};

}  // namespace

class LLMEngine::Impl {
 public:
  Impl(LoadedModel loaded, std::optional<Tokenizer> tokenizer, std::vector<int32_t> eos_ids,
       const EngineConfig& config)
      : config_(config),
        loaded_(std::move(loaded)),
        tokenizer_(std::move(tokenizer)),
        eos_ids_(std::move(eos_ids)),
        engine_(*loaded_.model, e4kv::EngineConfig{config.max_num_batched_tokens,
                                                   config.max_num_seqs, config.enforce_eager}) {
    if (tokenizer_) processor_.emplace(*tokenizer_);
    stats_.kv_blocks_total = loaded_.model->n_blocks();
    stats_.block_size = loaded_.model->block_size();
    stats_.kv_pool_tokens = loaded_.pool.n_tokens;
    stats_.kv_fp16_equivalent_tokens = loaded_.pool.fp16_equivalent_tokens;
    const KvScales& scales = loaded_.model->kv_scales();
    stats_.kv_cache_dtype = kv_cache_dtype_name(loaded_.model->kv_cache_dtype());
    stats_.kv_scales = scales.dtype != KvCacheDtype::kE4m3 ? "none"
                       : scales.negative_control()         ? "unit"
                                                           : "calibrated";
    loop_ = std::thread([this] { run_loop(); });
  }

  ~Impl() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    loop_.join();
  }

  Result<RequestId> submit(const Prompt& prompt, const SamplingParams& sp,
                           OutputCallback on_output) {
    Result<RequestParams> params = request_params(sp);
    if (!params.ok()) return params.status();
    Result<std::vector<int32_t>> ids = encode_prompt(prompt, /*add_special_tokens=*/true);
    if (!ids.ok()) return ids.status();
    if (Status fits = check_fits(*ids, params->max_tokens); !fits.ok()) return fits;
    const auto submitted = std::chrono::steady_clock::now();
    const RequestId id = next_id_.fetch_add(1) + 1;
    {
      std::lock_guard lock(mu_);
      if (stopping_) {
        return Status::error("the engine is shutting down; the request was not queued");
      }
      if (!broken_.empty()) {
        return Status::error(cat("the engine failed and takes no more requests: ", broken_));
      }
      inbox_.push_back(Pending{id, std::move(ids).value(), std::move(params).value(),
                               std::move(on_output), submitted});
      in_flight_.insert(id);
    }
    cv_.notify_one();
    return id;
  }

  bool abort(RequestId id) {
    {
      std::lock_guard lock(mu_);
      if (!in_flight_.contains(id)) return false;
      abort_inbox_.push_back(id);
    }
    cv_.notify_one();
    return true;
  }

  int64_t vocab_size() const { return loaded_.model->vocab_size(); }
  int64_t max_model_len() const { return loaded_.model->max_model_len(); }
  const std::vector<std::string>& notes() const { return loaded_.notes; }
  const Tokenizer* tokenizer() const { return tokenizer_ ? &*tokenizer_ : nullptr; }

  EngineStats stats() const {
    std::lock_guard lock(stats_mu_);
    return stats_;
  }

  Result<std::vector<int32_t>> tokenize(const Prompt& prompt, bool add_special_tokens) {
    return encode_prompt(prompt, add_special_tokens);
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    RequestId id = 0;
    std::vector<int32_t> prompt;
    RequestParams params;
    OutputCallback on_output;
    Clock::time_point submitted;
  };
  // A request the loop has admitted (loop thread only).
  struct Live {
    RequestId id = 0;
    OutputCallback on_output;
    Usage usage;
    Clock::time_point submitted;
    double queue_seconds = -1.0;  // set at its first forward
  };

  // The public fields as the internal engine's, checked (errors name the public field).
  Result<RequestParams> request_params(const SamplingParams& sp) const {
    RequestParams p;
    p.n = sp.n;
    p.sampling.temperature = sp.temperature;
    p.sampling.top_p = sp.top_p;
    p.sampling.top_k = sp.top_k;
    p.sampling.min_p = sp.min_p;
    p.sampling.repetition_penalty = sp.repetition_penalty;
    p.sampling.presence_penalty = sp.presence_penalty;
    p.sampling.frequency_penalty = sp.frequency_penalty;
    p.sampling.logit_bias = sp.logit_bias;
    p.sampling.seed = sp.seed;
    p.max_tokens = sp.max_tokens;
    p.min_tokens = sp.min_tokens;
    p.stop_ids = sp.stop_token_ids;
    p.eos_ids = eos_ids_;
    p.ignore_eos = sp.ignore_eos;
    p.stop = sp.stop;
    p.include_stop_str_in_output = sp.include_stop_str_in_output;
    p.skip_special_tokens = sp.skip_special_tokens;
    for (const auto& [n, name] :
         {std::pair{sp.logprobs, "logprobs"}, std::pair{sp.prompt_logprobs, "prompt_logprobs"}}) {
      if (n && (*n < 0 || *n > kMaxLogprobs)) {
        return field_error(name, cat("must be in [0, ", kMaxLogprobs, "], got ", *n));
      }
    }
    p.logprobs = sp.logprobs.value_or(-1);
    p.prompt_logprobs = sp.prompt_logprobs.value_or(-1);
    if (e4kv::Status valid = validate_request_params(p, vocab_size()); !valid.ok()) {
      return to_public(valid);
    }
    if (const int64_t max_seqs = engine_.scheduler().config().max_num_seqs; p.n > max_seqs) {
      return field_error("n", cat(p.n, " completions cannot run at once: the engine runs at most ",
                                  max_seqs, " sequences (max_num_seqs)"));
    }
    if (!p.stop.empty() && !tokenizer_) {
      return field_error("stop", cat("stop strings need the model's tokenizer.json to read the "
                                     "output as text; ",
                                     config_.model, " has none"));
    }
    return p;
  }

  Result<std::vector<int32_t>> encode_prompt(const Prompt& prompt, bool add_special_tokens) {
    const int n_kinds = int(prompt.text.has_value()) + int(prompt.token_ids.has_value()) +
                        int(prompt.messages.has_value()) + int(prompt.chat_json.has_value());
    if (n_kinds != 1) {
      return field_error("prompt", "give exactly one of text, token_ids and messages");
    }
    std::vector<int32_t> ids;
    if (prompt.token_ids) {
      ids = *prompt.token_ids;
    } else {
      if (!tokenizer_) {
        return field_error("prompt", cat(config_.model,
                                         " has no tokenizer.json, so text and "
                                         "messages cannot be encoded; give token ids"));
      }
      if (prompt.text) {
        if (const std::optional<size_t> bad = first_invalid_utf8(*prompt.text)) {
          return field_error("prompt", cat("invalid UTF-8 at byte ", *bad));
        }
        ids = tokenizer_->encode(*prompt.text, add_special_tokens);
      } else if (prompt.chat_json) {
        Result<RenderedPrompt> rendered = render_json(*prompt.chat_json);
        if (!rendered.ok()) return rendered.status();
        ids = tokenizer_->encode(rendered->text, /*add_special_tokens=*/false, rendered->untrusted);
      } else {
        if (prompt.messages->empty()) return field_error("messages", "no messages");
        nlohmann::ordered_json messages = nlohmann::ordered_json::array();
        for (const ChatMessage& m : *prompt.messages) {
          for (const std::string* s : {&m.role, &m.content}) {
            if (const std::optional<size_t> bad = first_invalid_utf8(*s)) {
              return field_error("messages", cat("invalid UTF-8 at byte ", *bad));
            }
          }
          messages.push_back({{"role", m.role}, {"content", m.content}});
        }
        ChatRenderOptions options;
        options.add_generation_prompt = prompt.messages->back().role != "assistant";
        options.special_tokens_in_content = config_.special_tokens_in_content;
        Result<RenderedPrompt> rendered = render(messages, options);
        if (!rendered.ok()) return rendered.status();
        ids = tokenizer_->encode(rendered->text, /*add_special_tokens=*/false, rendered->untrusted);
      }
    }
    if (ids.empty()) return field_error("prompt", "no tokens; give at least one");
    const int64_t vocab = vocab_size();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= vocab) {
        return field_error("prompt", cat("token ", i, " is id ", ids[i],
                                         ", outside the model's vocabulary [0, ", vocab, ")"));
      }
    }
    return ids;
  }

  // A chat in JSON form (ChatJson): parsed and checked here, rendered by render().
  Result<RenderedPrompt> render_json(const ChatJson& chat) {
    using nlohmann::ordered_json;
    auto parse = [](const std::string& text, const char* field) -> Result<ordered_json> {
      if (const std::optional<size_t> bad = first_invalid_utf8(text)) {
        return field_error(field, cat("invalid UTF-8 at byte ", *bad));
      }
      ordered_json value = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (value.is_discarded()) return field_error(field, "not valid JSON");
      return value;
    };
    Result<ordered_json> messages = parse(chat.messages, "messages");
    if (!messages.ok()) return messages.status();
    if (!messages->is_array()) return field_error("messages", "must be an array of messages");
    if (messages->empty()) return field_error("messages", "no messages");
    for (size_t i = 0; i < messages->size(); ++i) {
      const ordered_json& m = (*messages)[i];
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        return field_error("messages", cat("message ", i, " is not an object with a \"role\""));
      }
    }
    ChatRenderOptions options;
    if (!chat.tools.empty()) {
      Result<ordered_json> tools = parse(chat.tools, "tools");
      if (!tools.ok()) return tools.status();
      if (!tools->is_array()) return field_error("tools", "must be an array of tools");
      options.tools = std::move(tools).value();
    }
    if (!chat.template_kwargs.empty()) {
      Result<ordered_json> extra = parse(chat.template_kwargs, "chat_template_kwargs");
      if (!extra.ok()) return extra.status();
      if (!extra->is_object()) return field_error("chat_template_kwargs", "must be an object");
      options.extra = std::move(extra).value();
    }
    options.add_generation_prompt =
        chat.add_generation_prompt.value_or(messages->back()["role"] != "assistant");
    options.special_tokens_in_content = config_.special_tokens_in_content;
    return render(*messages, options);
  }

  // The chat template is loaded on first use; rendering is serialised (one template object).
  Result<RenderedPrompt> render(const nlohmann::ordered_json& messages,
                                const ChatRenderOptions& options) {
    std::lock_guard lock(chat_mu_);
    if (!chat_template_) {
      e4kv::Result<ChatTemplate> loaded =
          config_.chat_template.empty()
              ? ChatTemplate::load(config_.model)
              : ChatTemplate::load_file(config_.chat_template, config_.model);
      if (!loaded.ok()) return field_error("messages", loaded.message());
      chat_template_ = std::make_unique<ChatTemplate>(std::move(loaded).value());
    }
    e4kv::Result<RenderedPrompt> rendered = chat_template_->render_tracked(messages, options);
    if (!rendered.ok()) return field_error("messages", rendered.message());
    return std::move(rendered).value();
  }

  // What the engine's add_request would refuse for the prompt's length, said here so that a
  // request the loop admits is never refused there.
  Status check_fits(const std::vector<int32_t>& prompt, int64_t max_tokens) const {
    const Model& model = *loaded_.model;
    const int64_t n_prompt = int64_t(prompt.size());
    const int64_t max_len = model.max_model_len();
    if (n_prompt >= max_len) {
      return field_error("prompt", cat(n_prompt, " tokens; the max model length is ", max_len,
                                       " (prompt plus generated tokens)"));
    }
    const int64_t total = std::min(n_prompt + std::max<int64_t>(max_tokens, 1), max_len);
    const int64_t pool_tokens = model.n_blocks() * model.block_size();
    if (total > pool_tokens) {
      return field_error("max_tokens",
                         cat("the request may grow to ", total, " tokens; the KV pool holds ",
                             pool_tokens, " (", model.n_blocks(), " blocks of ", model.block_size(),
                             "); lower max_tokens or give the pool more"));
    }
    return Status();
  }

  // ---- loop thread ------------------------------------------------------------------------------

  void run_loop() {
    for (;;) {
      std::vector<Pending> adds;
      std::vector<RequestId> aborts;
      bool stop = false;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] {
          return stopping_ || !inbox_.empty() || !abort_inbox_.empty() || engine_.has_unfinished();
        });
        adds.swap(inbox_);
        aborts.swap(abort_inbox_);
        stop = stopping_;
      }
      for (Pending& p : adds) admit(p);
      for (RequestId id : aborts) abort_live(id, "abort", "");
      publish_stats();
      if (stop) {
        std::vector<RequestId> all;
        for (const auto& [engine_id, live] : live_) all.push_back(live.id);
        std::sort(all.begin(), all.end());
        for (RequestId id : all) abort_live(id, "abort", "");
        return;
      }
      if (!engine_.has_unfinished()) continue;
      e4kv::Result<std::vector<RequestUpdate>> updates = engine_.step();
      if (!updates.ok()) {
        // Only a broken model fails a whole step: every request ends with its error, and the
        // engine takes no more.
        {
          std::lock_guard lock(mu_);
          broken_ = updates.message();
        }
        std::vector<RequestId> all;
        for (const auto& [engine_id, live] : live_) all.push_back(live.id);
        for (RequestId id : all) abort_live(id, "error", updates.message());
        continue;
      }
      const auto now = Clock::now();
      for (const e4kv::RequestId engine_id : engine_.take_first_runs()) {
        auto it = live_.find(engine_id);
        if (it == live_.end()) continue;
        it->second.queue_seconds =
            std::chrono::duration<double>(now - it->second.submitted).count();
      }
      std::vector<RequestOutput> outputs;
      if (processor_) {
        outputs = processor_->process(*updates, &engine_);
      } else {
        for (const RequestUpdate& u : *updates) outputs.push_back(output_without_text(u));
      }
      for (const RequestOutput& o : outputs) deliver(o);
      publish_stats();
    }
  }

  void publish_stats() {
    const Scheduler& scheduler = engine_.scheduler();
    size_t not_admitted = 0;
    {
      std::lock_guard lock(mu_);
      not_admitted = inbox_.size();
    }
    std::lock_guard lock(stats_mu_);
    stats_.running = scheduler.n_running();
    stats_.waiting = scheduler.n_waiting() + int64_t(not_admitted);
    stats_.kv_blocks_used = scheduler.n_used_blocks();
    stats_.preemptions = scheduler.n_preemptions();
    stats_.prompt_tokens = prompt_tokens_;
    stats_.generation_tokens = generation_tokens_;
    stats_.kv_nonfinite_inputs = int64_t(loaded_.model->kv_nonfinite_inputs());
  }

  void admit(Pending& p) {
    e4kv::Result<e4kv::RequestId> engine_id = engine_.add_request(p.prompt, p.params);
    Live live{p.id, std::move(p.on_output), {}, p.submitted};
    live.usage.prompt_tokens = int64_t(p.prompt.size());
    live.usage.total_tokens = live.usage.prompt_tokens;
    if (!engine_id.ok()) {
      // submit() checked what the engine checks; this is the one place a request could still be
      // refused (e.g. min_tokens with every id a stop id), and it gets its final output here.
      CompletionOutput out;
      out.request_id = p.id;
      out.finished = true;
      out.finish_reason = "error";
      out.error = engine_id.message();
      out.usage = live.usage;
      out.request_finished = true;
      finish_and_call(live, out);
      return;
    }
    prompt_tokens_ += int64_t(p.prompt.size());
    if (processor_) processor_->add_request(*engine_id, p.params);
    engine_ids_[p.id] = *engine_id;
    live_.emplace(*engine_id, std::move(live));
  }

  // Ends an admitted request with `reason` ("abort" or "error"); nothing for one already finished.
  void abort_live(RequestId id, const char* reason, const std::string& error) {
    auto it = engine_ids_.find(id);
    if (it == engine_ids_.end()) return;
    const e4kv::RequestId engine_id = it->second;
    std::vector<RequestOutput> outs;
    if (processor_) {
      outs = processor_->abort(engine_id, &engine_);
    } else {
      engine_.abort(engine_id);
    }
    if (outs.empty()) {  // no processor: one final output stands for the request
      RequestOutput out;
      out.id = engine_id;
      out.finished = true;
      out.request_finished = true;
      outs.push_back(out);
    }
    for (RequestOutput& out : outs) {
      out.finish_reason = reason;
      out.error = error;
      deliver(out);
    }
  }

  void deliver(const RequestOutput& o) {
    auto it = live_.find(o.id);
    if (it == live_.end()) return;
    Live& live = it->second;
    CompletionOutput out;
    out.request_id = live.id;
    out.index = o.index;
    out.text = o.new_text;
    out.token_ids = o.new_tokens;
    out.logprobs = public_logprobs(o.logprobs);
    out.prompt_logprobs = public_logprobs(o.prompt_logprobs);
    out.prompt_logprobs_start = o.prompt_logprobs_start;
    live.usage.completion_tokens += int64_t(o.new_tokens.size());
    generation_tokens_ += int64_t(o.new_tokens.size());
    live.usage.total_tokens = live.usage.prompt_tokens + live.usage.completion_tokens;
    out.usage = live.usage;
    if (!o.finished) {
      call(live, out);
      return;
    }
    out.finished = true;
    out.finish_reason = o.finish_reason;
    out.stop_string = o.stop_string;
    out.stop_token_id = o.stop_token;
    out.error = o.error;
    if (!o.request_finished) {
      call(live, out);
      return;
    }
    out.request_finished = true;
    out.queue_seconds = live.queue_seconds;
    Live done = std::move(live);
    live_.erase(it);
    engine_ids_.erase(done.id);
    finish_and_call(done, out);
  }

  // The final output: the request leaves in_flight_ first, so abort() from the callback on says
  // false, and stats() already counts its tokens when the caller hears it finished (a client that
  // reads the metrics after its response must see its own request in them).
  void finish_and_call(Live& live, const CompletionOutput& out) {
    {
      std::lock_guard lock(mu_);
      in_flight_.erase(live.id);
    }
    publish_stats();
    call(live, out);
  }

  static void call(Live& live, const CompletionOutput& out) {
    if (!live.on_output) return;
    try {
      live.on_output(out);
    } catch (...) {
      // A callback must not throw (engine.h); one that does loses only its own output.
    }
  }

  std::vector<Logprob> public_logprobs(const std::vector<TokenLogprobs>& entries) const {
    std::vector<Logprob> out;
    out.reserve(entries.size());
    auto text = [&](int32_t token) {
      const int32_t one[1] = {token};
      return tokenizer_ ? tokenizer_->decode(one, /*skip_special_tokens=*/false) : std::string();
    };
    for (const TokenLogprobs& e : entries) {
      Logprob p{e.token, text(e.token), e.logprob, e.rank, {}};
      for (const TokenLogprob& t : e.top)
        p.top_logprobs.push_back({t.token, text(t.token), t.logprob});
      out.push_back(std::move(p));
    }
    return out;
  }

  const EngineConfig config_;
  LoadedModel loaded_;
  const std::optional<Tokenizer> tokenizer_;
  const std::vector<int32_t> eos_ids_;
  std::atomic<RequestId> next_id_{0};

  mutable std::mutex stats_mu_;
  EngineStats stats_;              // under stats_mu_
  int64_t prompt_tokens_ = 0;      // loop thread
  int64_t generation_tokens_ = 0;  // loop thread

  std::mutex chat_mu_;
  std::unique_ptr<ChatTemplate> chat_template_;  // under chat_mu_

  // Shared with the callers, under mu_.
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Pending> inbox_;
  std::vector<RequestId> abort_inbox_;
  std::unordered_set<RequestId> in_flight_;  // accepted, final output not yet delivered
  bool stopping_ = false;
  std::string broken_;  // why the engine takes no more requests

  // The loop thread's.
  Engine engine_;
  std::optional<OutputProcessor> processor_;
  std::unordered_map<e4kv::RequestId, Live> live_;
  std::unordered_map<RequestId, e4kv::RequestId> engine_ids_;
  std::thread loop_;  // last: started when everything above is built
};

Result<std::unique_ptr<LLMEngine>> LLMEngine::create(const EngineConfig& config) {
  if (config.model.empty()) return field_error("model", "no model directory given");
  std::error_code ec;
  if (!fs::is_directory(config.model, ec)) {
    return field_error("model", cat(config.model,
                                    ": not a directory; give a Hugging Face model "
                                    "directory (config.json, *.safetensors)"));
  }
  for (const auto& [n, name] :
       {std::pair{config.max_num_seqs, "max_num_seqs"},
        std::pair{config.max_num_batched_tokens, "max_num_batched_tokens"}}) {
    if (n < 0) return field_error(name, cat("must be >= 0 (0: the model's default), got ", n));
  }
  if (config.tensor_parallel_size < 1 || config.tensor_parallel_size > kMaxTensorParallelSize) {
    return field_error("tensor_parallel_size", cat("expected 1 to ", kMaxTensorParallelSize,
                                                   " ranks, got ", config.tensor_parallel_size));
  }
  ModelSetup setup;
  setup.model_dir = config.model;
  setup.device = config.device;
  setup.kv_cache_dtype = config.kv_cache_dtype;
  setup.kv_scales = config.kv_scales_mode;
  setup.ple_dtype = config.ple_dtype;
  setup.block_size = config.block_size;
  setup.max_model_len = config.max_model_len;
  setup.threads = config.threads;
  setup.tensor_parallel_size = config.tensor_parallel_size;
  setup.kv_cache_memory_bytes = config.kv_cache_memory_bytes;
  setup.num_gpu_blocks_override = config.num_gpu_blocks_override;
  setup.gpu_memory_utilization = config.gpu_memory_utilization;
  setup.max_seqs = config.max_num_seqs;
  setup.max_batch_tokens = config.max_num_batched_tokens;
  setup.option_name = &config_option_name;
  setup.load_progress = config.load_progress;
  if (!config.chat_template.empty() && !fs::is_regular_file(config.chat_template, ec)) {
    return field_error("chat_template",
                       cat(config.chat_template, ": not a file; give a Jinja chat template file"));
  }

  // The tokenizer and EOS ids first: a broken tokenizer.json costs no model load.
  std::optional<Tokenizer> tokenizer;
  if (fs::exists(fs::path(config.model) / "tokenizer.json", ec)) {
    e4kv::Result<Tokenizer> loaded = Tokenizer::from_model_dir(config.model);
    if (!loaded.ok()) return to_public(loaded.status());
    tokenizer.emplace(std::move(loaded).value());
  }
  e4kv::Result<std::vector<int32_t>> eos_ids = load_eos_token_ids(config.model);
  if (!eos_ids.ok()) return to_public(eos_ids.status());
  if (tokenizer && tokenizer->eos_id()) eos_ids->push_back(*tokenizer->eos_id());

  // Without a pool option, a pool of one max_model_len sequence (load_model caps the tokens).
  e4kv::Result<LoadedModel> loaded = load_model(setup, kMaxTokenCount, 0, 1);
  if (!loaded.ok()) return to_public(loaded.status());
  auto impl = std::make_unique<Impl>(std::move(loaded).value(), std::move(tokenizer),
                                     std::move(eos_ids).value(), config);
  return std::unique_ptr<LLMEngine>(new LLMEngine(std::move(impl)));
}

LLMEngine::LLMEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LLMEngine::~LLMEngine() = default;

Result<RequestId> LLMEngine::submit(const Prompt& prompt, const SamplingParams& params,
                                    OutputCallback on_output) {
  return impl_->submit(prompt, params, std::move(on_output));
}

Result<std::unique_ptr<RequestStream>> LLMEngine::stream(const Prompt& prompt,
                                                         const SamplingParams& params) {
  auto state = std::make_shared<StreamState>();
  Result<RequestId> id = impl_->submit(prompt, params, [state](const CompletionOutput& out) {
    {
      std::lock_guard lock(state->mu);
      state->queue.push_back(out);
    }
    state->cv.notify_one();
  });
  if (!id.ok()) return id.status();
  return std::unique_ptr<RequestStream>(new StreamImpl(*id, std::move(state)));
}

bool LLMEngine::abort(RequestId id) {
  return impl_->abort(id);
}

Result<std::vector<Completion>> LLMEngine::generate(const std::vector<Prompt>& prompts,
                                                    const SamplingParams& params) {
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Result<std::unique_ptr<RequestStream>> s = stream(prompts[i], params);
    if (!s.ok()) {
      for (const auto& queued : streams) impl_->abort(queued->id());
      for (const auto& queued : streams) (void)queued->collect();
      return Status::error(cat("prompts[", i, "]: ", s.message()), s.status().field());
    }
    streams.push_back(std::move(s).value());
  }
  std::vector<Completion> out;
  out.reserve(streams.size());
  for (const auto& s : streams) out.push_back(s->collect());
  return out;
}

int64_t LLMEngine::vocab_size() const {
  return impl_->vocab_size();
}
int64_t LLMEngine::max_model_len() const {
  return impl_->max_model_len();
}
const std::vector<std::string>& LLMEngine::notes() const {
  return impl_->notes();
}
EngineStats LLMEngine::stats() const {
  return impl_->stats();
}
Result<std::vector<int32_t>> LLMEngine::tokenize(const Prompt& prompt, bool add_special_tokens) {
  return impl_->tokenize(prompt, add_special_tokens);
}

Result<std::vector<int32_t>> LLMEngine::encode(const std::string& text,
                                               bool add_special_tokens) const {
  const Tokenizer* tok = impl_->tokenizer();
  if (tok == nullptr) return Status::error("the model directory has no tokenizer.json");
  return tok->encode(text, add_special_tokens);
}

Result<std::string> LLMEngine::decode(const std::vector<int32_t>& ids,
                                      bool skip_special_tokens) const {
  const Tokenizer* tok = impl_->tokenizer();
  if (tok == nullptr) return Status::error("the model directory has no tokenizer.json");
  return tok->decode(ids, skip_special_tokens);
}

}  // namespace e4kv::api
