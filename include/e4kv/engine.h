// e4kv's public C++ API: an inference engine over one model directory, continuously batched.
//
//   #include <e4kv/engine.h>
//   e4kv::api::EngineConfig config;
//   config.model = "/models/Qwen3-0.6B";
//   auto engine = e4kv::api::LLMEngine::create(config);        // Result<unique_ptr<LLMEngine>>
//   if (!engine.ok()) { std::cerr << engine.message() << "\n"; return 1; }
//   e4kv::api::SamplingParams params;
//   params.max_tokens = 32;
//   auto id = (*engine)->submit("The capital of France is", params,
//                               [](const e4kv::api::CompletionOutput& out) {
//                                 std::cout << out.text;   // each piece of text as it comes
//                                 if (out.finished) std::cout << "\n";
//                               });
//
// Threading rule. An LLMEngine owns one thread, the engine loop, and only that thread touches the
// model, the KV cache and the scheduler. Every public method may be called from any thread at any
// time: they validate on the caller's thread, then hand the work to the loop through a queue under
// a mutex. submit(), stream() and abort() never wait for a forward; generate() and
// RequestStream::next() wait for their own outputs only. The loop sleeps while there is no work
// and wakes on submit() or abort(). Output callbacks run on the loop thread, one at a time, so a
// callback must be quick and must not throw; it may call submit() and abort() (they do not wait for
// the loop) but must not wait on the loop (generate(), RequestStream::next()) or destroy the
// engine.
//
// Per request, outputs come in order: zero or more incremental outputs (new token ids and the
// text that became final with them), then exactly one final output (finished = true, with the
// finish reason and the usage). Every request that submit() accepted gets its final output, also
// when it is aborted, fails, or the engine is destroyed first. A request with n > 1 completions
// has that sequence for each completion (CompletionOutput::index), interleaved; the last output
// of the request has request_finished = true.
//
// Shutdown: the destructor aborts every request not yet finished (its final output has
// finish_reason "abort"), delivers those final outputs, and joins the loop before it returns.
// submit() racing with the destructor is refused with an error.
//
// Errors are values, never exceptions: Status and Result<T> below. A refused configuration or
// request names the field ("max_tokens: must be >= 0, got -1"); field() gives the name alone.
//
// This header includes only the standard library; the implementation's headers stay private.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace e4kv::api {

// An error, or success (an empty message).
class Status {
 public:
  Status() = default;
  static Status error(std::string message, std::string field = {}) {
    Status s;
    s.message_ = std::move(message);
    s.field_ = std::move(field);
    s.ok_ = false;
    return s;
  }
  bool ok() const { return ok_; }
  const std::string& message() const { return message_; }
  // The configuration or request field the error is about ("top_p"); empty when none.
  const std::string& field() const { return field_; }

 private:
  bool ok_ = true;
  std::string message_;
  std::string field_;
};

// A value or the error that prevented it.
template <class T>
class Result {
 public:
  Result(T value) : state_(std::move(value)) {}       // NOLINT: implicit by design
  Result(Status error) : state_(std::move(error)) {}  // NOLINT: implicit by design; not ok

