// Limits that flags and config.json set, through the built e4kv program: memory follows what a run
// uses, not the largest length it may reach; every bound a command enforces is the one its message
// states; a measure over nothing is never reported as a number.
#include <sys/resource.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/cli.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::run_cli_timed;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

void expect_ok(const RunResult& r, const std::string& what) {
  ASSERT_TRUE(r.exited) << what;
  ASSERT_EQ(r.exit_code, 0) << what << ": " << r.err << r.out;
}

// Exit code 1 or 2 (CLI11's usage errors), one "e4kv: error:" line holding `needle`.
void expect_error(const RunResult& r, const std::string& needle) {
  SCOPED_TRACE(needle);
  ASSERT_TRUE(r.exited);
  EXPECT_TRUE(r.exit_code == 1 || r.exit_code == 2) << r.exit_code;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_EQ(r.err.rfind("e4kv: error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

// The largest resident set of any child this process has waited for, in bytes.
int64_t children_max_rss() {
  rusage usage{};
  getrusage(RUSAGE_CHILDREN, &usage);
  return int64_t(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

class Limits : public ::testing::Test {
 protected:
  void SetUp() override {
    scratch_ = tmp_.path() / "scratch";
    fs::create_directories(scratch_);
    // A small dense checkpoint with a tokenizer and embedded K/V scales (compare's E4M3 runs pass
    // the gate): 2 layers, 1 KV head of 16 (16 values per token per K/V tensor).
    model_ = tmp_.path() / "llama";
    expect_ok(run_cli(scratch_, {"synth-checkpoint", model_.string(), "--layers", "2",
                                 "--hidden-size", "32", "--heads", "2", "--kv-heads", "1",
                                 "--head-dim", "16", "--vocab", "256", "--with-kv-scales"}),
              "synth-checkpoint");
  }

  // A copy of the checkpoint whose config.json says max_position_embeddings = `n`.
  fs::path with_max_positions(int64_t n) {
    const fs::path copy = tmp_.path() / ("llama-" + std::to_string(n));
    fs::copy(model_, copy, fs::copy_options::recursive);
    json config = json::parse(read_text(copy / "config.json"));
    config["max_position_embeddings"] = n;
    write_text(copy / "config.json", config.dump(2));
    return copy;
  }

  // A prompts file of one document of `n` token ids.
  fs::path prompt_of(int n) {
    json ids = json::array();
    for (int i = 0; i < n; ++i) ids.push_back(3 + i % 200);
    const fs::path path = tmp_.path() / ("prompt-" + std::to_string(n) + ".jsonl");
    write_text(path, json{{"token_ids", ids}}.dump() + "\n");
    return path;
  }

  TempDir tmp_;
  fs::path scratch_;
  fs::path model_;
};

// --max-model-len 2147483647 (or a config.json that allows that many positions) is a limit, not a
// reservation: generate and calibrate size every table by the KV pool a run needs. Before, the
// block table alone was sized for 2^31 positions per sequence (over 8 GB).
TEST_F(Limits, HugeMaxModelLenCostsOnlyWhatTheRunUses) {
  constexpr int64_t kMaxRss = int64_t{1} << 30;  // the runs below need a few tens of MB
  const auto timeout = std::chrono::seconds(120);
  const fs::path corpus = prompt_of(12);
  auto check = [&](const std::vector<std::string>& args, const std::string& what) {
    const auto r = run_cli_timed(scratch_, args, timeout);
    ASSERT_FALSE(r.timed_out) << what;
    ASSERT_EQ(r.signal, 0) << what << ": " << r.err;
    expect_ok(r, what);
    EXPECT_LT(children_max_rss(), kMaxRss) << what;
  };
  check({"generate", model_.string(), "--prompt-ids", "1,2,3", "--max-tokens", "4",
         "--max-model-len", "2147483647"},
        "generate --max-model-len 2147483647");
  check({"calibrate", model_.string(), "--corpus", corpus.string(), "--out",
         (tmp_.path() / "stats-flag").string(), "--generate-tokens", "2", "--max-model-len",
         "2147483647", "--no-progress"},
        "calibrate --max-model-len 2147483647");
  const fs::path huge = with_max_positions(2147483647);
  check({"generate", huge.string(), "--prompt-ids", "1,2,3", "--max-tokens", "4"},
        "generate, max_position_embeddings 2147483647");
  check({"calibrate", huge.string(), "--corpus", corpus.string(), "--out",
         (tmp_.path() / "stats-config").string(), "--generate-tokens", "2", "--no-progress"},
        "calibrate, max_position_embeddings 2147483647");
}

// synth-stats draws every value, so its bound is on the values drawn (2^30), stated per model.
TEST_F(Limits, SynthStatsBoundsTheValuesItDraws) {
  // 2 layers x (K, V) = 4 tensors of 1 KV head x 16 channels: 64 values per token.
  const int64_t max_tokens = (int64_t{1} << 30) / (4 * 16);
  const fs::path out = tmp_.path() / "stats.jsonl";
  RunResult r = run_cli(scratch_, {"synth-stats", model_.string(), "--out", out.string(),
                                   "--tokens", std::to_string(max_tokens + 1)});
  expect_error(r, "--tokens: expected 1 to " + std::to_string(max_tokens) + " for this model");
  EXPECT_FALSE(fs::exists(out));
  // The documented maximum of before (10^8 tokens) is refused at once, not drawn for minutes.
  r = run_cli(scratch_, {"synth-stats", model_.string(), "--out", out.string(), "--tokens",
                         "100000000"});
  expect_error(r, "--tokens: expected 1 to " + std::to_string(max_tokens));
}

// compare needs the positions its runs use: a teacher-forced prompt its length, a greedy
// continuation of T tokens after P prompt tokens P + T, whatever else is asked.
TEST_F(Limits, CompareNeedsThePositionsItsRunsUse) {
  const fs::path prompts = prompt_of(40);
  RunResult r = run_cli(scratch_, {"compare", model_.string(), "--prompts", prompts.string(),
                                   "--max-tokens", "0", "--max-model-len", "40"});
  expect_ok(r, "compare --max-tokens 0 at the prompt's own length");
  r = run_cli(scratch_, {"compare", model_.string(), "--prompts", prompts.string(),
                         "--max-tokens", "3", "--max-model-len", "42"});
  expect_error(r, "needs 43 positions; the max model length is 42 (--max-model-len)");
  r = run_cli(scratch_, {"compare", model_.string(), "--prompts", prompts.string(),
                         "--max-tokens", "3", "--max-model-len", "43"});
  expect_ok(r, "compare --max-tokens 3 at prompt + 3 positions");
}

TEST_F(Limits, ComparePasskeyRefusesEmptyOrTooShortContexts) {
  RunResult r = run_cli(scratch_, {"compare", model_.string(), "--task", "passkey", "--context",
                                   "0"});
  expect_error(r, "--context: 0 is outside 1 to 2147483647");
  r = run_cli(scratch_, {"compare", model_.string(), "--task", "passkey", "--context", "1k,0k"});
  expect_error(r, "--context: 0k is outside 1 to 2147483647");
  r = run_cli(scratch_, {"compare", model_.string(), "--task", "passkey", "--context", "5"});
  expect_error(r, "--context 5: a passkey prompt's fixed text alone takes");
  r = run_cli(scratch_, {"compare", model_.string(), "--task", "passkey", "--depths", "-5"});
  expect_error(r, "--depths: -5 is outside 0 to 100");
  r = run_cli(scratch_, {"compare", model_.string(), "--task", "passkey", "--depths", "50,x"});
  expect_error(r, "--depths: \"x\" is not a depth in percent");
}

// A passkey-only run measures no prompt: its report has no perplexity, KL or attention error.
TEST_F(Limits, ComparePasskeyOnlyReportsNoMeasureOverNothing) {
  const fs::path out = tmp_.path() / "compare";
  RunResult r = run_cli(scratch_, {"compare", model_.string(), "--task", "passkey", "--context",
                                   "1k", "--depths", "50", "--out", out.string()});
  expect_ok(r, "compare --task passkey");
  const json report = json::parse(read_text(out / "compare.json"));
  EXPECT_EQ(report["prompts"], 0);
  EXPECT_TRUE(report["reference"]["perplexity"].is_null()) << report.dump();
  for (const json& mode : report["modes"]) {
    EXPECT_TRUE(mode["perplexity"].is_null());
    EXPECT_TRUE(mode["mean_kl"].is_null());
    EXPECT_TRUE(mode["attention_output"]["rel_l2"].is_null());
    EXPECT_TRUE(mode["attention_output"]["cosine"].is_null());
    ASSERT_EQ(mode["passkey"].size(), 1u);
    EXPECT_EQ(mode["passkey"][0]["total"], 1);
  }
  EXPECT_NE(r.out.find("| fp16 | - | - |"), std::string::npos) << r.out;
}

// The bound calibrate names is the one that is short.
TEST_F(Limits, CalibrateNamesTheLimitThatLeavesNoRoom) {
  const fs::path corpus = prompt_of(8);
  RunResult r = run_cli(scratch_, {"calibrate", model_.string(), "--corpus", corpus.string(),
                                   "--out", (tmp_.path() / "a").string(), "--max-model-len", "1"});
  expect_error(r, "--max-model-len 1 leaves no room for a prompt");
  EXPECT_EQ(r.err.find("--generate-tokens 0"), std::string::npos) << r.err;
  r = run_cli(scratch_, {"calibrate", model_.string(), "--corpus", corpus.string(), "--out",
                         (tmp_.path() / "b").string(), "--max-model-len", "8",
                         "--generate-tokens", "7"});
  expect_error(r, "--generate-tokens 7 leaves no room for a prompt within --max-model-len 8");
  const fs::path one = with_max_positions(1);
  r = run_cli(scratch_, {"calibrate", one.string(), "--corpus", corpus.string(), "--out",
                         (tmp_.path() / "c").string()});
  expect_error(r, "max_position_embeddings 1 (config.json) leaves no room for a prompt");
}

// A value beyond the flag's type and a value beyond its range get the same message.
TEST_F(Limits, OutOfRangeIntegersQuoteTheFlagsRange) {
  for (const std::string value : {"2147483648", "99999999999999999999", "-1"}) {
    RunResult r = run_cli(scratch_, {"generate", model_.string(), "--prompt-ids", "1",
                                     "--max-tokens", value});
    expect_error(r, "--max-tokens: expected 0 to 2147483647, got " + value);
    r = run_cli(scratch_, {"compare", model_.string(), "--prompts", prompt_of(4).string(),
                           "--max-tokens", value});
    expect_error(r, "--max-tokens: expected 0 to 2147483647, got " + value);
    r = run_cli(scratch_, {"generate", model_.string(), "--prompt-ids", "1", "--max-model-len",
                           value});
    expect_error(r, "--max-model-len: expected 0 to 2147483647, got " + value);
  }
}

}  // namespace
}  // namespace e4kv
