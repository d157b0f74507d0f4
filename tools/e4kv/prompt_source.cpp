#include "prompt_source.h"

#include <string>
#include <utility>

#include "chat/chat_template.h"
#include "core/utf8.h"

namespace e4kv::cli {

PromptSource::PromptSource(std::filesystem::path model_dir, bool special_tokens_in_content)
    : model_dir_(std::move(model_dir)), special_tokens_in_content_(special_tokens_in_content) {}
PromptSource::~PromptSource() = default;
PromptSource::PromptSource(PromptSource&&) noexcept = default;

Result<const Tokenizer*> PromptSource::tokenizer() {
  if (!tokenizer_) {
    std::error_code ec;
    if (!std::filesystem::exists(model_dir_ / "tokenizer.json", ec)) {
      return Status::error(cat(model_dir_.string(),
                               " has no tokenizer.json, so text and messages cannot be encoded; "
                               "give {\"token_ids\": [...]} documents instead"));
    }
    E4KV_ASSIGN_OR_RETURN(Tokenizer loaded, Tokenizer::from_model_dir(model_dir_));
    tokenizer_.emplace(std::move(loaded));
  }
  return &*tokenizer_;
}

Result<std::vector<int32_t>> PromptSource::ids(const CorpusDocument& doc, int64_t vocab_size) {
  std::vector<int32_t> out;
  switch (doc.kind) {
    case CorpusKind::kTokenIds:
      out = doc.token_ids;
      break;
    case CorpusKind::kText: {
      if (const std::optional<size_t> bad = first_invalid_utf8(doc.text)) {
        return Status::error(cat("\"text\" is invalid UTF-8 at byte ", *bad));
      }
      E4KV_ASSIGN_OR_RETURN(const Tokenizer* tok, tokenizer());
      out = tok->encode(doc.text, /*add_special_tokens=*/true);
      break;
    }
    case CorpusKind::kMessages: {
      E4KV_ASSIGN_OR_RETURN(const Tokenizer* tok, tokenizer());
      if (!chat_template_) {
        Result<ChatTemplate> loaded = ChatTemplate::load(model_dir_);
        if (!loaded.ok()) return loaded.status();
        chat_template_ = std::make_unique<ChatTemplate>(std::move(loaded).value());
      }
      ChatRenderOptions options;
      options.add_generation_prompt = doc.messages.back().value("role", "") != "assistant";
      options.special_tokens_in_content = special_tokens_in_content_;
      Result<RenderedPrompt> prompt = chat_template_->render_tracked(doc.messages, options);
      if (!prompt.ok()) return prompt.status();
      out = tok->encode(prompt->text, /*add_special_tokens=*/false, prompt->untrusted);
      break;
    }
  }
  if (out.empty()) return Status::error("the document encodes to no tokens");
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] < 0 || out[i] >= vocab_size) {
      return Status::error(cat("token ", i, " is id ", out[i],
                               ", outside the model's vocabulary [0, ", vocab_size, ")"));
    }
  }
  return out;
}

}  // namespace e4kv::cli
