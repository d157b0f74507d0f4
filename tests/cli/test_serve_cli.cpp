// `e4kv serve` as a process: the scale gate stops start-up with its message and exit code 1;
// SIGTERM lets the request in flight finish, then the server exits 0.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <future>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "testing/cli.h"
#include "testing/files.h"

namespace e4kv {
namespace {

const std::string kModel = std::string(E4KV_SOURCE_DIR) + "/models/tiny-qwen4exp";

TEST(ServeCli, ScaleGateStopsStartUp) {
  testing_support::TempDir dir;
  const auto r = testing_support::run_cli_timed(
      dir.path(), {"serve", kModel, "--port", "0", "--kv-cache-dtype", "fp8_e4m3"},
      std::chrono::seconds(60));
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out.find("listening"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("e4kv: error:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("scale"), std::string::npos) << r.err;
}

TEST(ServeCli, EngineErrorsNameTheFlag) {
  testing_support::TempDir dir;
  const auto r = testing_support::run_cli_timed(
      dir.path(), {"serve", kModel, "--port", "0", "--kv-cache-memory-bytes", "20000000"},
      std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("e4kv: error: --kv-cache-memory-bytes: "), std::string::npos) << r.err;
}

TEST(ServeCli, SigtermFinishesTheRequestInFlightThenExitsZero) {
  testing_support::TempDir dir;
  const std::string out_path = (dir.path() / "out.txt").string();
  const std::string err_path = (dir.path() / "err.txt").string();
  const pid_t pid = ::fork();
  if (pid == 0) {
    FILE* out = std::freopen(out_path.c_str(), "w", stdout);
    FILE* err = std::freopen(err_path.c_str(), "w", stderr);
    if (out == nullptr || err == nullptr) ::_exit(127);
    ::execl(E4KV_CLI_PATH, E4KV_CLI_PATH, "serve", kModel.c_str(), "--port", "0", "--max-model-len",
            "512", "--threads", "2", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(pid, 0);
  int port = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  const std::string listening = "listening on http://127.0.0.1:";
  while (port == 0 && std::chrono::steady_clock::now() < until) {
    const std::string text = testing_support::read_text(out_path);
    const size_t at = text.find(listening);
    if (at != std::string::npos && text.find('\n', at) != std::string::npos) {
      port = std::atoi(text.c_str() + at + listening.size());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_NE(port, 0) << testing_support::read_text(err_path);
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60);
  ASSERT_EQ(c.Get("/health")->status, 200);
  // A request long enough to be in flight when the signal comes.
  auto reply = std::async(std::launch::async, [&] {
    httplib::Client r("127.0.0.1", port);
    r.set_read_timeout(60);
    return r.Post("/v1/completions",
                  R"({"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": true})",
                  "application/json");
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ::kill(pid, SIGTERM);
  httplib::Result r = reply.get();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  const nlohmann::json body = nlohmann::json::parse(r->body);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], 300);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << testing_support::read_text(err_path);
  EXPECT_NE(testing_support::read_text(err_path).find("stopped"), std::string::npos);
}

}  // namespace
}  // namespace e4kv
