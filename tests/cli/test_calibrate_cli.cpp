// The scale workflow on real forwards through the built e4kv program (E4KV_CLI_PATH):
// calibrate -> summarize -> overlay -> verify -> generate with E4M3 -> compare, on a small Qwen4Exp
// and a small dense checkpoint (random weights); shards of a calibration merge to the one-shot
// statistics; calibrate refuses an E4M3 cache; chat-template corpora render through the template.
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "calib/kv_stats.h"
#include "chat/chat_template.h"
#include "testing/cli.h"
#include "testing/synth_tokenizer.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

void expect_ok(const RunResult& r, const std::string& what) {
  ASSERT_TRUE(r.exited) << what;
  ASSERT_EQ(r.exit_code, 0) << what << ": " << r.err << r.out;
}

// A corpus of every kind of document but messages: long text (longer than the QSA budget, so the
// selection is sparse), token ids, a short text.
void write_corpus(const fs::path& path) {
  std::string text;
  for (int i = 0; i < 12; ++i) text += "Calibration sees what the cache write receives. ";
  json ids = json::array();
  for (int i = 5; i < 110; ++i) ids.push_back(i);
  write_text(path, json{{"text", text}}.dump() + "\n" + json{{"token_ids", ids}}.dump() + "\n\n" +
                       json{{"text", "A short one."}}.dump() + "\n" +
                       json{{"text", "The quick brown fox jumps over the lazy dog."}}.dump() +
                       "\n");
}

// calibrate -> summarize (the directory) -> overlay -> verify -> generate E4M3 -> compare.
void run_workflow(const TempDir& tmp, const std::vector<std::string>& synth_flags,
                  const std::vector<int64_t>& kv_layers) {
  const fs::path base = tmp.path() / "base";
  std::vector<std::string> synth = {"synth-checkpoint", base.string()};
  synth.insert(synth.end(), synth_flags.begin(), synth_flags.end());
  expect_ok(run_cli(tmp.path(), synth), "synth-checkpoint");
  const fs::path corpus = tmp.path() / "corpus.jsonl";
  write_corpus(corpus);
  const fs::path stats = tmp.path() / "stats";
  RunResult cal = run_cli(tmp.path(), {"calibrate", base.string(), "--corpus", corpus.string(),
                                       "--out", stats.string(), "--generate-tokens", "3"});
  expect_ok(cal, "calibrate");
  EXPECT_NE(cal.out.find("calibrated 4 documents"), std::string::npos) << cal.out;
  Result<KvStats> observed = read_kv_stats(stats / "kv-stats-shard-0-of-1.jsonl");
  ASSERT_TRUE(observed.ok()) << observed.message();
  EXPECT_EQ(observed->header().source, "observed");
  EXPECT_EQ(observed->header().kv_layers, kv_layers);
  const json run = json::parse(read_text(stats / "calibrate-shard-0-of-1.json"));
  EXPECT_EQ(run["documents"], 4);
  EXPECT_EQ(run["generated_tokens"], 4 * 3);
  EXPECT_EQ(observed->header().tokens, run["tokens"].get<int64_t>());
  // Every K value observed once per token and channel.
  const int64_t kv_dim = observed->at(0).count() / observed->header().tokens;
  EXPECT_EQ(observed->at(0).count(), observed->header().tokens * kv_dim);
  EXPECT_GT(observed->at(0).absmax(), 0.0f);
  // The same outputs again are refused without --force.
  RunResult again = run_cli(tmp.path(), {"calibrate", base.string(), "--corpus", corpus.string(),
                                         "--out", stats.string()});
  EXPECT_NE(again.exit_code, 0);
  EXPECT_NE(again.err.find("--force"), std::string::npos) << again.err;

  const fs::path scales = tmp.path() / "scales.json";
  RunResult sum = run_cli(tmp.path(), {"summarize", stats.string(), "--out", scales.string(),
                                       "--report", (tmp.path() / "report").string()});
  expect_ok(sum, "summarize");
  EXPECT_EQ(sum.out.find("SYNTHETIC"), std::string::npos) << sum.out;
  const fs::path derived = tmp.path() / "derived";
  expect_ok(run_cli(tmp.path(), {"overlay", base.string(), "--scales", scales.string(), "--out",
                                 derived.string()}),
            "overlay");
  expect_ok(run_cli(tmp.path(), {"verify", derived.string()}), "verify");
  RunResult gen = run_cli(tmp.path(), {"generate", derived.string(), "--prompt", "The cache",
                                       "--max-tokens", "4", "--kv-cache-dtype", "fp8_e4m3",
                                       "--json"});
  expect_ok(gen, "generate e4m3");
  EXPECT_EQ(json::parse(gen.out)["output_ids"].size(), 4u);

  const fs::path out = tmp.path() / "compare";
  RunResult cmp = run_cli(tmp.path(), {"compare", derived.string(), "--prompts", corpus.string(),
                                       "--max-tokens", "4", "--with-unit-control", "--out",
                                       out.string(), "--prefill-chunk", "64", "--isolated"});
  expect_ok(cmp, "compare");
  EXPECT_NE(cmp.out.find("| e4m3 | calibrated |"), std::string::npos) << cmp.out;
  const json report = json::parse(read_text(out / "compare.json"));
  EXPECT_EQ(report["prompts"], 4);
  ASSERT_EQ(report["modes"].size(), 2u);
  EXPECT_EQ(report["modes"][0]["name"], "e4m3");
  EXPECT_EQ(report["modes"][1]["name"], "unit");
  for (const json& mode : report["modes"]) {
    ASSERT_EQ(mode["layers"].size(), kv_layers.size());
    for (size_t i = 0; i < kv_layers.size(); ++i) {
      const json& layer = mode["layers"][i];
      EXPECT_EQ(layer["layer"], kv_layers[i]);
      // E4M3 K/V change the attention output a little, never to nothing or to garbage.
      EXPECT_GT(layer["rel_l2"].get<double>(), 0.0);
      EXPECT_LT(layer["rel_l2"].get<double>(), 0.2);
      EXPECT_GT(layer["cosine"].get<double>(), 0.98);
      // --isolated: the first KV layer reads the same input in both passes; every later one
      // reads the FP16 run's input instead of one carrying the earlier layers' E4M3 error.
      const double isolated = layer["isolated"]["rel_l2"].get<double>();
      EXPECT_GT(isolated, 0.0);
      EXPECT_LT(isolated, 0.2);
      if (i == 0) {
        EXPECT_DOUBLE_EQ(isolated, layer["rel_l2"].get<double>());
      } else {
        EXPECT_NE(isolated, layer["rel_l2"].get<double>()) << "layer " << kv_layers[i];
      }
    }
    EXPECT_GE(mode["mean_kl"].get<double>(), 0.0);
    EXPECT_EQ(mode["greedy"]["prompts"], 4);
  }
  EXPECT_TRUE(fs::exists(out / "compare.svg"));
  EXPECT_TRUE(fs::exists(out / "compare.md"));
}

