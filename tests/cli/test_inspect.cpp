// Runs the built e4kv program (E4KV_CLI_PATH) as a user would: `synth-checkpoint` then `inspect`,
// and checks that every malformed checkpoint gives exit code 1 and one "e4kv: error:" line.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/status.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "testing/cli.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;
using json = nlohmann::json;

// Exit code exactly 1 (not a signal: a shell reports those as 128 + n), nothing on stdout, and
// exactly one line on stderr starting with "e4kv: error:".
void expect_one_line_error(const RunResult& r, const std::string& what,
                           const std::string& needle = "") {
  SCOPED_TRACE(what);
  EXPECT_TRUE(r.exited);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("e4kv: error:", 0), 0u) << r.err;
  ASSERT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.back(), '\n') << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  if (!needle.empty()) {
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  }
}

// A sharded Qwen4Exp-shaped checkpoint made through the CLI: 8 layers, 3 shards, K/V scales.
fs::path make_sharded(const TempDir& tmp) {
  const fs::path dir = tmp.path() / "ckpt";
  RunResult r =
      run_cli(tmp.path(), {"synth-checkpoint", dir.string(), "--family", "qwen4exp", "--layers",
                           "8", "--shards", "3", "--with-kv-scales", "--seed", "3"});
  EXPECT_TRUE(r.exited && r.exit_code == 0) << r.err;
  EXPECT_NE(r.out.find("wrote qwen4exp checkpoint"), std::string::npos) << r.out;
  return dir;
}

TEST(CliInspect, TextOutput) {
  TempDir tmp;
  const fs::path dir = make_sharded(tmp);
  RunResult r = run_cli(tmp.path(), {"inspect", dir.string()});
  ASSERT_TRUE(r.exited);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  for (const char* needle : {
           "architecture  Qwen4ExpForCausalLM",
           "model_type    qwen4_exp_text",
           "layers        8",
           "qwen_sparse_attention  2 [3 7]",
           "linear_attention  6 [0 1 2 4 5 6]",
           "kv cache      2 layers [3 7]",
           "qsa           2 layers [3 7]",
           "q heads 4, kv heads 2, head_dim 32, rotary_dim 8, gqa group 2",
           "heads 4, kv heads 1, head_dim 32, budget 64, compress ratio 4, top-k groups 16",
           "shards        3 (indexed)",
           "model-00002-of-00003.safetensors",
           "kv scales     4/4 present, 0 missing, 0 unexpected, 0 conflicting",
           "k model.layers.3.self_attn.k_scale = ",
       }) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << "missing \"" << needle << "\" in\n"
                                                     << r.out;
  }
}

