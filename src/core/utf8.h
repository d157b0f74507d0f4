// UTF-8 as the Unicode standard defines it: sequence lengths, validation, lossy repair (each
// maximal invalid subpart becomes U+FFFD, as Rust's from_utf8_lossy and Python's
// decode(errors="replace") do) and encoding of code points.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace e4kv {

inline constexpr std::string_view kReplacementUtf8 = "\xEF\xBF\xBD";  // U+FFFD

struct Utf8Step {
  size_t length = 1;       // bytes of the sequence, or of the maximal invalid subpart
  bool valid = true;       // a complete, valid sequence
  bool truncated = false;  // invalid only because the text ends inside a valid prefix
};

// The sequence at text[pos] (pos < size), judged by the standard's "maximal subpart" practice.
Utf8Step utf8_step(std::string_view text, size_t pos);

// The code point of the valid sequence of `length` bytes at text[pos].
char32_t utf8_decode(std::string_view text, size_t pos, size_t length);

// Appends the UTF-8 bytes of code point `cp` (at most U+10FFFF) to `out`.
void append_utf8(std::string& out, char32_t cp);

bool is_valid_utf8(std::string_view text);

// The byte offset of the first invalid or truncated sequence; nullopt for valid UTF-8.
std::optional<size_t> first_invalid_utf8(std::string_view text);

// Appends `bytes` to `out` with every maximal invalid subpart replaced by U+FFFD. With `final`
// false, a valid but incomplete sequence at the very end is left for later; returns the number of
// bytes consumed.
size_t append_lossy_utf8(std::string_view bytes, bool final, std::string& out);

// `text` with every maximal invalid subpart replaced by U+FFFD.
std::string to_valid_utf8(std::string_view text);

}  // namespace e4kv
