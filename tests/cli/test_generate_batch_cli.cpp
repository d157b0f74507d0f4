// `e4kv generate --prompts FILE --out FILE` (offline batch inference through the engine): every
// line's output equals what `generate` gives that prompt alone, in input order, with its own
// sampling fields; bad lines are refused with FILE:LINE before anything runs.
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
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

class GenerateBatch : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = tmp_.path() / "llama";
    RunResult r = run_cli(tmp_.path(), {"synth-checkpoint", model_.string(), "--layers", "2",
                                        "--hidden-size", "32", "--heads", "2", "--kv-heads", "1",
                                        "--head-dim", "16", "--vocab", "256"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }

  // `generate --prompt-ids IDS --json` alone, with extra flags.
  json alone(const std::vector<int32_t>& ids, const std::vector<std::string>& flags) {
    std::string list;
    for (int32_t id : ids) list += (list.empty() ? "" : ",") + std::to_string(id);
    std::vector<std::string> args = {"generate", model_.string(), "--prompt-ids", list, "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    RunResult r = run_cli(tmp_.path(), args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? json::parse(r.out) : json();
  }

  TempDir tmp_;
  fs::path model_;
};

TEST_F(GenerateBatch, EveryLineGetsWhatItGetsAloneInInputOrder) {
  std::vector<std::vector<int32_t>> prompts;
  std::string lines;
  for (int i = 0; i < 9; ++i) {
    std::vector<int32_t> ids;
    for (int t = 0; t < 3 + 7 * i; ++t) ids.push_back(10 + (t * 13 + i * 29) % 200);
    prompts.push_back(ids);
    json line = {{"token_ids", ids}, {"id", "req-" + std::to_string(i)}};
    if (i % 3 == 1) line["max_tokens"] = 3 + i;
    if (i % 3 == 2) {  // sampled, seeded: reproducible alone and in the batch
      line["temperature"] = 0.8;
      line["seed"] = 100 + i;
      line["top_k"] = 20;
    }
    lines += line.dump() + "\n";
  }
  const fs::path in = tmp_.path() / "prompts.jsonl";
  const fs::path out = tmp_.path() / "out.jsonl";
  write_text(in, lines);
  RunResult r = run_cli(tmp_.path(), {"generate", model_.string(), "--prompts", in.string(),
                                      "--out", out.string(), "--max-tokens", "6", "--ignore-eos"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("9 requests"), std::string::npos) << r.err;
  std::vector<json> got;
  const std::string text = read_text(out);
  for (size_t begin = 0, end; (end = text.find('\n', begin)) != std::string::npos; begin = end + 1) {
    got.push_back(json::parse(text.substr(begin, end - begin)));
  }
  ASSERT_EQ(got.size(), 9u);
  for (int i = 0; i < 9; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i]["id"], "req-" + std::to_string(i));
    std::vector<std::string> flags = {"--ignore-eos", "--max-tokens",
                                      std::to_string(i % 3 == 1 ? 3 + i : 6)};
    if (i % 3 == 2) {
      flags.insert(flags.end(), {"--temperature", "0.8", "--seed", std::to_string(100 + i),
                                 "--top-k", "20"});
    }
    const json want = alone(prompts[size_t(i)], flags);
    EXPECT_EQ(got[i]["output_ids"], want["output_ids"]);
    EXPECT_EQ(got[i]["text"], want["text"]);
    EXPECT_EQ(got[i]["finish_reason"], "length");
    EXPECT_EQ(got[i]["usage"]["prompt_tokens"], prompts[size_t(i)].size());
    EXPECT_EQ(got[i]["usage"]["completion_tokens"], want["output_ids"].size());
    EXPECT_EQ(got[i]["usage"]["total_tokens"],
              prompts[size_t(i)].size() + want["output_ids"].size());
  }
}

