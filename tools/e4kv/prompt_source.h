// What `calibrate` and `compare` share: turning corpus documents (io/corpus.h) into token ids with
// the model's tokenizer and chat template, read from the model directory only when a document
// needs them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "core/status.h"
#include "io/corpus.h"
#include "io/tokenizer.h"

namespace e4kv {
class ChatTemplate;
}

namespace e4kv::cli {

// The help of --special-tokens-in-content, the flag of every command that renders messages.
inline constexpr const char* kSpecialTokensInContentHelp =
    "Let text in a message that spells a control token (e.g. <|im_end|>) become that token, as "
    "encoding the output of transformers' apply_chat_template does; by default a message's text "
    "is always encoded as text, so it cannot fake a role boundary";

class PromptSource {
 public:
  // special_tokens_in_content: text in a message that spells a control token becomes that token
  // (ChatRenderOptions::special_tokens_in_content); by default it is encoded as text.
  explicit PromptSource(std::filesystem::path model_dir, bool special_tokens_in_content = false);
  ~PromptSource();
  PromptSource(PromptSource&&) noexcept;

  // The document's ids: text encoded with special tokens (as transformers' encode); token ids as
  // they are; messages rendered with the chat template (add_generation_prompt when the last
  // message is not the assistant's) and encoded without adding special tokens (the template
  // writes them), control tokens matched only in the template's own text. Errors say what is
  // missing (a tokenizer, a chat template) or wrong (ids outside [0, vocab_size) among them),
  // without the document's place: callers add "FILE:LINE: ".
  Result<std::vector<int32_t>> ids(const CorpusDocument& doc, int64_t vocab_size);

  // The tokenizer, loaded on first use; an error when the model directory has none.
  Result<const Tokenizer*> tokenizer();

 private:
  std::filesystem::path model_dir_;
  bool special_tokens_in_content_ = false;
  std::optional<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
};

}  // namespace e4kv::cli
