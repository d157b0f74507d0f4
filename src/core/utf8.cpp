#include "core/utf8.h"

#include <cstdint>

namespace e4kv {

// The sequence at text[pos] (pos < size), judged as the Unicode standard's "maximal subpart"
// practice does (what Rust's from_utf8_lossy and Python's decode(errors="replace") follow).
Utf8Step utf8_step(std::string_view text, size_t pos) {
  const auto b0 = static_cast<uint8_t>(text[pos]);
  if (b0 < 0x80) return {1, true, false};
  size_t need = 0;
  uint8_t lo = 0x80;
  uint8_t hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 == 0xE0) {
    need = 2;
    lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    need = 2;
  } else if (b0 == 0xED) {
    need = 2;
    hi = 0x9F;
  } else if (b0 == 0xF0) {
    need = 3;
    lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    need = 3;
  } else if (b0 == 0xF4) {
    need = 3;
    hi = 0x8F;
  } else {
    return {1, false, false};
  }
  size_t length = 1;
  for (size_t k = 0; k < need; ++k) {
    if (pos + length >= text.size()) return {length, false, true};
    const auto b = static_cast<uint8_t>(text[pos + length]);
    if (b < (k == 0 ? lo : 0x80) || b > (k == 0 ? hi : 0xBF)) return {length, false, false};
    ++length;
  }
  return {length, true, false};
}

// The code point of the valid sequence at text[pos].
char32_t utf8_decode(std::string_view text, size_t pos, size_t length) {
  const auto b0 = static_cast<uint8_t>(text[pos]);
  if (length == 1) return b0;
  char32_t cp = b0 & (0x7F >> length);
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[pos + k]) & 0x3F);
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::optional<size_t> first_invalid_utf8(std::string_view text) {
  for (size_t pos = 0; pos < text.size();) {
    const Utf8Step step = utf8_step(text, pos);
    if (!step.valid) return pos;
    pos += step.length;
  }
  return std::nullopt;
}

bool is_valid_utf8(std::string_view text) {
  return !first_invalid_utf8(text).has_value();
}

// Appends `bytes` to `out` with every maximal invalid subpart replaced by U+FFFD. With `final`
// false, a valid but incomplete sequence at the very end is left for later; returns the number of
// bytes consumed.
size_t append_lossy_utf8(std::string_view bytes, bool final, std::string& out) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    const Utf8Step step = utf8_step(bytes, pos);
    if (step.valid) {
      out.append(bytes.substr(pos, step.length));
    } else {
      if (step.truncated && !final) return pos;
      out.append(kReplacementUtf8);
    }
    pos += step.length;
  }
  return pos;
}

std::string to_valid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  append_lossy_utf8(text, true, out);
  return out;
}

}  // namespace e4kv