TEST(CliInspect, JsonOutput) {
  TempDir tmp;
  const fs::path dir = make_sharded(tmp);
  RunResult r = run_cli(tmp.path(), {"inspect", dir.string(), "--json"});
  ASSERT_TRUE(r.exited);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json report;
  ASSERT_NO_THROW(report = json::parse(r.out)) << r.out;

  EXPECT_EQ(report["architecture"], "Qwen4ExpForCausalLM");
  EXPECT_EQ(report["model_type"], "qwen4_exp_text");
  EXPECT_EQ(report["layers"]["count"], 8);
  EXPECT_EQ(report["layers"]["by_kind"]["qwen_sparse_attention"]["count"], 2);
  EXPECT_EQ(report["layers"]["by_kind"]["qwen_sparse_attention"]["indices"], json({3, 7}));
  EXPECT_EQ(report["layers"]["by_kind"]["linear_attention"]["count"], 6);
  EXPECT_FALSE(report["layers"]["by_kind"].contains("full_attention"));
  EXPECT_EQ(report["layers"]["kinds"].size(), 8u);
  EXPECT_EQ(report["kv_cache_layers"], json({3, 7}));
  EXPECT_EQ(report["qsa_layers"], json({3, 7}));
  EXPECT_EQ(report["attention"]["n_heads"], 4);
  EXPECT_EQ(report["attention"]["n_kv_heads"], 2);
  EXPECT_EQ(report["attention"]["head_dim"], 32);
  EXPECT_EQ(report["attention"]["rotary_dim"], 8);
  EXPECT_EQ(report["attention"]["gqa_group"], 2);
  EXPECT_EQ(report["qsa_indexer"]["n_heads"], 4);
  EXPECT_EQ(report["qsa_indexer"]["n_kv_heads"], 1);
  EXPECT_EQ(report["qsa_indexer"]["head_dim"], 32);
  EXPECT_EQ(report["qsa_indexer"]["budget"], 64);
  EXPECT_EQ(report["qsa_indexer"]["compress_ratio"], 4);
  EXPECT_EQ(report["rope"]["type"], "default");
  EXPECT_DOUBLE_EQ(report["rope"]["theta"].get<double>(), 1e7);
  EXPECT_DOUBLE_EQ(report["rope"]["partial_rotary_factor"].get<double>(), 0.25);

  // Tensor counts and bytes agree with what the generator made.
  SynthCheckpointOptions options;
  options.family = SynthFamily::kQwen4Exp;
  options.n_layers = 8;
  options.n_shards = 3;
  options.with_kv_scales = true;
  options.seed = 3;
  Result<SynthCheckpoint> expected = make_synth_checkpoint(options);
  ASSERT_TRUE(expected.ok()) << expected.message();
  uint64_t bytes = 0;
  uint64_t f32_count = 0;
  for (const SynthTensor& t : expected->tensors) {
    bytes += t.data.size();
    f32_count += t.dtype == DType::kF32 ? 1 : 0;
  }
  EXPECT_EQ(report["tensors"]["count"], expected->tensors.size());
  EXPECT_EQ(report["tensors"]["bytes"], bytes);
  EXPECT_EQ(report["tensors"]["by_dtype"]["F32"]["count"], f32_count);
  EXPECT_EQ(report["tensors"]["by_dtype"]["BF16"]["count"], expected->tensors.size() - f32_count);
  EXPECT_EQ(report["sharded"], true);
  ASSERT_EQ(report["shards"].size(), 3u);
  uint64_t shard_tensors = 0;
  for (const json& shard : report["shards"]) shard_tensors += shard["tensors"].get<uint64_t>();
  EXPECT_EQ(shard_tensors, expected->tensors.size());
  EXPECT_EQ(report["shards"][0]["file"], "model-00001-of-00003.safetensors");

  const json& scales = report["kv_scales"];
  EXPECT_EQ(scales["expected"], 4);
  EXPECT_EQ(scales["present"], 4);
  EXPECT_TRUE(scales["missing"].empty());
  EXPECT_TRUE(scales["unexpected"].empty());
  ASSERT_EQ(scales["layers"].size(), 2u);
  EXPECT_EQ(scales["layers"][0]["layer"], 3);
  EXPECT_EQ(scales["layers"][0]["k"]["key"], "model.layers.3.self_attn.k_scale");
  EXPECT_GT(scales["layers"][0]["k"]["value"].get<double>(), 0.0);
}

