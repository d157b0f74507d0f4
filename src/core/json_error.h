// The reason of a JSON library exception without its "[json.exception.kind.N] " prefix and without
// any echoed input: "number overflow parsing '1e400'".
#pragma once

#include <exception>
#include <string>

namespace e4kv {

inline std::string json_exception_reason(const std::exception& e) {
  std::string text = e.what();
  if (text.starts_with("[json.exception.")) {
    if (const size_t end = text.find("] "); end != std::string::npos) text = text.substr(end + 2);
  }
  if (const size_t pos = text.find("; last read:"); pos != std::string::npos) text.resize(pos);
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return text;
}

}  // namespace e4kv
