// Outputs made of several files, through the built e4kv program (core/output_set.h):
//   - calibrate's two files of a shard: a kill between them (the crash hook E4KV_TEST_CRASH_AT)
//     leaves a set that summarize refuses, naming both files; the next run replaces it;
//   - compare --out and summarize --report appear at once: a kill before the rename leaves the
//     old set (or nothing), never a mix;
//   - a second writer of the same output is refused while the first holds its lock file, naming
//     the lock and its holder (for calibrate, compare, summarize and overlay); other shards of a
//     calibration still run beside each other; a lock file left by a killed run blocks nothing;
//   - no command writes into the root directory /.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/sha256.h"
#include "testing/cli.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::expect_one_line_error;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

void expect_ok(const RunResult& r, const std::string& what) {
  ASSERT_TRUE(r.exited) << what;
  ASSERT_EQ(r.exit_code, 0) << what << ": " << r.err << r.out;
}

// What the crash hook's _exit(9) looks like from outside.
void expect_crashed(const RunResult& r, const std::string& what) {
  ASSERT_TRUE(r.exited) << what;
  ASSERT_EQ(r.exit_code, 9) << what << ": " << r.err << r.out;
}

// Entries of a directory, by name.
std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir))
    names.insert(entry.path().filename().string());
  return names;
}

// Another process's lock, as a running e4kv would hold it: the test opens the lock file and takes
// flock() itself (the e4kv under test is a separate process with its own open file).
class HeldLock {
 public:
  explicit HeldLock(const fs::path& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    EXPECT_GE(fd_, 0) << path;
    EXPECT_EQ(::flock(fd_, LOCK_EX | LOCK_NB), 0) << path;
    const std::string holder = "pid 424242: e4kv held-by-the-test\n";
    EXPECT_EQ(::write(fd_, holder.data(), holder.size()), ssize_t(holder.size()));
  }
  ~HeldLock() { ::close(fd_); }
  HeldLock(const HeldLock&) = delete;
  HeldLock& operator=(const HeldLock&) = delete;

 private:
  int fd_ = -1;
};

class OutputSets : public ::testing::Test {
 protected:
  void SetUp() override {
    scratch_ = tmp_.path() / "scratch";
    fs::create_directories(scratch_);
    for (const auto& [dir, extra] : {std::pair{&plain_, std::string()},
                                     std::pair{&scaled_, std::string("--with-kv-scales")}}) {
      *dir = tmp_.path() / (extra.empty() ? "plain" : "scaled");
      std::vector<std::string> args = {"synth-checkpoint", dir->string(), "--layers",   "2",
                                       "--hidden-size",    "32",          "--heads",    "2",
                                       "--kv-heads",       "1",           "--head-dim", "16",
                                       "--vocab",          "256"};
      if (!extra.empty()) args.push_back(extra);
      expect_ok(run_cli(scratch_, args), "synth-checkpoint");
    }
    corpus_ = tmp_.path() / "corpus.jsonl";
    write_text(corpus_, "{\"token_ids\": [1, 2, 3, 4]}\n{\"token_ids\": [5, 6, 7, 8, 9]}\n");
    other_corpus_ = tmp_.path() / "other.jsonl";
    write_text(other_corpus_, "{\"token_ids\": [9, 8, 7, 6, 5, 4, 3]}\n");
  }

