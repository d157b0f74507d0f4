// Output paths through the built e4kv program: no command overwrites one of its inputs, writes
// inside a checkpoint, or replaces an existing file without --force; a kill -9 leaves nothing
// half-written under the final name. Also: text inputs must be valid UTF-8.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/file_io.h"
#include "io/checkpoint.h"
#include "testing/cli.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::expect_one_line_error;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

void expect_ok(const RunResult& r, const std::string& what) {
  ASSERT_TRUE(r.exited) << what;
  ASSERT_EQ(r.exit_code, 0) << what << ": " << r.err;
}

class OutputPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    ckpt_ = tmp_.path() / "ckpt";
    expect_ok(run_cli(tmp_.path(), {"synth-checkpoint", ckpt_.string(), "--family", "qwen4exp",
                                    "--layers", "4", "--seed", "1"}),
              "synth-checkpoint");
    stats_ = tmp_.path() / "stats.jsonl";
    expect_ok(run_cli(tmp_.path(), {"synth-stats", ckpt_.string(), "--out", stats_.string(),
                                    "--tokens", "64"}),
              "synth-stats");
  }
  RunResult summarize(const fs::path& out, const fs::path& report, bool force = false) {
    std::vector<std::string> args = {"summarize", stats_.string(), "--out", out.string(),
                                     "--report", report.string()};
    if (force) args.push_back("--force");
    return run_cli(tmp_.path(), args);
  }

  TempDir tmp_;
  fs::path ckpt_;
  fs::path stats_;
};

TEST_F(OutputPaths, SummarizeRefusesToOverwriteItsInput) {
  const std::string before = read_text(stats_);
  expect_one_line_error(summarize(stats_, tmp_.path() / "report", /*force=*/true),
                        "--out: " + stats_.string() + ": is the input");
  EXPECT_EQ(read_text(stats_), before);
  EXPECT_FALSE(fs::exists(tmp_.path() / "report"));
}

TEST_F(OutputPaths, NothingIsWrittenInsideACheckpoint) {
  const fs::path weights = ckpt_ / "model-00001-of-00001.safetensors";
  const fs::path target = fs::exists(weights) ? weights : ckpt_ / "config.json";
  const std::string before = read_text(target);
  expect_one_line_error(run_cli(tmp_.path(), {"synth-stats", ckpt_.string(), "--out",
                                              target.string(), "--force"}),
                        "inside the checkpoint directory");
  expect_one_line_error(summarize(ckpt_ / "scales.json", tmp_.path() / "report"),
                        "inside the checkpoint directory");
  expect_one_line_error(summarize(tmp_.path() / "scales.json", ckpt_ / "report"),
                        "inside the checkpoint directory");
  expect_one_line_error(run_cli(tmp_.path(), {"synth-checkpoint", (ckpt_ / "nested").string()}),
                        "inside the checkpoint directory");
  EXPECT_EQ(read_text(target), before);
  EXPECT_FALSE(fs::exists(ckpt_ / "scales.json"));
  EXPECT_FALSE(fs::exists(ckpt_ / "report"));
  EXPECT_FALSE(fs::exists(ckpt_ / "nested"));
}

TEST_F(OutputPaths, ExistingFilesNeedForce) {
  const fs::path out = tmp_.path() / "scales.json";
  const fs::path report = tmp_.path() / "report";
  expect_ok(summarize(out, report), "first summarize");
  const std::string first = read_text(out);
  write_text(out, "user data");
  expect_one_line_error(summarize(out, report), "--force");
  EXPECT_EQ(read_text(out), "user data");
  // The report's files count too, even when scales.json is new.
  expect_one_line_error(summarize(tmp_.path() / "other.json", report), "report.json: exists");
  EXPECT_FALSE(fs::exists(tmp_.path() / "other.json"));
  expect_ok(summarize(out, report, /*force=*/true), "summarize --force");
  EXPECT_EQ(read_text(out), first);

  write_text(tmp_.path() / "s2.jsonl", "mine");
  expect_one_line_error(run_cli(tmp_.path(), {"synth-stats", ckpt_.string(), "--out",
                                              (tmp_.path() / "s2.jsonl").string()}),
                        "--force");
  EXPECT_EQ(read_text(tmp_.path() / "s2.jsonl"), "mine");
}

// synth-checkpoint killed at several moments after it starts writing (its temporary directory
// exists): the output directory is never there afterwards, complete or not.
TEST_F(OutputPaths, KilledSynthCheckpointLeavesNothingHalfWritten) {
  for (int delay_ms : {0, 2, 10, 40, 120}) {
    const fs::path out = tmp_.path() / ("killed-" + std::to_string(delay_ms));
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::execl(E4KV_CLI_PATH, E4KV_CLI_PATH, "synth-checkpoint", out.c_str(), "--family", "llama",
              "--layers", "8", "--hidden-size", "512", "--vocab", "32000", "--shards", "4",
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    // Wait for the temporary directory (the run takes over a second; its writes start after
    // argument checks), then let it write a little longer.
    bool writing = false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!writing && std::chrono::steady_clock::now() < deadline) {
      for (const auto& entry : fs::directory_iterator(tmp_.path())) {
        if (is_temporary_name_for(entry.path(), out)) writing = true;
      }
      if (!writing) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(writing) << "synth-checkpoint never created its temporary directory";
    ASSERT_TRUE(WIFSIGNALED(status)) << "synth-checkpoint finished within " << delay_ms << " ms";
    EXPECT_FALSE(fs::exists(out)) << "a partial checkpoint at " << out;
  }
}

TEST_F(OutputPaths, InvalidUtf8TextIsRejectedWithItsOffset) {
  expect_one_line_error(run_cli(tmp_.path(), {"tokenize", ckpt_.string(), "--text", "ok \xFF"}),
                        "--text: invalid UTF-8 at byte 3");
  expect_one_line_error(
      run_cli(tmp_.path(), {"generate", ckpt_.string(), "--prompt", "ab\xC0\x80", "--max-tokens",
                            "1"}),
      "--prompt: invalid UTF-8 at byte 2");
}

}  // namespace
}  // namespace e4kv
