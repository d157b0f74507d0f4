// Hugging Face tokenizer.json: loading, encode, decode and streaming decode. The pipeline follows
// the `tokenizers` library step by step (io/tokenizer.h lists what is supported); each section
// below is one stage: UTF-8, the byte-level alphabet, regexes, normalizers, pre-tokenizers, the BPE
// model, added tokens, the post-processor, the decoder chain, then loading.
#include "io/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#if E4KV_HAVE_ICU
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#endif

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <queue>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "core/json.h"
#include "core/utf8.h"

namespace e4kv {
namespace {

using json = nlohmann::json;

// Ids above this are certainly a broken file (real vocabularies stay below 1M); refusing them keeps
// the per-id tables small.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;
// The BPE cache keeps the merges of short pre-tokens (words); long ones (a SentencePiece-style
// tokenizer BPE-encodes whole lines) are rarely repeated.
constexpr size_t kBpeCacheMaxEntries = size_t{1} << 16;
constexpr size_t kBpeCacheMaxPieceBytes = 256;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
template <class T>
using StringMap = std::unordered_map<std::string, T, StringHash, std::equal_to<>>;

// The length of the (valid) character at text[pos].
size_t char_length(std::string_view text, size_t pos) {
  return utf8_step(text, pos).length;
}

// Unicode White_Space: what Rust's char::is_whitespace and its regex crate's \s test.
bool is_white_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// ---- Byte-level alphabet ------------------------------------------------------------------------

// GPT-2's reversible byte <-> character table: the printable bytes stand for themselves, the other
// 68 bytes take the characters from U+0100 on, in byte order. Byte-level vocabularies spell their
// tokens in these characters (a space is "Ġ", U+0120).
struct ByteAlphabet {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the character standing for each byte
  std::array<int16_t, 512> char_to_byte;      // code point -> byte, -1 for other characters
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet = [] {
    ByteAlphabet a;
    a.char_to_byte.fill(-1);
    char32_t next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t cp = printable ? static_cast<char32_t>(b) : next_extra++;
      append_utf8(a.byte_to_char[b], cp);
      a.char_to_byte[cp] = static_cast<int16_t>(b);
    }
    E4KV_ASSERT(next_extra == 256 + 68, "the byte-level alphabet maps 68 bytes above U+00FF");
    return a;
  }();
  return alphabet;
}

std::string bytes_to_byte_level(std::string_view text) {
  const ByteAlphabet& alphabet = byte_alphabet();
  std::string out;
  out.reserve(text.size() * 2);
  for (char c : text) out += alphabet.byte_to_char[static_cast<uint8_t>(c)];
  return out;
}

// ---- Regexes and patterns -----------------------------------------------------------------------

struct Span {
  size_t start = 0;
  size_t end = 0;
};

// A PCRE2 regex compiled with UTF and UCP (\s, \w, \d and POSIX classes read Unicode properties,
// as Oniguruma's do in `tokenizers`), JIT-compiled when the library has a JIT.
class Regex {
 public:
  static Result<std::shared_ptr<const Regex>> compile(std::string_view pattern) {
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error_code, message, sizeof(message));
      return Status::error(cat("is not a valid regex (PCRE2: ", reinterpret_cast<char*>(message),
                               " at offset ", error_offset, ")"));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // an interpreter run when no JIT is available
    return std::shared_ptr<const Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends every match in `text` (valid UTF-8), left to right and non-overlapping, as the
  // Oniguruma iterator of `tokenizers` finds them: an empty match right where the previous match
  // ended is skipped. A match that fails for resource limits ends the search (the rest of the
  // text stays unmatched).
  void find_all(std::string_view text, std::vector<Span>& out) const {
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    E4KV_ASSERT(data != nullptr, "PCRE2 match data allocation failed");
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t search_from = 0;
    size_t last_match_end = std::numeric_limits<size_t>::max();
    while (search_from <= text.size()) {
      int rc =
          pcre2_match(code_, subject, text.size(), search_from, PCRE2_NO_UTF_CHECK, data, nullptr);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        rc = pcre2_match(code_, subject, text.size(), search_from,
                         PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, data, nullptr);
      }
      if (rc < 0) break;
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
      const size_t start = ovector[0];
      const size_t end = std::max(ovector[0], ovector[1]);
      if (start == end && end == last_match_end) {
        search_from += search_from < text.size() ? char_length(text, search_from) : 1;
        continue;
      }
      out.push_back({start, end});
      search_from = end;
      last_match_end = end;
    }
    pcre2_match_data_free(data);
  }

  // Whether the regex matches at the very start of `text`.
  bool matches_at_start(std::string_view text) const {
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    E4KV_ASSERT(data != nullptr, "PCRE2 match data allocation failed");
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0,
                               PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, data, nullptr);
    pcre2_match_data_free(data);
    return rc >= 0;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

// GPT-2's pre-tokenizer regex: what a ByteLevel pre-tokenizer with use_regex splits on.
const Regex& gpt2_regex() {
  static const std::shared_ptr<const Regex> regex = [] {
    auto compiled = Regex::compile(
        R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
    E4KV_ASSERT(compiled.ok(), "the GPT-2 regex compiles");
    return compiled.value();
  }();
  return *regex;
}

// A character of Rust's Unicode \w (what an added token's single_word option tests).
bool is_word_char_at(std::string_view text) {
  static const std::shared_ptr<const Regex> regex = [] {
    auto compiled = Regex::compile(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])");
    E4KV_ASSERT(compiled.ok(), "the word-character class compiles");
    return compiled.value();
  }();
  return !text.empty() && regex->matches_at_start(text);
}

// The pattern of a Split pre-tokenizer or a Replace normalizer / decoder: {"String": s} (a
// literal) or {"Regex": r}.
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;  // null for a literal

  void find_all(std::string_view text, std::vector<Span>& out) const {
    if (regex) {
      regex->find_all(text, out);
      return;
    }
    for (size_t pos = text.find(literal); pos != std::string_view::npos;
         pos = text.find(literal, pos + literal.size())) {
      out.push_back({pos, pos + literal.size()});
    }
  }
};

// Every match of `pattern` in `text` replaced by `content`.
std::string replace_all(const Pattern& pattern, std::string_view text, std::string_view content) {
  std::vector<Span> matches;
  pattern.find_all(text, matches);
  if (matches.empty()) return std::string(text);
  std::string out;
  out.reserve(text.size());
  size_t prev = 0;
  for (const Span& m : matches) {
    out.append(text.substr(prev, m.start - prev));
    out.append(content);
    prev = m.end;
  }
  out.append(text.substr(prev));
  return out;
}

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Cuts a text of `size` bytes as the `tokenizers` NormalizedString::split does: `matches` are a
// pattern's matches in order, `invert` swaps matched and unmatched parts, `behavior` says where a
// matched part goes. Appends every non-empty part kept.
void split_spans(size_t size, const std::vector<Span>& matches, bool invert, SplitBehavior behavior,
                 std::vector<Span>& parts) {
  struct Part {
    Span span;
    bool is_match;
  };
  std::vector<Part> all;
  all.reserve(matches.size() * 2 + 1);
  size_t prev = 0;
  for (const Span& m : matches) {
    if (prev != m.start) all.push_back({{prev, m.start}, invert});
    all.push_back({m, !invert});
    prev = m.end;
  }
  if (prev != size || all.empty()) all.push_back({{prev, size}, invert});

  std::vector<Span> kept;
  kept.reserve(all.size());
  bool prev_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Part& p : all) kept.push_back(p.span);
      break;
    case SplitBehavior::kRemoved:
      for (const Part& p : all) {
        if (!p.is_match) kept.push_back(p.span);
      }
      break;
    case SplitBehavior::kContiguous:
      for (const Part& p : all) {
        if (!kept.empty() && p.is_match == prev_match) {
          kept.back().end = p.span.end;
        } else {
          kept.push_back(p.span);
        }
        prev_match = p.is_match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Part& p : all) {
        if (!kept.empty() && p.is_match && !prev_match) {
          kept.back().end = p.span.end;
        } else {
          kept.push_back(p.span);
        }
        prev_match = p.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = all.rbegin(); it != all.rend(); ++it) {
        if (!kept.empty() && it->is_match && !prev_match) {
          kept.back().start = it->span.start;
        } else {
          kept.push_back(it->span);
        }
        prev_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  for (const Span& s : kept) {
    if (s.end > s.start) parts.push_back(s);
  }
}

// ---- Normalizers --------------------------------------------------------------------------------

enum class NormalizerKind { kPrepend, kReplace, kStrip, kNfc, kNfd, kNfkc, kNfkd, kLowercase };

struct NormalizerStep {
  NormalizerKind kind = NormalizerKind::kPrepend;
  std::string text;  // Prepend: the prefix; Replace: the replacement
  Pattern pattern;   // Replace
  bool strip_left = false;
  bool strip_right = false;
};

std::string strip_white_space(std::string_view text, bool left, bool right) {
  size_t begin = 0;
  size_t end = text.size();
  if (left) {
    while (begin < end) {
      const Utf8Step step = utf8_step(text, begin);
      if (!is_white_space(utf8_decode(text, begin, step.length))) break;
      begin += step.length;
    }
  }
  if (right) {
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
      if (!is_white_space(utf8_decode(text, start, end - start))) break;
      end = start;
    }
  }
  return std::string(text.substr(begin, end - begin));
}