  RunResult calibrate(const fs::path& out, const fs::path& corpus,
                      const std::vector<std::string>& extra = {}, const std::string& env = "") {
    std::vector<std::string> args = {"calibrate",     plain_.string(), "--corpus",
                                     corpus.string(), "--out",         out.string(),
                                     "--no-progress", "--threads",     "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(scratch_, args, env);
  }
  RunResult summarize(const std::vector<std::string>& stats, const fs::path& out,
                      const fs::path& report, const std::vector<std::string>& extra = {},
                      const std::string& env = "") {
    std::vector<std::string> args = {"summarize"};
    args.insert(args.end(), stats.begin(), stats.end());
    for (const std::string& a :
         {std::string("--out"), out.string(), std::string("--report"), report.string()}) {
      args.push_back(a);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(scratch_, args, env);
  }
  RunResult compare(const fs::path& out, const std::vector<std::string>& extra = {},
                    const std::string& env = "", const std::string& max_tokens = "2") {
    std::vector<std::string> args = {"compare", scaled_.string(), "--prompts", corpus_.string(),
                                     "--out",   out.string(),     "--threads", "1"};
    args.push_back("--max-tokens");
    args.push_back(max_tokens);
    args.insert(args.end(), extra.begin(), extra.end());
    return run_cli(scratch_, args, env);
  }
  // scales.json for the plain checkpoint, from synthetic statistics.
  fs::path make_scales() {
    const fs::path stats = tmp_.path() / "synth.jsonl";
    expect_ok(run_cli(scratch_,
                      {"synth-stats", plain_.string(), "--out", stats.string(), "--tokens", "32"}),
              "synth-stats");
    const fs::path scales = tmp_.path() / "scales.json";
    expect_ok(summarize({stats.string()}, scales, tmp_.path() / "synth-report"), "summarize");
    return scales;
  }

  TempDir tmp_;
  fs::path scratch_;
  fs::path plain_;   // no K/V scales: calibrate and overlay take it
  fs::path scaled_;  // embedded K/V scales: compare runs on it
  fs::path corpus_;
  fs::path other_corpus_;
};

// The kill between calibrate's two renames, replacing an earlier run (--force): the new statistics
// beside the earlier run file. summarize refuses the pair; a full re-run mends it.
TEST_F(OutputSets, CalibrateKilledBetweenItsFilesIsRefusedBySummarize) {
  const fs::path stats = tmp_.path() / "stats";
  const fs::path scales = tmp_.path() / "scales.json";
  const fs::path report = tmp_.path() / "report";
  const fs::path stats_file = stats / "kv-stats-shard-0-of-1.jsonl";
  const fs::path run_file = stats / "calibrate-shard-0-of-1.json";
  expect_ok(calibrate(stats, corpus_), "calibrate");
  // The run file vouches for the statistics: their size and SHA-256, computed here independently.
  const std::string first_stats = read_text(stats_file);
  const std::string first_run = read_text(run_file);
  const json run = json::parse(first_run);
  EXPECT_EQ(run["statistics_bytes"].get<uint64_t>(), first_stats.size());
  EXPECT_EQ(run["statistics_sha256"].get<std::string>(), sha256_hex(first_stats));
  EXPECT_EQ(entries(stats),
            (std::set<std::string>{stats_file.filename().string(), run_file.filename().string()}))
      << "the lock file is removed on exit";
  expect_ok(summarize({stats.string()}, scales, report), "summarize");

  // Another corpus, killed after its statistics are in place and before its run file is.
  expect_crashed(
      calibrate(stats, other_corpus_, {"--force"}, "E4KV_TEST_CRASH_AT=after-statistics"),
      "calibrate killed between its files");
  ASSERT_NE(read_text(stats_file), first_stats) << "the new statistics should be in place";
  ASSERT_EQ(read_text(run_file), first_run) << "the earlier run file should still be there";
  EXPECT_TRUE(fs::exists(stats / ".calibrate-shard-0-of-1.lock")) << "a killed run's lock stays";
  const RunResult mixed =
      summarize({stats.string()}, tmp_.path() / "mixed.json", tmp_.path() / "mixed-report");
  expect_one_line_error(mixed, stats_file.string() + " (");
  EXPECT_NE(mixed.err.find("is not the statistics file its run file " + run_file.string()),
            std::string::npos)
      << mixed.err;
  EXPECT_NE(mixed.err.find("re-run that shard"), std::string::npos) << mixed.err;
  EXPECT_FALSE(fs::exists(tmp_.path() / "mixed.json"));
  EXPECT_FALSE(fs::exists(tmp_.path() / "mixed-report"));

  // The killed run's lock file blocks nothing: the re-run takes it over and removes it.
  expect_ok(calibrate(stats, other_corpus_, {"--force"}), "calibrate again");
  EXPECT_EQ(entries(stats),
            (std::set<std::string>{stats_file.filename().string(), run_file.filename().string()}));
  expect_ok(summarize({stats.string()}, scales, report, {"--force"}), "summarize the mended set");
}

// The kill before any run file existed: statistics alone are refused, the run file named.
TEST_F(OutputSets, CalibrateKilledBeforeItsFirstRunFileIsRefusedBySummarize) {
  const fs::path stats = tmp_.path() / "stats";
  expect_crashed(calibrate(stats, corpus_, {}, "E4KV_TEST_CRASH_AT=after-statistics"),
                 "calibrate killed between its files");
  ASSERT_TRUE(fs::exists(stats / "kv-stats-shard-0-of-1.jsonl"));
  expect_one_line_error(
      summarize({(stats / "kv-stats-shard-0-of-1.jsonl").string()}, tmp_.path() / "s.json",
                tmp_.path() / "r"),
      "its run file " + (stats / "calibrate-shard-0-of-1.json").string() + " is missing");
  // Statistics under any other name (synth-stats writes them) are not calibrate's set.
  const fs::path synth = tmp_.path() / "synth.jsonl";
  expect_ok(run_cli(scratch_, {"synth-stats", plain_.string(), "--out", synth.string()}),
            "synth-stats");
  expect_ok(summarize({synth.string()}, tmp_.path() / "s.json", tmp_.path() / "r"),
            "summarize synth-stats");
}

// compare --out and summarize --report: a kill just before the one rename leaves the earlier set
// complete (or no directory at all); the next run replaces it as a whole.
TEST_F(OutputSets, ReportDirectoriesAppearAtOnce) {
  const fs::path cmp = tmp_.path() / "cmp";
  expect_crashed(compare(cmp, {}, "E4KV_TEST_CRASH_AT=before-publish"), "compare killed");
  EXPECT_FALSE(fs::exists(cmp));
  expect_ok(compare(cmp), "compare");
  const std::set<std::string> compare_files = {"compare.json", "compare.md", "compare.svg"};
  EXPECT_EQ(entries(cmp), compare_files);
  std::vector<std::string> before;
  for (const std::string& name : compare_files) before.push_back(read_text(cmp / name));
  expect_crashed(compare(cmp, {"--force"}, "E4KV_TEST_CRASH_AT=before-publish", "3"),
                 "compare --force killed");
  std::vector<std::string> after;
  for (const std::string& name : compare_files) after.push_back(read_text(cmp / name));
  EXPECT_EQ(after, before) << "the earlier set must be untouched";
  expect_ok(compare(cmp, {"--force"}, "", "3"), "compare --force");
  EXPECT_EQ(entries(cmp), compare_files);
  EXPECT_NE(read_text(cmp / "compare.json"), before[0]);
  // A directory holding anything else is not replaced as a whole.
  write_text(cmp / "notes.txt", "mine");
  expect_one_line_error(compare(cmp, {"--force"}), "holds notes.txt");
  EXPECT_EQ(read_text(cmp / "notes.txt"), "mine");

  const fs::path stats = tmp_.path() / "synth.jsonl";
  expect_ok(run_cli(scratch_, {"synth-stats", plain_.string(), "--out", stats.string()}),
            "synth-stats");
  const fs::path scales = tmp_.path() / "scales.json";
  const fs::path report = tmp_.path() / "report";
  expect_ok(summarize({stats.string()}, scales, report), "summarize");
  const std::string report_json = read_text(report / "report.json");
  const std::string scales_json = read_text(scales);
  expect_crashed(summarize({stats.string()}, scales, report, {"--force", "--policy", "p99.9"},
                           "E4KV_TEST_CRASH_AT=before-publish"),
                 "summarize killed");
  EXPECT_EQ(read_text(report / "report.json"), report_json);
  EXPECT_EQ(read_text(scales), scales_json);
  expect_ok(summarize({stats.string()}, scales, report, {"--force", "--policy", "p99.9"}),
            "summarize --force");
  EXPECT_NE(read_text(report / "report.json"), report_json);
  EXPECT_EQ(entries(report), (std::set<std::string>{"report.json", "report.md", "report.svg"}));
  // scales.json inside the report directory would be replaced with it.
  expect_one_line_error(summarize({stats.string()}, report / "scales.json", report, {"--force"}),
                        "lies inside the --report directory");
}

// A second writer of an output another process is writing is refused, naming the lock and its
// holder, and writes nothing; once the holder is gone its lock file blocks nobody.
TEST_F(OutputSets, SecondWriterIsRefusedNamingTheLock) {
  const std::string holder = "held by pid 424242: e4kv held-by-the-test";
  // calibrate: per shard. Shard 0 is being written; shard 1 runs beside it.
  const fs::path stats = tmp_.path() / "stats";
  fs::create_directories(stats);
  const fs::path shard0_lock = stats / ".calibrate-shard-0-of-2.lock";
  {
    HeldLock held(shard0_lock);
    const RunResult r = calibrate(stats, corpus_, {"--shard", "0/2"});
    expect_one_line_error(r, "lock " + shard0_lock.string() + " " + holder);
    EXPECT_NE(r.err.find("another e4kv is writing it"), std::string::npos) << r.err;
    expect_ok(calibrate(stats, corpus_, {"--shard", "1/2"}), "the other shard");
    EXPECT_EQ(entries(stats),
              (std::set<std::string>{shard0_lock.filename().string(), "kv-stats-shard-1-of-2.jsonl",
                                     "calibrate-shard-1-of-2.json"}));
  }
  expect_ok(calibrate(stats, corpus_, {"--shard", "0/2"}), "shard 0 after the holder left");
  EXPECT_FALSE(fs::exists(shard0_lock));
  expect_ok(summarize({stats.string()}, tmp_.path() / "two.json", tmp_.path() / "two"),
            "summarize both shards");

  // compare --out DIR: the lock is .DIR.lock beside it.
  const fs::path cmp = tmp_.path() / "cmp";
  {
    HeldLock held(tmp_.path() / ".cmp.lock");
    expect_one_line_error(compare(cmp),
                          "lock " + (tmp_.path() / ".cmp.lock").string() + " " + holder);
    EXPECT_FALSE(fs::exists(cmp));
  }
  expect_ok(compare(cmp), "compare after the holder left");
  EXPECT_FALSE(fs::exists(tmp_.path() / ".cmp.lock"));

  // summarize: scales.json and the report directory, each locked.
  const fs::path synth = tmp_.path() / "synth.jsonl";
  expect_ok(run_cli(scratch_, {"synth-stats", plain_.string(), "--out", synth.string()}),
            "synth-stats");
  const fs::path scales = tmp_.path() / "scales.json";
  const fs::path report = tmp_.path() / "report";
  {
    HeldLock held(tmp_.path() / ".report.lock");
    expect_one_line_error(summarize({synth.string()}, scales, report),
                          "--report: " + report.string() + ": another e4kv is writing it (lock " +
                              (tmp_.path() / ".report.lock").string() + " " + holder);
  }
  {
    HeldLock held(tmp_.path() / ".scales.json.lock");
    expect_one_line_error(summarize({synth.string()}, scales, report),
                          "--out: " + scales.string() + ": another e4kv is writing it (lock " +
                              (tmp_.path() / ".scales.json.lock").string() + " " + holder);
  }
  EXPECT_FALSE(fs::exists(scales));
  EXPECT_FALSE(fs::exists(report));
  expect_ok(summarize({synth.string()}, scales, report), "summarize after the holders left");
  EXPECT_FALSE(fs::exists(tmp_.path() / ".report.lock"));
  EXPECT_FALSE(fs::exists(tmp_.path() / ".scales.json.lock"));

  // overlay --out DIR.
  const fs::path derived = tmp_.path() / "derived";
  const std::vector<std::string> overlay = {"overlay",       plain_.string(), "--scales",
                                            scales.string(), "--out",         derived.string()};
  {
    HeldLock held(tmp_.path() / ".derived.lock");
    expect_one_line_error(run_cli(scratch_, overlay),
                          "lock " + (tmp_.path() / ".derived.lock").string() + " " + holder);
    EXPECT_FALSE(fs::exists(derived));
  }
  // A killed overlay leaves its lock file; the next one is not blocked by it.
  expect_crashed(run_cli(scratch_, overlay, "E4KV_TEST_CRASH_AT=after-scales"), "overlay killed");
  EXPECT_TRUE(fs::exists(tmp_.path() / ".derived.lock"));
  expect_ok(run_cli(scratch_, overlay), "overlay after a killed one");
  EXPECT_FALSE(fs::exists(tmp_.path() / ".derived.lock"));
  expect_ok(run_cli(scratch_, {"verify", derived.string()}), "verify");
}

// A calibrate that fails after taking its lock leaves neither the lock nor the directory it made.
TEST_F(OutputSets, FailedCalibrateLeavesNothing) {
  const fs::path bad = tmp_.path() / "bad.jsonl";
  write_text(bad, "{\"token_ids\": [1, 2, 999999]}\n");
  const fs::path stats = tmp_.path() / "stats";
  const RunResult r = calibrate(stats, bad);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_FALSE(fs::exists(stats));
}

// `/` itself, or an entry directly in it, is refused by every writing command, and nothing appears
// in / (the tests may run as root, where a write there would succeed).
TEST_F(OutputSets, NothingIsWrittenIntoTheRootDirectory) {
  const std::string unique = "e4kv-output-sets-" + std::to_string(::getpid());
  const fs::path stats = tmp_.path() / "synth.jsonl";
  expect_ok(run_cli(scratch_, {"synth-stats", plain_.string(), "--out", stats.string()}),
            "synth-stats");
  const fs::path scales = tmp_.path() / "scales.json";
  expect_ok(summarize({stats.string()}, scales, tmp_.path() / "report"), "summarize");
  const std::set<std::string> root_before = entries("/");
  const std::vector<std::vector<std::string>> cases = {
      {"calibrate", plain_.string(), "--corpus", corpus_.string(), "--out", "/", "--no-progress"},
      {"calibrate", plain_.string(), "--corpus", corpus_.string(), "--out", "/" + unique},
      {"compare", scaled_.string(), "--prompts", corpus_.string(), "--max-tokens", "1", "--out",
       "/"},
      {"compare", scaled_.string(), "--prompts", corpus_.string(), "--max-tokens", "1", "--out",
       "/" + unique},
      {"summarize", stats.string(), "--out", "/" + unique + ".json", "--report",
       (tmp_.path() / "r1").string()},
      {"summarize", stats.string(), "--out", (tmp_.path() / "s1.json").string(), "--report", "/"},
      {"summarize", stats.string(), "--out", (tmp_.path() / "s1.json").string(), "--report",
       "/" + unique},
      {"synth-stats", plain_.string(), "--out", "/" + unique + ".jsonl"},
      {"synth-checkpoint", "/"},
      {"synth-checkpoint", "/" + unique},
      {"overlay", plain_.string(), "--scales", scales.string(), "--out", "/"},
      {"overlay", plain_.string(), "--scales", scales.string(), "--out", "/" + unique},
      {"overlay", plain_.string(), "--scales", scales.string(), "--out", "/tmp/../" + unique},
  };
  for (const std::vector<std::string>& args : cases) {
    SCOPED_TRACE(args[0] + " " + args[args.size() - 1]);
    const RunResult r = run_cli(scratch_, args);
    expect_one_line_error(r, "the root directory /");
    EXPECT_NE(r.err.find("e4kv writes nothing into /"), std::string::npos) << r.err;
  }
  // Only what another process made meanwhile may differ; nothing of these commands' names.
  for (const std::string& name : entries("/")) {
    if (root_before.count(name) != 0) continue;
    EXPECT_EQ(name.find(unique), std::string::npos) << "/" << name;
    for (const char* made : {"kv-stats-", "calibrate-", "compare.", "report.", ".lock", ".tmp."}) {
      EXPECT_EQ(name.find(made), std::string::npos) << "/" << name;
    }
  }
  EXPECT_FALSE(fs::exists(tmp_.path() / "r1"));
  EXPECT_FALSE(fs::exists(tmp_.path() / "s1.json"));
}

}  // namespace
}  // namespace e4kv
