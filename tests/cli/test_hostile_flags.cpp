// Every numeric flag of every e4kv command under hostile values: 0, -1, 2^31, 2^53,
// 2^62, 2^63 - 1, nan, inf, 1e999 and 0x10, each on an otherwise valid command line. Every run must
// end normally within a time limit (never a signal, never a hang, no sanitizer report) and either
//   - succeed, when the value is valid for that flag (kValid lists each such (command, flag,
//     value) and says why), or
//   - exit with code 1 or 2, exactly one line on stderr ("e4kv: error: ...") that names the flag,
//     nothing on stdout, and for a command that writes a file or directory: nothing at the output
//     path and nothing else (no temporary file) in its directory.
// A second test reads `e4kv --help` and `e4kv COMMAND --help` so that a new command or a new
// numeric flag (CLI11 shows them as INT, UINT or FLOAT) cannot be left out of the table.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "testing/cli.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::has_sanitizer_report;
using testing_support::run_cli;
using testing_support::run_cli_timed;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::TimedRunResult;

const std::vector<std::string> kHostileValues = {"0",
                                                 "-1",
                                                 "2147483648",
                                                 "9007199254740992",
                                                 "4611686018427387904",
                                                 "9223372036854775807",
                                                 "nan",
                                                 "inf",
                                                 "1e999",
                                                 "0x10"};

// What a command line is built from: the fixture's checkpoints and, for a command that writes one,
// the output path (in an empty directory of its own).
struct Paths {
  fs::path llama;     // a small dense checkpoint with a tokenizer
  fs::path qwen4exp;  // a small Qwen4Exp checkpoint (QSA layers: --max-seqs reserves rings)
  fs::path corpus;    // a corpus / prompts file of one short document
  fs::path out;
};

enum class Output { kNone, kFile, kDirectory };

struct CommandSpec {
  std::string name;
  Output output = Output::kNone;
  bool needs_qwen4exp = false;
  // The command line without its numeric flags.
  std::vector<std::string> (*base)(const Paths&) = nullptr;
  // Every numeric flag with a small valid value; the flag under test gets the hostile value.
  std::vector<std::pair<std::string, std::string>> numeric_flags;
  // Flags that exclude one another (the KV pool's sizes): each is on the line only when it is the
  // flag under test.
  std::set<std::string> alone;
  // A command that serves until stopped (serve): a valid value must bring it to "listening on",
  // and SIGTERM must then end it with exit code 0.
  bool serves = false;
};

const std::set<std::string> kPoolFlags = {"--kv-cache-memory-bytes", "--num-gpu-blocks-override",
                                          "--gpu-memory-utilization"};