TEST(CliCalibrate, Qwen4ExpWorkflowOnRealForwards) {
  TempDir tmp;
  run_workflow(tmp, {"--family", "qwen4exp", "--layers", "8", "--shards", "2"}, {3, 7});
  // The QSA layers select sparsely on the long prompts: selection overlap is measured.
  const json report = json::parse(read_text(tmp.path() / "compare" / "compare.json"));
  EXPECT_TRUE(report["modes"][0]["layers"][0].contains("selection"));
  EXPECT_GT(report["modes"][0]["layers"][0]["selection"]["rows"].get<int64_t>(), 0);
}

TEST(CliCalibrate, DenseWorkflowOnRealForwards) {
  TempDir tmp;
  run_workflow(tmp, {"--family", "llama", "--head-dim", "64"}, {0, 1, 2, 3});
}

// Statistics of shards 0/2 and 1/2, merged, equal the statistics of one process over the corpus.
TEST(CliCalibrate, ShardsMergeToTheOneShotStatistics) {
  TempDir tmp;
  const fs::path base = tmp.path() / "base";
  expect_ok(run_cli(tmp.path(), {"synth-checkpoint", base.string(), "--family", "qwen4exp"}),
            "synth-checkpoint");
  const fs::path corpus = tmp.path() / "corpus.jsonl";
  write_corpus(corpus);
  for (const char* shard : {"0/1", "0/2", "1/2"}) {
    const std::string dir = std::string(shard) == "0/1" ? "one" : "sharded";
    expect_ok(run_cli(tmp.path(), {"calibrate", base.string(), "--corpus", corpus.string(), "--out",
                                   (tmp.path() / dir).string(), "--shard", shard,
                                   "--generate-tokens", "2", "--no-progress"}),
              std::string("calibrate ") + shard);
  }
  Result<KvStats> one = read_kv_stats(tmp.path() / "one" / "kv-stats-shard-0-of-1.jsonl");
  Result<KvStats> a = read_kv_stats(tmp.path() / "sharded" / "kv-stats-shard-0-of-2.jsonl");
  Result<KvStats> b = read_kv_stats(tmp.path() / "sharded" / "kv-stats-shard-1-of-2.jsonl");
  ASSERT_TRUE(one.ok() && a.ok() && b.ok());
  EXPECT_EQ(a->header().shard, std::optional<int64_t>(0));
  EXPECT_EQ(b->header().shard, std::optional<int64_t>(1));
  ASSERT_TRUE(a->merge(*b).ok());
  EXPECT_EQ(a->header().tokens, one->header().tokens);
  ASSERT_EQ(a->size(), one->size());
  for (size_t i = 0; i < one->size(); ++i) {
    EXPECT_TRUE(a->at(i) == one->at(i)) << one->key_at(i);
  }
}

