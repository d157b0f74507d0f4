// examples/simple_generate.cpp, built against the public library alone, run on a synthetic
// checkpoint: three prompts (text, chat messages, token ids) from three threads each stream their
// pieces and finish once; a bad model directory is one error line and exit code 1.
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "testing/cli.h"
#include "testing/files.h"

namespace e4kv {
namespace {

#if defined(E4KV_EXAMPLE_SIMPLE_PATH)

namespace fs = std::filesystem;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::shell_quote;
using testing_support::TempDir;

RunResult run_example(const fs::path& scratch, const std::string& args) {
  const fs::path out = scratch / "example-out.txt";
  const fs::path err = scratch / "example-err.txt";
  const std::string command = shell_quote(E4KV_EXAMPLE_SIMPLE_PATH) + " " + args + " >" +
                              shell_quote(out.string()) + " 2>" + shell_quote(err.string());
  const int status = std::system(command.c_str());
  RunResult r;
  r.exited = status != -1 && WIFEXITED(status);
  r.exit_code = r.exited ? WEXITSTATUS(status) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

TEST(ApiExample, ThreePromptsFromThreeThreadsStreamAndFinishOnce) {
  TempDir tmp;
  const fs::path model = tmp.path() / "model";
  RunResult made = run_cli(
      tmp.path(), {"synth-checkpoint", model.string(), "--layers", "2", "--hidden-size", "32",
                   "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--vocab", "320"});
  ASSERT_EQ(made.exit_code, 0) << made.err;

  RunResult r = run_example(tmp.path(), shell_quote(model.string()) + " 7");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<std::string, int> done;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    const size_t at = line.find("] done: ");
    if (line.rfind("[request ", 0) == 0 && at != std::string::npos) {
      done[line.substr(9, at - 9)] += 1;
      EXPECT_EQ(line.substr(at + 8), "length, 7 tokens") << line;
    }
  }
  EXPECT_EQ(done, (std::map<std::string, int>{{"0", 1}, {"1", 1}, {"2", 1}})) << r.out;
  // Text streamed for the text prompt before it finished.
  EXPECT_NE(r.out.find("[request 0] "), r.out.find("[request 0] done: ")) << r.out;

  RunResult bad = run_example(tmp.path(), shell_quote((tmp.path() / "nothing").string()));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_TRUE(bad.out.empty()) << bad.out;
  EXPECT_NE(bad.err.find("e4kv_example_simple: error: model: "), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("nothing: not a directory"), std::string::npos) << bad.err;
}

#endif  // E4KV_EXAMPLE_SIMPLE_PATH

}  // namespace
}  // namespace e4kv
