// `e4kv overlay` and `e4kv verify` through the built program (E4KV_CLI_PATH): the happy path in
// every link mode, exit code 1 with a clear message for each bad input, and a process killed at any
// point leaves no derived directory (only a clearly named temporary one that the next run removes).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/sha256.h"
#include "core/status.h"
#include "testing/cli.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

// Runs `[env] e4kv args...` with stdout and stderr captured in files under `scratch`.

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// Exit code 1, nothing on stdout, stderr "e4kv: error: ..." holding `needle`; one line unless
// `multi_line` (the gate's message lists every problem on its own line).
void expect_error(const RunResult& r, const std::string& what, const std::string& needle,
                  bool multi_line = false) {
  SCOPED_TRACE(what);
  EXPECT_TRUE(r.exited);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("e4kv: error: ", 0), 0u) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_TRUE(contains(r.err, needle)) << "expected \"" << needle << "\" in\n" << r.err;
  if (!multi_line) {
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// Every entry below `root`: mode, size, digest or link target, mtime (ns).
std::map<std::string, std::string> snapshot(const fs::path& root) {
  std::map<std::string, std::string> entries;
  auto add = [&](const fs::path& path) {
    struct stat st {};
    EXPECT_EQ(::lstat(path.c_str(), &st), 0);
    std::string digest;
    if (S_ISREG(st.st_mode)) digest = *sha256_file(path);
    entries[path.string()] = cat(st.st_mode, " ", st.st_size, " ", digest, " ", st.st_mtim.tv_sec,
                                 ".", st.st_mtim.tv_nsec);
  };
  add(root);
  for (const auto& entry : fs::recursive_directory_iterator(root)) add(entry.path());
  return entries;
}

std::vector<std::string> temp_dirs(const fs::path& dir) {
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (contains(name, ".e4kv-overlay-tmp.")) found.push_back(name);
  }
  return found;
}

const char* kScalesJson = R"({"format": "e4kv-kv-scales/1", "policy": "absmax",
  "scales": {"model.layers.3.self_attn.k_scale": 0.0171247218,
             "model.layers.3.self_attn.v_scale": 0.0841238871,
             "model.layers.7.self_attn.k_scale": 1.0,
             "model.layers.7.self_attn.v_scale": 0.5},
  "source": {"statistics": ["shard0.stats.json"]}})";