#if E4KV_HAVE_ICU
// NFC / NFD / NFKC / NFKD and full Unicode lowercasing (with final sigma, as Rust's to_lowercase)
// through ICU. ASCII text is left as is by all four normalizations.
std::string icu_transform(std::string_view text, NormalizerKind kind) {
  const bool ascii =
      std::all_of(text.begin(), text.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; });
  if (ascii) {
    std::string out(text);
    if (kind == NormalizerKind::kLowercase) {
      for (char& c : out) {
        if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      }
    }
    return out;
  }
  UErrorCode status = U_ZERO_ERROR;
  int32_t length16 = 0;
  u_strFromUTF8(nullptr, 0, &length16, text.data(), static_cast<int32_t>(text.size()), &status);
  status = U_ZERO_ERROR;
  std::u16string source(static_cast<size_t>(length16), u'\0');
  u_strFromUTF8(source.data(), length16, nullptr, text.data(), static_cast<int32_t>(text.size()),
                &status);
  E4KV_ASSERT(U_SUCCESS(status), cat("ICU UTF-8 to UTF-16 failed: ", u_errorName(status)));

  std::u16string result(source.size() * 4 + 16, u'\0');
  int32_t result_length = 0;
  for (int attempt = 0; attempt < 2; ++attempt) {
    status = U_ZERO_ERROR;
    if (kind == NormalizerKind::kLowercase) {
      result_length = u_strToLower(result.data(), static_cast<int32_t>(result.size()),
                                   source.data(), static_cast<int32_t>(source.size()), "", &status);
    } else {
      const UNormalizer2* normalizer = nullptr;
      UErrorCode instance_status = U_ZERO_ERROR;
      switch (kind) {
        case NormalizerKind::kNfc:
          normalizer = unorm2_getNFCInstance(&instance_status);
          break;
        case NormalizerKind::kNfd:
          normalizer = unorm2_getNFDInstance(&instance_status);
          break;
        case NormalizerKind::kNfkc:
          normalizer = unorm2_getNFKCInstance(&instance_status);
          break;
        default:
          normalizer = unorm2_getNFKDInstance(&instance_status);
          break;
      }
      E4KV_ASSERT(U_SUCCESS(instance_status), "ICU normalizer instance");
      result_length =
          unorm2_normalize(normalizer, source.data(), static_cast<int32_t>(source.size()),
                           result.data(), static_cast<int32_t>(result.size()), &status);
    }
    if (status != U_BUFFER_OVERFLOW_ERROR) break;
    result.assign(static_cast<size_t>(result_length) + 1, u'\0');
  }
  E4KV_ASSERT(U_SUCCESS(status), cat("ICU transform failed: ", u_errorName(status)));

  int32_t length8 = 0;
  status = U_ZERO_ERROR;
  u_strToUTF8(nullptr, 0, &length8, result.data(), result_length, &status);
  std::string out(static_cast<size_t>(length8), '\0');
  status = U_ZERO_ERROR;
  u_strToUTF8(out.data(), length8, nullptr, result.data(), result_length, &status);
  E4KV_ASSERT(U_SUCCESS(status), cat("ICU UTF-16 to UTF-8 failed: ", u_errorName(status)));
  return out;
}
#endif

std::string normalize(const std::vector<NormalizerStep>& steps, std::string text) {
  for (const NormalizerStep& step : steps) {
    switch (step.kind) {
      case NormalizerKind::kPrepend:
        if (!text.empty()) text.insert(0, step.text);
        break;
      case NormalizerKind::kReplace:
        text = replace_all(step.pattern, text, step.text);
        break;
      case NormalizerKind::kStrip:
        text = strip_white_space(text, step.strip_left, step.strip_right);
        break;
      default:
#if E4KV_HAVE_ICU
        text = icu_transform(text, step.kind);
#else
        E4KV_ASSERT(false, "Unicode normalizers are refused at load without ICU");
#endif
        break;
    }
  }
  return text;
}

// ---- Pre-tokenizers -----------------------------------------------------------------------------

enum class PrependScheme { kAlways, kFirst, kNever };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace };
  Kind kind = Kind::kSplit;
  // Split (a Digits pre-tokenizer is a Split on \p{N} or \p{N}+)
  Pattern pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // ByteLevel
  bool add_prefix_space = true;
  bool use_regex = true;
  // Metaspace
  std::string replacement;
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
};

// A piece of text on its way to the model. at_start: the piece begins where the input begins
// (Metaspace's prepend_scheme "first" prepends only there).
struct Piece {
  std::string text;
  bool at_start = false;
};

void split_piece(const Piece& piece, const std::vector<Span>& matches, bool invert,
                 SplitBehavior behavior, std::vector<Piece>& out) {
  std::vector<Span> parts;
  split_spans(piece.text.size(), matches, invert, behavior, parts);
  for (const Span& s : parts) {
    out.push_back({piece.text.substr(s.start, s.end - s.start), piece.at_start && s.start == 0});
  }
}

void pre_tokenize(const std::vector<PreTokenizerStep>& steps, std::vector<Piece>& pieces) {
  std::vector<Piece> next;
  std::vector<Span> matches;
  for (const PreTokenizerStep& step : steps) {
    next.clear();
    for (Piece& piece : pieces) {
      matches.clear();
      switch (step.kind) {
        case PreTokenizerStep::Kind::kSplit:
          step.pattern.find_all(piece.text, matches);
          split_piece(piece, matches, step.invert, step.behavior, next);
          break;
        case PreTokenizerStep::Kind::kByteLevel:
          if (step.add_prefix_space && !piece.text.starts_with(' ')) piece.text.insert(0, " ");
          if (step.use_regex) {
            gpt2_regex().find_all(piece.text, matches);
            const size_t first = next.size();
            split_piece(piece, matches, false, SplitBehavior::kIsolated, next);
            for (size_t i = first; i < next.size(); ++i) {
              next[i].text = bytes_to_byte_level(next[i].text);
            }
          } else if (!piece.text.empty()) {
            next.push_back({bytes_to_byte_level(piece.text), piece.at_start});
          }
          break;
        case PreTokenizerStep::Kind::kMetaspace: {
          Piece replaced{replace_all(Pattern{" ", nullptr}, piece.text, step.replacement),
                         piece.at_start};
          const bool prepend =
              !replaced.text.starts_with(step.replacement) &&
              (step.prepend_scheme == PrependScheme::kAlways ||
               (step.prepend_scheme == PrependScheme::kFirst && replaced.at_start));
          if (prepend) replaced.text.insert(0, step.replacement);
          if (step.split) {
            Pattern{step.replacement, nullptr}.find_all(replaced.text, matches);
            split_piece(replaced, matches, false, SplitBehavior::kMergedWithNext, next);
          } else if (!replaced.text.empty()) {
            next.push_back(std::move(replaced));
          }
          break;
        }
      }
    }
    pieces.swap(next);
  }
}

// ---- BPE model ----------------------------------------------------------------------------------

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Byte-pair encoding of one pre-token, as the `tokenizers` BPE model does: each character becomes
// a symbol (its vocabulary entry, else its "<0xNN>" byte tokens under byte_fallback, else the unk
// token, fused with a preceding unk under fuse_unk, else nothing); then the pair with the lowest
// merge rank is merged, leftmost first on ties, until no pair has a merge. A min-heap over
// (rank, position) with lazily discarded stale entries makes this O(n log n) per pre-token.
class BpeModel {
 public:
  StringMap<int32_t> vocab;
  // (left id, right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
  std::array<int32_t, 256> byte_token_ids{};  // "<0xNN>" ids, -1 when absent

