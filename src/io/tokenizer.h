// Hugging Face `tokenizer.json` tokenizers: byte-level BPE (GPT-2 / Llama-3 / Qwen2 style, regex
// pre-tokenizer through PCRE2) and SentencePiece-style BPE with byte fallback (Llama-2 / Mistral
// style), added and special tokens, encode and decode, and a streaming decoder that never emits a
// partial UTF-8 sequence.
//
// The semantics are those of the `tokenizers` library (what transformers' fast tokenizers run):
// - encode: added tokens that are not "normalized" are matched in the raw text first (leftmost
//   longest, with their lstrip / rstrip / single_word options); the rest is normalized piece by
//   piece, normalized added tokens are matched, the pieces are pre-tokenized and BPE-encoded, and
//   the post-processor adds its special tokens when asked.
// - decode: every id becomes its string (an added token's content first, else the vocabulary
//   entry) and the whole list goes through the decoder chain.
// Supported parts (anything else is an error naming the field and the type):
//   model: BPE (vocab, merges as "a b" or ["a", "b"], unk_token, fuse_unk, byte_fallback,
//     ignore_merges, continuing_subword_prefix, end_of_word_suffix; dropout null or 0)
//   normalizer: Sequence, Prepend, Replace, Strip; NFC, NFD, NFKC, NFKD and Lowercase when e4kv is
//     built with ICU (E4KV_HAVE_ICU), an error naming the build otherwise
//   pre_tokenizer: Sequence, Split (String or Regex pattern, every behavior, invert), ByteLevel,
//     Metaspace, Digits
//   post_processor: ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing, Sequence
//   decoder: Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace
// "truncation" and "padding" are ignored (they shape batches, not ids).
//
// Known differences from `tokenizers` (none matter for real tokenizers): regexes run on PCRE2
// (Unicode 14 tables) instead of Oniguruma, so characters assigned after Unicode 14 and U+180E
// may fall in other classes; a Replace decoder after Fuse takes String patterns only; ByteLevel and
// ByteFallback decoders after a Fuse are refused.
//
// A Tokenizer is immutable after loading; encode and decode may run on several threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace e4kv {

class TokenizerImpl;
class DecodeStream;

// Byte ranges [begin, end) of a text, sorted and disjoint.
using PlainRanges = std::vector<std::pair<size_t, size_t>>;

class Tokenizer {
 public:
  // Parses tokenizer.json text. `source` names the file in error messages. Unsupported parts
  // (a model type other than BPE, an unknown pre-tokenizer, normalizer or decoder) are errors that
  // name the field.
  static Result<Tokenizer> from_json(std::string_view json_text, const std::string& source);
  // Reads dir/tokenizer.json, and dir/tokenizer_config.json when present: bos_token and eos_token
  // (a string or {"content": ...}; they must be tokens of tokenizer.json) give bos_id() and
  // eos_id(); add_bos_token / add_eos_token, when given, decide whether encode(text, true) starts
  // with BOS / ends with EOS, whatever the post-processor says (as transformers' Llama tokenizers
  // do). Without tokenizer_config.json, bos_id() and eos_id() are empty.
  static Result<Tokenizer> from_model_dir(const std::filesystem::path& model_dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text`. Added tokens found in the text are matched first (longest match); the
  // rest is normalized, pre-tokenized and BPE-encoded. add_special_tokens: apply the
  // post-processor (e.g. a BOS token), as transformers' encode(add_special_tokens=True).
  // Invalid UTF-8 in `text` is read as U+FFFD (one per maximal invalid subsequence), as a lossy
  // UTF-8 read does.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  // As encode(text, add_special_tokens), except that a special added token (a control token such
  // as <|im_start|>) is matched only where it overlaps none of `plain`: text there is encoded as
  // ordinary text, whatever it spells. Non-special added tokens match as they do in encode().
  // A chat prompt passes the ranges that came from message content (ChatTemplate::render_tracked),
  // so a message cannot fake a role boundary. Outside the ranges, and with no ranges, the ids are
  // those encode(text, add_special_tokens) gives.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens,
                              const PlainRanges& plain) const;
  // Text of `ids`; always valid UTF-8 (bytes that do not form UTF-8 decode to U+FFFD).
  // skip_special_tokens drops special added tokens. Ids that name no token (negative, >=
  // vocab_size(), or a gap in the vocabulary) decode to nothing, as in the `tokenizers` library:
  // a model whose embedding has more rows than the tokenizer has tokens can sample such ids.
  // Callers that take ids from a user should check them against vocab_size() / id_to_token().
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // Number of ids (model vocabulary plus added tokens): the largest id + 1.
  int64_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's string as stored in the vocabulary (byte-level symbols, not decoded bytes).
  std::optional<std::string> id_to_token(int32_t id) const;
  // A special added token (one that decode(..., skip_special_tokens = true) drops).
  bool is_special(int32_t id) const;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;

 private:
  friend class StreamingDecoder;
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);
  std::unique_ptr<TokenizerImpl> impl_;
};

// Decodes a stream of generated ids piece by piece: push() returns the text that has become
// final (never a partial UTF-8 sequence; a byte-level token that ends mid-character is held until
// the character completes, a run of byte-fallback tokens until a token that is not a byte ends it,
// and text a decoder may still strip (Strip's trailing characters) until it is known to stay);
// finish() returns what is left (invalid or incomplete bytes as U+FFFD) and starts a new stream.
// The concatenation of every push() and finish() equals tokenizer.decode(all ids). Each call
// costs time proportional to the text it returns. The tokenizer must outlive the decoder.
class StreamingDecoder {
 public:
  StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
  StreamingDecoder(StreamingDecoder&&) noexcept;
  StreamingDecoder& operator=(StreamingDecoder&&) noexcept;
  ~StreamingDecoder();

  std::string push(int32_t id);
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::unique_ptr<DecodeStream> stream_;
};

}  // namespace e4kv
