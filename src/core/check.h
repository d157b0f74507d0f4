// Always-on invariant checks. A failed E4KV_ASSERT is a bug in e4kv, never a user error: it prints
// the condition, file and line and aborts.
#pragma once

#include <string>

namespace e4kv::detail {
[[noreturn]] void assert_fail(const char* condition, const char* file, int line,
                              const std::string& message);
}  // namespace e4kv::detail

#define E4KV_ASSERT(cond, ...)                                                                     \
  do {                                                                                             \
    if (!(cond)) ::e4kv::detail::assert_fail(#cond, __FILE__, __LINE__, std::string(__VA_ARGS__)); \
  } while (0)
