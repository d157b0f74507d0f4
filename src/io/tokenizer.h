// Hugging Face `tokenizer.json` tokenizers: byte-level BPE (GPT-2 / Llama-3 / Qwen2 style, regex
// pre-tokenizer through PCRE2) and SentencePiece-style BPE with byte fallback (Llama-2 / Mistral
// style), added and special tokens, encode and decode, and a streaming decoder that never emits a
// partial UTF-8 sequence.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace e4kv {

class TokenizerImpl;

class Tokenizer {
 public:
  // Parses tokenizer.json text. `source` names the file in error messages. Unsupported parts
  // (a model type other than BPE, an unknown pre-tokenizer, normalizer or decoder) are errors that
  // name the field.
  static Result<Tokenizer> from_json(std::string_view json_text, const std::string& source);
  // Reads dir/tokenizer.json, and dir/tokenizer_config.json when present (bos/eos tokens,
  // add_bos_token).
  static Result<Tokenizer> from_model_dir(const std::filesystem::path& model_dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text`. Added tokens found in the text are matched first (longest match); the
  // rest is normalized, pre-tokenized and BPE-encoded. add_special_tokens: apply the
  // post-processor (e.g. a BOS token), as transformers' encode(add_special_tokens=True).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  // Text of `ids`. Ids outside the vocabulary decode to nothing... (see implementation notes).
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // Number of ids (model vocabulary plus added tokens): the largest id + 1.
  int64_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's string as stored in the vocabulary (byte-level symbols, not decoded bytes).
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;

 private:
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);
  std::unique_ptr<TokenizerImpl> impl_;
};

// Decodes a stream of generated ids piece by piece: push() returns the text that has become
// complete (never a partial UTF-8 sequence; a byte-fallback or byte-level token that ends
// mid-character is held until the character completes); finish() returns what is left (invalid
// or incomplete bytes as U+FFFD). The concatenation of every push() and finish() equals
// tokenizer.decode(all ids).
class StreamingDecoder {
 public:
  StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
  std::string push(int32_t id);
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> ids_;
  size_t emitted_bytes_ = 0;
};

}  // namespace e4kv
