// A checkpoint's chat template: found the way transformers finds it, rendered the way
// apply_chat_template renders it (chat/jinja.h is the engine).
//
// Where the template comes from, first match wins:
//   1. <dir>/chat_template.jinja (transformers' layout since 4.43; `name` picks
//      <dir>/additional_chat_templates/<name>.jinja instead);
//   2. "chat_template" in <dir>/tokenizer_config.json: a string, or a list of {"name", "template"}
//      from which `name` (default "default") is picked;
//   3. "chat_template" in <dir>/chat_template.json (multimodal processors' layout).
// bos_token / eos_token come from tokenizer_config.json ("<s>" or {"content": "<s>", ...}).
//
// render() builds transformers' context: messages (passed through unchanged: content may be a
// string or a list of parts; tool_calls, name, tool_call_id, reasoning_content ... as given),
// tools (null without tools), documents (null), add_generation_prompt, bos_token / eos_token when
// the tokenizer sets them, then the caller's extra variables (enable_thinking, reasoning_effort,
// date_string ...). render_tracked() also says which bytes of the prompt came from the caller's
// data, so that encoding it turns only the template's own markers into control tokens.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "chat/jinja.h"
#include "core/status.h"

namespace e4kv {

// A rendered prompt and the byte ranges of it that came from the caller's data.
using RenderedPrompt = jinja::TrackedText;

struct ChatRenderOptions {
  // Appends the header that opens the assistant's turn (transformers' default is false; a prompt
  // for generation wants it).
  bool add_generation_prompt = true;
  // Tool schemas (a JSON array, OpenAI form {"type": "function", "function": {...}}).
  std::optional<nlohmann::ordered_json> tools;
  // More template variables (a JSON object), e.g. {"enable_thinking": false}.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  // render_tracked() reports no untrusted ranges, so text in a message that spells a control
  // token ("<|im_end|>") is encoded as that control token, as transformers' apply_chat_template
  // then encode does. Off by default: a message's text is always encoded as text.
  bool special_tokens_in_content = false;
  JinjaLimits limits;
};

class ChatTemplate {
 public:
  // Loads the template of the checkpoint in `dir` (see the header comment). `name` selects a named
  // template ("tool_use", "rag" ...); empty means the default one. Errors: no template (the message
  // says to pass token ids or plain text instead), an unknown name (listing the names there are),
  // unreadable or malformed files, a template that does not parse.
  static Result<ChatTemplate> load(const std::filesystem::path& dir, std::string_view name = {});

  // The template in `file` (a .jinja file, vLLM's --chat-template), with bos_token / eos_token
  // from the tokenizer_config.json of the checkpoint in `dir` when it has one.
  static Result<ChatTemplate> load_file(const std::filesystem::path& file,
                                        const std::filesystem::path& dir);

  // A template given as text; unset tokens are not defined while rendering.
  static Result<ChatTemplate> from_source(std::string source,
                                          std::optional<std::string> bos_token = std::nullopt,
                                          std::optional<std::string> eos_token = std::nullopt);

  // `messages`: a JSON array of message objects ({"role": ..., "content": ...}).
  Result<std::string> render(const nlohmann::ordered_json& messages,
                             const ChatRenderOptions& options = {}) const;
  // As render(), and says which bytes of the prompt came from the caller's data: every string of
  // the messages, the tools and the extra variables (roles, content, names, tool-call arguments,
  // tool schemas ...), through whatever the template computed from them. Only bos_token,
  // eos_token and the template's own text are trusted. Tokenizer::encode(text, ..., untrusted)
  // then matches control tokens only in the trusted text, so message content cannot fake a role
  // boundary. With options.special_tokens_in_content, no range is untrusted.
  Result<RenderedPrompt> render_tracked(const nlohmann::ordered_json& messages,
                                        const ChatRenderOptions& options = {}) const;

  const std::string& source() const { return source_; }
  const std::optional<std::string>& bos_token() const { return bos_token_; }
  const std::optional<std::string>& eos_token() const { return eos_token_; }

 private:
  ChatTemplate(JinjaTemplate engine, std::string source, std::optional<std::string> bos_token,
               std::optional<std::string> eos_token)
      : engine_(std::move(engine)),
        source_(std::move(source)),
        bos_token_(std::move(bos_token)),
        eos_token_(std::move(eos_token)) {}

  JinjaTemplate engine_;
  std::string source_;
  std::optional<std::string> bos_token_;
  std::optional<std::string> eos_token_;
};

}  // namespace e4kv