  bool ok() const { return std::holds_alternative<T>(state_); }
  Status status() const { return ok() ? Status() : std::get<Status>(state_); }
  const std::string& message() const {
    static const std::string kEmpty;
    return ok() ? kEmpty : std::get<Status>(state_).message();
  }
  // The value; std::bad_variant_access on an error Result (check ok() first).
  T& value() & { return std::get<T>(state_); }
  const T& value() const& { return std::get<T>(state_); }
  T&& value() && { return std::get<T>(std::move(state_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> state_;
};

struct EngineConfig {
  std::string model;           // a Hugging Face model directory (config.json, *.safetensors)
  std::string device = "cpu";  // "cpu", or "cuda" / "cuda:N" in a build with the CUDA backend
  // "fp16", or "fp8_e4m3": an E4M3 cache needs the checkpoint's calibrated K/V scales and is
  // refused without them (the scale gate fails closed; `e4kv calibrate` makes them).
  std::string kv_cache_dtype = "fp16";
  // "calibrated" (the checkpoint's scales), or "unit" (every scale 1.0: a negative control).
  std::string kv_scales_mode = "calibrated";
  // The PLE n-gram tables (Qwen4Exp) in host memory: "auto" (the checkpoint's dtype, read in place
  // from the memory-mapped checkpoint) or "fp8_e4m3" (converted at load to E4M3 with an FP32 scale
  // per row: half the host memory of a BF16 table). A model without PLE takes either.
  std::string ple_dtype = "auto";
  int64_t block_size = 64;             // tokens per KV cache block, a multiple of 16
  int64_t max_model_len = 0;           // prompt plus output; 0: max_position_embeddings
  int64_t max_num_seqs = 0;            // requests running at once; 0: 64
  int64_t max_num_batched_tokens = 0;  // rows of one forward; 0: min(max_model_len, 8192)
  // Every step op by op: no CUDA graphs of the decode step (captured per batch-size bucket and
  // replayed; on by default on CUDA, where they cut the host's launch cost).
  bool enforce_eager = false;
  // The KV cache pool, sized by at most one of these. None: a pool that holds one sequence of
  // max_model_len tokens (the least that can serve every request; more requests then take turns).
  std::optional<int64_t> kv_cache_memory_bytes;    // blocks and per-sequence states in this
  std::optional<int64_t> num_gpu_blocks_override;  // exactly this many blocks
  std::optional<double> gpu_memory_utilization;    // CUDA: this fraction of the card
  int threads = 0;  // CPU backend threads; 0: one per hardware thread
  // Ranks of tensor parallelism, each holding its share of the heads, channels and experts (and
  // of the KV pool). CPU ranks (threads) today; GPU ranks need the NCCL communicator.
  int tensor_parallel_size = 1;
  // Text in a chat message that spells a control token (<|im_end|>) becomes that token, as
  // encoding transformers' apply_chat_template output does; by default it stays text.
  bool special_tokens_in_content = false;
  // A Jinja chat template file used instead of the checkpoint's (vLLM's --chat-template); empty:
  // the checkpoint's own.
  std::string chat_template;
  // Called while the weights load with the checkpoint's tensor bytes taken so far and in all
  // (every further 1% and at the end; on the thread that calls create). Null: none.
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> load_progress;
};

// vLLM's sampling and request fields, their names and meanings.
struct SamplingParams {
  // Completions of the prompt (1..64, and at most max_num_seqs): the prompt is computed once,
  // completion i samples with seed + i.
  int64_t n = 1;
  int64_t max_tokens = 16;   // new tokens at most (also cut at max_model_len)
  int64_t min_tokens = 0;    // no stop (id, EOS or string) before this many tokens
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;
  int64_t top_k = 0;  // 0 or -1: off
  double min_p = 0.0;
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::map<int32_t, double> logit_bias;  // token id -> added to its logit
  uint64_t seed = 0;              // the request's own generator: the same tokens whatever else runs
  std::vector<std::string> stop;  // stop strings (cut from the text)
  std::vector<int32_t> stop_token_ids;  // stop ids (kept in token_ids)
  bool ignore_eos = false;              // do not stop at the model's EOS ids
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;         // in the text
  std::optional<int64_t> logprobs;         // 0..20: each new token's logprob and the top n
  std::optional<int64_t> prompt_logprobs;  // 0..20: the same for each prompt token after the first
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

// A chat in OpenAI's JSON form, for what ChatMessage cannot say (content parts, tool calls, tool
// results, names), with the template's other inputs. Every field is JSON text.
struct ChatJson {
  std::string messages;         // an array of message objects, passed to the template as given
  std::string tools;            // empty, or an array of {"type": "function", "function": {...}}
  std::string template_kwargs;  // empty, or an object of extra template variables
  // Unset: the generation prompt unless the last message is the assistant's.
  std::optional<bool> add_generation_prompt;
};

// What to complete: text (encoded with the model's tokenizer, special tokens added), token ids as
// they are, or chat messages (rendered with the model's chat template, with the generation prompt
// unless the last message is the assistant's).
struct Prompt {
  // Implicit by design: submit("text", ...), submit(ids, ...), submit(messages, ...).
  Prompt(std::string s) : text(std::move(s)) {}                         // NOLINT
  Prompt(const char* s) : text(s) {}                                    // NOLINT
  Prompt(std::vector<int32_t> ids) : token_ids(std::move(ids)) {}       // NOLINT
  Prompt(std::vector<ChatMessage> chat) : messages(std::move(chat)) {}  // NOLINT
  Prompt(ChatJson chat) : chat_json(std::move(chat)) {}                 // NOLINT

  std::optional<std::string> text;
  std::optional<std::vector<int32_t>> token_ids;
  std::optional<std::vector<ChatMessage>> messages;
  std::optional<ChatJson> chat_json;
};

struct TopLogprob {
  int32_t token_id = 0;
  std::string token;  // its text (special tokens spelled out)
  double logprob = 0.0;
};

// One position's log-probabilities (of the raw model, vLLM's default).
struct Logprob {
  int32_t token_id = 0;
  std::string token;
  double logprob = 0.0;
  int64_t rank = 0;  // 1: the most probable
  std::vector<TopLogprob> top_logprobs;
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // so far
  int64_t total_tokens = 0;
};

using RequestId = uint64_t;

// One output of one request: what is new since its previous output.
struct CompletionOutput {
  RequestId request_id = 0;
  int32_t index = 0;                     // the completion, 0..n-1
  std::string text;                      // text that became final with this output (may be empty)
  std::vector<int32_t> token_ids;        // tokens generated since the previous output
  std::vector<Logprob> logprobs;         // [token_ids.size()] when the request asked for logprobs
  std::vector<Logprob> prompt_logprobs;  // prompt positions from prompt_logprobs_start on
  int64_t prompt_logprobs_start = 0;
  bool finished = false;
  // Set on the final output: "stop" (a stop id, EOS id or stop string), "length" (max_tokens or
  // max_model_len), "abort" (abort() or the engine's shutdown), "error" (see error).
  std::string finish_reason;
  std::string stop_string;     // the stop string that matched
  int32_t stop_token_id = -1;  // the stop or EOS id that matched
  std::string error;
  Usage usage;  // the request's counts so far, all completions (final on the request's last)
  // The request's last output (every completion finished); the same as finished for n = 1.
  bool request_finished = false;
  // On the request's last output: seconds from submit() until its first forward; -1 when it
  // never ran (aborted or refused while waiting).
  double queue_seconds = -1.0;
};

// A whole completion (generate(), RequestStream::collect()).
struct Completion {
  RequestId request_id = 0;
  int32_t index = 0;
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<Logprob> logprobs;
  std::vector<Logprob> prompt_logprobs;
  std::string finish_reason;
  std::string stop_string;
  int32_t stop_token_id = -1;
  std::string error;
  Usage usage;
};

using OutputCallback = std::function<void(const CompletionOutput&)>;

// A request's outputs as a queue the caller pulls from (any thread; one reader).
class RequestStream {
 public:
  virtual ~RequestStream() = default;
  virtual RequestId id() const = 0;
  // The next output, waiting for it; nullopt after the request's last one was returned.
  virtual std::optional<CompletionOutput> next() = 0;
  // Every remaining output merged into one completion (waits for the final output); for n > 1,
  // completion 0 (the others are dropped: use collect_all()).
  virtual Completion collect() = 0;
  // Every remaining output merged, one completion per index.
  virtual std::vector<Completion> collect_all() = 0;
};

// What the engine holds now (stats()): a snapshot taken by the loop after each step and before each
// request's final output is delivered (so it counts that request's tokens).
struct EngineStats {
  int64_t running = 0;  // sequences in the running batch
  int64_t waiting = 0;  // sequences waiting (new, or preempted), and requests not yet admitted
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_used = 0;
  int64_t block_size = 0;
  int64_t kv_pool_tokens = 0;             // kv_blocks_total * block_size
  int64_t kv_fp16_equivalent_tokens = 0;  // what the same bytes hold as an FP16 cache
  std::string kv_cache_dtype;             // "fp16" or "fp8_e4m3"
  // "calibrated", "unit" (every scale 1.0, a negative control), or "none" (an FP16 cache).
  std::string kv_scales;
  // Running totals since start.
  int64_t preemptions = 0;
  int64_t prompt_tokens = 0;        // of admitted requests
  int64_t generation_tokens = 0;    // delivered
  int64_t kv_nonfinite_inputs = 0;  // inf/NaN K/V values the cache writes refused
};

class LLMEngine {
 public:
  // Loads the model and starts the engine loop. Refused, with a message naming the field or the
  // file: a missing or broken model directory, a bad device, an E4M3 cache without calibrated
  // scales (the scale gate's message), out-of-range sizes, a pool that cannot hold one sequence.
  static Result<std::unique_ptr<LLMEngine>> create(const EngineConfig& config);

  LLMEngine(const LLMEngine&) = delete;
  LLMEngine& operator=(const LLMEngine&) = delete;
  // Aborts what is in flight (each such request's final output: "abort") and joins the loop.
  ~LLMEngine();

  // Queues a request; `on_output` gets its outputs on the loop thread (header comment). Refused
  // here, before anything is queued, naming the field: bad sampling fields, stop strings without a
  // tokenizer, a prompt that encodes to nothing, ids outside the vocabulary, a prompt of
  // max_model_len tokens or more, a request the KV pool could not hold alone, text or messages
  // without a tokenizer (or chat template), an engine shutting down or broken.
  Result<RequestId> submit(const Prompt& prompt, const SamplingParams& params,
                           OutputCallback on_output);

  // As submit(), with the outputs queued for the caller to pull.
  Result<std::unique_ptr<RequestStream>> stream(const Prompt& prompt, const SamplingParams& params);

  // Ends a request: its final output has finish_reason "abort" unless it finished first. False
  // when the id is not in flight (unknown, or its final output was already delivered or is due).
  bool abort(RequestId id);

  // Offline convenience: submits every prompt and waits for all; completions in prompt order. A
  // prompt refused at submit refuses the call ("prompts[2]: max_tokens: ...") and aborts those
  // already queued.
  Result<std::vector<Completion>> generate(const std::vector<Prompt>& prompts,
                                           const SamplingParams& params);

  // The model's vocabulary size and max model length (prompt plus output).
  int64_t vocab_size() const;
  int64_t max_model_len() const;
  // What loading said: the pool line, and for an E4M3 cache the K/V scale summary.
  const std::vector<std::string>& notes() const;
  // The loop's latest snapshot (any thread).
  EngineStats stats() const;
  // The token ids submit() would run for `prompt` (text, token ids or a chat), checked as
  // submit() checks a prompt. add_special_tokens applies to text only.
  Result<std::vector<int32_t>> tokenize(const Prompt& prompt, bool add_special_tokens = true);
  // Token ids <-> text with the model's tokenizer (errors: no tokenizer.json). Any thread.
  Result<std::vector<int32_t>> encode(const std::string& text,
                                      bool add_special_tokens = true) const;
  Result<std::string> decode(const std::vector<int32_t>& ids,
                             bool skip_special_tokens = true) const;

  class Impl;

 private:
  explicit LLMEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace e4kv::api
