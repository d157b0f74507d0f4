// e4kv overlay BASE_DIR --scales scales.json --out DERIVED_DIR: a derived checkpoint that adds the
// calibrated K/V scales to a base without writing into it (calib/overlay.h describes the layout).
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "calib/overlay.h"
#include "commands.h"

namespace e4kv::cli {
namespace {

struct OverlayArgs {
  std::string base_dir;
  std::string scales;
  std::string out_dir;
  std::string link = "symlink";
  std::string hash = "all";
  bool unit_scale_negative_control = false;
  bool replace_embedded_scales = false;
  bool progress = false;
};

Status run_overlay(const OverlayArgs& args) {
  OverlayOptions options;
  options.base_dir = args.base_dir;
  options.scales_path = args.scales;
  options.out_dir = args.out_dir;
  options.unit_scale_negative_control = args.unit_scale_negative_control;
  options.replace_embedded_scales = args.replace_embedded_scales;
  E4KV_ASSIGN_OR_RETURN(options.link, parse_overlay_link_mode(args.link));
  E4KV_ASSIGN_OR_RETURN(options.hash, parse_overlay_hash_scope(args.hash));
  std::optional<HashProgressBar> bar;
  if (args.progress || ::isatty(STDERR_FILENO) == 1) {
    bar.emplace(stderr);
    options.progress = bar->callback();
  }
  Result<OverlayResult> made = make_overlay(options);
  bar.reset();  // finish the progress line before any other output
  if (!made.ok()) return made.status();
  const OverlayResult& r = *made;
  for (const auto& stale : r.removed_stale) {
    std::printf("removed a temporary directory left by an interrupted overlay: %s\n",
                stale.string().c_str());
  }
  std::printf("wrote overlay %s\n", r.out_dir.string().c_str());
  std::printf("  base revision  %s (sha256 of %s)\n", r.base_revision.c_str(),
              r.revision_file.c_str());
  std::printf("  scales         %lld K/V scales, policy %s\n", static_cast<long long>(r.n_scales),
              r.policy.empty() ? "(none given)" : r.policy.c_str());
  std::printf("  %s\n", r.scales.summary.c_str());
  std::printf(
      "  base entries   %lld (%s), %lld files hashed (%s)", static_cast<long long>(r.n_linked),
      std::string(overlay_link_mode_name(options.link)).c_str(), static_cast<long long>(r.n_hashed),
      std::string(overlay_hash_scope_name(options.hash)).c_str());
  if (r.n_size_only > 0) {
    std::printf(", %lld recorded by size only", static_cast<long long>(r.n_size_only));
  }
  std::printf("\n");
  if (options.replace_embedded_scales) {
    std::string shards;
    for (const std::string& shard : r.rewritten_shards)
      shards += cat(shards.empty() ? "" : ", ", shard);
    std::printf("  replaced       %zu K/V scale key(s) embedded in the base%s%s\n",
                r.replaced_keys.size(),
                shards.empty() ? "" : "; shards written anew without them: ", shards.c_str());
  }
  if (options.unit_scale_negative_control) {
    std::printf(
        "  NEGATIVE CONTROL: every scale is 1.0 (--unit-scale-negative-control); not calibrated, "
        "not for production\n");
  }
  return ok_status();
}

}  // namespace

void add_overlay_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "overlay",
      "Make a derived checkpoint: links to a base checkpoint plus calibrated K/V scales "
      "(model-kvscales.safetensors, a merged index and provenance); never writes into the base");
  auto args = std::make_shared<OverlayArgs>();
  cmd->add_option("BASE_DIR", args->base_dir, "The base checkpoint directory (read only)")
      ->required();
  cmd->add_option("--scales", args->scales, "scales.json made by e4kv summarize");
  cmd->add_option(
      "--out", args->out_dir,
      "The derived directory to create (must not exist, or be empty; outside the base)");
  cmd->add_option("--link", args->link,
                  "How base files enter the derived directory: symlink (absolute), hardlink or "
                  "copy")
      ->capture_default_str();
  cmd->add_option("--hash", args->hash,
                  "Base files hashed into the provenance: all, or index-config (the index, "
                  "config.json, generation_config.json and tokenizer files are hashed; shards "
                  "are recorded by size only)")
      ->capture_default_str();
  cmd->add_flag("--unit-scale-negative-control", args->unit_scale_negative_control,
                "Write 1.0 for every expected scale instead of reading --scales (a negative "
                "control; the provenance says so)");
  cmd->add_flag("--replace-embedded-scales", args->replace_embedded_scales,
                "The base already holds K/V scale keys: leave them out of the derived checkpoint "
                "and use --scales instead (the base shards holding them are written anew into the "
                "derived directory without them; the base is never touched)");
  cmd->add_flag("--progress", args->progress,
                "Show the hashing progress bar even when stderr is not a terminal");
  cmd->callback([args, &result] { result = run_overlay(*args); });
}

}  // namespace e4kv::cli