  void tokenize(std::string_view piece, std::vector<int32_t>& out) const {
    if (piece.empty()) return;
    if (ignore_merges) {
      if (auto it = vocab.find(piece); it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    const bool cacheable = piece.size() <= kBpeCacheMaxPieceBytes;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (auto it = cache_.find(piece); it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids = merge_word(piece);
    out.insert(out.end(), ids.begin(), ids.end());
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (cache_.size() >= kBpeCacheMaxEntries) cache_.clear();
      cache_.emplace(std::string(piece), std::move(ids));
    }
  }

 private:
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t length;  // bytes of the piece it covers; 0 once merged into its left neighbour
  };
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  struct LaterCandidate {  // the priority queue's "less": lower rank, then leftmost, comes first
    bool operator()(const Candidate& a, const Candidate& b) const {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    }
  };

  std::vector<int32_t> merge_word(std::string_view piece) const {
    std::vector<Symbol> symbols;
    symbols.reserve(piece.size());
    auto add = [&symbols](int32_t id, uint32_t length) {
      const auto index = static_cast<int32_t>(symbols.size());
      if (!symbols.empty()) symbols.back().next = index;
      symbols.push_back({id, index - 1, -1, length});
    };
    // A run of unknown characters waiting to become one unk symbol (fuse_unk) or several.
    int32_t pending_unk_id = -1;
    uint32_t pending_unk_length = 0;
    auto flush_unk = [&]() {
      if (pending_unk_id >= 0) add(pending_unk_id, pending_unk_length);
      pending_unk_id = -1;
      pending_unk_length = 0;
    };
    std::string symbol;
    for (size_t pos = 0; pos < piece.size();) {
      const size_t length = char_length(piece, pos);
      const bool is_first = pos == 0;
      const bool is_last = pos + length >= piece.size();
      symbol.clear();
      if (!is_first) symbol += continuing_subword_prefix;
      symbol.append(piece.substr(pos, length));
      if (is_last) symbol += end_of_word_suffix;
      pos += length;

      if (auto it = vocab.find(symbol); it != vocab.end()) {
        flush_unk();
        add(it->second, static_cast<uint32_t>(length));
        continue;
      }
      if (byte_fallback) {
        const bool all_bytes = std::all_of(symbol.begin(), symbol.end(), [this](char c) {
          return byte_token_ids[static_cast<uint8_t>(c)] >= 0;
        });
        if (all_bytes) {
          // note: like `tokenizers`, a pending unk is not flushed here and lands after the bytes.
          for (char c : symbol) add(byte_token_ids[static_cast<uint8_t>(c)], 1);
          continue;
        }
      }
      if (unk_id) {
        if (pending_unk_id >= 0 && fuse_unk) {
          pending_unk_length += static_cast<uint32_t>(length);
        } else {
          flush_unk();
          pending_unk_id = *unk_id;
          pending_unk_length = static_cast<uint32_t>(length);
        }
      }
    }
    flush_unk();

    std::priority_queue<Candidate, std::vector<Candidate>, LaterCandidate> queue;
    auto find_merge = [this](int32_t left, int32_t right) -> const std::pair<uint32_t, int32_t>* {
      auto it = merges.find(pair_key(left, right));
      return it == merges.end() ? nullptr : &it->second;
    };
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      if (const auto* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
        queue.push({m->first, static_cast<int32_t>(i), m->second});
      }
    }
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (left.length == 0 || left.next < 0) continue;
      const int32_t right_pos = left.next;
      const Symbol right = symbols[right_pos];
      const auto* current = find_merge(left.id, right.id);
      if (current == nullptr || current->second != top.new_id) continue;  // a stale entry

      left.id = top.new_id;
      left.length += right.length;
      left.next = right.next;
      symbols[right_pos].length = 0;
      if (right.next >= 0) symbols[right.next].prev = top.pos;
      if (left.prev >= 0) {
        if (const auto* m = find_merge(symbols[left.prev].id, left.id)) {
          queue.push({m->first, left.prev, m->second});
        }
      }
      if (left.next >= 0) {
        if (const auto* m = find_merge(left.id, symbols[left.next].id)) {
          queue.push({m->first, top.pos, m->second});
        }
      }
    }
    std::vector<int32_t> ids;
    ids.reserve(symbols.size());
    for (const Symbol& s : symbols) {
      if (s.length != 0) ids.push_back(s.id);
    }
    return ids;
  }

  mutable std::mutex cache_mutex_;
  mutable StringMap<std::vector<int32_t>> cache_;
};

// ---- Added tokens -------------------------------------------------------------------------------

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Finds added tokens in a text: leftmost match first, the longest at that position (the
// Aho-Corasick "leftmost longest" search of `tokenizers`), over a byte trie.
class TokenMatcher {
 public:
  struct Match {
    size_t start;
    size_t end;
    size_t token;  // index into the added tokens
  };

  void add(std::string_view pattern, size_t token) {
    if (pattern.empty()) return;
    first_byte_[static_cast<uint8_t>(pattern[0])] = true;
    int32_t node = 0;
    for (char c : pattern) {
      const uint64_t key = edge_key(node, c);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        it = edges_.emplace(key, static_cast<int32_t>(terminal_.size())).first;
        terminal_.push_back(-1);
      }
      node = it->second;
    }
    if (terminal_[node] < 0) terminal_[node] = static_cast<int64_t>(token);  // the first one wins
  }

  bool empty() const { return edges_.empty(); }

  // `allowed(match)` drops candidates (the longest allowed one at the leftmost start wins).
  template <typename Allowed>
  std::optional<Match> find(std::string_view text, size_t from, const Allowed& allowed) const {
    for (size_t start = from; start < text.size(); ++start) {
      if (!first_byte_[static_cast<uint8_t>(text[start])]) continue;
      int32_t node = 0;
      std::optional<Match> best;
      for (size_t pos = start; pos < text.size(); ++pos) {
        auto it = edges_.find(edge_key(node, text[pos]));
        if (it == edges_.end()) break;
        node = it->second;
        if (terminal_[node] < 0) continue;
        const Match match{start, pos + 1, static_cast<size_t>(terminal_[node])};
        if (allowed(match)) best = match;
      }
      if (best) return best;
    }
    return std::nullopt;
  }

 private:
  static uint64_t edge_key(int32_t node, char c) {
    return (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(c);
  }
  std::unordered_map<uint64_t, int32_t> edges_;
  std::vector<int64_t> terminal_{-1};  // per node: the token ending there, -1 for none
  std::array<bool, 256> first_byte_{};
};

// A stretch of text, or an added token (id >= 0) found in it. `plain`: byte ranges of `text`
// where special added tokens must not match (see Tokenizer::encode).
struct Segment {
  std::string text;
  int32_t id = -1;
  bool at_start = false;
  PlainRanges plain;
};

// The part of `ranges` inside [begin, end), shifted to start at 0.
PlainRanges cut_ranges(const PlainRanges& ranges, size_t begin, size_t end) {
  PlainRanges out;
  for (const auto& [b, e] : ranges) {
    const size_t from = std::max(b, begin);
    const size_t to = std::min(e, end);
    if (from < to) out.emplace_back(from - begin, to - begin);
  }
  return out;
}

bool overlaps_any(const PlainRanges& ranges, size_t begin, size_t end) {
  for (const auto& [b, e] : ranges) {
    if (b < end && begin < e) return true;
  }
  return false;
}

size_t trailing_white_space_start(std::string_view text) {
  size_t start = text.size();
  while (start > 0) {
    size_t prev = start - 1;
    while (prev > 0 && (static_cast<uint8_t>(text[prev]) & 0xC0) == 0x80) --prev;
    if (!is_white_space(utf8_decode(text, prev, start - prev))) break;
    start = prev;
  }
  return start;
}

size_t leading_white_space_length(std::string_view text) {
  size_t end = 0;
  while (end < text.size()) {
    const size_t length = char_length(text, end);
    if (!is_white_space(utf8_decode(text, end, length))) break;
    end += length;
  }
  return end;
}

bool ends_with_word_char(std::string_view text) {
  if (text.empty()) return false;
  size_t start = text.size() - 1;
  while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
  return is_word_char_at(text.substr(start));
}

// Splits `text` around the added tokens `matcher` finds, as AddedVocabulary::find_matches does:
// a single_word token must not touch word characters (a rejected match is skipped over, not
// searched again one byte later), lstrip / rstrip pull the white space on that side into the
// token.
// A special token matches only where it overlaps none of `plain` (byte ranges of `text`); the
// stretches of text between matches carry their part of `plain` along.
void split_on_added_tokens(const std::string& text, bool at_start, const PlainRanges& plain,
                           const TokenMatcher& matcher, const std::vector<AddedToken>& tokens,
                           std::vector<Segment>& out) {
  if (text.empty()) return;
  if (matcher.empty()) {
    out.push_back({text, -1, at_start, plain});
    return;
  }
  auto allowed = [&](const TokenMatcher::Match& m) {
    return !tokens[m.token].special || !overlaps_any(plain, m.start, m.end);
  };
  size_t start_offset = 0;
  size_t search_from = 0;
  while (std::optional<TokenMatcher::Match> m = matcher.find(text, search_from, allowed)) {
    search_from = m->end;
    const AddedToken& token = tokens[m->token];
    size_t start = m->start;
    size_t stop = m->end;
    const std::string_view view(text);
    if (token.single_word) {
      const bool space_before = start == 0 || !ends_with_word_char(view.substr(0, start));
      const bool space_after = stop == text.size() || !is_word_char_at(view.substr(stop));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) start = trailing_white_space_start(view.substr(0, start));
    start = std::max(start, start_offset);
    if (token.rstrip) stop += leading_white_space_length(view.substr(stop));
    if (start_offset < start) {
      out.push_back({text.substr(start_offset, start - start_offset), -1,
                     at_start && start_offset == 0, cut_ranges(plain, start_offset, start)});
    }
    out.push_back({std::string(), token.id, false, {}});
    start_offset = stop;
  }
  if (start_offset < text.size()) {
    out.push_back({text.substr(start_offset), -1, at_start && start_offset == 0,
                   cut_ranges(plain, start_offset, text.size())});
  }
}

// ---- Decoder chain ------------------------------------------------------------------------------

struct DecodeStep {
  enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace, kByteLevel };
  Kind kind = Kind::kFuse;
  // The tokens reaching this step are already one fused string (after Fuse or ByteLevel), which
  // the streaming decoder receives a piece at a time.
  bool fused_input = false;
  Pattern pattern;         // Replace
  std::string content;     // Replace: the replacement; Strip: the character; Metaspace: replacement
  size_t strip_start = 0;  // Strip
  size_t strip_stop = 0;
  bool strip_first_token = false;  // Metaspace: prepend_scheme is not "never"
};

struct DecoderChain {
  bool present = false;  // no decoder: tokens are joined with single spaces
  std::vector<DecodeStep> steps;
};

