// The KV pool's sizing flags (generate) and `e4kv bench`, run as a user runs them on a small
// synthetic dense checkpoint: 2 layers, 1 KV head of 16, so one block of 16 tokens takes
// 2 layers * 16 tokens * 2 (K, V) * 16 * 2 bytes = 2048 bytes in FP16 and 1024 in E4M3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "testing/cli.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;

class BenchCli : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = tmp_.path() / "llama";
    const RunResult r = run_cli(
        tmp_.path(), {"synth-checkpoint", model_.string(), "--layers", "2", "--hidden-size", "32",
                      "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--vocab", "256"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }

  // generate with 3 prompt ids, 2 new tokens, blocks of 16, max model length 64, and `extra`.
  RunResult generate(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"generate",     model_.string(), "--prompt-ids",
                                     "1,2,3",        "--max-tokens",  "2",
                                     "--block-size", "16",            "--max-model-len",
                                     "64"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(tmp_.path(), args);
  }

  static void expect_one_line_error(const RunResult& r, const std::string& needle) {
    SCOPED_TRACE(needle);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_TRUE(r.err.starts_with("e4kv: error: ")) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  }

  TempDir tmp_;
  fs::path model_;
};

TEST_F(BenchCli, MemoryBytesSizeThePoolAndTheLineSaysWhatItHolds) {
  // 20,480 bytes: 10 FP16 blocks (160 tokens); 64-token sequences take 4 blocks: 2.50x.
  RunResult r = generate({"--kv-cache-memory-bytes", "20480"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("KV cache pool: 10 blocks x 16 = 160 tokens (fp16"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("FP16 would hold 160 tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("maximum concurrency for 64 tokens per request: 2.50x"), std::string::npos)
      << r.err;

  // The same bytes in E4M3: 20 blocks (320 tokens), still 160 in FP16, 5.00x; the pool line comes
  // before the scale line (here the negative control's).
  r = generate({"--kv-cache-memory-bytes", "20480", "--kv-cache-dtype", "fp8_e4m3", "--kv-scales",
                "unit"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const size_t pool = r.err.find("KV cache pool: 20 blocks x 16 = 320 tokens (fp8_e4m3");
  ASSERT_NE(pool, std::string::npos) << r.err;
  EXPECT_NE(r.err.find("FP16 would hold 160 tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("per request: 5.00x"), std::string::npos) << r.err;
  const size_t control = r.err.find("NEGATIVE CONTROL");
  ASSERT_NE(control, std::string::npos) << r.err;
  EXPECT_LT(pool, control) << r.err;

  // 20,479 bytes hold only 9 whole blocks.
  r = generate({"--kv-cache-memory-bytes", "20479"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("KV cache pool: 9 blocks x 16 = 144 tokens"), std::string::npos) << r.err;
}

TEST_F(BenchCli, BlockOverrideIsExactAndWithoutAFlagThePoolFitsTheRun) {
  RunResult r = generate({"--num-gpu-blocks-override", "7"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("KV cache pool: 7 blocks x 16 = 112 tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("per request: 1.75x"), std::string::npos) << r.err;
  // No flag: 3 + 2 tokens take one block, which cannot hold a 64-token sequence (0.25x); the run
  // needs no more, so it is not refused.
  r = generate({});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("KV cache pool: 1 block x 16 = 16 tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("per request: 0.25x"), std::string::npos) << r.err;
}

TEST_F(BenchCli, PoolsThatCannotHoldTheMaxModelLengthAreRefused) {
  // 6,144 bytes = 3 blocks = 48 tokens < 64.
  expect_one_line_error(generate({"--kv-cache-memory-bytes", "6144"}),
                        "--kv-cache-memory-bytes: the KV cache pool holds 3 blocks of 16 tokens = "
                        "48 tokens, fewer than the max model length of 64");
  expect_one_line_error(generate({"--num-gpu-blocks-override", "3"}),
                        "--num-gpu-blocks-override: the KV cache pool holds 3 blocks");
  // Less than one block.
  expect_one_line_error(generate({"--kv-cache-memory-bytes", "2047"}),
                        "holds 0 blocks of 16 tokens = 0 tokens");
  // bench refuses the same way, before running anything.
  const fs::path out = tmp_.path() / "refused";
  expect_one_line_error(
      run_cli(tmp_.path(), {"bench", model_.string(), "--kv-cache-dtype", "fp16", "--context",
                            "8", "--concurrency", "1", "--output-tokens", "2", "--block-size",
                            "16", "--max-model-len", "64", "--num-gpu-blocks-override", "2",
                            "--out", out.string()}),
      "fewer than the max model length of 64");
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(BenchCli, PoolFlagRefusals) {
  expect_one_line_error(generate({"--gpu-memory-utilization", "0.9"}),
                        "--gpu-memory-utilization: the CPU backend has no device memory");
  expect_one_line_error(
      generate({"--kv-cache-memory-bytes", "20480", "--num-gpu-blocks-override", "7"}),
      "give at most one");
  // A hybrid model reserves its per-sequence states first (64 sequences by default).
  const fs::path qwen = tmp_.path() / "qwen4exp";
  const RunResult synth = run_cli(tmp_.path(), {"synth-checkpoint", qwen.string(), "--family",
                                                "qwen4exp", "--layers", "4", "--no-tokenizer"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  expect_one_line_error(
      run_cli(tmp_.path(), {"generate", qwen.string(), "--prompt-ids", "1,2,3", "--max-tokens",
                            "2", "--max-model-len", "64", "--kv-cache-memory-bytes", "4096"}),
      "--kv-cache-memory-bytes: the per-sequence state");
}

// bench reserves per-sequence state for its widest cell only: a budget that the default 64
// sequences' state would exceed runs a matrix of concurrency 1 and 2.
TEST_F(BenchCli, HybridStateIsReservedForTheWidestCell) {
  const fs::path qwen = tmp_.path() / "qwen4exp";
  const RunResult synth = run_cli(tmp_.path(), {"synth-checkpoint", qwen.string(), "--family",
                                                "qwen4exp", "--layers", "4", "--no-tokenizer"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  // The state of 64 sequences, from generate's refusal.
  const RunResult refused =
      run_cli(tmp_.path(), {"generate", qwen.string(), "--prompt-ids", "1,2,3", "--max-tokens",
                            "2", "--max-model-len", "64", "--kv-cache-memory-bytes", "4096"});
  ASSERT_EQ(refused.exit_code, 1);
  const std::string marker = "of 64 sequences needs ";
  const size_t at = refused.err.find(marker);
  ASSERT_NE(at, std::string::npos) << refused.err;
  const int64_t state_64 = std::stoll(refused.err.substr(at + marker.size()));
  const int64_t per_seq = (state_64 + 63) / 64;
  // Two sequences' state and 64 KiB of blocks: far less than 64 sequences' state.
  const int64_t budget = 2 * per_seq + 65536;
  ASSERT_LT(budget, state_64);
  const RunResult r = run_cli(
      tmp_.path(), {"bench", qwen.string(), "--concurrency", "1,2", "--context", "16",
                    "--output-tokens", "2", "--max-model-len", "64", "--kv-scales", "unit",
                    "--kv-cache-memory-bytes", std::to_string(budget), "--no-progress"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n') > 4, true) << r.out;
  EXPECT_EQ(r.out.find("skipped"), std::string::npos) << r.out;
}

// The geometric mean of E4M3 / FP16 decode tok/s over the cells both modes completed, with
// context >= min_context, recomputed from the JSON's per-cell figures; NaN when there is none.
double recomputed_ratio(const json& report, int64_t min_context, int64_t* n_cells) {
  const json& f16 = report["modes"][0]["cells"];
  const json& e4m3 = report["modes"][1]["cells"];
  double log_sum = 0.0;
  *n_cells = 0;
  for (size_t i = 0; i < f16.size(); ++i) {
    if (f16[i]["status"] != "completed" || e4m3[i]["status"] != "completed") continue;
    if (f16[i]["context"].get<int64_t>() < min_context) continue;
    EXPECT_EQ(f16[i]["concurrency"], e4m3[i]["concurrency"]);
    EXPECT_EQ(f16[i]["context"], e4m3[i]["context"]);
    log_sum += std::log(e4m3[i]["mean"]["decode_tok_s"].get<double>() /
                        f16[i]["mean"]["decode_tok_s"].get<double>());
    *n_cells += 1;
  }
  return *n_cells > 0 ? std::exp(log_sum / double(*n_cells)) : std::nan("");
}

TEST_F(BenchCli, TinyMatrixEndToEnd) {
  // 8,192 bytes: 4 FP16 blocks (64 tokens), 8 E4M3 blocks (128 tokens). Max model length 64:
  // context 64 + 4 output tokens cannot run (skipped, both modes); two requests of 32 + 4 tokens
  // (3 blocks each) do not fit the FP16 pool at once, and run anyway (one waits or is preempted).
  const fs::path out = tmp_.path() / "bench";
  const RunResult r = run_cli(
      tmp_.path(),
      {"bench", model_.string(), "--concurrency", "1,2", "--context", "32,64", "--output-tokens",
       "4", "--repeats", "1", "--kv-cache-dtype", "fp16,fp8_e4m3", "--kv-scales", "unit",
       "--block-size", "16", "--max-model-len", "64", "--kv-cache-memory-bytes", "8192",
       "--threads", "1", "--out", out.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("# e4kv bench"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("- device: cpu"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("- date: 20"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| fp16 | 1 | 64 | skipped (capacity) |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fp8_e4m3 (unit scales: NEGATIVE CONTROL)"), std::string::npos) << r.out;
  // The pool line of each load, before the negative control's scale line.
  EXPECT_NE(r.err.find("KV cache pool: 4 blocks x 16 = 64 tokens (fp16"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("KV cache pool: 8 blocks x 16 = 128 tokens (fp8_e4m3"), std::string::npos)
      << r.err;

  ASSERT_TRUE(fs::exists(out / "bench.json"));
  ASSERT_TRUE(fs::exists(out / "bench.md"));
  ASSERT_TRUE(fs::exists(out / "bench.svg"));
  EXPECT_TRUE(read_text(out / "bench.svg").starts_with("<svg")) << read_text(out / "bench.svg");
  EXPECT_NE(r.out.find(read_text(out / "bench.md")), std::string::npos);
  const json report = json::parse(read_text(out / "bench.json"));
  EXPECT_EQ(report["device"].get<std::string>().rfind("cpu", 0), 0u) << report["device"];
  EXPECT_TRUE(report["date"].is_string());
  EXPECT_EQ(report["output_tokens"], 4);
  EXPECT_EQ(report["repeats"], 1);

  ASSERT_EQ(report["modes"].size(), 2u);
  const json& f16 = report["modes"][0];
  const json& e4m3 = report["modes"][1];
  EXPECT_EQ(f16["kv_cache_dtype"], "fp16");
  EXPECT_EQ(f16["negative_control"], false);
  EXPECT_EQ(f16["n_blocks"], 4);
  EXPECT_EQ(f16["kv_capacity_tokens"], 64);
  EXPECT_EQ(e4m3["kv_cache_dtype"], "fp8_e4m3");
  EXPECT_EQ(e4m3["kv_scales"], "unit");
  EXPECT_EQ(e4m3["negative_control"], true);
  EXPECT_EQ(e4m3["n_blocks"], 8);
  EXPECT_EQ(e4m3["kv_capacity_tokens"], 128);

  // Cells in order: (1, 32), (1, 64), (2, 32), (2, 64).
  const int64_t expected[4][2] = {{1, 32}, {1, 64}, {2, 32}, {2, 64}};
  for (const json* mode : {&f16, &e4m3}) {
    const json& cells = (*mode)["cells"];
    ASSERT_EQ(cells.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      SCOPED_TRACE(cells[i].dump());
      const int64_t concurrency = expected[i][0];
      const int64_t context = expected[i][1];
      EXPECT_EQ(cells[i]["concurrency"], concurrency);
      EXPECT_EQ(cells[i]["context"], context);
      if (context == 64) {
        EXPECT_EQ(cells[i]["status"], "skipped (capacity)");
        EXPECT_NE(cells[i]["reason"].get<std::string>().find("max model length 64"),
                  std::string::npos);
        EXPECT_FALSE(cells[i].contains("mean"));
        continue;
      }
      ASSERT_EQ(cells[i]["status"], "completed");
      ASSERT_EQ(cells[i]["runs"].size(), 1u);
      for (const json& figures : {cells[i]["mean"], cells[i]["runs"][0]}) {
        EXPECT_EQ(figures["output_tokens"], concurrency * 4);
        EXPECT_EQ(figures["prompt_tokens"], concurrency * context);
        EXPECT_GT(figures["decode_tok_s"].get<double>(), 0.0);
        EXPECT_GT(figures["prefill_tok_s"].get<double>(), 0.0);
        EXPECT_GT(figures["ttft_ms"].get<double>(), 0.0);
        EXPECT_GT(figures["tpot_ms"].get<double>(), 0.0);
        EXPECT_GE(figures["e2e_s"].get<double>(), figures["ttft_ms"].get<double>() / 1e3);
        EXPECT_GE(figures["preemptions"].get<double>(), 0.0);
      }
    }
  }

  // The ratios, over the matched completed cells only: (1, 32) and (2, 32); none at >= 16K.
  const json& ratios = report["decode_tok_s_ratio_e4m3_over_fp16"];
  int64_t n_cells = 0;
  const double all = recomputed_ratio(report, 0, &n_cells);
  EXPECT_EQ(n_cells, 2);
  EXPECT_EQ(ratios["all"]["n_cells"], 2);
  EXPECT_NEAR(ratios["all"]["geomean"].get<double>(), all, 1e-12 * all);
  recomputed_ratio(report, 16 * 1024, &n_cells);
  EXPECT_EQ(n_cells, 0);
  EXPECT_EQ(ratios["context_ge_16k"]["n_cells"], 0);
  EXPECT_TRUE(ratios["context_ge_16k"]["geomean"].is_null());

  // The output set is not replaced without --force.
  const RunResult again = run_cli(
      tmp_.path(), {"bench", model_.string(), "--concurrency", "1", "--context", "8",
                    "--output-tokens", "2", "--kv-cache-dtype", "fp16", "--max-model-len", "64",
                    "--out", out.string()});
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find("--out"), std::string::npos) << again.err;
}

TEST_F(BenchCli, FlagRefusals) {
  const fs::path out = tmp_.path() / "never";
  auto bench = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"bench",           model_.string(), "--max-model-len", "64",
                                     "--kv-cache-dtype", "fp16",         "--out",
                                     out.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(tmp_.path(), args);
  };
  expect_one_line_error(bench({"--concurrency", "0"}), "--concurrency: 0 is outside 1 to");
  expect_one_line_error(bench({"--concurrency", "1,x"}), "--concurrency: \"x\"");
  expect_one_line_error(bench({"--context", "1k,0"}), "--context: 0 is outside 1 to");
  const RunResult one = bench({"--output-tokens", "1"});
  EXPECT_EQ(one.exit_code, 2) << one.err;
  EXPECT_NE(one.err.find("--output-tokens"), std::string::npos) << one.err;
  const RunResult repeats = bench({"--repeats", "1001"});
  EXPECT_EQ(repeats.exit_code, 2) << repeats.err;
  EXPECT_NE(repeats.err.find("--repeats"), std::string::npos) << repeats.err;
  // The dtype list: each known, none twice.
  const RunResult twice = run_cli(tmp_.path(), {"bench", model_.string(), "--kv-cache-dtype",
                                                "fp16,fp16", "--out", out.string()});
  expect_one_line_error(twice, "--kv-cache-dtype: fp16 is listed twice");
  const RunResult unknown = run_cli(tmp_.path(), {"bench", model_.string(), "--kv-cache-dtype",
                                                  "fp16,int4", "--out", out.string()});
  expect_one_line_error(unknown, "--kv-cache-dtype: ");
  // E4M3 needs calibrated scales as every E4M3 run does (this checkpoint has none), unless the
  // negative control is asked for.
  const RunResult gate =
      run_cli(tmp_.path(), {"bench", model_.string(), "--kv-cache-dtype", "fp8_e4m3",
                            "--max-model-len", "64", "--context", "8", "--concurrency", "1",
                            "--output-tokens", "2", "--out", out.string()});
  EXPECT_EQ(gate.exit_code, 1) << gate.err;
  EXPECT_NE(gate.err.find("e4kv: error: "), std::string::npos) << gate.err;
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace e4kv
