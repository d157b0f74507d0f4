// Library errors about one option (Status::option_error) name the option as the library does:
// "top_p: must be in (0, 1]". The command line says it its own way: "--top-p: must be in (0, 1]".
// A flag is "--" and the option's name with dashes, except where the command line shortens it.
#pragma once

#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <utility>

#include "core/status.h"

namespace e4kv::cli {

inline std::string flag_for_option(std::string_view option) {
  static constexpr std::array<std::pair<std::string_view, std::string_view>, 3> kShortened{{
      {"scales_path", "--scales"},
      {"out_dir", "--out"},
      {"kv_scales_mode", "--kv-scales"},
  }};
  for (const auto& [name, flag] : kShortened) {
    if (name == option) return std::string(flag);
  }
  std::string flag = "--" + std::string(option);
  std::replace(flag.begin() + 2, flag.end(), '_', '-');
  return flag;
}

// The message as the command line prints it.
inline std::string cli_message(const Status& status) {
  if (status.option().empty()) return status.message();
  return cat(flag_for_option(status.option()), ": ", status.detail());
}

}  // namespace e4kv::cli