TEST(CliInspect, ScaleKeyAnomalies) {
  // Qwen4Exp (KV caches on layers 3 and 7) with: an alias and a canonical key for layer 3 K (a
  // conflict), a scale on linear layer 0 (no KV cache), and nothing for 3 V, 7 K, 7 V.
  TempDir tmp;
  SynthCheckpointOptions options;
  options.family = SynthFamily::kQwen4Exp;
  options.n_layers = 8;
  Result<SynthCheckpoint> synth = make_synth_checkpoint(options);
  ASSERT_TRUE(synth.ok()) << synth.message();
  const fs::path dir = tmp.path() / "ckpt";
  fs::create_directories(dir);
  write_text(dir / "config.json", synth->config_json);
  std::vector<SafetensorsWriteTensor> tensors;
  for (const SynthTensor& t : synth->tensors) tensors.push_back({t.name, t.dtype, t.shape, t.data});
  const float one = 1.0f;
  const std::span<const std::byte> scalar(reinterpret_cast<const std::byte*>(&one), 4);
  tensors.push_back({"model.layers.3.self_attn.k_scale", DType::kF32, {}, scalar});
  tensors.push_back({"model.layers.3.self_attn.k_proj.k_scale", DType::kF32, {}, scalar});
  tensors.push_back({"model.layers.0.self_attn.k_scale", DType::kF32, {}, scalar});
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", tensors).ok());

  RunResult r = run_cli(tmp.path(), {"inspect", dir.string(), "--json"});
  ASSERT_TRUE(r.exited);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json scales = json::parse(r.out)["kv_scales"];
  EXPECT_EQ(scales["expected"], 4);
  EXPECT_EQ(scales["present"], 1);
  EXPECT_EQ(scales["missing"],
            json({"model.layers.3.self_attn.v_scale", "model.layers.7.self_attn.k_scale",
                  "model.layers.7.self_attn.v_scale"}));
  ASSERT_EQ(scales["unexpected"].size(), 1u);
  EXPECT_EQ(scales["unexpected"][0]["key"], "model.layers.0.self_attn.k_scale");
  EXPECT_NE(scales["unexpected"][0]["reason"].get<std::string>().find("no KV cache"),
            std::string::npos);
  ASSERT_EQ(scales["conflicts"].size(), 1u);
  EXPECT_EQ(scales["conflicts"][0]["layer"], 3);
  EXPECT_DOUBLE_EQ(scales["layers"][0]["k"]["value"].get<double>(), 1.0);

  RunResult text = run_cli(tmp.path(), {"inspect", dir.string()});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("1/4 present, 3 missing, 1 unexpected, 1 conflicting"), std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("missing     model.layers.7.self_attn.k_scale"), std::string::npos);
}

struct BrokenCase {
  const char* name;
  const char* needle;  // a piece of the expected message
  std::function<void(const fs::path& dir)> breakage;
};