const std::vector<CommandSpec>& commands() {
  static const std::vector<CommandSpec> specs = {
      {"generate",
       Output::kNone,
       false,
       [](const Paths& p) -> std::vector<std::string> {
         return {"generate", p.llama.string(), "--prompt-ids", "1,2,3"};
       },
       {{"--block-size", "16"},
        {"--max-model-len", "64"},
        {"--threads", "1"},
        {"--tensor-parallel-size", "1"},
        {"--max-tokens", "4"},
        {"--temperature", "0"},
        {"--top-p", "1"},
        {"--top-k", "0"},
        {"--repetition-penalty", "1"},
        {"--seed", "0"},
        {"--prefill-chunk", "0"},
        {"--kv-cache-memory-bytes", "65536"},
        {"--num-gpu-blocks-override", "8"},
        {"--gpu-memory-utilization", "0.5"}},
       kPoolFlags},
      {"bench",
       Output::kDirectory,
       false,
       [](const Paths& p) -> std::vector<std::string> {
         return {"bench",     p.llama.string(), "--concurrency", "1",     "--context",
                 "8",         "--kv-cache-dtype", "fp16",        "--out", p.out.string(),
                 "--no-progress"};
       },
       {{"--block-size", "16"},
        {"--max-model-len", "64"},
        {"--threads", "1"},
        {"--tensor-parallel-size", "1"},
        {"--output-tokens", "2"},
        {"--repeats", "1"},
        {"--seed", "0"},
        {"--kv-cache-memory-bytes", "65536"},
        {"--num-gpu-blocks-override", "8"},
        {"--gpu-memory-utilization", "0.5"}},
       kPoolFlags},
      {"serve",
       Output::kNone,
       false,
       [](const Paths& p) -> std::vector<std::string> {
         return {"serve", p.llama.string(), "--no-warmup"};
       },
       {{"--port", "0"},
        {"--block-size", "16"},
        {"--max-model-len", "64"},
        {"--threads", "1"},
        {"--tensor-parallel-size", "1"},
        {"--max-num-seqs", "2"},
        {"--max-num-batched-tokens", "0"},
        {"--max-request-bytes", "65536"},
        {"--max-connections", "4"},
        {"--timeout", "5"},
        {"--shutdown-timeout", "1"},
        {"--kv-cache-memory-bytes", "65536"},
        {"--num-gpu-blocks-override", "8"},
        {"--gpu-memory-utilization", "0.5"}},
       kPoolFlags,
       true},
      {"logits",
       Output::kNone,
       false,
       [](const Paths& p) -> std::vector<std::string> {
         return {"logits", p.llama.string(), "--ids", "1,2,3"};
       },
       {{"--block-size", "16"}, {"--max-model-len", "64"}, {"--threads", "1"},
        {"--tensor-parallel-size", "1"}}},
      {"capacity",
       Output::kNone,
       true,
       [](const Paths& p) -> std::vector<std::string> {
         return {"capacity", p.qwen4exp.string()};
       },
       {{"--budget-gib", "1"},
        {"--gpu-memory-gib", "80"},
        {"--gpu-memory-utilization", "0.9"},
        {"--request-tokens", "4096"},
        {"--block-size", "64"},
        {"--max-seqs", "1"},
        {"--tensor-parallel-size", "1"}}},
      {"synth-checkpoint",
       Output::kDirectory,
       false,
       [](const Paths& p) -> std::vector<std::string> {
         // Qwen4Exp with AWQ weights: every shape and quantization flag applies.
         return {"synth-checkpoint", p.out.string(), "--family", "qwen4exp", "--quant", "awq"};
       },
       {{"--layers", "1"},
        {"--shards", "1"},
        {"--seed", "0"},
        {"--hidden-size", "32"},
        {"--heads", "2"},
        {"--kv-heads", "1"},
        {"--head-dim", "16"},
        {"--vocab", "256"},
        {"--expert-width", "16"},
        {"--experts", "4"},
        {"--hc-count", "2"},
        {"--hc-lowrank", "8"},
        {"--index-budget", "32"},
        {"--index-dim", "16"},
        {"--index-heads", "2"},
        {"--intermediate-size", "64"},
        {"--linear-head-dim", "8"},
        {"--linear-key-heads", "2"},
        {"--linear-value-heads", "4"},
        {"--max-shard-mb", "1"},
        {"--max-total-gib", "1"},
        {"--ple-layer", "0"},
        {"--ple-ngram-base", "100"},
        {"--quant-group", "32"},
        {"--shared-expert-width", "16"},
        {"--threads", "1"},
        {"--top-k", "1"}},
       {"--shards", "--max-shard-mb"}},
      {"synth-stats",
       Output::kFile,
       false,
       [](const Paths& p) -> std::vector<std::string> {
         return {"synth-stats", p.llama.string(), "--out", p.out.string()};
       },
       {{"--shard", "0"}, {"--tokens", "64"}, {"--seed", "0"}, {"--scale-magnitude", "0.15"}}},
      {"calibrate",
       Output::kDirectory,
       false,
       [](const Paths& p) -> std::vector<std::string> {
         return {"calibrate", p.llama.string(), "--corpus", p.corpus.string(), "--out",
                 p.out.string(), "--no-progress"};
       },
       {{"--block-size", "16"},
        {"--max-model-len", "64"},
        {"--threads", "1"},
        {"--tensor-parallel-size", "1"},
        {"--generate-tokens", "2"},
        {"--prefill-chunk", "4"},
        {"--max-documents", "1"}}},
      {"compare",
       Output::kDirectory,
       false,
       [](const Paths& p) -> std::vector<std::string> {
         return {"compare", p.llama.string(), "--prompts", p.corpus.string(), "--out",
                 p.out.string()};
       },
       {{"--block-size", "16"},
        {"--max-model-len", "64"},
        {"--threads", "1"},
        {"--tensor-parallel-size", "1"},
        {"--max-tokens", "2"},
        {"--prefill-chunk", "4"},
        {"--passkey-trials", "1"}}},
      // No numeric flags; listed so the coverage test knows they were looked at.
      {"inspect", Output::kNone, false, nullptr, {}},
      {"summarize", Output::kNone, false, nullptr, {}},
      {"overlay", Output::kNone, false, nullptr, {}},
      {"verify", Output::kNone, false, nullptr, {}},
      {"tokenize", Output::kNone, false, nullptr, {}},
      {"detokenize", Output::kNone, false, nullptr, {}},
  };
  return specs;
}