std::optional<uint8_t> byte_token_value(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(token[3]);
  const int lo = hex(token[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

// A token's bytes for the ByteLevel decoder: its characters mapped back through the byte-level
// alphabet, or its own UTF-8 bytes when any character is outside the alphabet.
void append_byte_level_bytes(std::string_view token, std::string& out) {
  const ByteAlphabet& alphabet = byte_alphabet();
  const size_t mark = out.size();
  for (size_t pos = 0; pos < token.size();) {
    const Utf8Step step = utf8_step(token, pos);
    const char32_t cp = utf8_decode(token, pos, step.length);
    if (cp >= alphabet.char_to_byte.size() || alphabet.char_to_byte[cp] < 0) {
      out.resize(mark);
      out.append(token);
      return;
    }
    out += static_cast<char>(alphabet.char_to_byte[cp]);
    pos += step.length;
  }
}

std::string metaspace_decode_token(std::string_view token, std::string_view replacement,
                                   bool drop_replacement) {
  std::string out;
  out.reserve(token.size());
  for (size_t pos = 0; pos < token.size();) {
    if (token.substr(pos).starts_with(replacement)) {
      if (!drop_replacement) out += ' ';
      pos += replacement.size();
    } else {
      const size_t length = char_length(token, pos);
      out.append(token.substr(pos, length));
      pos += length;
    }
  }
  return out;
}

// The Strip decoder on one token: up to `start` leading and then up to `stop` trailing copies of
// the character `c` removed.
std::string strip_decode_token(std::string_view token, std::string_view c, size_t start,
                               size_t stop) {
  size_t begin = 0;
  for (size_t k = 0; k < start && token.substr(begin).starts_with(c); ++k) begin += c.size();
  size_t end = token.size();
  for (size_t k = 0; k < stop && end - begin >= c.size() && token.substr(0, end).ends_with(c);
       ++k) {
    end -= c.size();
  }
  return std::string(token.substr(begin, end - begin));
}

// Whole-list decoding, step for step as the `tokenizers` decoders do (decode_chain), then joined
// ("" after a decoder, " " without one).
std::string decode_batch(const DecoderChain& chain, std::vector<std::string> tokens) {
  for (const DecodeStep& step : chain.steps) {
    std::vector<std::string> next;
    next.reserve(tokens.size());
    switch (step.kind) {
      case DecodeStep::Kind::kReplace:
        for (const std::string& t : tokens)
          next.push_back(replace_all(step.pattern, t, step.content));
        break;
      case DecodeStep::Kind::kByteFallback: {
        std::string bytes;
        auto flush = [&]() {
          if (bytes.empty()) return;
          if (is_valid_utf8(bytes)) {
            next.push_back(bytes);
          } else {
            for (size_t i = 0; i < bytes.size(); ++i) next.emplace_back(kReplacementUtf8);
          }
          bytes.clear();
        };
        for (std::string& t : tokens) {
          if (std::optional<uint8_t> byte = byte_token_value(t)) {
            bytes += static_cast<char>(*byte);
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        flush();
        break;
      }
      case DecodeStep::Kind::kFuse: {
        std::string fused;
        for (const std::string& t : tokens) fused += t;
        next.push_back(std::move(fused));
        break;
      }
      case DecodeStep::Kind::kStrip:
        for (const std::string& t : tokens) {
          next.push_back(strip_decode_token(t, step.content, step.strip_start, step.strip_stop));
        }
        break;
      case DecodeStep::Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          next.push_back(
              metaspace_decode_token(tokens[i], step.content, i == 0 && step.strip_first_token));
        }
        break;
      case DecodeStep::Kind::kByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) append_byte_level_bytes(t, bytes);
        std::string text;
        append_lossy_utf8(bytes, true, text);
        next.push_back(std::move(text));
        break;
      }
    }
    tokens.swap(next);
  }
  std::string out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0 && !chain.present) out += ' ';
    out += tokens[i];
  }
  return out;
}

}  // namespace

// The decoder chain run incrementally. Every step hands on only what no later token can change:
// ByteFallback holds a run of byte tokens until a token that is not a byte ends it (the run
// decodes as a whole: valid UTF-8, else one U+FFFD per byte), ByteLevel holds an incomplete UTF-8
// tail, Strip holds trailing characters it may still remove, and a Replace after Fuse holds a
// tail that may begin a match. Steps after Fuse / ByteLevel receive the single fused token a
// piece at a time.
class DecodeStream {
 public:
  explicit DecodeStream(const DecoderChain& chain) : chain_(&chain), states_(chain.steps.size()) {}

  void push(std::string_view token) { deliver(0, token); }

  // Ends the stream: every step hands on what it holds.
  void finish() {
    for (size_t i = 0; i < states_.size(); ++i) flush(i);
  }

  std::string take() { return std::exchange(output_, std::string()); }

 private:
  struct StepState {
    std::string held;            // bytes or text waiting for more input
    size_t tokens_seen = 0;      // Metaspace: tokens received
    size_t leading_removed = 0;  // Strip after Fuse: leading characters removed so far
    bool leading_done = false;   // Strip after Fuse: past the leading characters
    size_t trailing_held = 0;    // Strip after Fuse: trailing characters held back
  };

  // Hands `text` to step `index`: a whole token, or more of the fused token when that step's input
  // is fused. index == steps: the output.
  void deliver(size_t index, std::string_view text) {
    if (index == chain_->steps.size()) {
      if (!chain_->present && tokens_out_++ > 0) output_ += ' ';
      output_.append(text);
      return;
    }
    const DecodeStep& step = chain_->steps[index];
    StepState& state = states_[index];
    if (step.fused_input && text.empty()) return;
    switch (step.kind) {
      case DecodeStep::Kind::kReplace:
        if (!step.fused_input) {
          deliver(index + 1, replace_all(step.pattern, text, step.content));
        } else {
          state.held.append(text);
          replace_fused(index, false);
        }
        break;
      case DecodeStep::Kind::kByteFallback:
        if (std::optional<uint8_t> byte = byte_token_value(text)) {
          state.held += static_cast<char>(*byte);
        } else {
          flush_bytes(index);
          deliver(index + 1, text);
        }
        break;
      case DecodeStep::Kind::kFuse:
        deliver(index + 1, text);
        break;
      case DecodeStep::Kind::kStrip:
        if (!step.fused_input) {
          deliver(index + 1,
                  strip_decode_token(text, step.content, step.strip_start, step.strip_stop));
        } else {
          strip_fused(index, text);
        }
        break;
      case DecodeStep::Kind::kMetaspace: {
        const bool first = step.fused_input || state.tokens_seen++ == 0;
        deliver(index + 1,
                metaspace_decode_token(text, step.content, first && step.strip_first_token));
        break;
      }
      case DecodeStep::Kind::kByteLevel: {
        append_byte_level_bytes(text, state.held);
        std::string ready;
        const size_t consumed = append_lossy_utf8(state.held, false, ready);
        state.held.erase(0, consumed);
        deliver(index + 1, ready);
        break;
      }
    }
  }

  void flush(size_t index) {
    const DecodeStep& step = chain_->steps[index];
    StepState& state = states_[index];
    switch (step.kind) {
      case DecodeStep::Kind::kReplace:
        if (step.fused_input) replace_fused(index, true);
        break;
      case DecodeStep::Kind::kByteFallback:
        flush_bytes(index);
        break;
      case DecodeStep::Kind::kByteLevel: {
        std::string rest;
        append_lossy_utf8(state.held, true, rest);
        state.held.clear();
        deliver(index + 1, rest);
        break;
      }
      default:
        break;  // Strip drops the trailing characters it holds
    }
  }

  void flush_bytes(size_t index) {
    std::string bytes = std::exchange(states_[index].held, std::string());
    if (bytes.empty()) return;
    if (is_valid_utf8(bytes)) {
      deliver(index + 1, bytes);
    } else {
      for (size_t i = 0; i < bytes.size(); ++i) deliver(index + 1, kReplacementUtf8);
    }
  }

  // Replace on the fused token: hands on the held text with every match replaced, except a tail
  // that may still begin a match (all of it when `final`).
  void replace_fused(size_t index, bool final) {
    const DecodeStep& step = chain_->steps[index];
    std::string& held = states_[index].held;
    const std::string& pattern = step.pattern.literal;
    std::string ready;
    size_t pos = 0;
    while (pos < held.size()) {
      if (held.compare(pos, pattern.size(), pattern) == 0) {
        ready += step.content;
        pos += pattern.size();
      } else if (!final && held.size() - pos < pattern.size() &&
                 pattern.compare(0, held.size() - pos, held, pos) == 0) {
        break;
      } else {
        ready += held[pos++];
      }
    }
    held.erase(0, pos);
    deliver(index + 1, ready);
  }

  // Strip on the fused token: the first strip_start copies of the character at the very start
  // are dropped; trailing copies (up to strip_stop) are held until another character follows.
  void strip_fused(size_t index, std::string_view text) {
    const DecodeStep& step = chain_->steps[index];
    StepState& state = states_[index];
    const std::string& c = step.content;
    std::string ready;
    for (size_t pos = 0; pos < text.size();) {
      const size_t length = char_length(text, pos);
      const std::string_view ch = text.substr(pos, length);
      pos += length;
      if (!state.leading_done) {
        if (state.leading_removed < step.strip_start && ch == c) {
          ++state.leading_removed;
          continue;
        }
        state.leading_done = true;
      }
      if (step.strip_stop == 0) {
        ready.append(ch);
      } else if (ch == c) {
        if (state.trailing_held == step.strip_stop) {
          ready.append(c);
        } else {
          ++state.trailing_held;
        }
      } else {
        for (; state.trailing_held > 0; --state.trailing_held) ready.append(c);
        ready.append(ch);
      }
    }
    deliver(index + 1, ready);
  }

