// Numeric flags read strictly. CLI11 2.1 converts an option's text with strtoll / strtoull /
// strtold (base 0), so on its own it reads "010" as octal 8, "0x10" as 16, "-1" as 2^64 - 1 for an
// unsigned flag, clamps "99999999999999999999" to INT64_MAX without a word, and takes "nan",
// "inf" and "1e999" (= inf) for a floating-point flag. The validators below run on the text before
// that conversion (CLI::Option::transform), so every numeric flag is plain decimal:
//   - an integer flag takes an optional '-' (signed types only) and decimal digits that fit its
//     type; the text is rewritten to canonical decimal ("010" -> "10") so CLI11 cannot read it as
//     octal. Hex is refused with the rest: no size or count here needs it, and one rule is easier
//     to state than "hex yes, octal no".
//   - a number flag takes a finite decimal number (std::from_chars' general format: no hex float,
//     no nan/inf, nothing that overflows a double).
// A flag that fails is a usage error: main prints "e4kv: error: --flag: ..." and exits 2. The range
// of a flag's value is its command's business ("--flag: expected ..., got X", exit code 1).
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

#include "api/model_setup.h"
#include "core/status.h"

namespace e4kv::cli {

// The ranges of the token-count, pool and thread flags are the library's (api/model_setup.h:
// kMaxTokenCount, kMaxPoolBytes, kMaxPoolBlocks, kMaxThreads).
// The most sequences --max-seqs reserves for (sequence ids are int32 too).
inline constexpr int64_t kMaxSequences = std::numeric_limits<int32_t>::max();

// The flag's text for an error message: on one line, and short.
inline std::string flag_text_for_message(const std::string& text) {
  std::string out = text.size() > 40 ? text.substr(0, 37) + "..." : text;
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return out;
}

// For an integer flag of type T: ->transform(decimal_integer<T>()), or with the flag's range,
// ->transform(decimal_integer<T>(lo, hi)). A value outside [lo, hi] and one beyond T get the same
// message ("expected LO to HI, got TEXT"), so "99999999999999999999" is not told T's range while
// "5000000000" is told the flag's.
template <typename T>
CLI::Validator decimal_integer(T lo = std::numeric_limits<T>::min(),
                               T hi = std::numeric_limits<T>::max()) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        T value{};
        const char* begin = text.data();
        const char* end = begin + text.size();
        const bool negative = !text.empty() && text[0] == '-';
        const bool digits =
            text.size() > (negative ? 1u : 0u) &&
            text.find_first_not_of("0123456789", negative ? 1 : 0) == std::string::npos;
        if (!digits || (negative && std::is_unsigned_v<T>)) {
          return cat("expected a ", std::is_unsigned_v<T> ? "non-negative " : "",
                     "decimal integer, got \"", flag_text_for_message(text), "\"");
        }
        const auto [ptr, ec] = std::from_chars(begin, end, value, 10);
        if (ec != std::errc() || ptr != end || value < lo || value > hi) {
          return cat("expected ", lo, " to ", hi, ", got ", flag_text_for_message(text));
        }
        text = std::to_string(value);
        return std::string();
      },
      /*validator_desc=*/"", "decimal integer");
}

// For a floating-point flag: ->transform(finite_number()).
inline CLI::Validator finite_number() {
  return CLI::Validator(
      [](const std::string& text) -> std::string {
        double value = 0.0;
        const char* begin = text.data();
        const char* end = begin + text.size();
        const auto [ptr, ec] = std::from_chars(begin, end, value, std::chars_format::general);
        if (ec != std::errc() || ptr != end || !std::isfinite(value)) {
          return cat("expected a finite decimal number, got \"", flag_text_for_message(text), "\"");
        }
        return std::string();
      },
      /*validator_desc=*/"", "finite number");
}

// A comma-separated list of whole numbers in [lo, hi] ("1k" = 1024 where allow_k); errors name the
// flag, the item and the range. For list flags (compare --context, bench --concurrency), which
// CLI11 takes as text.
inline Result<std::vector<int64_t>> parse_list(const std::string& flag, const std::string& text,
                                               bool allow_k, int64_t lo, int64_t hi,
                                               const std::string& what) {
  std::vector<int64_t> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    std::string item = text.substr(begin, end - begin);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    const std::string shown = flag_text_for_message(item);
    int64_t scale = 1;
    if (allow_k && !item.empty() && (item.back() == 'k' || item.back() == 'K')) {
      scale = 1024;
      item.pop_back();
    }
    const bool negative = !item.empty() && item[0] == '-';
    const bool digits = item.size() > (negative ? 1u : 0u) &&
                        item.find_first_not_of("0123456789", negative ? 1 : 0) == std::string::npos;
    if (!digits) {
      return Status::error(cat(flag, ": \"", shown, "\" is not ", what,
                               "; expected a comma-separated list of whole numbers from ", lo, " to ",
                               hi, allow_k ? " (1k = 1024)" : ""));
    }
    int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    const bool in_range = ec == std::errc() && ptr == item.data() + item.size() &&
                          v >= lo / scale && v <= hi / scale;
    if (!in_range || v * scale < lo) {
      return Status::error(cat(flag, ": ", shown, " is outside ", lo, " to ", hi, " (", what, ")"));
    }
    out.push_back(v * scale);
    begin = end + 1;
  }
  return out;
}

}  // namespace e4kv::cli
