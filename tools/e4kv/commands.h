// Subcommands of the e4kv program, one file each. Each add_*_command registers a subcommand whose
// callback stores its outcome in `result`; main prints a failed Status as one line and exits 1.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "core/status.h"

namespace e4kv::cli {

// `status` with its message folded onto one line (main prints it after "e4kv: error: ").
inline Status one_line(Status status) {
  if (status.ok()) return status;
  std::string message = status.message();
  for (char& c : message) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return Status::error(message);
}

void add_inspect_command(CLI::App& app, Status& result);
void add_synth_command(CLI::App& app, Status& result);
void add_capacity_command(CLI::App& app, Status& result);
void add_synth_stats_command(CLI::App& app, Status& result);
// The calibration statistics of real forwards (cmd_calibrate.cpp).
void add_calibrate_command(CLI::App& app, Status& result);
// FP16 KV against E4M3 KV on the same tokens (cmd_compare.cpp).
void add_compare_command(CLI::App& app, Status& result);
void add_summarize_command(CLI::App& app, Status& result);
void add_overlay_command(CLI::App& app, Status& result);
void add_verify_command(CLI::App& app, Status& result);
// tokenize and detokenize (cmd_tokenize.cpp).
void add_tokenize_commands(CLI::App& app, Status& result);
// The dense model runtime (cmd_generate.cpp, cmd_logits.cpp).
void add_generate_command(CLI::App& app, Status& result);
void add_logits_command(CLI::App& app, Status& result);
// The serving benchmark through the engine (cmd_bench.cpp).
void add_bench_command(CLI::App& app, Status& result);
// The OpenAI-compatible server (cmd_serve.cpp).
void add_serve_command(CLI::App& app, Status& result);

}  // namespace e4kv::cli