  const DecoderChain* chain_;
  std::vector<StepState> states_;
  size_t tokens_out_ = 0;
  std::string output_;
};

namespace {

// ---- tokenizer.json reading ---------------------------------------------------------------------

std::string describe(const json& value) {
  return cat(value.type_name(), " ", json_excerpt(value, 48));
}

// One JSON value of a file and its path in it ("pre_tokenizer.pretokenizers[1].type"); errors
// name the file and the path. A missing key reads as an absent node.
class Node {
 public:
  Node(const json* value, const std::string* source, std::string path)
      : value_(value), source_(source), path_(std::move(path)) {}

  bool present() const { return value_ != nullptr; }
  bool is_null() const { return value_ == nullptr || value_->is_null(); }
  const json& value() const { return *value_; }
  const std::string& path() const { return path_; }

  Node operator[](std::string_view key) const {
    std::string child_path = path_.empty() ? std::string(key) : cat(path_, ".", key);
    if (value_ == nullptr || !value_->is_object()) return Node(nullptr, source_, child_path);
    auto it = value_->find(key);
    return Node(it == value_->end() ? nullptr : &*it, source_, child_path);
  }
  Node at(size_t i) const { return Node(&(*value_)[i], source_, cat(path_, "[", i, "]")); }

  Status error(std::string_view what) const {
    return Status::error(cat(*source_, ": \"", path_, "\" ", what));
  }
  Status missing() const {
    return Status::error(cat(*source_, ": required field \"", path_, "\" is missing"));
  }
  Status bad_value(std::string_view expected) const {
    if (value_ == nullptr) return missing();
    return error(cat("must be ", expected, ", got ", describe(*value_)));
  }

  Result<std::string> string() const {
    if (value_ == nullptr || !value_->is_string()) return bad_value("a string");
    return value_->get<std::string>();
  }
  // A string, or nullopt for null / absent.
  Result<std::optional<std::string>> opt_string() const {
    if (is_null()) return std::optional<std::string>();
    E4KV_ASSIGN_OR_RETURN(std::string text, string());
    return std::optional<std::string>(std::move(text));
  }
  // One character, as serde reads a Rust `char`; returned as its UTF-8.
  Result<std::string> character() const {
    E4KV_ASSIGN_OR_RETURN(std::string text, string());
    if (text.empty() || char_length(text, 0) != text.size()) {
      return bad_value("a string of one character");
    }
    return text;
  }
  Result<bool> boolean(bool default_value) const {
    if (is_null()) return default_value;
    if (!value_->is_boolean()) return bad_value("true or false");
    return value_->get<bool>();
  }
  Result<int64_t> integer(int64_t min, int64_t max) const {
    if (value_ != nullptr && value_->is_number_integer()) {
      if (value_->is_number_unsigned()) {
        const auto u = value_->get<uint64_t>();
        if (u <= static_cast<uint64_t>(max) && static_cast<int64_t>(u) >= min) {
          return static_cast<int64_t>(u);
        }
      } else {
        const auto v = value_->get<int64_t>();
        if (v >= min && v <= max) return v;
      }
    }
    return bad_value(cat("an integer in [", min, ", ", max, "]"));
  }
  Result<size_t> array_size() const {
    if (value_ == nullptr || !value_->is_array()) return bad_value("an array");
    return value_->size();
  }
  Status require_object() const {
    if (value_ == nullptr || !value_->is_object()) return bad_value("an object");
    return ok_status();
  }
  Result<std::string> type() const {
    E4KV_RETURN_IF_ERROR(require_object());
    return (*this)["type"].string();
  }
  Status unsupported(std::string_view type, std::string_view supported) const {
    return Status::error(cat(*source_, ": \"", path_, ".type\" \"", type,
                             "\" is not supported by e4kv (supported: ", supported, ")"));
  }

 private:
  const json* value_;
  const std::string* source_;
  std::string path_;
};

Result<Pattern> read_pattern(const Node& node) {
  E4KV_RETURN_IF_ERROR(node.require_object());
  const Node literal = node["String"];
  const Node regex = node["Regex"];
  if (literal.present() == regex.present()) {
    return node.error("must be {\"String\": ...} or {\"Regex\": ...}");
  }
  Pattern pattern;
  if (literal.present()) {
    E4KV_ASSIGN_OR_RETURN(pattern.literal, literal.string());
    if (pattern.literal.empty()) return literal.error("must not be empty");
    return pattern;
  }
  E4KV_ASSIGN_OR_RETURN(std::string text, regex.string());
  if (text.empty()) return regex.error("must not be empty");
  Result<std::shared_ptr<const Regex>> compiled = Regex::compile(text);
  if (!compiled.ok()) return regex.error(compiled.message());
  pattern.literal = std::move(text);
  pattern.regex = std::move(compiled).value();
  return pattern;
}

Result<NormalizerStep> read_replace(const Node& node, bool allow_regex) {
  NormalizerStep step;
  step.kind = NormalizerKind::kReplace;
  E4KV_ASSIGN_OR_RETURN(step.pattern, read_pattern(node["pattern"]));
  E4KV_ASSIGN_OR_RETURN(step.text, node["content"].string());
  if (step.pattern.regex) {
    if (!allow_regex) {
      return node["pattern"].error(
          "must be a String pattern: a Replace decoder after Fuse / ByteLevel sees the fused text "
          "a piece at a time, which e4kv supports for literal patterns only");
    }
    // note: capture-group references ("$1") in the replacement are not expanded.
    for (size_t i = 0; i + 1 < step.text.size(); ++i) {
      const char next = step.text[i + 1];
      if (step.text[i] == '$' && ((next >= '0' && next <= '9') || next == '{')) {
        return node["content"].error("uses a capture-group reference, which e4kv does not expand");
      }
    }
  }
  return step;
}

Status read_normalizer(const Node& node, std::vector<NormalizerStep>& steps) {
  if (node.is_null()) return ok_status();
  E4KV_ASSIGN_OR_RETURN(std::string type, node.type());
  if (type == "Sequence") {
    const Node list = node["normalizers"];
    E4KV_ASSIGN_OR_RETURN(size_t n, list.array_size());
    for (size_t i = 0; i < n; ++i) E4KV_RETURN_IF_ERROR(read_normalizer(list.at(i), steps));
    return ok_status();
  }
  if (type == "Prepend") {
    NormalizerStep step;
    step.kind = NormalizerKind::kPrepend;
    E4KV_ASSIGN_OR_RETURN(step.text, node["prepend"].string());
    steps.push_back(std::move(step));
    return ok_status();
  }
  if (type == "Replace") {
    E4KV_ASSIGN_OR_RETURN(NormalizerStep step, read_replace(node, true));
    steps.push_back(std::move(step));
    return ok_status();
  }
  if (type == "Strip") {
    NormalizerStep step;
    step.kind = NormalizerKind::kStrip;
    E4KV_ASSIGN_OR_RETURN(step.strip_left, node["strip_left"].boolean(true));
    E4KV_ASSIGN_OR_RETURN(step.strip_right, node["strip_right"].boolean(true));
    steps.push_back(std::move(step));
    return ok_status();
  }
  const std::map<std::string, NormalizerKind, std::less<>> unicode = {
      {"NFC", NormalizerKind::kNfc},
      {"NFD", NormalizerKind::kNfd},
      {"NFKC", NormalizerKind::kNfkc},
      {"NFKD", NormalizerKind::kNfkd},
      {"Lowercase", NormalizerKind::kLowercase}};
  if (auto it = unicode.find(type); it != unicode.end()) {
#if E4KV_HAVE_ICU
    NormalizerStep step;
    step.kind = it->second;
    steps.push_back(std::move(step));
    return ok_status();
#else
    return node.error(cat("is a ", type,
                          " normalizer, which needs Unicode tables: this e4kv was built without "
                          "ICU (install libicu-dev and rebuild)"));
#endif
  }
  return node.unsupported(type,
                          "Sequence, Prepend, Replace, Strip, NFC, NFD, NFKC, NFKD, Lowercase");
}

Result<SplitBehavior> read_behavior(const Node& node) {
  E4KV_ASSIGN_OR_RETURN(std::string name, node.string());
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return node.error(cat("\"", name,
                        "\" is not a split behavior (Removed, Isolated, MergedWithPrevious, "
                        "MergedWithNext, Contiguous)"));
}

// Metaspace's replacement and prepend_scheme, also in the older add_prefix_space spelling.
Status read_metaspace(const Node& node, std::string& replacement, PrependScheme& scheme) {
  E4KV_ASSIGN_OR_RETURN(replacement, node["replacement"].character());
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> scheme_name,
                        node["prepend_scheme"].opt_string());
  scheme = PrependScheme::kAlways;
  if (scheme_name) {
    if (*scheme_name == "always") {
      scheme = PrependScheme::kAlways;
    } else if (*scheme_name == "first") {
      scheme = PrependScheme::kFirst;
    } else if (*scheme_name == "never") {
      scheme = PrependScheme::kNever;
    } else {
      return node["prepend_scheme"].error(
          cat("\"", *scheme_name, "\" is not a prepend scheme (always, first, never)"));
    }
  }
  E4KV_ASSIGN_OR_RETURN(bool add_prefix_space, node["add_prefix_space"].boolean(true));
  if (!add_prefix_space) {
    if (scheme_name && scheme != PrependScheme::kNever) {
      return node["add_prefix_space"].error("is false but prepend_scheme is not \"never\"");
    }
    scheme = PrependScheme::kNever;
  }
  return ok_status();
}