TEST(CliInspect, MalformedCheckpointsFailWithOneLine) {
  const auto shard = [](int k) { return cat("model-0000", k, "-of-00003.safetensors"); };
  const auto edit_index = [](const fs::path& dir, const std::function<void(json&)>& edit) {
    json index = json::parse(read_text(dir / kSafetensorsIndexName));
    edit(index);
    write_text(dir / kSafetensorsIndexName, index.dump());
  };
  const auto edit_config = [](const fs::path& dir, const std::function<void(json&)>& edit) {
    json config = json::parse(read_text(dir / "config.json"));
    edit(config);
    write_text(dir / "config.json", config.dump());
  };
  const std::vector<BrokenCase> cases = {
      {"truncated shard", "model-00002-of-00003.safetensors",
       [&](const fs::path& dir) {
         fs::resize_file(dir / shard(2), fs::file_size(dir / shard(2)) / 2);
       }},
      {"shard shorter than its length prefix", "model-00001-of-00003.safetensors",
       [&](const fs::path& dir) { write_text(dir / shard(1), "abc"); }},
      {"bad header JSON", "model-00003-of-00003.safetensors",
       [&](const fs::path& dir) {
         std::fstream file(dir / shard(3), std::ios::in | std::ios::out | std::ios::binary);
         file.seekp(8);
         file.write("[[[[", 4);
       }},
      {"missing shard", "does not exist", [&](const fs::path& dir) { fs::remove(dir / shard(2)); }},
      {"index naming a missing tensor", "model.layers.42.mlp.up_proj.weight",
       [&](const fs::path& dir) {
         edit_index(dir, [&](json& index) {
           index["weight_map"]["model.layers.42.mlp.up_proj.weight"] = shard(1);
         });
       }},
      {"tensor missing from index", "not listed",
       [&](const fs::path& dir) {
         edit_index(dir, [](json& index) { index["weight_map"].erase("lm_head.weight"); });
       }},
      {"shard outside the directory", "not a plain file name",
       [&](const fs::path& dir) {
         edit_index(dir, [](json& index) {
           index["weight_map"]["lm_head.weight"] = "../model.safetensors";
         });
       }},
      {"index not JSON", "invalid JSON",
       [&](const fs::path& dir) { write_text(dir / kSafetensorsIndexName, "{\"weight_map\""); }},
      {"bad config.json", "config.json: invalid JSON",
       [&](const fs::path& dir) { write_text(dir / "config.json", "{\"hidden_size\": 64,\n"); }},
      {"config with a string size", "\"hidden_size\" must be an integer",
       [&](const fs::path& dir) {
         edit_config(dir, [](json& config) { config["hidden_size"] = "64"; });
       }},
      {"unknown layer type", "\"mamba\"",
       [&](const fs::path& dir) {
         edit_config(dir, [](json& config) { config["layer_types"][2] = "mamba"; });
       }},
      {"incomplete QSA fields", "indexer_budget",
       [&](const fs::path& dir) {
         edit_config(dir, [](json& config) { config.erase("indexer_budget"); });
       }},
      {"missing config", "config.json",
       [&](const fs::path& dir) { fs::remove(dir / "config.json"); }},
      {"empty dir", "config.json",
       [&](const fs::path& dir) {
         for (const auto& entry : fs::directory_iterator(dir)) fs::remove(entry.path());
       }},
      {"no weights", "no model.safetensors.index.json or model.safetensors",
       [&](const fs::path& dir) {
         fs::remove(dir / kSafetensorsIndexName);
         for (int k = 1; k <= 3; ++k) fs::remove(dir / shard(k));
       }},
      {"not a directory", "not a directory",
       [&](const fs::path& dir) {
         fs::remove_all(dir);
         write_text(dir, "x");
       }},
      {"absent directory", "not found", [&](const fs::path& dir) { fs::remove_all(dir); }},
  };
  TempDir tmp;
  SynthCheckpointOptions options;
  options.family = SynthFamily::kQwen4Exp;
  options.n_layers = 8;
  options.n_shards = 3;
  for (const BrokenCase& c : cases) {
    const fs::path dir = tmp.path() / "ckpt";
    fs::remove_all(dir);
    ASSERT_TRUE(write_synth_checkpoint(dir, options).ok());
    c.breakage(dir);
    expect_one_line_error(run_cli(tmp.path(), {"inspect", dir.string()}), c.name, c.needle);
    expect_one_line_error(run_cli(tmp.path(), {"inspect", dir.string(), "--json"}),
                          cat(c.name, " (--json)"), c.needle);
  }
}

TEST(CliSynth, RefusesNonEmptyDirAndBadOptions) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "out";
  fs::create_directories(dir);
  write_text(dir / "keep.txt", "x");
  expect_one_line_error(run_cli(tmp.path(), {"synth-checkpoint", dir.string()}), "non-empty",
                        "not empty");
  EXPECT_EQ(read_text(dir / "keep.txt"), "x");

  expect_one_line_error(
      run_cli(tmp.path(), {"synth-checkpoint", (tmp.path() / "a").string(), "--family", "gpt2"}),
      "bad family", "gpt2");
  expect_one_line_error(
      run_cli(tmp.path(), {"synth-checkpoint", (tmp.path() / "b").string(), "--dtype", "f8"}),
      "bad dtype", "--dtype");
  expect_one_line_error(
      run_cli(tmp.path(), {"synth-checkpoint", (tmp.path() / "c").string(), "--shards", "1000"}),
      "too many shards", "shards");
  EXPECT_FALSE(fs::exists(tmp.path() / "c"));

  // An existing empty directory is fine; the result opens and matches the options.
  const fs::path empty = tmp.path() / "empty";
  fs::create_directories(empty);
  RunResult r = run_cli(tmp.path(), {"synth-checkpoint", empty.string(), "--dtype", "f32",
                                     "--layers", "2", "--shards", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  Result<Checkpoint> ckpt = Checkpoint::open(empty);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  EXPECT_EQ(ckpt->config().n_layers, 2);
  EXPECT_EQ(ckpt->shards().size(), 2u);
  EXPECT_EQ(ckpt->find("model.embed_tokens.weight")->dtype, DType::kF32);
}

}  // namespace
}  // namespace e4kv
