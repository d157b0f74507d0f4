// `e4kv generate` and `e4kv logits` run as a user runs them, on a synthetic checkpoint with its
// synthetic tokenizer (synth-checkpoint writes both).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "testing/cli.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;

class GenerateCli : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = tmp_.path() / "model";
    RunResult r = run_cli(
        tmp_.path(), {"synth-checkpoint", model_.string(), "--layers", "2", "--with-kv-scales"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ASSERT_TRUE(fs::exists(model_ / "tokenizer.json"));
  }

  RunResult run(std::vector<std::string> args) {
    args.insert(args.begin() + 1, model_.string());
    return run_cli(tmp_.path(), args);
  }

  static json parse(const RunResult& r) {
    EXPECT_EQ(r.exit_code, 0) << r.err;
    json out = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(out.is_discarded()) << r.out;
    return out;
  }

  void expect_error(const RunResult& r, const std::string& needle) {
    EXPECT_NE(r.exit_code, 0) << r.out;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  }

  TempDir tmp_;
  fs::path model_;
};

TEST_F(GenerateCli, JsonOutputIsDeterministicAtTemperatureZero) {
  const std::vector<std::string> args{"generate",     "--prompt", "Hello world",
                                      "--max-tokens", "8",        "--json"};
  const json a = parse(run(args));
  const json b = parse(run(args));
  ASSERT_TRUE(a.contains("output_ids") && a.contains("text"));
  EXPECT_LE(a["output_ids"].size(), 8u);
  EXPECT_GE(a["output_ids"].size(), 1u);
  EXPECT_TRUE(a["text"].is_string());
  EXPECT_EQ(a, b);
}

// --enforce-eager (no decode-step graphs; the CPU backend has none, so the tokens are the same).
TEST_F(GenerateCli, EnforceEagerIsAcceptedAndChangesNoToken) {
  const std::vector<std::string> args{"generate",     "--prompt", "Hello world",
                                      "--max-tokens", "8",        "--json"};
  std::vector<std::string> eager = args;
  eager.push_back("--enforce-eager");
  EXPECT_EQ(parse(run(eager))["output_ids"], parse(run(args))["output_ids"]);
}

TEST_F(GenerateCli, StreamedTextEqualsTheJsonText) {
  const json j = parse(run({"generate", "--prompt", "Hello world", "--max-tokens", "8", "--json"}));
  RunResult streamed = run({"generate", "--prompt", "Hello world", "--max-tokens", "8"});
  ASSERT_EQ(streamed.exit_code, 0) << streamed.err;
  EXPECT_EQ(streamed.out, j["text"].get<std::string>() + "\n");
}

TEST_F(GenerateCli, PromptIdsAndLogitsAgree) {
  const json g = parse(run(
      {"generate", "--prompt-ids", "5,17,99,3", "--max-tokens", "4", "--json", "--ignore-eos"}));
  EXPECT_EQ(g["prompt_ids"], json::array({5, 17, 99, 3}));
  ASSERT_EQ(g["output_ids"].size(), 4u);

  const json l = parse(run({"logits", "--ids", "5,17,99,3", "--json"}));
  ASSERT_TRUE(l["logits"].is_array());
  ASSERT_EQ(l["logits"].size(), 4u);
  for (const json& row : l["logits"]) {
    ASSERT_EQ(row.size(), 256u);
    for (const json& v : row) ASSERT_TRUE(v.is_number() && std::isfinite(v.get<double>()));
  }
  // The last position's argmax is the first greedy token.
  const json& last = l["logits"][3];
  size_t best = 0;
  for (size_t i = 1; i < last.size(); ++i) {
    if (last[i].get<double>() > last[best].get<double>()) best = i;
  }
  EXPECT_EQ(g["output_ids"][0].get<size_t>(), best);
}

TEST_F(GenerateCli, SeededSamplingIsReproducible) {
  const std::vector<std::string> args{
      "generate", "--prompt-ids", "1,2,3", "--max-tokens", "8", "--temperature", "0.9", "--top-p",
      "0.95",     "--top-k",      "40",    "--seed",       "5", "--json"};
  EXPECT_EQ(parse(run(args)), parse(run(args)));
}

TEST_F(GenerateCli, E4m3CacheModes) {
  RunResult calibrated = run({"generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json",
                              "--kv-cache-dtype", "fp8_e4m3"});
  EXPECT_EQ(calibrated.exit_code, 0) << calibrated.err;
  EXPECT_NE(calibrated.err.find("kv scales: 4/4 valid"), std::string::npos) << calibrated.err;
  RunResult unit = run({"generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json",
                        "--kv-cache-dtype", "fp8_e4m3", "--kv-scales", "unit"});
  EXPECT_EQ(unit.exit_code, 0) << unit.err;
  EXPECT_NE(unit.err.find("NEGATIVE CONTROL"), std::string::npos) << unit.err;
}