TEST(CliCalibrate, RefusesAnE4m3CacheAndBadCorpora) {
  TempDir tmp;
  const fs::path base = tmp.path() / "base";
  expect_ok(run_cli(tmp.path(), {"synth-checkpoint", base.string(), "--family", "qwen4exp"}),
            "synth-checkpoint");
  const fs::path corpus = tmp.path() / "corpus.jsonl";
  write_corpus(corpus);
  RunResult e4m3 = run_cli(tmp.path(), {"calibrate", base.string(), "--corpus", corpus.string(),
                                        "--out", (tmp.path() / "s").string(), "--kv-cache-dtype",
                                        "fp8_e4m3"});
  EXPECT_EQ(e4m3.exit_code, 1);
  EXPECT_NE(e4m3.err.find("FP16 cache stores"), std::string::npos) << e4m3.err;
  EXPECT_FALSE(fs::exists(tmp.path() / "s"));

  const fs::path bad = tmp.path() / "bad.jsonl";
  write_text(bad, "{\"text\": \"ok\"}\n{\"token_ids\": [1, 99999]}\n");
  RunResult r = run_cli(tmp.path(), {"calibrate", base.string(), "--corpus", bad.string(), "--out",
                                     (tmp.path() / "s").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("bad.jsonl:2: token 1 is id 99999"), std::string::npos) << r.err;

  // messages without a chat template in the checkpoint (the synthetic one carries one: drop it)
  json tokenizer_config = json::parse(read_text(base / "tokenizer_config.json"));
  ASSERT_TRUE(tokenizer_config.contains("chat_template"));
  tokenizer_config.erase("chat_template");
  write_text(base / "tokenizer_config.json", tokenizer_config.dump());
  const fs::path chat = tmp.path() / "chat.jsonl";
  write_text(chat, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
  RunResult no_template = run_cli(tmp.path(), {"calibrate", base.string(), "--corpus",
                                               chat.string(), "--out", (tmp.path() / "s").string()});
  EXPECT_EQ(no_template.exit_code, 1);
  EXPECT_NE(no_template.err.find("chat template"), std::string::npos) << no_template.err;

  // With a template (chat_template.jinja beside the checkpoint) the conversation renders and
  // calibrates.
  write_text(base / "chat_template.jinja",
             "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}");
  RunResult with_template = run_cli(tmp.path(), {"calibrate", base.string(), "--corpus",
                                                 chat.string(), "--out",
                                                 (tmp.path() / "s").string()});
  expect_ok(with_template, "calibrate messages");
  const json run = json::parse(read_text(tmp.path() / "s" / "calibrate-shard-0-of-1.json"));
  // "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n": 3 special tokens among them.
  EXPECT_GT(run["prompt_tokens"].get<int64_t>(), 5);
}

// The template synthetic checkpoints carry renders ChatML exactly.
TEST(CliCalibrate, SyntheticChatTemplateRendersChatMl) {
  Result<ChatTemplate> t = ChatTemplate::from_source(kSynthChatTemplate);
  ASSERT_TRUE(t.ok()) << t.message();
  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(
      R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])");
  ChatRenderOptions options;
  options.add_generation_prompt = true;
  Result<std::string> text = t->render(messages, options);
  ASSERT_TRUE(text.ok()) << text.message();
  EXPECT_EQ(*text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n");
  options.add_generation_prompt = false;
  EXPECT_EQ(*t->render(messages, options),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
}

}  // namespace
}  // namespace e4kv