const std::vector<std::string> kLargeIntegers = {"2147483648", "9007199254740992",
                                                 "4611686018427387904", "9223372036854775807"};

// (command, flag) -> the hostile values that are valid for it, with the reason. Every other
// (command, flag, value) must be refused.
const std::map<std::pair<std::string, std::string>, std::set<std::string>>& valid_values() {
  static const std::map<std::pair<std::string, std::string>, std::set<std::string>> valid = [] {
    std::map<std::pair<std::string, std::string>, std::set<std::string>> v;
    std::set<std::string> zero_and_large{"0"};
    zero_and_large.insert(kLargeIntegers.begin(), kLargeIntegers.end());
    // 0 = max_position_embeddings of config.json.
    v[{"generate", "--max-model-len"}] = {"0"};
    v[{"logits", "--max-model-len"}] = {"0"};
    // 0 = one thread per hardware thread.
    v[{"generate", "--threads"}] = {"0"};
    v[{"logits", "--threads"}] = {"0"};
    // 0 new tokens is a valid (empty) request.
    v[{"generate", "--max-tokens"}] = {"0"};
    // 0 is greedy; any finite temperature above it is valid (a huge one samples nearly uniformly).
    v[{"generate", "--temperature"}] = zero_and_large;
    // 0 and -1 turn top-k off (engine/sampler.h); k at or above the vocabulary keeps every token.
    v[{"generate", "--top-k"}] = zero_and_large;
    v[{"generate", "--top-k"}].insert("-1");
    // Any finite penalty above 0 (a huge one all but bans the tokens already seen).
    v[{"generate", "--repetition-penalty"}] = {kLargeIntegers.begin(), kLargeIntegers.end()};
    // Any 64-bit unsigned seed.
    v[{"generate", "--seed"}] = zero_and_large;
    v[{"synth-checkpoint", "--seed"}] = zero_and_large;
    // 0 is the first layer, -1 no PLE layer; 0 threads is one per hardware thread.
    v[{"synth-checkpoint", "--ple-layer"}] = {"0", "-1"};
    v[{"synth-checkpoint", "--threads"}] = {"0"};
    v[{"synth-stats", "--seed"}] = zero_and_large;
    // 0 = the whole prompt in one forward.
    v[{"generate", "--prefill-chunk"}] = {"0"};
    // 0 sequences: no QSA raw ring is reserved before blocks are counted.
    v[{"capacity", "--max-seqs"}] = {"0"};
    // 2 GiB is a pool like any other (2^53 bytes and more are beyond --kv-cache-memory-bytes'
    // range; --num-gpu-blocks-override stops at 2^31 - 1 blocks; --gpu-memory-utilization is
    // refused on the CPU whatever its value).
    v[{"generate", "--kv-cache-memory-bytes"}] = {"2147483648"};
    v[{"bench", "--kv-cache-memory-bytes"}] = {"2147483648"};
    v[{"bench", "--max-model-len"}] = {"0"};
    v[{"bench", "--threads"}] = {"0"};
    v[{"bench", "--seed"}] = zero_and_large;
    // serve: 0 is any free port; 0 sequences / batched tokens / threads / max model length are
    // the defaults; a 2 GiB pool and a 2 GiB request limit are sizes like others; 0 s to finish
    // the requests in flight aborts them at once.
    v[{"serve", "--port"}] = {"0"};
    v[{"serve", "--max-model-len"}] = {"0"};
    v[{"serve", "--threads"}] = {"0"};
    v[{"serve", "--max-num-seqs"}] = {"0"};
    v[{"serve", "--max-num-batched-tokens"}] = {"0"};
    v[{"serve", "--kv-cache-memory-bytes"}] = {"2147483648"};
    v[{"serve", "--max-request-bytes"}] = {"2147483648"};
    v[{"serve", "--shutdown-timeout"}] = {"0"};
    v[{"calibrate", "--max-model-len"}] = {"0"};
    v[{"compare", "--max-model-len"}] = {"0"};
    v[{"calibrate", "--threads"}] = {"0"};
    v[{"compare", "--threads"}] = {"0"};
    // 0 greedy tokens: prompts only.
    v[{"calibrate", "--generate-tokens"}] = {"0"};
    v[{"compare", "--max-tokens"}] = {"0"};
    // 0 = every document; any larger count than the corpus holds takes them all.
    v[{"calibrate", "--max-documents"}] = zero_and_large;
    // The shard number is a label recorded in the statistics file (any non-negative int64).
    v[{"synth-stats", "--shard"}] = zero_and_large;
    return v;
  }();
  return valid;
}

