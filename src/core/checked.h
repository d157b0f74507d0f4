// Checked integer arithmetic for sizes that come from user input (flags, config.json): a product or
// sum that does not fit returns nullopt, and the caller turns that into an error naming the input.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>

namespace e4kv {

inline std::optional<int64_t> checked_add(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

inline std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// The product of all factors, nullopt when any partial product overflows int64.
inline std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
  }
  return out;
}

// a + b clamped to [INT64_MIN, INT64_MAX] (for "prompt + max new tokens" style bounds that are
// capped afterwards anyway).
inline int64_t saturating_add(int64_t a, int64_t b) {
  int64_t out = 0;
  if (!__builtin_add_overflow(a, b, &out)) return out;
  return b > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
}

}  // namespace e4kv