// A line with "n": 3 gets an "outputs" array in index order, completion i what the line gets
// alone with seed + i; a line without n keeps the flat shape; n out of range names the field.
TEST_F(GenerateBatch, NCompletionsOfALineComeInOutputs) {
  const std::vector<int32_t> ids = {30, 31, 32, 33, 34, 35, 36, 37, 38, 39,
                                    40, 41, 42, 43, 44, 45, 46, 47, 48};
  json a = {{"token_ids", ids}, {"id", "a"},   {"n", 3},       {"temperature", 0.9},
            {"seed", 50},       {"top_k", 30}, {"logprobs", 1}};
  json b = {{"token_ids", ids}, {"id", "b"}};
  const fs::path in = tmp_.path() / "prompts.jsonl";
  const fs::path out = tmp_.path() / "out.jsonl";
  write_text(in, a.dump() + "\n" + b.dump() + "\n");
  RunResult r = run_cli(tmp_.path(), {"generate", model_.string(), "--prompts", in.string(),
                                      "--out", out.string(), "--max-tokens", "7", "--ignore-eos"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string text = read_text(out);
  const json first = json::parse(text.substr(0, text.find('\n')));
  const json second = json::parse(text.substr(text.find('\n') + 1));
  EXPECT_EQ(first["id"], "a");
  EXPECT_FALSE(first.contains("output_ids"));
  ASSERT_EQ(first["outputs"].size(), 3u);
  size_t completion_tokens = 0;
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    const json& o = first["outputs"][i];
    EXPECT_EQ(o["index"], i);
    const json want = alone(ids, {"--ignore-eos", "--max-tokens", "7", "--temperature", "0.9",
                                  "--seed", std::to_string(50 + i), "--top-k", "30"});
    EXPECT_EQ(o["output_ids"], want["output_ids"]);
    EXPECT_EQ(o["text"], want["text"]);
    EXPECT_EQ(o["finish_reason"], "length");
    EXPECT_EQ(o["logprobs"].size(), 7u);
    completion_tokens += o["output_ids"].size();
  }
  EXPECT_NE(first["outputs"][0]["output_ids"], first["outputs"][1]["output_ids"]);
  EXPECT_EQ(first["usage"]["completion_tokens"], completion_tokens);
  EXPECT_EQ(first["usage"]["total_tokens"], ids.size() + completion_tokens);
  EXPECT_FALSE(second.contains("outputs"));
  EXPECT_EQ(second["output_ids"], alone(ids, {"--ignore-eos", "--max-tokens", "7"})["output_ids"]);

  write_text(in, json({{"token_ids", ids}, {"n", 0}}).dump() + "\n");
  r = run_cli(tmp_.path(), {"generate", model_.string(), "--prompts", in.string(), "--out",
                            out.string(), "--force"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("\"n\" must be an integer from 1 to 64"), std::string::npos) << r.err;
}

// A line's stop string ends it where the text alone holds it (the text before it is returned,
// the stop string not); logprobs come per output token.
TEST_F(GenerateBatch, StopStringsAndLogprobsPerLine) {
  const std::vector<int32_t> ids = {40, 41, 42, 43, 44, 45};
  const json want = alone(ids, {"--ignore-eos", "--max-tokens", "12"});
  const std::string full = want["text"];
  ASSERT_GE(full.size(), 6u) << full;
  // A stop string from the middle of the text alone: one whole UTF-8 character starting at byte 2
  // or later (its first occurrence decides).
  auto continuation = [&](size_t i) { return (static_cast<unsigned char>(full[i]) & 0xC0) == 0x80; };
  size_t begin = 2;
  while (begin < full.size() && continuation(begin)) ++begin;
  size_t end = begin + 1;
  while (end < full.size() && continuation(end)) ++end;
  ASSERT_LT(begin, full.size()) << full;
  const std::string stop = full.substr(begin, end - begin);
  const size_t at = full.find(stop);
  json a = {{"token_ids", ids}, {"max_tokens", 12}, {"ignore_eos", true}, {"stop", stop}};
  json b = {{"token_ids", ids}, {"max_tokens", 5}, {"ignore_eos", true}, {"logprobs", 2}};
  const fs::path in = tmp_.path() / "prompts.jsonl";
  const fs::path out = tmp_.path() / "out.jsonl";
  write_text(in, a.dump() + "\n" + b.dump() + "\n");
  RunResult r = run_cli(tmp_.path(), {"generate", model_.string(), "--prompts", in.string(),
                                      "--out", out.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string text = read_text(out);
  const json first = json::parse(text.substr(0, text.find('\n')));
  const json second = json::parse(text.substr(text.find('\n') + 1));
  EXPECT_EQ(first["text"], full.substr(0, at));
  EXPECT_EQ(first["finish_reason"], "stop");
  EXPECT_EQ(first["stop_reason"], stop);
  ASSERT_EQ(second["logprobs"].size(), 5u);
  for (size_t k = 0; k < 5; ++k) {
    const json& e = second["logprobs"][k];
    EXPECT_EQ(e["token_id"], second["output_ids"][k]);
    EXPECT_LE(e["logprob"].get<double>(), 0.0);
    ASSERT_EQ(e["top_logprobs"].size(), 2u);
    // Greedy: the chosen token is the most probable one.
    EXPECT_EQ(e["rank"], 1);
    EXPECT_EQ(e["top_logprobs"][0]["token_id"], e["token_id"]);
  }
}

TEST_F(GenerateBatch, BadLinesAndOutputsAreRefusedBeforeAnythingRuns) {
  const fs::path in = tmp_.path() / "prompts.jsonl";
  const fs::path out = tmp_.path() / "out.jsonl";
  auto refused = [&](const std::string& lines, const std::string& needle) {
    SCOPED_TRACE(needle);
    write_text(in, lines);
    RunResult r = run_cli(tmp_.path(), {"generate", model_.string(), "--prompts", in.string(),
                                        "--out", out.string()});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(out));
  };
  refused("{\"token_ids\": [1, 2]}\n{\"token_ids\": [3], \"max_token\": 4}\n",
          "prompts.jsonl:2: unknown field \"max_token\"");
  refused("{\"token_ids\": [1, 2], \"temperature\": -1}\n", "prompts.jsonl:1: ");
  refused("{\"token_ids\": [1, 2], \"max_tokens\": \"8\"}\n",
          "prompts.jsonl:1: \"max_tokens\" must be an integer");
  refused("{\"token_ids\": [1, 999]}\n", "prompts.jsonl:1: ");
  write_text(in, "{\"token_ids\": [1, 2]}\n");
  RunResult r = run_cli(tmp_.path(), {"generate", model_.string(), "--prompts", in.string()});
  EXPECT_NE(r.err.find("--prompts needs --out"), std::string::npos) << r.err;
  write_text(out, "keep me\n");
  r = run_cli(tmp_.path(), {"generate", model_.string(), "--prompts", in.string(), "--out",
                            out.string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_EQ(read_text(out), "keep me\n");
  r = run_cli(tmp_.path(), {"generate", model_.string(), "--prompts", in.string(), "--out",
                            out.string(), "--force"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(read_text(out), "keep me\n");
}

}  // namespace
}  // namespace e4kv
