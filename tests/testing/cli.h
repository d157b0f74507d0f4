// Runs the built e4kv program (E4KV_CLI_PATH, defined for the test binary) and captures its exit
// status, standard output and standard error.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
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

// True when `err` holds a report of AddressSanitizer, LeakSanitizer or UndefinedBehaviorSanitizer
// (a sanitizer build, `make test-sanitize`): the e4kv process under test broke memory safety or
// hit undefined behaviour, whatever its exit code says.
inline bool has_sanitizer_report(const std::string& err) {
  return err.find("ERROR: AddressSanitizer") != std::string::npos ||
         err.find("ERROR: LeakSanitizer") != std::string::npos ||
         err.find(": runtime error: ") != std::string::npos;
}

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
  EXPECT_FALSE(has_sanitizer_report(result.err)) << result.err;
  return result;
}

struct TimedRunResult : RunResult {
  int signal = 0;          // the signal that ended the process, 0 when it exited
  bool timed_out = false;  // killed (SIGKILL) by run_cli_timed after the timeout
  double seconds = 0.0;    // wall time
};

// Runs `e4kv args...` directly (no shell) with stdout and stderr captured in files under `scratch`,
// in a process group of its own that is killed when it runs longer than `timeout`: a hang is a
// test failure, not a stuck CI job. Reports the signal that ended the process, if any.
// `poll`, when given, is called with the child's pid and its stdout path on every poll while it
// runs (run_cli_serving stops a server through it).
inline TimedRunResult run_cli_timed(
    const std::filesystem::path& scratch, const std::vector<std::string>& args,
    std::chrono::milliseconds timeout,
    const std::function<void(pid_t, const std::filesystem::path&)>& poll = {}) {
  const std::filesystem::path out_path = scratch / "stdout.txt";
  const std::filesystem::path err_path = scratch / "stderr.txt";
  std::vector<std::string> argv_text{E4KV_CLI_PATH};
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_text) argv.push_back(arg.data());
  argv.push_back(nullptr);

  TimedRunResult result;
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // The child: only async-signal-safe calls until exec.
    ::setpgid(0, 0);
    const int out_fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err_fd = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (out_fd < 0 || err_fd < 0 || null_fd < 0) ::_exit(127);
    ::dup2(null_fd, STDIN_FILENO);
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  if (pid < 0) {
    ADD_FAILURE() << "fork failed";
    return result;
  }
  ::setpgid(pid, pid);  // also here, so the group exists whichever of the two runs first
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0) {
      ADD_FAILURE() << "waitpid failed";
      return result;
    }
    if (poll) poll(pid, out_path);
    if (std::chrono::steady_clock::now() - start > timeout) {
      result.timed_out = true;
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.exited = WIFEXITED(status);
  result.exit_code = result.exited ? WEXITSTATUS(status) : -1;
  result.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  result.out = read_text(out_path);
  result.err = read_text(err_path);
  std::filesystem::remove(out_path);
  std::filesystem::remove(err_path);
  return result;
}

// run_cli_timed for a command that serves until told to stop (`e4kv serve`): once its stdout
// holds `ready` ("listening on"), it gets SIGTERM and must exit by itself. `served` says whether
// it got that far; a command that ends before (a refused flag) is reported as it ended.
struct ServedRunResult : TimedRunResult {
  bool served = false;
};
inline ServedRunResult run_cli_serving(const std::filesystem::path& scratch,
                                       const std::vector<std::string>& args,
                                       std::chrono::milliseconds timeout,
                                       const std::string& ready = "listening on") {
  bool served = false;
  ServedRunResult result{run_cli_timed(
      scratch, args, timeout, [&](pid_t pid, const std::filesystem::path& out_path) {
        if (!served && read_text(out_path).find(ready) != std::string::npos) {
          served = true;
          ::kill(pid, SIGTERM);
        }
      })};
  result.served = served;
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
