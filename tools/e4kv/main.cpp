// e4kv: calibrated FP8 (E4M3) KV cache tools and engine.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "option_flags.h"

int main(int argc, char** argv) {
  CLI::App app{"e4kv: a calibrated FP8 (E4M3) KV cache engine and its tools"};
  app.set_version_flag("--version", std::string("e4kv ") + E4KV_VERSION);
  app.require_subcommand(1);

  e4kv::Status result;
  e4kv::cli::add_inspect_command(app, result);
  e4kv::cli::add_synth_command(app, result);
  e4kv::cli::add_capacity_command(app, result);
  e4kv::cli::add_synth_stats_command(app, result);
  e4kv::cli::add_calibrate_command(app, result);
  e4kv::cli::add_compare_command(app, result);
  e4kv::cli::add_summarize_command(app, result);
  e4kv::cli::add_overlay_command(app, result);
  e4kv::cli::add_verify_command(app, result);
  e4kv::cli::add_tokenize_commands(app, result);
  e4kv::cli::add_generate_command(app, result);
  e4kv::cli::add_logits_command(app, result);
  e4kv::cli::add_bench_command(app, result);
  e4kv::cli::add_serve_command(app, result);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // A bad command line: one line naming the flag, exit code 2 (as usage errors conventionally
    // do).
    std::fprintf(stderr, "e4kv: error: %s (run 'e4kv --help' for usage)\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "e4kv: error: %s\n", e.what());
    return 1;
  }
  if (!result.ok()) {
    std::fprintf(stderr, "e4kv: error: %s\n", e4kv::cli::cli_message(result).c_str());
    return 1;
  }
  return 0;
}
