// Every JSON input of the e4kv program, given 100,000 arrays inside one another, through the real
// program: each must end with one short "e4kv: error:" line naming the file and the nesting limit,
// exit code 1, and no signal. A parser that accepted the nesting would overflow the stack later
// (copying the value, printing it, or the chat template's conversion).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/json.h"
#include "testing/cli.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::read_text;
using testing_support::run_cli_timed;
using testing_support::TempDir;
using testing_support::TimedRunResult;
using testing_support::write_text;

constexpr int kDeep = 100'000;

std::string deep_array() {
  return std::string(kDeep, '[') + std::string(kDeep, ']');
}

// Sets `key` of the JSON object in `path` to 100,000 nested arrays: a key the reader uses, so a
// reader that accepted the nesting would go on to copy or print the value.
void set_deep_field(const fs::path& path, const std::string& key) {
  nlohmann::ordered_json object = nlohmann::ordered_json::parse(read_text(path));
  ASSERT_TRUE(object.is_object()) << path;
  const std::string placeholder = "deep-value-placeholder";
  object[key] = placeholder;
  std::string text = object.dump();
  const size_t at = text.find('"' + placeholder + '"');
  ASSERT_NE(at, std::string::npos);
  text.replace(at, placeholder.size() + 2, deep_array());
  write_text(path, text);
}

class DeepJsonCli : public ::testing::Test {
 protected:
  void SetUp() override {
    SynthCheckpointOptions options;
    options.with_tokenizer = true;
    options.n_shards = 2;  // so the checkpoint has model.safetensors.index.json
    ASSERT_TRUE(write_synth_checkpoint(model_, options).ok());
  }

  // Runs e4kv and checks the one clean error line: exit 1, no signal, the file and the limit named,
  // and short (the nested value is not echoed).
  void expect_refused(const std::vector<std::string>& args, const std::string& file) {
    SCOPED_TRACE(args.front() + " " + file);
    const TimedRunResult r = run_cli_timed(tmp_.path(), args, std::chrono::seconds(120));
    EXPECT_FALSE(r.timed_out);
    EXPECT_EQ(r.signal, 0) << r.err;
    ASSERT_TRUE(r.exited) << r.err;
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(r.err.rfind("e4kv: error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(
        r.err.find(file + ": JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels"),
        std::string::npos)
        << r.err;
    EXPECT_LT(r.err.size(), 400u) << r.err;
    EXPECT_EQ(r.err.find("[[[["), std::string::npos) << r.err;
  }

  TempDir tmp_;
  const fs::path model_ = tmp_.path() / "model";
  const fs::path out_ = tmp_.path() / "out";
};

TEST_F(DeepJsonCli, CorpusMessagesContent) {
  const fs::path corpus = tmp_.path() / "corpus.jsonl";
  write_text(corpus, "{\"text\": \"fine\"}\n{\"messages\": [{\"role\": \"user\", \"content\": " +
                         deep_array() + "}]}\n");
  expect_refused(
      {"calibrate", model_.string(), "--corpus", corpus.string(), "--out", out_.string()},
      corpus.string() + ":2");
}

TEST_F(DeepJsonCli, CorpusTokenIds) {
  const fs::path corpus = tmp_.path() / "corpus.jsonl";
  write_text(corpus, "{\"token_ids\": " + deep_array() + "}\n");
  expect_refused(
      {"calibrate", model_.string(), "--corpus", corpus.string(), "--out", out_.string()},
      corpus.string() + ":1");
}

TEST_F(DeepJsonCli, ComparePrompts) {
  const fs::path prompts = tmp_.path() / "prompts.jsonl";
  write_text(prompts,
             "{\"messages\": [{\"role\": \"user\", \"content\": " + deep_array() + "}]}\n");
  expect_refused({"compare", model_.string(), "--prompts", prompts.string()},
                 prompts.string() + ":1");
}

TEST_F(DeepJsonCli, ConfigJsonField) {
  set_deep_field(model_ / "config.json", "rope_scaling");
  expect_refused({"inspect", model_.string()}, (model_ / "config.json").string());
}

TEST_F(DeepJsonCli, SafetensorsIndex) {
  set_deep_field(model_ / "model.safetensors.index.json", "metadata");
  expect_refused({"inspect", model_.string()}, (model_ / "model.safetensors.index.json").string());
}

TEST_F(DeepJsonCli, TokenizerJson) {
  set_deep_field(model_ / "tokenizer.json", "normalizer");
  expect_refused({"tokenize", model_.string(), "--text", "hello"},
                 (model_ / "tokenizer.json").string());
}

TEST_F(DeepJsonCli, TokenizerConfigJson) {
  set_deep_field(model_ / "tokenizer_config.json", "bos_token");
  expect_refused({"tokenize", model_.string(), "--text", "hello"},
                 (model_ / "tokenizer_config.json").string());
}

TEST_F(DeepJsonCli, GenerationConfigJson) {
  write_text(model_ / "generation_config.json", "{\"eos_token_id\": " + deep_array() + "}\n");
  expect_refused({"generate", model_.string(), "--prompt", "hello", "--max-tokens", "1"},
                 (model_ / "generation_config.json").string());
}

TEST_F(DeepJsonCli, StatisticsFile) {
  const fs::path stats = tmp_.path() / "kv-stats.jsonl";
  write_text(stats, "{\"format\": " + deep_array() + "}\n");
  expect_refused({"summarize", stats.string(), "--out", (tmp_.path() / "scales.json").string(),
                  "--report", (tmp_.path() / "report").string()},
                 stats.string() + ":1");
}

TEST_F(DeepJsonCli, ScalesFile) {
  const fs::path scales = tmp_.path() / "scales.json";
  write_text(scales, "{\"format\": " + deep_array() + ", \"scales\": {}}\n");
  expect_refused({"overlay", model_.string(), "--scales", scales.string(), "--out", out_.string()},
                 scales.string());
}

// The safetensors header keeps its own, stricter limit through the same parser.
TEST_F(DeepJsonCli, SafetensorsHeader) {
  const fs::path shard = model_ / "model-00001-of-00002.safetensors";
  ASSERT_TRUE(fs::exists(shard));
  const std::string header = "{\"w\": " + deep_array() + "}";
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes += char((uint64_t(header.size()) >> (8 * i)) & 0xFF);
  write_text(shard, bytes + header);
  const TimedRunResult r =
      run_cli_timed(tmp_.path(), {"inspect", model_.string()}, std::chrono::seconds(120));
  EXPECT_EQ(r.signal, 0) << r.err;
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(shard.string() + ": header: JSON nests deeper than 16 levels"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace e4kv
