// The OpenAI-compatible protocol of `e4kv serve`, without HTTP: request bodies of
// /v1/completions and /v1/chat/completions checked and turned into the engine's prompt and
// sampling parameters, and the engine's outputs turned into response bodies and stream chunks.
//
// Field names and meanings are OpenAI's, with vLLM's extra sampling fields (top_k, min_p,
// repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
// skip_special_tokens, chat_template_kwargs, add_generation_prompt). A field we do not support is a
// 400 naming it; the fields vLLM also accepts and ignores (kIgnoredFields) are accepted and
// ignored.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "e4kv/engine.h"
#include "serve/reasoning_parser.h"
#include "serve/tool_call_parser.h"

namespace e4kv::serve {

using json = nlohmann::ordered_json;

// An error as the client sees it: the HTTP status and OpenAI's error object.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // the request field it is about; empty: none
};

// {"error": {"message", "type", "param", "code"}}; type from the status (BadRequestError ...).
json error_body(const ApiError& error);

// Fields accepted and ignored, as vLLM does (named in the README).
inline constexpr const char* kIgnoredFields[] = {"user", "store", "metadata", "service_tier",
                                                 "parallel_tool_calls"};

enum class Endpoint { kCompletions, kChat };

struct ProtocolLimits {
  int64_t max_model_len = 0;
  int64_t max_logprobs = 20;
};

// A checked request. The prompt is still text, ids or a chat: the server tokenizes it (once) and
// submits the ids.
struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // as given
  api::Prompt prompt{std::string()};
  bool add_special_tokens = true;  // text prompts
  api::SamplingParams params;
  bool max_tokens_given = false;  // else: the rest of the context (chat) or 16 (completions)
  bool seed_given = false;        // else: the server draws a random seed (OpenAI's behaviour)
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Completions: logprobs = n top entries (0..20); chat: logprobs true and top_logprobs.
  bool logprobs = false;
  int64_t top_logprobs = 0;
  // Chat: the request has tools and tool_choice is not "none" (the tool-call parser runs).
  bool parse_tool_calls = false;
  int64_t best_of = 0;  // completions: accepted when equal to n
};

// Checks a request body (a JSON object) for `endpoint`. Errors are 400s naming the field.
std::optional<ApiError> parse_request(Endpoint endpoint, const json& body,
                                      const ProtocolLimits& limits, ParsedRequest* out);

// What the server's flags choose for a chat's output text.
struct OutputParsing {
  bool reasoning = false;         // --reasoning-parser qwen3
  bool reasoning_opened = false;  // the prompt ends inside <think> (prompt_opens_reasoning)
  bool tool_calls = false;        // --tool-call-parser hermes, and the request asks for tools
  ToolCallIdGenerator make_tool_call_id;  // empty: make_tool_call_id()
};

// One choice (completion index) of a response, fed the engine's outputs in order; builds the
// stream chunks' choice objects and, at the end, the whole response's choice object.
class ChoiceBuilder {
 public:
  ChoiceBuilder(Endpoint endpoint, int32_t index, const OutputParsing& parsing, bool logprobs);

  // The choice objects to stream for `out` (zero or more: a chat's first output also sends the
  // role; text held back by a parser waits). Final outputs end with a choice carrying
  // finish_reason.
  std::vector<json> stream_choices(const api::CompletionOutput& out);
  // Feeds `out` without streaming (the non-streaming response).
  void add(const api::CompletionOutput& out);
  // The whole choice object (after the final output was fed).
  json whole_choice() const;

  bool finished() const { return finished_; }
  // "stop", "length", "tool_calls", "abort" or "error" (after the final output).
  const std::string& finish_reason() const { return finish_reason_; }
  const std::string& error() const { return error_; }

 private:
  struct Delta {
    std::string content, reasoning;
    std::vector<ToolCallDelta> tool_calls;
  };
  Delta take_text(const std::string& text, bool final);
  json logprobs_json(const std::vector<api::Logprob>& entries);
  void finish(const api::CompletionOutput& out);

  Endpoint endpoint_;
  int32_t index_;
  OutputParsing parsing_;
  bool want_logprobs_;
  std::optional<ReasoningParser> reasoning_;
  std::optional<ToolCallParser> tools_;
  bool sent_role_ = false;
  bool finished_ = false;
  std::string finish_reason_;
  json stop_reason_;  // null, the stop string, or the stop token id
  std::string error_;
  // The whole response's parts.
  std::string text_, content_, reasoning_text_;
  std::vector<ToolCall> calls_;
  std::vector<api::Logprob> logprobs_;
  int64_t text_offset_ = 0;  // completions logprobs: the text so far
};

// Compact JSON text; invalid UTF-8 in a string (a token's partial character) becomes U+FFFD
// instead of an exception.
std::string to_text(const json& value);

// The usage object.
json usage_json(const api::Usage& usage);

// A response id: prefix + 24 random hex digits ("cmpl-", "chatcmpl-").
std::string make_response_id(const char* prefix);

}  // namespace e4kv::serve