Status read_pre_tokenizer(const Node& node, std::vector<PreTokenizerStep>& steps) {
  if (node.is_null()) return ok_status();
  E4KV_ASSIGN_OR_RETURN(std::string type, node.type());
  PreTokenizerStep step;
  if (type == "Sequence") {
    const Node list = node["pretokenizers"];
    E4KV_ASSIGN_OR_RETURN(size_t n, list.array_size());
    for (size_t i = 0; i < n; ++i) E4KV_RETURN_IF_ERROR(read_pre_tokenizer(list.at(i), steps));
    return ok_status();
  }
  if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    E4KV_ASSIGN_OR_RETURN(step.pattern, read_pattern(node["pattern"]));
    E4KV_ASSIGN_OR_RETURN(step.behavior, read_behavior(node["behavior"]));
    E4KV_ASSIGN_OR_RETURN(step.invert, node["invert"].boolean(false));
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    E4KV_ASSIGN_OR_RETURN(step.add_prefix_space, node["add_prefix_space"].boolean(true));
    E4KV_ASSIGN_OR_RETURN(step.use_regex, node["use_regex"].boolean(true));
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    E4KV_RETURN_IF_ERROR(read_metaspace(node, step.replacement, step.prepend_scheme));
    E4KV_ASSIGN_OR_RETURN(step.split, node["split"].boolean(true));
  } else if (type == "Digits") {
    // Digits splits off numeric characters: each alone, or runs of them together.
    E4KV_ASSIGN_OR_RETURN(bool individual, node["individual_digits"].boolean(false));
    step.kind = PreTokenizerStep::Kind::kSplit;
    auto regex = Regex::compile(individual ? R"(\p{N})" : R"(\p{N}+)");
    E4KV_ASSERT(regex.ok(), "the digit regexes compile");
    step.pattern.regex = std::move(regex).value();
    step.behavior = SplitBehavior::kIsolated;
  } else {
    return node.unsupported(type, "Sequence, Split, ByteLevel, Metaspace, Digits");
  }
  steps.push_back(std::move(step));
  return ok_status();
}

Status read_decoder(const Node& node, DecoderChain& chain, bool& fused) {
  E4KV_ASSIGN_OR_RETURN(std::string type, node.type());
  DecodeStep step;
  step.fused_input = fused;
  if (type == "Sequence") {
    const Node list = node["decoders"];
    E4KV_ASSIGN_OR_RETURN(size_t n, list.array_size());
    for (size_t i = 0; i < n; ++i) E4KV_RETURN_IF_ERROR(read_decoder(list.at(i), chain, fused));
    return ok_status();
  }
  if (type == "Replace") {
    E4KV_ASSIGN_OR_RETURN(NormalizerStep replace, read_replace(node, !fused));
    step.kind = DecodeStep::Kind::kReplace;
    step.pattern = std::move(replace.pattern);
    step.content = std::move(replace.text);
  } else if (type == "ByteFallback") {
    if (fused) return node.error("is a ByteFallback after Fuse / ByteLevel, which e4kv refuses");
    step.kind = DecodeStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecodeStep::Kind::kFuse;
    fused = true;
  } else if (type == "Strip") {
    step.kind = DecodeStep::Kind::kStrip;
    E4KV_ASSIGN_OR_RETURN(step.content, node["content"].character());
    E4KV_ASSIGN_OR_RETURN(int64_t start, node["start"].integer(0, 1 << 20));
    E4KV_ASSIGN_OR_RETURN(int64_t stop, node["stop"].integer(0, 1 << 20));
    step.strip_start = static_cast<size_t>(start);
    step.strip_stop = static_cast<size_t>(stop);
  } else if (type == "Metaspace") {
    step.kind = DecodeStep::Kind::kMetaspace;
    PrependScheme scheme = PrependScheme::kAlways;
    E4KV_RETURN_IF_ERROR(read_metaspace(node, step.content, scheme));
    step.strip_first_token = scheme != PrependScheme::kNever;
  } else if (type == "ByteLevel") {
    if (fused)
      return node.error("is a ByteLevel decoder after Fuse / ByteLevel, which e4kv refuses");
    step.kind = DecodeStep::Kind::kByteLevel;
    fused = true;
  } else {
    return node.unsupported(type,
                            "Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace");
  }
  chain.steps.push_back(std::move(step));
  return ok_status();
}

}  // namespace

// ---- The tokenizer ------------------------------------------------------------------------------

class TokenizerImpl {
 public:
  std::string source;
  BpeModel model;
  std::vector<AddedToken> added;  // in file order
  StringMap<int32_t> added_by_content;
  TokenMatcher raw_matcher;         // added tokens matched in the raw text
  TokenMatcher normalized_matcher;  // added tokens matched after normalization
  bool has_normalized_special = false;  // a special token is in normalized_matcher
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  // The post-processor reduced to what it adds around the sequence.
  std::vector<int32_t> post_prefix;
  std::vector<int32_t> post_suffix;
  DecoderChain decoder;

  // Per id: its string (an added token's content first) and flags.
  std::vector<std::string> id_text;
  std::vector<uint8_t> id_flags;
  static constexpr uint8_t kHasText = 1;
  static constexpr uint8_t kSpecial = 2;  // its string is a special token's content

  std::optional<int32_t> bos;
  std::optional<int32_t> eos;

  bool valid_id(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < id_flags.size() && (id_flags[id] & kHasText);
  }

  std::vector<int32_t> encode(std::string_view input, bool add_special_tokens,
                              const PlainRanges& input_plain) const {
    std::string text;
    PlainRanges plain;
    if (is_valid_utf8(input)) {
      text = std::string(input);
      plain = input_plain;
    } else {
      // Repairing the UTF-8 moves bytes: repair the stretches inside and outside the plain ranges
      // one by one, so the ranges keep covering what they covered.
      size_t at = 0;
      for (const auto& [b, e] : input_plain) {
        const size_t begin = std::clamp(b, at, input.size());
        const size_t end = std::clamp(e, begin, input.size());
        text += to_valid_utf8(input.substr(at, begin - at));
        const size_t plain_begin = text.size();
        text += to_valid_utf8(input.substr(begin, end - begin));
        if (plain_begin < text.size()) plain.emplace_back(plain_begin, text.size());
        at = end;
      }
      text += to_valid_utf8(input.substr(at));
    }
    std::vector<int32_t> ids;
    if (add_special_tokens) ids = post_prefix;
    std::vector<Segment> raw_segments;
    split_on_added_tokens(text, true, plain, raw_matcher, added, raw_segments);
    std::vector<Segment> segments;
    std::vector<Piece> pieces;
    for (Segment& raw : raw_segments) {
      if (raw.id >= 0) {
        ids.push_back(raw.id);
        continue;
      }
      const PlainRanges normalized_plain = has_normalized_special && !raw.plain.empty()
                                               ? normalized_ranges(raw.text, raw.plain)
                                               : PlainRanges();
      const std::string normalized = normalize(normalizer, std::move(raw.text));
      segments.clear();
      split_on_added_tokens(normalized, raw.at_start, normalized_plain, normalized_matcher, added,
                            segments);
      for (Segment& segment : segments) {
        if (segment.id >= 0) {
          ids.push_back(segment.id);
          continue;
        }
        pieces.clear();
        pieces.push_back({std::move(segment.text), segment.at_start});
        pre_tokenize(pre_tokenizer, pieces);
        for (const Piece& piece : pieces) model.tokenize(piece.text, ids);
      }
    }
    if (add_special_tokens) ids.insert(ids.end(), post_suffix.begin(), post_suffix.end());
    return ids;
  }

  // The plain ranges of `text` carried over to normalize(text). A normalizer rewrites the text
  // (prepends, replaces, strips, recomposes), so offset x is carried over as the length of the
  // normalized prefix text[0, x), or the common prefix of the two where that is not a prefix of
  // the whole. White space at the end of a range is left out: a special token's normalized form
  // may start with what the normalizer makes of a space (SentencePiece's "▁"), and a space spells
  // no token. Only tokenizers with normalized special tokens (rare: special tokens are usually
  // matched in the raw text) need this.
  PlainRanges normalized_ranges(const std::string& text, const PlainRanges& plain) const {
    const std::string whole = normalize(normalizer, text);
    auto carried = [&](size_t x) -> size_t {
      const std::string prefix = normalize(normalizer, text.substr(0, x));
      size_t common = 0;
      while (common < prefix.size() && common < whole.size() && prefix[common] == whole[common]) {
        ++common;
      }
      return common;
    };
    PlainRanges out;
    for (const auto& [b, e] : plain) {
      const size_t kept_end =
          b + trailing_white_space_start(std::string_view(text).substr(b, e - b));
      if (kept_end == b) continue;
      const size_t begin = carried(b);
      const size_t end = std::max(begin, carried(kept_end));
      if (begin == end) continue;
      if (!out.empty() && out.back().second >= begin) {
        out.back().second = std::max(out.back().second, end);
      } else {
        out.emplace_back(begin, end);
      }
    }
    return out;
  }

