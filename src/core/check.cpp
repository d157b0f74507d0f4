#include "core/check.h"

#include <cstdio>
#include <cstdlib>

namespace e4kv::detail {

void assert_fail(const char* condition, const char* file, int line, const std::string& message) {
  std::fprintf(stderr, "e4kv: internal error: %s:%d: assertion '%s' failed%s%s\n", file, line,
               condition, message.empty() ? "" : ": ", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace e4kv::detail
