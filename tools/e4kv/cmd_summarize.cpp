// e4kv summarize STATS... --policy absmax|p99.9|p99.99 [--envelope OLD] --out scales.json
//   --report DIR: merges calibration statistics (one file per shard and process) into one fp32
// K/V scale per KV-cache layer, writes scales.json (the input of `e4kv overlay`) and a report
// (report.json, report.md, report.svg). Conventions: calib/summarize.h.
// A calibrate shard's statistics file is read only when its run file records its size and SHA-256
// (check_calibrate_run_file, calib/kv_stats.h). The report directory appears at once, then
// scales.json; both are locked against a second summarize (core/output_set.h).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "calib/kv_stats.h"
#include "calib/report.h"
#include "calib/scales_file.h"
#include "calib/summarize.h"
#include "commands.h"
#include "core/file_io.h"
#include "core/output_set.h"
#include "core/sha256.h"

namespace e4kv::cli {
namespace {

struct SummarizeArgs {
  std::vector<std::string> stats;
  std::string policy = "absmax";
  std::string envelope;
  std::string out;
  std::string report_dir;
  bool force = false;
};


// STATS arguments: files as given; a directory stands for its kv-stats-*.jsonl files (what
// `e4kv calibrate --out DIR` writes), in name order. A directory without any is an error.
Result<std::vector<std::string>> expand_stats_paths(const std::vector<std::string>& args) {
  std::vector<std::string> files;
  for (const std::string& arg : args) {
    std::error_code ec;
    if (!std::filesystem::is_directory(arg, ec)) {
      files.push_back(arg);
      continue;
    }
    std::vector<std::string> found;
    for (const auto& entry : std::filesystem::directory_iterator(arg, ec)) {
      const std::string name = entry.path().filename().string();
      if (entry.is_regular_file() && name.starts_with("kv-stats-") && name.ends_with(".jsonl")) {
        found.push_back(entry.path().string());
      }
    }
    if (ec) return Status::error(cat(arg, ": cannot list the directory: ", ec.message()));
    if (found.empty()) {
      return Status::error(cat(arg, ": a directory without kv-stats-*.jsonl files; give the "
                                    "directory `e4kv calibrate --out` wrote, or statistics files"));
    }
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

// Every output is checked before anything is read or written: none may be an input, lie inside a
// checkpoint, or replace a file without --force; the report directory holds its three files only.
Status check_outputs(const SummarizeArgs& args) {
  OutputRules rules;
  rules.force = args.force;
  rules.force_name = "--force";
  for (const std::string& path : args.stats) rules.inputs.emplace_back(path);
  if (!args.envelope.empty()) rules.inputs.emplace_back(args.envelope);
  if (Status out = check_output_file(args.out, rules); !out.ok()) {
    return Status::error(cat("--out: ", out.message()));
  }
  // The report directory is replaced as a whole, so scales.json cannot live inside it.
  auto resolved = [](const std::string& path) {
    std::error_code ec;
    std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
    if (ec) p = std::filesystem::absolute(path, ec).lexically_normal();
    if (!p.has_filename() && p.has_relative_path()) p = p.parent_path();
    return p;
  };
  if (resolved(args.out).parent_path() == resolved(args.report_dir)) {
    return Status::error(cat("--out: ", args.out, ": lies inside the --report directory ",
                             args.report_dir,
                             ", which is written as a whole; put scales.json beside it"));
  }
  if (Status report = check_output_set_dir(args.report_dir, kReportFileNames, rules);
      !report.ok()) {
    return Status::error(cat("--report: ", report.message()));
  }
  return ok_status();
}

// One summarize per output at a time: a lock beside scales.json and one beside the report
// directory (core/output_set.h), held until both are written.
struct OutputLocks {
  std::optional<OutputLock> scales;
  std::optional<OutputLock> report;
};

Result<OutputLocks> lock_outputs(const SummarizeArgs& args) {
  OutputLocks locks;
  Result<OutputLock> scales = OutputLock::acquire(lock_path_for(args.out), args.out);
  if (!scales.ok()) return Status::error(cat("--out: ", scales.message()));
  locks.scales.emplace(std::move(scales).value());
  Result<OutputLock> report = OutputLock::acquire(lock_path_for(args.report_dir), args.report_dir);
  if (!report.ok()) return Status::error(cat("--report: ", report.message()));
  locks.report.emplace(std::move(report).value());
  return locks;
}

Status run_summarize(const SummarizeArgs& args) {
  E4KV_RETURN_IF_ERROR(check_outputs(args));
  E4KV_ASSIGN_OR_RETURN(const OutputLocks locks, lock_outputs(args));
  E4KV_RETURN_IF_ERROR(check_outputs(args));  // again: another run may have finished meanwhile
  SummarizeOptions options;
  E4KV_ASSIGN_OR_RETURN(options.policy, parse_scale_policy(args.policy));
  std::vector<SummaryInput> inputs;
  E4KV_ASSIGN_OR_RETURN(const std::vector<std::string> files, expand_stats_paths(args.stats));
  for (const std::string& path : files) {
    E4KV_ASSIGN_OR_RETURN(const std::string text, read_file(path));
    // A shard's statistics count only beside the run file that vouches for them (kv_stats.h).
    E4KV_RETURN_IF_ERROR(check_calibrate_run_file(path, text));
    E4KV_ASSIGN_OR_RETURN(KvStats stats, parse_kv_stats(text, path));
    inputs.push_back({path, sha256_hex(text), std::move(stats)});
  }
  if (!args.envelope.empty()) {
    E4KV_ASSIGN_OR_RETURN(options.envelope, read_scales_file(args.envelope));
    E4KV_ASSIGN_OR_RETURN(options.envelope_sha256, sha256_file(args.envelope));
    options.envelope_path = args.envelope;
  }
  E4KV_ASSIGN_OR_RETURN(const Summary summary, summarize(std::move(inputs), options));
  // The report appears at once (one rename); scales.json last: it is only there when everything
  // before it worked.
  E4KV_RETURN_IF_ERROR(write_report(args.report_dir, summary, args.force));
  E4KV_RETURN_IF_ERROR(write_scales_file(args.out, summary_scales_file(summary)));

  const SummaryTotals& totals = summary.totals;
  std::printf("%zu K/V scales (%s%s) from %zu statistics file%s, %lld tokens, %zu shard%s%s\n",
              summary.tensors.size(), std::string(scale_policy_name(summary.policy)).c_str(),
              summary.envelope_path ? " + envelope" : "", summary.inputs.size(),
              summary.inputs.size() == 1 ? "" : "s", static_cast<long long>(summary.tokens),
              summary.shards.size(), summary.shards.size() == 1 ? "" : "s",
              summary.source != "observed" ? " [SYNTHETIC statistics]" : "");
  std::printf("scales %.9g .. %.9g, saturation %lld of %lld values\n", double(totals.min_scale),
              double(totals.max_scale), static_cast<long long>(totals.saturated),
              static_cast<long long>(totals.count));
  std::printf(
      "non-zero values below 2^-9: %.4f%% at scale 1.0, %.4f%% at the calibrated scales; in "
      "[2^-9, 2^-6): %.4f%% -> %.4f%%\n",
      100.0 * totals.at_unit.below_min_subnormal, 100.0 * totals.at_scale.below_min_subnormal,
      100.0 * totals.at_unit.subnormal, 100.0 * totals.at_scale.subnormal);
  if (totals.non_finite > 0) {
    std::printf("warning: %lld non-finite values were observed (not part of the scales)\n",
                static_cast<long long>(totals.non_finite));
  }
  std::printf("wrote %s and %s/report.{json,md,svg}\n", args.out.c_str(), args.report_dir.c_str());
  return ok_status();
}

}  // namespace

void add_summarize_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "summarize", "Turn K/V calibration statistics into scales.json and a report");
  auto args = std::make_shared<SummarizeArgs>();
  cmd->add_option("STATS", args->stats,
                  "Statistics files (JSON lines), one per shard/process, or directories of them "
                  "(e4kv calibrate --out)")
      ->required();
  cmd->add_option("--policy", args->policy,
                  "absmax (no observed value saturates), p99.9 or p99.99 (the percentile maps "
                  "to 448; the report gives the predicted saturation)")
      ->capture_default_str();
  cmd->add_option("--envelope", args->envelope,
                  "An earlier scales.json: each scale becomes max(new, old)");
  cmd->add_option("--out", args->out, "scales.json to write")->required();
  cmd->add_option("--report", args->report_dir,
                  "Directory for report.json, report.md and report.svg, which appear at once "
                  "(built beside it, then renamed onto it); new or empty, or with --force one "
                  "holding only those files")
      ->required();
  cmd->add_flag("--force", args->force,
                "Replace an existing scales file and report files (never an input or a file in a "
                "checkpoint)");
  cmd->callback([args, &result] { result = one_line(run_summarize(*args)); });
}

}  // namespace e4kv::cli
