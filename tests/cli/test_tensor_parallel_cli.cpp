// --tensor-parallel-size on the command line: the same greedy continuation as one rank, the pool
// line per rank, and refusals that name the flag.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/cli.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::run_cli;

TEST(CliTensorParallel, GenerateMatchesOneRankAndRefusesWhatItCannotRun) {
  TempDir tmp;
  SynthCheckpointOptions synth;
  synth.n_layers = 2;
  synth.n_heads = 4;
  synth.n_kv_heads = 2;
  const fs::path model = tmp.path() / "m";
  ASSERT_TRUE(write_synth_checkpoint(model, synth).ok());
  auto generate = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"generate", model.string(), "--prompt-ids", "5,6,7",
                                     "--max-tokens", "8", "--threads", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(tmp.path(), args);
  };
  const RunResult one = generate({});
  ASSERT_EQ(one.exit_code, 0) << one.err;
  for (const char* size : {"2", "4"}) {
    const RunResult tp = generate({"--tensor-parallel-size", size});
    ASSERT_EQ(tp.exit_code, 0) << tp.err;
    EXPECT_EQ(tp.out, one.out) << "TP " << size;
  }
  const RunResult three = generate({"--tensor-parallel-size", "3"});
  EXPECT_EQ(three.exit_code, 1);
  EXPECT_NE(three.err.find("tensor parallel rank 0 of 3"), std::string::npos) << three.err;
  const RunResult gpu = generate({"--tensor-parallel-size", "2", "--device", "cuda"});
  EXPECT_EQ(gpu.exit_code, 1);
  EXPECT_NE(gpu.err.find("--tensor-parallel-size: 2 ranks on cuda"), std::string::npos) << gpu.err;
  const RunResult zero = generate({"--tensor-parallel-size", "0"});
  EXPECT_NE(zero.exit_code, 0);
  EXPECT_NE(zero.err.find("--tensor-parallel-size"), std::string::npos) << zero.err;
  // Calibration measures whole layers: refused under tensor parallelism, naming why.
  const fs::path corpus = tmp.path() / "corpus.jsonl";
  testing_support::write_text(corpus, "{\"token_ids\": [1, 2, 3, 4]}\n");
  const RunResult calibrate =
      run_cli(tmp.path(), {"calibrate", model.string(), "--corpus", corpus.string(),
                           "--tensor-parallel-size", "2", "--out", (tmp.path() / "stats").string()});
  EXPECT_NE(calibrate.exit_code, 0);
  EXPECT_NE(calibrate.err.find("tensor parallel size 1"), std::string::npos) << calibrate.err;
}

TEST(CliTensorParallel, CapacityIsPerRankWithTotals) {
  TempDir tmp;
  SynthCheckpointOptions synth;
  synth.n_layers = 2;
  synth.n_heads = 4;
  synth.n_kv_heads = 2;
  const fs::path model = tmp.path() / "m";
  ASSERT_TRUE(write_synth_checkpoint(model, synth).ok());
  auto capacity = [&](const char* size) {
    const RunResult r = run_cli(tmp.path(), {"capacity", model.string(), "--gpu-memory-gib", "0.01",
                                             "--tensor-parallel-size", size, "--json"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const nlohmann::json one = capacity("1");
  const nlohmann::json two = capacity("2");
  // One of the two key/value heads per rank: half the cache bytes of a token.
  EXPECT_EQ(two["bytes_per_token_fp16"].get<double>() * 2, one["bytes_per_token_fp16"].get<double>());
  // Per rank: the split kinds halved (rounded up), the rest whole.
  const nlohmann::json& plan = two["memory_plan"];
  int64_t want = 0;
  for (const auto& [kind, entry] : plan["weights_device"].items()) {
    const int64_t bytes = entry["bytes"].get<int64_t>();
    const bool split = kind == "attention" || kind == "deltanet" || kind == "moe_experts" ||
                       kind == "shared_expert" || kind == "mlp";
    want += split ? (bytes + 1) / 2 : bytes;
  }
  EXPECT_EQ(plan["weights_device_bytes_per_rank"].get<int64_t>(), want);
  EXPECT_EQ(plan["kv_pool_bytes"].get<int64_t>(), plan["share_bytes"].get<int64_t>() - want);
  EXPECT_EQ(plan["kv_pool_bytes_total"].get<int64_t>(), 2 * plan["kv_pool_bytes"].get<int64_t>());
  EXPECT_GT(plan["contexts"][0]["max_concurrency_e4m3"].get<double>(),
            2 * one["memory_plan"]["contexts"][0]["max_concurrency_e4m3"].get<double>());
}

}  // namespace
}  // namespace e4kv
