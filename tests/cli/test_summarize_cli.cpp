// The calibration pipeline through the built e4kv program (E4KV_CLI_PATH), as a user runs it:
// synth-checkpoint -> synth-stats (two shards) -> summarize, then the scales file and the report.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "calib/kv_stats.h"
#include "calib/scales_file.h"
#include "calib/summarize.h"
#include "core/sha256.h"
#include "core/status.h"
#include "testing/cli.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::expect_one_line_error;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;
using json = nlohmann::json;

void expect_ok(const RunResult& r, const std::string& what) {
  ASSERT_TRUE(r.exited) << what;
  ASSERT_EQ(r.exit_code, 0) << what << ": " << r.err;
  EXPECT_TRUE(r.err.empty()) << what << ": " << r.err;
}

struct Pipeline {
  fs::path ckpt;
  fs::path stats0;
  fs::path stats1;
};

// A Qwen4Exp-shaped checkpoint (KV-cache layers 3 and 7) and two shards of synthetic statistics.
Pipeline make_stats(const TempDir& tmp) {
  Pipeline p{tmp.path() / "ckpt", tmp.path() / "shard0.jsonl", tmp.path() / "shard1.jsonl"};
  expect_ok(run_cli(tmp.path(), {"synth-checkpoint", p.ckpt.string(), "--family", "qwen4exp",
                                 "--layers", "8", "--seed", "2"}),
            "synth-checkpoint");
  RunResult r0 = run_cli(tmp.path(), {"synth-stats", p.ckpt.string(), "--out", p.stats0.string(),
                                      "--shard", "0", "--tokens", "512", "--seed", "5"});
  expect_ok(r0, "synth-stats 0");
  EXPECT_NE(r0.out.find("wrote synthetic K/V statistics"), std::string::npos) << r0.out;
  expect_ok(run_cli(tmp.path(), {"synth-stats", p.ckpt.string(), "--out", p.stats1.string(),
                                 "--shard", "1", "--tokens", "512", "--seed", "5"}),
            "synth-stats 1");
  return p;
}

