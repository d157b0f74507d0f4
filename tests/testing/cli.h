// Runs the built e4kv program (E4KV_CLI_PATH, defined for the test binary) and captures its exit
// status, standard output and standard error.
#pragma once

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/files.h"

namespace e4kv::testing_support {

// Single-quotes an argument for /bin/sh.
inline std::string shell_quote(const std::string& arg) {
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct RunResult {
  bool exited = false;  // false: killed by a signal (or system() failed)
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs `[env] e4kv args...` with stdout and stderr captured in files under `scratch`. `env` is
// prepended as is (e.g. "E4KV_TEST_CRASH_AT=after-links").
inline RunResult run_cli(const std::filesystem::path& scratch, const std::vector<std::string>& args,
                         const std::string& env = "") {
  const std::filesystem::path out_path = scratch / "stdout.txt";
  const std::filesystem::path err_path = scratch / "stderr.txt";
  std::string command = env.empty() ? "" : env + " ";
  command += shell_quote(E4KV_CLI_PATH);
  for (const std::string& arg : args) command += " " + shell_quote(arg);
  command += " >" + shell_quote(out_path.string()) + " 2>" + shell_quote(err_path.string());
  const int status = std::system(command.c_str());
  RunResult result;
  result.exited = status != -1 && WIFEXITED(status);
  result.exit_code = result.exited ? WEXITSTATUS(status) : -1;
  result.out = read_text(out_path);
  result.err = read_text(err_path);
  std::filesystem::remove(out_path);
  std::filesystem::remove(err_path);
  return result;
}

// Exit code 1, nothing on stdout, one "e4kv: error:" line containing `needle`.
inline void expect_one_line_error(const RunResult& r, const std::string& needle) {
  SCOPED_TRACE(needle);
  EXPECT_TRUE(r.exited);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("e4kv: error:", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

}  // namespace e4kv::testing_support