  // The strings decode() hands to the decoder chain.
  bool token_for_decode(int32_t id, bool skip_special_tokens, std::string_view& token) const {
    if (!valid_id(id)) return false;
    if (skip_special_tokens && (id_flags[id] & kSpecial)) return false;
    token = id_text[id];
    return true;
  }

  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    std::string_view token;
    for (int32_t id : ids) {
      if (token_for_decode(id, skip_special_tokens, token)) tokens.emplace_back(token);
    }
    return decode_batch(decoder, std::move(tokens));
  }

  std::optional<int32_t> token_to_id(std::string_view token) const {
    if (auto it = added_by_content.find(token); it != added_by_content.end()) return it->second;
    if (auto it = model.vocab.find(token); it != model.vocab.end()) return it->second;
    return std::nullopt;
  }

  Status load(const json& root);

 private:
  Status load_model(const Node& node);
  Status load_added_tokens(const Node& node);
  Status load_post_processor(const Node& node, std::vector<int32_t>& prefix,
                             std::vector<int32_t>& suffix);
  Status build_id_tables();
};

Status TokenizerImpl::load_model(const Node& node) {
  E4KV_RETURN_IF_ERROR(node.require_object());
  const Node type_node = node["type"];
  if (type_node.present()) {
    E4KV_ASSIGN_OR_RETURN(std::string type, type_node.string());
    if (type != "BPE") return node.unsupported(type, "BPE");
  }
  const Node dropout = node["dropout"];
  if (!dropout.is_null() &&
      !(dropout.value().is_number() && dropout.value().get<double>() == 0.0)) {
    return dropout.error(
        cat("must be null (e4kv encodes deterministically), got ", describe(dropout.value())));
  }

  const Node vocab = node["vocab"];
  E4KV_RETURN_IF_ERROR(vocab.require_object());
  model.vocab.reserve(vocab.value().size());
  for (const auto& [token, id_value] : vocab.value().items()) {
    const Node entry(&id_value, &source, cat(vocab.path(), "[", json(token).dump(), "]"));
    E4KV_ASSIGN_OR_RETURN(int64_t id, entry.integer(0, kMaxTokenId));
    model.vocab.emplace(token, static_cast<int32_t>(id));
  }

  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> unk, node["unk_token"].opt_string());
  if (unk) {
    auto it = model.vocab.find(*unk);
    if (it == model.vocab.end()) {
      return node["unk_token"].error(cat("\"", *unk, "\" is not in model.vocab"));
    }
    model.unk_id = it->second;
  }
  E4KV_ASSIGN_OR_RETURN(model.fuse_unk, node["fuse_unk"].boolean(false));
  E4KV_ASSIGN_OR_RETURN(model.byte_fallback, node["byte_fallback"].boolean(false));
  E4KV_ASSIGN_OR_RETURN(model.ignore_merges, node["ignore_merges"].boolean(false));
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> prefix,
                        node["continuing_subword_prefix"].opt_string());
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> suffix, node["end_of_word_suffix"].opt_string());
  model.continuing_subword_prefix = prefix.value_or("");
  model.end_of_word_suffix = suffix.value_or("");
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = model.vocab.find(std::string_view(name));
    model.byte_token_ids[b] = it == model.vocab.end() ? -1 : it->second;
  }

  const Node merges = node["merges"];
  E4KV_ASSIGN_OR_RETURN(size_t n_merges, merges.array_size());
  if (n_merges > std::numeric_limits<uint32_t>::max()) return merges.error("has too many entries");
  model.merges.reserve(n_merges);
  for (size_t rank = 0; rank < n_merges; ++rank) {
    const Node merge = merges.at(rank);
    std::string left;
    std::string right;
    if (merge.value().is_string()) {
      // The older "a b" form: exactly two parts around one space.
      const std::string line = merge.value().get<std::string>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        return merge.error(cat("must be two tokens separated by one space, got \"", line, "\""));
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.value().is_array() && merge.value().size() == 2 &&
               merge.value()[0].is_string() && merge.value()[1].is_string()) {
      left = merge.value()[0].get<std::string>();
      right = merge.value()[1].get<std::string>();
    } else {
      return merge.bad_value("\"a b\" or [\"a\", \"b\"]");
    }
    auto find = [this](const std::string& token) -> std::optional<int32_t> {
      auto it = model.vocab.find(token);
      return it == model.vocab.end() ? std::nullopt : std::optional<int32_t>(it->second);
    };
    const std::optional<int32_t> left_id = find(left);
    const std::optional<int32_t> right_id = find(right);
    if (!left_id || !right_id) {
      return merge.error(
          cat("names \"", left_id ? right : left, "\", which is not in model.vocab"));
    }
    std::string right_tail = right;
    if (!model.continuing_subword_prefix.empty()) {
      if (!right.starts_with(model.continuing_subword_prefix)) {
        return merge.error(cat("\"", right, "\" lacks the continuing_subword_prefix \"",
                               model.continuing_subword_prefix, "\""));
      }
      right_tail = right.substr(model.continuing_subword_prefix.size());
    }
    const std::optional<int32_t> merged = find(left + right_tail);
    if (!merged) {
      return merge.error(cat("makes \"", left + right_tail, "\", which is not in model.vocab"));
    }
    // A repeated pair takes its last rank, as a map built in file order keeps.
    model.merges[pair_key(*left_id, *right_id)] = {static_cast<uint32_t>(rank), *merged};
  }
  return ok_status();
}

Status TokenizerImpl::load_added_tokens(const Node& node) {
  if (node.is_null()) return ok_status();
  E4KV_ASSIGN_OR_RETURN(size_t n, node.array_size());
  for (size_t i = 0; i < n; ++i) {
    const Node entry = node.at(i);
    E4KV_RETURN_IF_ERROR(entry.require_object());
    AddedToken token;
    E4KV_ASSIGN_OR_RETURN(int64_t id, entry["id"].integer(0, kMaxTokenId));
    token.id = static_cast<int32_t>(id);
    E4KV_ASSIGN_OR_RETURN(token.content, entry["content"].string());
    E4KV_ASSIGN_OR_RETURN(token.special, entry["special"].boolean(false));
    E4KV_ASSIGN_OR_RETURN(token.single_word, entry["single_word"].boolean(false));
    E4KV_ASSIGN_OR_RETURN(token.lstrip, entry["lstrip"].boolean(false));
    E4KV_ASSIGN_OR_RETURN(token.rstrip, entry["rstrip"].boolean(false));
    E4KV_ASSIGN_OR_RETURN(token.normalized, entry["normalized"].boolean(!token.special));
    if (token.content.empty()) return entry["content"].error("must not be empty");
    if (auto [it, inserted] = added_by_content.emplace(token.content, token.id); !inserted) {
      if (it->second != token.id) {
        return entry["content"].error(
            cat("\"", token.content, "\" is also added with id ", it->second));
      }
      continue;
    }
    added.push_back(std::move(token));
  }
  // Special tokens first, then the others, each in file order, as `tokenizers` builds its tries.
  std::vector<size_t> order;
  for (size_t i = 0; i < added.size(); ++i) {
    if (added[i].special) order.push_back(i);
  }
  for (size_t i = 0; i < added.size(); ++i) {
    if (!added[i].special) order.push_back(i);
  }
  for (size_t i : order) {
    if (added[i].normalized) {
      normalized_matcher.add(normalize(normalizer, added[i].content), i);
      has_normalized_special = has_normalized_special || added[i].special;
    } else {
      raw_matcher.add(added[i].content, i);
    }
  }
  return ok_status();
}

Status TokenizerImpl::load_post_processor(const Node& node, std::vector<int32_t>& prefix,
                                          std::vector<int32_t>& suffix) {
  if (node.is_null()) return ok_status();
  E4KV_ASSIGN_OR_RETURN(std::string type, node.type());
  auto known_id = [this](const Node& where, const std::string& token, int64_t id) -> Status {
    if (!valid_id(static_cast<int32_t>(id))) {
      return where.error(cat("gives \"", token, "\" id ", id, ", which is not a token"));
    }
    return ok_status();
  };
  if (type == "Sequence") {
    const Node list = node["processors"];
    E4KV_ASSIGN_OR_RETURN(size_t n, list.array_size());
    for (size_t i = 0; i < n; ++i) {
      // Each processor wraps what the previous ones produced.
      std::vector<int32_t> inner_prefix;
      std::vector<int32_t> inner_suffix;
      E4KV_RETURN_IF_ERROR(load_post_processor(list.at(i), inner_prefix, inner_suffix));
      prefix.insert(prefix.begin(), inner_prefix.begin(), inner_prefix.end());
      suffix.insert(suffix.end(), inner_suffix.begin(), inner_suffix.end());
    }
    return ok_status();
  }
  if (type == "ByteLevel") return ok_status();  // trims offsets only
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const Node pair = node[key];
      if (!pair.present() || !pair.value().is_array() || pair.value().size() != 2 ||
          !pair.value()[0].is_string() || !pair.value()[1].is_number_integer()) {
        return pair.bad_value("[token, id]");
      }
      E4KV_ASSIGN_OR_RETURN(int64_t id, pair.at(1).integer(0, kMaxTokenId));
      E4KV_RETURN_IF_ERROR(known_id(pair, pair.value()[0].get<std::string>(), id));
      (std::string_view(key) == "cls" ? prefix : suffix).push_back(static_cast<int32_t>(id));
    }
    return ok_status();
  }
  if (type != "TemplateProcessing") {
    return node.unsupported(type,
                            "ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing, "
                            "Sequence");
  }
  const Node single = node["single"];
  const Node specials = node["special_tokens"];
  E4KV_ASSIGN_OR_RETURN(size_t n, single.array_size());
  bool seen_sequence = false;
  for (size_t i = 0; i < n; ++i) {
    const Node item = single.at(i);
    E4KV_RETURN_IF_ERROR(item.require_object());
    if (item["Sequence"].present()) {
      E4KV_ASSIGN_OR_RETURN(std::string which, item["Sequence"]["id"].string());
      if (which != "A" || seen_sequence) {
        return item.error("must name sequence A once (a single-sequence template)");
      }
      seen_sequence = true;
      continue;
    }
    E4KV_ASSIGN_OR_RETURN(std::string name, item["SpecialToken"]["id"].string());
    const Node special = specials[name];
    if (!special.present()) {
      return item.error(cat("names \"", name, "\", which is not in ", specials.path()));
    }
    const Node ids = special["ids"];
    E4KV_ASSIGN_OR_RETURN(size_t n_ids, ids.array_size());
    for (size_t k = 0; k < n_ids; ++k) {
      E4KV_ASSIGN_OR_RETURN(int64_t id, ids.at(k).integer(0, kMaxTokenId));
      E4KV_RETURN_IF_ERROR(known_id(ids.at(k), name, id));
      (seen_sequence ? suffix : prefix).push_back(static_cast<int32_t>(id));
    }
  }
  if (!seen_sequence) return single.error("has no {\"Sequence\": {\"id\": \"A\"}} entry");
  return ok_status();
}

