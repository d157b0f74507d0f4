// e4kv synth-checkpoint with quantized weights, size-based shards and --print-plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "testing/cli.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::expect_one_line_error;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;

// The published Qwen4Exp with AWQ g32 experts: the plan is printed, nothing is written, and it
// is the library's plan (plan_synth_checkpoint) of the same options.
TEST(CliSynthQuant, PrintPlanOfThePublishedShapeWritesNothing) {
  TempDir tmp;
  const RunResult r = run_cli(
      tmp.path(), {"synth-checkpoint", "--family", "qwen4exp", "--published", "--quant", "awq",
                   "--quant-group", "32", "--quant-scope", "experts", "--print-plan"});
  ASSERT_TRUE(r.exited);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  SynthCheckpointOptions o = published_qwen4exp_options();
  o.quant = SynthQuant::kAwq;
  o.quant_group = 32;
  o.quant_scope = SynthQuantScope::kExperts;
  Result<SynthPlan> plan = plan_synth_checkpoint(o);
  ASSERT_TRUE(plan.ok()) << plan.message();
  EXPECT_NE(r.out.find(format_synth_plan(*plan)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("routed experts            44694503424"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::is_empty(tmp.path()));
}

// A small quantized checkpoint in shards of at most 1 MB, with the index; it opens with the
// quantization config asked for.
TEST(CliSynthQuant, WritesAQuantizedShardedCheckpoint) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "q";
  const RunResult r = run_cli(
      tmp.path(), {"synth-checkpoint", dir.string(), "--family", "qwen4exp", "--layers", "4",
                   "--hidden-size", "64", "--head-dim", "16", "--experts", "16", "--expert-width",
                   "64", "--top-k", "4", "--ple-layer", "1", "--quant", "fp8-block",
                   "--quant-group", "32", "--quant-scope", "experts", "--max-shard-mb", "1"});
  ASSERT_TRUE(r.exited);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote qwen4exp checkpoint"), std::string::npos) << r.out;
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  EXPECT_EQ(ckpt->config().quant.method, QuantMethod::kFp8Block);
  EXPECT_EQ(ckpt->config().quant.block_rows, 32);
  EXPECT_GT(ckpt->shards().size(), 1u);
  EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  const SafetensorsTensor* w = ckpt->find("model.layers.0.mlp.experts.15.down_proj.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, DType::kF8E4M3);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{64, 64}));
  EXPECT_NE(ckpt->find("model.layers.0.mlp.experts.15.down_proj.weight_scale_inv"), nullptr);
  const SafetensorsTensor* dense = ckpt->find("model.layers.0.mlp.shared_expert.up_proj.weight");
  ASSERT_NE(dense, nullptr);
  EXPECT_EQ(dense->dtype, DType::kBF16);
}

// Flags that do not go together, and quantizations the loader could not read, are one-line errors
// that create nothing.
TEST(CliSynthQuant, RefusesFlagsThatDoNotFit) {
  TempDir tmp;
  const std::string out = (tmp.path() / "out").string();
  const struct {
    std::vector<std::string> args;
    const char* needle;
  } cases[] = {
      {{"--quant", "nvfp4", "--no-zero-point"}, "--no-zero-point: only --quant awq"},
      {{"--quant", "nvfp4", "--quant-group", "32"}, "--quant-group: only --quant awq"},
      {{"--quant", "awq", "--quant-group", "16"}, "AWQ groups of 32, 64 or 128"},
      {{"--quant", "int8"}, "unknown weight quantization \"int8\""},
      {{"--quant", "awq", "--quant-scope", "experts"}, "llama checkpoint has no experts"},
      {{"--published"}, "--published is the published Qwen4Exp shape"},
      {{"--shards", "2", "--max-shard-mb", "10"}, "--shards and --max-shard-mb"},
      {{"--family", "qwen4exp", "--experts", "4", "--top-k", "8"}, "experts_top_k"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"synth-checkpoint", out};
    args.insert(args.end(), c.args.begin(), c.args.end());
    SCOPED_TRACE(args.back());
    expect_one_line_error(run_cli(tmp.path(), args), c.needle);
    EXPECT_FALSE(fs::exists(out));
  }
  expect_one_line_error(run_cli(tmp.path(), {"synth-checkpoint"}), "OUT_DIR is required");
}

}  // namespace
}  // namespace e4kv
