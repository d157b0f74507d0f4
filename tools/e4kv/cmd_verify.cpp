// e4kv verify DIR [--kv-cache-dtype fp8_e4m3]: exit 0 only when engine start-up would accept the
// checkpoint's K/V scales and, for an overlay, its base still has the recorded revision
// (calib/verify.h).
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "calib/verify.h"
#include "commands.h"

namespace e4kv::cli {
namespace {

struct VerifyArgs {
  std::string dir;
  std::string kv_cache_dtype = "fp8_e4m3";
  bool progress = false;
};

Status run_verify(const VerifyArgs& args) {
  VerifyOptions options;
  options.dir = args.dir;
  E4KV_ASSIGN_OR_RETURN(options.dtype, parse_kv_cache_dtype(args.kv_cache_dtype));
  std::optional<HashProgressBar> bar;
  if (args.progress || ::isatty(STDERR_FILENO) == 1) {
    bar.emplace(stderr);
    options.progress = bar->callback();
  }
  Result<VerifyResult> verified = verify_overlay(options);
  bar.reset();
  if (!verified.ok()) return verified.status();
  std::printf(
      "verify %s: ok%s, start-up with --kv-cache-dtype %s would succeed\n", args.dir.c_str(),
      verified->scales.negative_control() ? " (NEGATIVE CONTROL: unit scales, not calibrated)" : "",
      std::string(kv_cache_dtype_name(options.dtype)).c_str());
  std::printf("  %s\n", verified->scales.summary.c_str());
  for (const std::string& note : verified->notes) std::printf("  %s\n", note.c_str());
  return ok_status();
}

}  // namespace

void add_verify_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "verify",
      "Check a checkpoint's K/V scales with the start-up gate and an overlay's provenance "
      "against its base files");
  auto args = std::make_shared<VerifyArgs>();
  cmd->add_option("DIR", args->dir, "The derived (overlay) or plain checkpoint directory")
      ->required();
  cmd->add_option("--kv-cache-dtype", args->kv_cache_dtype,
                  "The KV cache dtype start-up will use: fp8_e4m3 or fp16")
      ->capture_default_str();
  cmd->add_flag("--progress", args->progress,
                "Show the hashing progress bar even when stderr is not a terminal");
  cmd->callback([args, &result] { result = run_verify(*args); });
}

}  // namespace e4kv::cli
