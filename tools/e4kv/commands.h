// Subcommands of the e4kv program, one file each. Each add_*_command registers a subcommand whose
// callback stores its outcome in `result`; main prints a failed Status as one line and exits 1.
#pragma once

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace e4kv::cli {

void add_inspect_command(CLI::App& app, Status& result);
void add_synth_command(CLI::App& app, Status& result);
void add_capacity_command(CLI::App& app, Status& result);
void add_synth_stats_command(CLI::App& app, Status& result);
void add_summarize_command(CLI::App& app, Status& result);
void add_overlay_command(CLI::App& app, Status& result);
void add_verify_command(CLI::App& app, Status& result);
// tokenize and detokenize (cmd_tokenize.cpp).
void add_tokenize_commands(CLI::App& app, Status& result);
// The dense model runtime (cmd_generate.cpp, cmd_logits.cpp).
void add_generate_command(CLI::App& app, Status& result);
void add_logits_command(CLI::App& app, Status& result);

}  // namespace e4kv::cli
