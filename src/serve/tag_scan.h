// Byte matching of the ASCII tags the output parsers look for. Tags are ASCII, so a match never
// starts or ends inside a UTF-8 multibyte character and the text around it passes through as is.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace e4kv::serve {

// The length of the longest proper prefix of `tag` that `text` ends with (0 if none): the bytes a
// streaming parser must hold back because the next delta may complete the tag.
inline size_t partial_tag_suffix(std::string_view text, std::string_view tag) {
  const size_t longest = std::min(text.size(), tag.size() - 1);
  for (size_t k = longest; k > 0; --k) {
    if (text.substr(text.size() - k) == tag.substr(0, k)) return k;
  }
  return 0;
}

// Whitespace the parsers drop around tags: what templates put between blocks (ASCII only).
inline bool is_tag_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

}  // namespace e4kv::serve