TEST_F(GenerateCli, CalibratedFp8WithoutScalesFailsClosed) {
  const fs::path bare = tmp_.path() / "bare";
  ASSERT_EQ(run_cli(tmp_.path(), {"synth-checkpoint", bare.string(), "--layers", "2"}).exit_code,
            0);
  RunResult r = run_cli(tmp_.path(), {"generate", bare.string(), "--prompt-ids", "1,2",
                                      "--kv-cache-dtype", "fp8_e4m3"});
  expect_error(r, "KV scale gate: loaded 0/4");
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_F(GenerateCli, BadFlagsGiveClearErrors) {
  expect_error(run({"generate", "--prompt", "x", "--kv-cache-dtype", "fp4"}), "--kv-cache-dtype");
  expect_error(run({"generate", "--prompt", "x", "--kv-scales", "guess"}), "--kv-scales");
  expect_error(run({"generate", "--prompt", "x", "--prompt-ids", "1"}),
               "exactly one of --prompt TEXT, --prompt-ids 1,2,3 and --prompts FILE.jsonl");
  expect_error(run({"generate"}), "exactly one of --prompt TEXT, --prompt-ids 1,2,3 and --prompts FILE.jsonl");
  expect_error(run({"generate", "--prompt-ids", "1,99999"}),
               "prompt token 1 is id 99999, outside the model's vocabulary [0, 256)");
  expect_error(run({"generate", "--prompt-ids", "1,x"}), "--prompt-ids");
  expect_error(run({"generate", "--prompt-ids", "1", "--temperature", "-1"}), "--temperature");
  expect_error(run({"generate", "--prompt-ids", "1", "--block-size", "24"}), "--block-size");
  expect_error(run({"logits", "--ids", "1,300", "--json"}), "outside the model's vocabulary");
  expect_error(
      run_cli(tmp_.path(), {"generate", (tmp_.path() / "nope").string(), "--prompt-ids", "1"}),
      "not a directory");
  expect_error(
      run_cli(tmp_.path(), {"generate", (tmp_.path() / "nope").string(), "--prompt", "hi"}),
      "not a directory");
#if !defined(E4KV_HAVE_CUDA_BACKEND)
  expect_error(run({"generate", "--prompt-ids", "1", "--device", "cuda"}),
               "built without the CUDA backend");
#endif
  expect_error(run({"generate", "--prompt-ids", "1", "--device", "tpu"}), "--device");
}

// The Qwen4Exp family through the CLI: a transformers reference checkpoint (the multimodal
// layout, no tokenizer) runs `generate --prompt-ids` and `logits` on the CPU, FP16 and E4M3
// (unit scales), with the greedy tokens transformers produced.
TEST(Qwen4ExpCli, GenerateAndLogitsOnATransformersCheckpoint) {
  const fs::path dir = fs::path(E4KV_SOURCE_DIR) / "tests" / "data" / "hf_qwen4exp" /
                       "cg_f32_hd64_mha_r2k6_hc2_top1";
  std::ifstream in(dir / "reference.json");
  const json ref = json::parse(in);
  std::string prompt;
  for (int id : ref["greedy"]["prompt_ids"])
    prompt += (prompt.empty() ? "" : ",") + std::to_string(id);
  const std::vector<int> expected = ref["greedy"]["output_ids"].get<std::vector<int>>();
  TempDir tmp;
  RunResult r =
      run_cli(tmp.path(), {"generate", dir.string(), "--prompt-ids", prompt, "--max-tokens",
                           std::to_string(expected.size()), "--json", "--ignore-eos"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("skipped 21 checkpoint tensors of the vision tower"), std::string::npos)
      << r.err;
  const json out = json::parse(r.out);
  EXPECT_EQ(out["output_ids"].get<std::vector<int>>(), expected);
  r = run_cli(tmp.path(), {"logits", dir.string(), "--ids", prompt, "--kv-cache-dtype", "fp8_e4m3",
                           "--kv-scales", "unit", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("NEGATIVE CONTROL"), std::string::npos) << r.err;
  EXPECT_EQ(json::parse(r.out)["logits"].size(), ref["greedy"]["prompt_ids"].size());
}

}  // namespace
}  // namespace e4kv