class OverlayCli : public ::testing::Test {
 protected:
  fs::path make_base(const std::vector<std::string>& extra = {}, const std::string& name = "base") {
    const fs::path dir = tmp_.path() / name;
    std::vector<std::string> args = {"synth-checkpoint", dir.string(), "--family", "qwen4exp",
                                     "--layers",         "8",          "--shards", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    RunResult r = run_cli(tmp_.path(), args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return dir;
  }
  fs::path scales() {
    const fs::path path = tmp_.path() / "scales.json";
    if (!fs::exists(path)) write_text(path, kScalesJson);
    return path;
  }
  TempDir tmp_;
};

TEST_F(OverlayCli, OverlayThenVerifyInEveryLinkMode) {
  const fs::path base = make_base();
  const std::map<std::string, std::string> before = snapshot(base);
  for (const char* mode : {"symlink", "hardlink", "copy"}) {
    SCOPED_TRACE(mode);
    const fs::path out = tmp_.path() / cat("derived-", mode);
    RunResult r = run_cli(tmp_.path(), {"overlay", base.string(), "--scales", scales().string(),
                                        "--out", out.string(), "--link", mode});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;  // no progress bar: stderr is not a terminal
    EXPECT_TRUE(contains(r.out, "wrote overlay " + out.string())) << r.out;
    EXPECT_TRUE(contains(r.out, "kv scales: 4/4 valid for kv-cache-dtype fp8_e4m3")) << r.out;
    EXPECT_TRUE(contains(r.out, cat("(", mode, ")"))) << r.out;

    RunResult v = run_cli(tmp_.path(), {"verify", out.string()});
    ASSERT_EQ(v.exit_code, 0) << v.err;
    EXPECT_TRUE(contains(v.out, "start-up with --kv-cache-dtype fp8_e4m3 would succeed")) << v.out;
    EXPECT_TRUE(contains(v.out, "kv scales: 4/4 valid")) << v.out;
    EXPECT_TRUE(contains(v.out, "files hashed, all match")) << v.out;
  }
  EXPECT_EQ(snapshot(base), before);
  EXPECT_TRUE(temp_dirs(tmp_.path()).empty());
}

TEST_F(OverlayCli, ProgressBarOnRequest) {
  const fs::path base = make_base();
  RunResult r = run_cli(tmp_.path(), {"overlay", base.string(), "--scales", scales().string(),
                                      "--out", (tmp_.path() / "d").string(), "--progress"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "\rhashing [")) << r.err;
  EXPECT_TRUE(contains(r.err, "100.0%")) << r.err;
  EXPECT_EQ(r.err.back(), '\n');
  RunResult v = run_cli(tmp_.path(), {"verify", (tmp_.path() / "d").string(), "--progress"});
  ASSERT_EQ(v.exit_code, 0) << v.err;
  EXPECT_TRUE(contains(v.err, "\rhashing [")) << v.err;
}

TEST_F(OverlayCli, UnitScaleNegativeControl) {
  const fs::path base = make_base();
  const fs::path out = tmp_.path() / "unit";
  RunResult r = run_cli(tmp_.path(), {"overlay", base.string(), "--unit-scale-negative-control",
                                      "--out", out.string(), "--hash", "index-config"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "NEGATIVE CONTROL")) << r.out;
  EXPECT_TRUE(contains(r.out, "policy unit-scale-negative-control")) << r.out;
  RunResult v = run_cli(tmp_.path(), {"verify", out.string()});
  ASSERT_EQ(v.exit_code, 0) << v.err;
  EXPECT_TRUE(contains(v.out, "--hash index-config")) << v.out;
}

TEST_F(OverlayCli, BadOverlayInputs) {
  const fs::path base = make_base();
  const fs::path with_scales = make_base({"--with-kv-scales"}, "with_scales");
  const fs::path out = tmp_.path() / "d";
  const std::string s = scales().string();
  write_text(
      tmp_.path() / "incomplete.json",
      R"({"format": "e4kv-kv-scales/1", "scales": {"model.layers.3.self_attn.k_scale": 0.5}})");
  write_text(
      tmp_.path() / "zero.json",
      R"({"format": "e4kv-kv-scales/1", "scales": {"model.layers.3.self_attn.k_scale": 0}})");
  write_text(tmp_.path() / "broken.json", "{\"format\": ");
  fs::create_directories(tmp_.path() / "full");
  write_text(tmp_.path() / "full" / "x", "x");

  struct Case {
    std::string what;
    std::vector<std::string> args;
    std::string needle;
    bool multi_line = false;
  };
  const std::vector<Case> cases = {
      {"no scales", {"overlay", base.string(), "--out", out.string()}, "--scales: is required"},
      {"no out", {"overlay", base.string(), "--scales", s}, "--out: is required"},
      {"scales and unit",
       {"overlay", base.string(), "--scales", s, "--out", out.string(),
        "--unit-scale-negative-control"},
       "not both"},
      {"bad link",
       {"overlay", base.string(), "--scales", s, "--out", out.string(), "--link", "soft"},
       "--link: unknown mode \"soft\"; expected symlink, hardlink or copy"},
      {"bad hash",
       {"overlay", base.string(), "--scales", s, "--out", out.string(), "--hash", "some"},
       "--hash: unknown scope \"some\""},
      {"missing base",
       {"overlay", (tmp_.path() / "nope").string(), "--scales", s, "--out", out.string()},
       "base checkpoint directory not found"},
      {"missing scales",
       {"overlay", base.string(), "--scales", (tmp_.path() / "nope.json").string(), "--out",
        out.string()},
       "nope.json: not found"},
      {"broken scales",
       {"overlay", base.string(), "--scales", (tmp_.path() / "broken.json").string(), "--out",
        out.string()},
       "broken.json: invalid JSON"},
      {"zero scale",
       {"overlay", base.string(), "--scales", (tmp_.path() / "zero.json").string(), "--out",
        out.string()},
       "is not > 0"},
      {"incomplete scales",
       {"overlay", base.string(), "--scales", (tmp_.path() / "incomplete.json").string(), "--out",
        out.string()},
       "KV scale gate: loaded 1/4 K/V scales for kv-cache-dtype fp8_e4m3 from ",
       true},
      {"base holds scales",
       {"overlay", with_scales.string(), "--scales", s, "--out", out.string()},
       "the base already holds 4 K/V scale key(s)"},
      {"out is base",
       {"overlay", base.string(), "--scales", s, "--out", base.string()},
       "is the base directory"},
      {"out inside base",
       {"overlay", base.string(), "--scales", s, "--out", (base / "derived").string()},
       "lies inside the base directory"},
      {"out not empty",
       {"overlay", base.string(), "--scales", s, "--out", (tmp_.path() / "full").string()},
       "exists and is not empty"},
  };
  // Nothing changes in the bases or the non-empty output, and nothing new appears beside them.
  auto state = [&] {
    std::map<std::string, std::string> all = snapshot(base);
    all.merge(snapshot(with_scales));
    all.merge(snapshot(tmp_.path() / "full"));
    for (const auto& entry : fs::directory_iterator(tmp_.path())) all[entry.path().string()];
    return all;
  };
  const std::map<std::string, std::string> before = state();
  for (const Case& c : cases) {
    RunResult r = run_cli(tmp_.path(), c.args);
    expect_error(r, c.what, c.needle, c.multi_line);
    EXPECT_FALSE(fs::exists(out)) << c.what;
    EXPECT_FALSE(fs::exists(base / "derived")) << c.what;
  }
  EXPECT_EQ(state(), before);

  // The gate's message lists each missing key on its own line and says how to fix it.
  RunResult r =
      run_cli(tmp_.path(), {"overlay", base.string(), "--scales",
                            (tmp_.path() / "incomplete.json").string(), "--out", out.string()});
  EXPECT_TRUE(contains(r.err, "\n  missing: model.layers.3.self_attn.v_scale\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "\n  missing: model.layers.7.self_attn.k_scale\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "make complete scales: e4kv summarize")) << r.err;
}

TEST_F(OverlayCli, BadVerifyInputs) {
  const fs::path base = make_base();
  const fs::path out = tmp_.path() / "d";
  ASSERT_EQ(run_cli(tmp_.path(), {"overlay", base.string(), "--scales", scales().string(), "--out",
                                  out.string()})
                .exit_code,
            0);
  expect_error(run_cli(tmp_.path(), {"verify", out.string(), "--kv-cache-dtype", "int8"}),
               "bad dtype", "--kv-cache-dtype: unknown value \"int8\"");
  expect_error(run_cli(tmp_.path(), {"verify", (tmp_.path() / "nope").string()}), "missing dir",
               "checkpoint directory not found");

  // A plain checkpoint without scales: the start-up message, multi-line.
  RunResult plain = run_cli(tmp_.path(), {"verify", base.string()});
  expect_error(plain, "plain without scales", "KV scale gate: loaded 0/4", true);
  EXPECT_TRUE(contains(plain.err, cat("make an overlay: e4kv summarize STATS... --out "
                                      "scales.json --report report && e4kv overlay ",
                                      base.string())))
      << plain.err;
  // ... which is fine for an FP16 cache.
  RunResult fp16 = run_cli(tmp_.path(), {"verify", base.string(), "--kv-cache-dtype", "fp16"});
  EXPECT_EQ(fp16.exit_code, 0) << fp16.err;
  EXPECT_TRUE(contains(fp16.out, "provenance: not checked")) << fp16.out;

  // A changed base shard.
  {
    std::fstream shard(base / "model-00002-of-00002.safetensors",
                       std::ios::in | std::ios::out | std::ios::binary);
    shard.seekp(-1, std::ios::end);
    shard.put('\x7f');
  }
  expect_error(run_cli(tmp_.path(), {"verify", out.string()}), "changed shard",
               "base file model-00002-of-00002.safetensors changed since the overlay was made");
}

// The test hook stops the process at each named point, as a SIGKILL there would.
TEST_F(OverlayCli, KilledAtEveryPointLeavesNoDerivedDirectory) {
  const fs::path base = make_base();
  const fs::path out = tmp_.path() / "derived";
  const std::map<std::string, std::string> before = snapshot(base);
  for (const char* point : {"after-temp-dir", "after-links", "after-scales", "after-index",
                            "after-provenance", "before-rename"}) {
    SCOPED_TRACE(point);
    RunResult r =
        run_cli(tmp_.path(),
                {"overlay", base.string(), "--scales", scales().string(), "--out", out.string()},
                cat("E4KV_TEST_CRASH_AT=", point));
    EXPECT_TRUE(r.exited);
    EXPECT_EQ(r.exit_code, 9) << r.err;
    EXPECT_FALSE(fs::exists(out));
    const std::vector<std::string> left = temp_dirs(tmp_.path());
    ASSERT_EQ(left.size(), 1u);
    EXPECT_EQ(left[0].rfind(".derived.e4kv-overlay-tmp.", 0), 0u) << left[0];
    EXPECT_EQ(snapshot(base), before);

    // The next run removes the leftover and succeeds.
    RunResult next = run_cli(tmp_.path(), {"overlay", base.string(), "--scales", scales().string(),
                                           "--out", out.string()});
    ASSERT_EQ(next.exit_code, 0) << next.err;
    EXPECT_TRUE(contains(next.out,
                         "removed a temporary directory left by an interrupted "
                         "overlay: " +
                             (tmp_.path() / left[0]).string()))
        << next.out;
    EXPECT_TRUE(temp_dirs(tmp_.path()).empty());
    EXPECT_EQ(run_cli(tmp_.path(), {"verify", out.string()}).exit_code, 0);
    fs::remove_all(out);
  }
}

// A real SIGKILL at several moments of a copy-mode overlay of a larger base: afterwards the output
// either does not exist or is complete and verifies.
TEST_F(OverlayCli, SigkillAtAnyMomentLeavesNothingOrAWholeOverlay) {
  const fs::path base =
      make_base({"--dtype", "f32", "--vocab", "16384", "--hidden-size", "128", "--head-dim", "32"});
  const fs::path out = tmp_.path() / "derived";
  const std::string s = scales().string();
  int absent = 0;
  int complete = 0;
  for (int delay_ms : {0, 1, 3, 6, 10, 15, 25, 40, 60, 100}) {
    SCOPED_TRACE(cat("delay ", delay_ms, " ms"));
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, STDOUT_FILENO);
      ::dup2(null, STDERR_FILENO);
      ::execl(E4KV_CLI_PATH, E4KV_CLI_PATH, "overlay", base.c_str(), "--scales", s.c_str(), "--out",
              out.c_str(), "--link", "copy", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    if (fs::exists(out)) {
      ++complete;
      RunResult v = run_cli(tmp_.path(), {"verify", out.string()});
      EXPECT_EQ(v.exit_code, 0) << v.err;
      fs::remove_all(out);
    } else {
      ++absent;
    }
    for (const std::string& left : temp_dirs(tmp_.path())) {
      EXPECT_EQ(left.rfind(".derived.e4kv-overlay-tmp.", 0), 0u) << left;
    }
  }
  EXPECT_GT(absent, 0);
  // A final run cleans every leftover.
  RunResult r = run_cli(tmp_.path(), {"overlay", base.string(), "--scales", s, "--out",
                                      out.string(), "--link", "copy"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(temp_dirs(tmp_.path()).empty());
  (void)complete;
}

}  // namespace
}  // namespace e4kv