TEST(CliSummarize, SynthStatsWritesLabelledStatistics) {
  TempDir tmp;
  const Pipeline p = make_stats(tmp);
  Result<KvStats> stats = read_kv_stats(p.stats0);
  ASSERT_TRUE(stats.ok()) << stats.message();
  const KvStatsHeader& h = stats->header();
  EXPECT_EQ(h.source, "synthetic");
  EXPECT_EQ(h.model, "ckpt");
  EXPECT_EQ(h.prefix, "model");
  EXPECT_EQ(h.n_layers, 8);
  EXPECT_EQ(h.kv_layers, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(h.shard, std::optional<int64_t>(0));
  EXPECT_EQ(h.tokens, 512);
  const int64_t per_tensor = 512 * 2 * 32;  // tokens x kv heads x head_dim
  for (size_t i = 0; i < stats->size(); ++i) {
    EXPECT_EQ(stats->at(i).count() + stats->at(i).non_finite(), per_tensor);
    EXPECT_EQ(stats->at(i).non_finite(), 0);
    EXPECT_GT(stats->at(i).absmax(), 0.0f);
  }
  // Deterministic: the same arguments give the same bytes; another shard other values.
  const fs::path again = tmp.path() / "again.jsonl";
  expect_ok(run_cli(tmp.path(), {"synth-stats", p.ckpt.string(), "--out", again.string(), "--shard",
                                 "0", "--tokens", "512", "--seed", "5"}),
            "synth-stats again");
  EXPECT_EQ(read_text(again), read_text(p.stats0));
  EXPECT_NE(read_text(p.stats1), read_text(p.stats0));
}

TEST(CliSummarize, AbsmaxPipelineWritesScalesAndReport) {
  TempDir tmp;
  const Pipeline p = make_stats(tmp);
  const fs::path scales = tmp.path() / "scales.json";
  const fs::path report = tmp.path() / "report";
  RunResult r =
      run_cli(tmp.path(), {"summarize", p.stats0.string(), p.stats1.string(), "--policy", "absmax",
                           "--out", scales.string(), "--report", report.string()});
  expect_ok(r, "summarize");
  EXPECT_NE(r.out.find("4 K/V scales (absmax) from 2 statistics files, 1024 tokens, 2 shards "
                       "[SYNTHETIC statistics]"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("saturation 0 of"), std::string::npos) << r.out;

  Result<ScalesFile> file = read_scales_file(scales);
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_EQ(file->policy, "absmax");
  ASSERT_EQ(file->scales.size(), 4u);
  // Each scale is the smallest fp32 that maps the merged absmax to <= 448.
  Result<KvStats> s0 = read_kv_stats(p.stats0);
  Result<KvStats> s1 = read_kv_stats(p.stats1);
  ASSERT_TRUE(s0.ok() && s1.ok());
  for (size_t i = 0; i < s0->size(); ++i) {
    const std::string key = s0->key_at(i);
    ASSERT_TRUE(file->scales.contains(key)) << key;
    const float absmax = std::max(s0->at(i).absmax(), s1->at(i).absmax());
    EXPECT_EQ(file->scales.at(key), min_scale_for(absmax)) << key;
  }
  EXPECT_TRUE(file->scales.contains("model.layers.3.self_attn.k_scale"));
  EXPECT_TRUE(file->scales.contains("model.layers.7.self_attn.v_scale"));
  const json source = json::parse(file->source_json);
  EXPECT_EQ(source["synthetic"], true);
  EXPECT_EQ(source["tokens"], 1024);
  ASSERT_EQ(source["stats"].size(), 2u);
  EXPECT_EQ(source["stats"][0]["path"], p.stats0.string());
  Result<std::string> digest = sha256_file(p.stats0);
  ASSERT_TRUE(digest.ok());
  EXPECT_EQ(source["stats"][0]["sha256"], *digest);
  EXPECT_EQ(source["stats"][1]["shard"], "1");

  const json rj = json::parse(read_text(report / "report.json"));
  EXPECT_EQ(rj["format"], "e4kv-kv-report/1");
  EXPECT_EQ(rj["synthetic"], true);
  ASSERT_EQ(rj["tensors"].size(), 4u);
  for (const json& t : rj["tensors"]) {
    EXPECT_EQ(t["saturated"], 0);
    EXPECT_EQ(t["scale"].get<float>(), file->scales.at(t["key"].get<std::string>()));
    EXPECT_EQ(t["shard_absmax"].size(), 2u);
    EXPECT_GE(t["shard_spread"].get<double>(), 1.0);
    EXPECT_LE(t["p99.9"].get<float>(), t["p99.99"].get<float>());
    EXPECT_LE(t["p99.99"].get<float>(), t["absmax"].get<float>());
  }
  const std::string md = read_text(report / "report.md");
  EXPECT_NE(md.find("# K/V scale calibration report"), std::string::npos);
  EXPECT_NE(md.find("**Synthetic statistics**"), std::string::npos);
  EXPECT_NE(md.find("`model.layers.7.self_attn.k_scale`"), std::string::npos);
  const std::string svg = read_text(report / "report.svg");
  EXPECT_EQ(svg.rfind("<svg ", 0), 0u);
  EXPECT_NE(svg.find("layer 7 K"), std::string::npos);
}

TEST(CliSummarize, PercentilePolicyWithAbsmaxEnvelope) {
  TempDir tmp;
  const Pipeline p = make_stats(tmp);
  const fs::path absmax = tmp.path() / "absmax.json";
  const fs::path p999 = tmp.path() / "p999.json";
  const fs::path enveloped = tmp.path() / "enveloped.json";
  expect_ok(run_cli(tmp.path(), {"summarize", p.stats0.string(), "--out", absmax.string(),
                                 "--report", (tmp.path() / "r1").string()}),
            "absmax");
  expect_ok(run_cli(tmp.path(), {"summarize", p.stats0.string(), "--policy", "p99.9", "--out",
                                 p999.string(), "--report", (tmp.path() / "r2").string()}),
            "p99.9");
  expect_ok(run_cli(tmp.path(), {"summarize", p.stats0.string(), "--policy", "p99.9", "--envelope",
                                 absmax.string(), "--out", enveloped.string(), "--report",
                                 (tmp.path() / "r3").string()}),
            "p99.9 + envelope");
  Result<ScalesFile> a = read_scales_file(absmax);
  Result<ScalesFile> q = read_scales_file(p999);
  Result<ScalesFile> e = read_scales_file(enveloped);
  ASSERT_TRUE(a.ok() && q.ok() && e.ok());
  EXPECT_EQ(q->policy, "p99.9");
  for (const auto& [key, scale] : a->scales) {
    EXPECT_LT(q->scales.at(key), scale) << key;  // outlier channels: p99.9 well below absmax
    EXPECT_EQ(e->scales.at(key), scale) << key;  // max(p99.9, absmax)
  }
  const json r2 = json::parse(read_text(tmp.path() / "r2" / "report.json"));
  for (const json& t : r2["tensors"]) EXPECT_LE(t["saturation_ratio"].get<double>(), 1e-3);
  const json source = json::parse(e->source_json);
  EXPECT_EQ(source["envelope"]["path"], absmax.string());
  EXPECT_EQ(source["envelope"]["sha256"].get<std::string>().size(), 64u);
}

TEST(CliSummarize, ErrorsAreOneLine) {
  TempDir tmp;
  const Pipeline p = make_stats(tmp);
  const fs::path out = tmp.path() / "scales.json";
  const std::string report = (tmp.path() / "report").string();

  // A broken statistics file names the file and the line.
  std::string text = read_text(p.stats0);
  const fs::path broken = tmp.path() / "broken.jsonl";
  write_text(broken, text.substr(0, text.find('\n') + 1) + "{\"layer\": 3, oops}\n");
  expect_one_line_error(run_cli(tmp.path(), {"summarize", broken.string(), "--out", out.string(),
                                             "--report", report}),
                        broken.string() + ":2: invalid JSON");
  const fs::path wrong_format = tmp.path() / "format.jsonl";
  std::string bumped = text;
  bumped.replace(bumped.find("e4kv-kv-stats/1"), 15, "e4kv-kv-stats/9");
  write_text(wrong_format, bumped);
  expect_one_line_error(run_cli(tmp.path(), {"summarize", wrong_format.string(), "--out",
                                             out.string(), "--report", report}),
                        wrong_format.string() + ":1: unsupported format \"e4kv-kv-stats/9\"");
  expect_one_line_error(run_cli(tmp.path(), {"summarize", p.stats0.string(), "--policy", "p50",
                                             "--out", out.string(), "--report", report}),
                        "unknown scale policy \"p50\"");
  expect_one_line_error(run_cli(tmp.path(), {"summarize", (tmp.path() / "nope.jsonl").string(),
                                             "--out", out.string(), "--report", report}),
                        "nope.jsonl: cannot open");
  // The same file twice would count its values twice.
  const fs::path copy = tmp.path() / "copy.jsonl";
  write_text(copy, read_text(p.stats0));
  expect_one_line_error(run_cli(tmp.path(), {"summarize", p.stats0.string(), copy.string(), "--out",
                                             out.string(), "--report", report}),
                        copy.string() + ": the same contents as " + p.stats0.string());
  // Statistics of another model (dense llama: every layer has a KV cache).
  const fs::path llama = tmp.path() / "llama";
  expect_ok(run_cli(tmp.path(), {"synth-checkpoint", llama.string()}), "llama");
  const fs::path llama_stats = tmp.path() / "llama.jsonl";
  expect_ok(run_cli(tmp.path(), {"synth-stats", llama.string(), "--out", llama_stats.string(),
                                 "--tokens", "16"}),
            "llama stats");
  expect_one_line_error(run_cli(tmp.path(), {"summarize", p.stats0.string(), llama_stats.string(),
                                             "--out", out.string(), "--report", report}),
                        llama_stats.string() + ": statistics of different models");
  // An envelope of the other model.
  const fs::path llama_scales = tmp.path() / "llama_scales.json";
  expect_ok(run_cli(tmp.path(), {"summarize", llama_stats.string(), "--out", llama_scales.string(),
                                 "--report", report, "--force"}),
            "llama summarize");
  expect_one_line_error(
      run_cli(tmp.path(), {"summarize", p.stats0.string(), "--envelope", llama_scales.string(),
                           "--out", out.string(), "--report", report, "--force"}),
      "the envelope's keys differ");
  EXPECT_FALSE(fs::exists(out));  // nothing written on failure
  // synth-stats arguments.
  expect_one_line_error(run_cli(tmp.path(), {"synth-stats", p.ckpt.string(), "--out",
                                             (tmp.path() / "x.jsonl").string(), "--tokens", "0"}),
                        "--tokens");
  expect_one_line_error(
      run_cli(tmp.path(), {"synth-stats", p.ckpt.string(), "--out",
                           (tmp.path() / "x.jsonl").string(), "--scale-magnitude", "-1"}),
      "--scale-magnitude");
  expect_one_line_error(run_cli(tmp.path(), {"synth-stats", (tmp.path() / "missing").string(),
                                             "--out", (tmp.path() / "x.jsonl").string()}),
                        "missing");
}

}  // namespace
}  // namespace e4kv
