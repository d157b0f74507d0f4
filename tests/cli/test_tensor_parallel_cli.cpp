// --tensor-parallel-size on the command line: the same greedy continuation as one rank, the pool
// line per rank, and refusals that name the flag.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace e4kv