bool is_valid(const std::string& command, const std::string& flag, const std::string& value) {
  auto it = valid_values().find({command, flag});
  return it != valid_values().end() && it->second.count(value) > 0;
}

std::chrono::milliseconds run_timeout() {
  // Generous for a sanitizer build on a busy machine; every run here takes well under a second in
  // a normal build.
  const char* text = std::getenv("E4KV_TEST_CLI_TIMEOUT_SECONDS");
  const int seconds = text != nullptr ? std::atoi(text) : 0;
  return std::chrono::seconds(seconds > 0 ? seconds : 60);
}

std::string join(const std::vector<std::string>& args) {
  std::string out = "e4kv";
  for (const std::string& arg : args) out += " " + arg;
  return out;
}

struct FlagCase {
  const CommandSpec* command;
  std::string flag;
};

// gtest prints the parameter in test names and failures.
void PrintTo(const FlagCase& c, std::ostream* os) {
  *os << c.command->name << " " << c.flag;
}

std::vector<FlagCase> flag_cases() {
  std::vector<FlagCase> cases;
  for (const CommandSpec& command : commands()) {
    for (const auto& [flag, unused] : command.numeric_flags) cases.push_back({&command, flag});
  }
  return cases;
}

class HostileFlags : public ::testing::TestWithParam<FlagCase> {
 protected:
  void SetUp() override {
    scratch_ = tmp_.path() / "scratch";
    fs::create_directories(scratch_);
    paths_.llama = tmp_.path() / "llama";
    RunResult r = run_cli(
        scratch_, {"synth-checkpoint", paths_.llama.string(), "--layers", "2", "--hidden-size",
                   "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--vocab", "256",
                   "--with-kv-scales"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    paths_.corpus = tmp_.path() / "corpus.jsonl";
    testing_support::write_text(paths_.corpus, "{\"token_ids\": [1, 2, 3, 4]}\n");
    if (GetParam().command->needs_qwen4exp) {
      paths_.qwen4exp = tmp_.path() / "qwen4exp";
      r = run_cli(scratch_, {"synth-checkpoint", paths_.qwen4exp.string(), "--family", "qwen4exp",
                             "--layers", "4", "--no-tokenizer"});
      ASSERT_EQ(r.exit_code, 0) << r.err;
    }
  }

  TempDir tmp_;
  fs::path scratch_;
  Paths paths_;
};

TEST_P(HostileFlags, RefusedWithOneLineOrAcceptedWhenValid) {
  const CommandSpec& command = *GetParam().command;
  const std::string& flag = GetParam().flag;
  int index = 0;
  for (const std::string& value : kHostileValues) {
    const fs::path case_dir = tmp_.path() / ("case" + std::to_string(index++));
    fs::create_directories(case_dir);
    Paths paths = paths_;
    paths.out = case_dir / (command.output == Output::kFile ? "out.jsonl" : "out");
    std::vector<std::string> args = command.base(paths);
    for (const auto& [name, default_value] : command.numeric_flags) {
      if (name != flag && command.alone.contains(name)) continue;
      args.push_back(name);
      args.push_back(name == flag ? value : default_value);
    }
    SCOPED_TRACE(join(args));
    const testing_support::ServedRunResult r =
        command.serves ? testing_support::run_cli_serving(scratch_, args, run_timeout())
                       : testing_support::ServedRunResult{run_cli_timed(scratch_, args,
                                                                        run_timeout())};

    EXPECT_FALSE(r.timed_out) << "still running after " << r.seconds << " s; killed";
    EXPECT_TRUE(r.exited) << "ended by signal " << r.signal << "\n" << r.err;
    EXPECT_FALSE(has_sanitizer_report(r.err)) << r.err;
    if (is_valid(command.name, flag, value)) {
      EXPECT_EQ(r.exit_code, 0) << "the value is valid for " << flag << "\n" << r.err;
      if (command.serves) {
        EXPECT_TRUE(r.served) << "never listening\n" << r.err;
      }
      continue;
    }
    EXPECT_FALSE(r.served) << "a refused value, yet it served:\n" << r.out;
    EXPECT_TRUE(r.exit_code == 1 || r.exit_code == 2) << "exit code " << r.exit_code << "\n"
                                                      << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(r.err.ends_with("\n")) << r.err;
    EXPECT_TRUE(r.err.starts_with("e4kv: error: ")) << r.err;
    EXPECT_NE(r.err.find(flag), std::string::npos)
        << "the message does not name " << flag << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
    if (command.output != Output::kNone) {
      EXPECT_FALSE(fs::exists(paths.out)) << paths.out;
      std::string left;
      for (const fs::directory_entry& entry : fs::directory_iterator(case_dir)) {
        left += " " + entry.path().filename().string();
      }
      EXPECT_TRUE(left.empty()) << "left in the output directory:" << left;
    }
  }
}

std::string flag_case_name(const ::testing::TestParamInfo<FlagCase>& param) {
  std::string name = param.param.command->name + param.param.flag;
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(AllNumericFlags, HostileFlags, ::testing::ValuesIn(flag_cases()),
                         flag_case_name);

// Subcommand names from `e4kv --help`, numeric flags (INT / UINT / FLOAT) from `e4kv CMD --help`.
// (Parsed by hand: std::regex under GCC 13 with -fsanitize trips -Wmaybe-uninitialized.)
std::set<std::string> help_subcommands(const std::string& help) {
  std::set<std::string> names;
  std::istringstream lines(help);
  std::string line;
  bool in_section = false;
  while (std::getline(lines, line)) {
    if (line.starts_with("Subcommands:")) {
      in_section = true;
    } else if (in_section && line.size() > 2 && line.starts_with("  ") && line[2] >= 'a' &&
               line[2] <= 'z') {
      names.insert(line.substr(2, line.find(' ', 2) - 2));
    }
  }
  return names;
}

std::set<std::string> help_numeric_flags(const std::string& help) {
  std::set<std::string> flags;
  std::istringstream lines(help);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string name, type;
    words >> name >> type;
    if (name.size() > 3 && name[0] == '-' && name[1] != '-' && name[2] == ',') name.erase(0, 3);
    if (!name.starts_with("--")) continue;
    for (const char* numeric : {"INT", "UINT", "FLOAT"}) {
      const std::string t(numeric);
      if (type == t || type.starts_with(t + "=") || type.starts_with(t + ":")) flags.insert(name);
    }
  }
  return flags;
}

TEST(HostileFlagsTable, CoversEveryCommandAndNumericFlag) {
  TempDir tmp;
  const RunResult top = run_cli(tmp.path(), {"--help"});
  ASSERT_EQ(top.exit_code, 0) << top.err;
  const std::set<std::string> subcommands = help_subcommands(top.out);
  ASSERT_GE(subcommands.size(), 5u) << top.out;  // the parse itself works

  std::set<std::string> table;
  for (const CommandSpec& command : commands()) table.insert(command.name);
  EXPECT_EQ(subcommands, table) << "a command of `e4kv --help` is missing from (or extra in) the "
                                   "table of test_hostile_flags.cpp:\n"
                                << top.out;

  size_t total = 0;
  for (const CommandSpec& command : commands()) {
    const RunResult help = run_cli(tmp.path(), {command.name, "--help"});
    ASSERT_EQ(help.exit_code, 0) << help.err;
    std::set<std::string> listed;
    for (const auto& [flag, unused] : command.numeric_flags) listed.insert(flag);
    EXPECT_EQ(help_numeric_flags(help.out), listed)
        << command.name << ": the numeric flags of --help differ from the table:\n"
        << help.out;
    total += listed.size();
  }
  EXPECT_GE(total, 25u);
}

}  // namespace
}  // namespace e4kv
