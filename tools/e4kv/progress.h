// What the commands' progress lines share.
#pragma once

#include <cstdio>
#include <string>

namespace e4kv::cli {

// "H:MM:SS" for a duration or an ETA.
inline std::string duration_text(double seconds) {
  const long long s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

}  // namespace e4kv::cli