Status TokenizerImpl::build_id_tables() {
  int64_t max_id = -1;
  for (const auto& [token, id] : model.vocab) max_id = std::max<int64_t>(max_id, id);
  for (const AddedToken& token : added) max_id = std::max<int64_t>(max_id, token.id);
  id_text.assign(static_cast<size_t>(max_id + 1), std::string());
  id_flags.assign(static_cast<size_t>(max_id + 1), 0);
  // Where two vocabulary entries share an id, the smallest string names it (deterministically).
  std::map<int32_t, const std::string*> by_id;
  for (const auto& [token, id] : model.vocab) {
    auto [it, inserted] = by_id.emplace(id, &token);
    if (!inserted && token < *it->second) it->second = &token;
  }
  for (const auto& [id, token] : by_id) {
    id_text[id] = *token;
    id_flags[id] = kHasText;
  }
  for (const AddedToken& token : added) {
    id_text[token.id] = token.content;
    id_flags[token.id] = kHasText;
  }
  // skip_special_tokens drops ids whose string is a special token's content (what `tokenizers`
  // tests), which is nearly always the special token itself.
  std::set<std::string, std::less<>> special_contents;
  for (const AddedToken& token : added) {
    if (token.special) special_contents.insert(token.content);
  }
  for (size_t id = 0; id < id_text.size(); ++id) {
    if ((id_flags[id] & kHasText) && special_contents.count(id_text[id])) id_flags[id] |= kSpecial;
  }
  return ok_status();
}

Status TokenizerImpl::load(const json& root) {
  const Node top(&root, &source, "");
  E4KV_RETURN_IF_ERROR(top.require_object());
  E4KV_RETURN_IF_ERROR(load_model(top["model"]));
  E4KV_RETURN_IF_ERROR(read_normalizer(top["normalizer"], normalizer));
  E4KV_RETURN_IF_ERROR(load_added_tokens(top["added_tokens"]));
  E4KV_RETURN_IF_ERROR(build_id_tables());
  E4KV_RETURN_IF_ERROR(read_pre_tokenizer(top["pre_tokenizer"], pre_tokenizer));
  E4KV_RETURN_IF_ERROR(load_post_processor(top["post_processor"], post_prefix, post_suffix));
  const Node decoder_node = top["decoder"];
  if (!decoder_node.is_null()) {
    decoder.present = true;
    bool fused = false;
    E4KV_RETURN_IF_ERROR(read_decoder(decoder_node, decoder, fused));
  }
  if (id_text.empty()) return top["model"]["vocab"].error("is empty");
  return ok_status();
}

namespace {


// tokenizer_config.json's bos_token / eos_token: a string, {"content": ...} or null.
Result<std::optional<int32_t>> config_token(const Node& node, const TokenizerImpl& impl) {
  if (node.is_null()) return std::optional<int32_t>();
  std::string token;
  if (node.value().is_object()) {
    E4KV_ASSIGN_OR_RETURN(token, node["content"].string());
  } else {
    E4KV_ASSIGN_OR_RETURN(token, node.string());
  }
  std::optional<int32_t> id = impl.token_to_id(token);
  if (!id) return node.error(cat("\"", token, "\" is not a token of tokenizer.json"));
  return id;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::from_json(std::string_view json_text, const std::string& source) {
  E4KV_ASSIGN_OR_RETURN(const json root, parse_json(json_text, source));
  auto impl = std::make_unique<TokenizerImpl>();
  impl->source = source;
  E4KV_RETURN_IF_ERROR(impl->load(root));
  return Tokenizer(std::move(impl));
}

Result<Tokenizer> Tokenizer::from_model_dir(const std::filesystem::path& model_dir) {
  std::error_code ec;
  const std::filesystem::path path = model_dir / "tokenizer.json";
  if (!std::filesystem::is_directory(model_dir, ec)) {
    return Status::error(cat(model_dir.string(),
                             ": not a directory (expected a Hugging Face model "
                             "directory holding tokenizer.json)"));
  }
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> text_or, read_optional_file(path));
  if (!text_or) {
    return Status::error(cat(path.string(),
                             ": not found (e4kv reads Hugging Face tokenizer.json tokenizers; a "
                             "model with only a SentencePiece tokenizer.model needs converting)"));
  }
  const std::string& text = *text_or;
  E4KV_ASSIGN_OR_RETURN(Tokenizer tokenizer, from_json(text, path.string()));

  const std::filesystem::path config_path = model_dir / "tokenizer_config.json";
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> config_or, read_optional_file(config_path));
  if (!config_or) return tokenizer;
  const std::string& config_text = *config_or;
  const std::string config_source = config_path.string();
  E4KV_ASSIGN_OR_RETURN(const json config, parse_json(config_text, config_source));
  const Node top(&config, &config_source, "");
  E4KV_RETURN_IF_ERROR(top.require_object());
  TokenizerImpl& impl = *tokenizer.impl_;
  E4KV_ASSIGN_OR_RETURN(impl.bos, config_token(top["bos_token"], impl));
  E4KV_ASSIGN_OR_RETURN(impl.eos, config_token(top["eos_token"], impl));
  // add_bos_token / add_eos_token, when given, override what the post-processor adds.
  struct Override {
    const char* key;
    const std::optional<int32_t>& id;
    std::vector<int32_t>& ids;
    bool at_front;
  };
  for (const Override& o : {Override{"add_bos_token", impl.bos, impl.post_prefix, true},
                            Override{"add_eos_token", impl.eos, impl.post_suffix, false}}) {
    const Node flag = top[o.key];
    if (flag.is_null()) continue;
    E4KV_ASSIGN_OR_RETURN(bool add, flag.boolean(false));
    if (!o.id) {
      if (add) return flag.error("is true but the token it adds is not set");
      continue;
    }
    const bool has = !o.ids.empty() && (o.at_front ? o.ids.front() : o.ids.back()) == *o.id;
    if (add && !has) o.ids.insert(o.at_front ? o.ids.begin() : o.ids.end(), *o.id);
    if (!add && has) o.ids.erase(o.at_front ? o.ids.begin() : o.ids.end() - 1);
  }
  return tokenizer;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens, {});
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens,
                                       const PlainRanges& plain) const {
  for (size_t i = 0; i < plain.size(); ++i) {
    E4KV_ASSERT(plain[i].first <= plain[i].second && plain[i].second <= text.size() &&
                    (i == 0 || plain[i - 1].second <= plain[i].first),
                "plain ranges must be sorted, disjoint and inside the text");
  }
  return impl_->encode(text, add_special_tokens, plain);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

int64_t Tokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->id_text.size());
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (!impl_->valid_id(id)) return std::nullopt;
  return impl_->id_text[id];
}

bool Tokenizer::is_special(int32_t id) const {
  return impl_->valid_id(id) && (impl_->id_flags[id] & TokenizerImpl::kSpecial);
}

std::optional<int32_t> Tokenizer::bos_id() const {
  return impl_->bos;
}

std::optional<int32_t> Tokenizer::eos_id() const {
  return impl_->eos;
}

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer),
      skip_special_tokens_(skip_special_tokens),
      stream_(std::make_unique<DecodeStream>(tokenizer.impl_->decoder)) {}
StreamingDecoder::StreamingDecoder(StreamingDecoder&&) noexcept = default;
StreamingDecoder& StreamingDecoder::operator=(StreamingDecoder&&) noexcept = default;
StreamingDecoder::~StreamingDecoder() = default;

std::string StreamingDecoder::push(int32_t id) {
  std::string_view token;
  if (!tokenizer_->impl_->token_for_decode(id, skip_special_tokens_, token)) return std::string();
  stream_->push(token);
  return stream_->take();
}

std::string StreamingDecoder::finish() {
  stream_->finish();
  std::string rest = stream_->take();
  stream_ = std::make_unique<DecodeStream>(tokenizer_->impl_->decoder);
  return rest;
}

}  // namespace e4kv
