#include "io/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kv/scale_keys.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::read_text;
using testing_support::TempDir;
using testing_support::write_text;
using json = nlohmann::json;

// A fresh directory under the system temp dir, removed with everything in it at scope exit.

SynthCheckpointOptions sharded_qwen() {
  SynthCheckpointOptions options;
  options.family = SynthFamily::kQwen4Exp;
  options.n_layers = 8;
  options.n_shards = 3;
  options.with_kv_scales = true;
  options.seed = 7;
  return options;
}

// Every tensor of `expected` is found with the same dtype, shape, bytes and shard.
void expect_matches(const Checkpoint& ckpt, const SynthCheckpoint& expected) {
  ASSERT_EQ(ckpt.tensor_names().size(), expected.tensors.size());
  for (size_t i = 0; i < expected.tensors.size(); ++i) {
    const SynthTensor& want = expected.tensors[i];
    const SafetensorsTensor* got = ckpt.find(want.name);
    ASSERT_NE(got, nullptr) << want.name;
    EXPECT_EQ(got->dtype, want.dtype) << want.name;
    EXPECT_EQ(got->shape, want.shape) << want.name;
    ASSERT_EQ(got->bytes.size(), want.data.size()) << want.name;
    EXPECT_TRUE(std::equal(got->bytes.begin(), got->bytes.end(), want.data.begin())) << want.name;
    EXPECT_EQ(ckpt.shard_of(want.name), expected.shard_names[expected.shard_of[i]]) << want.name;
  }
}

TEST(Checkpoint, SingleFile) {
  TempDir dir;
  SynthCheckpointOptions options;  // llama, 4 layers, one file
  ASSERT_TRUE(write_synth_checkpoint(dir.path(), options).ok());
  EXPECT_FALSE(fs::exists(dir.path() / kSafetensorsIndexName));

  Result<Checkpoint> ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  EXPECT_FALSE(ckpt->sharded());
  ASSERT_EQ(ckpt->shards().size(), 1u);
  EXPECT_EQ(ckpt->dir(), dir.path());
  EXPECT_EQ(ckpt->config().architecture, "LlamaForCausalLM");
  EXPECT_EQ(ckpt->config().n_layers, 4);
  EXPECT_EQ(ckpt->config().count_layers(LayerKind::kFullAttention), 4);

  Result<SynthCheckpoint> expected = make_synth_checkpoint(options);
  ASSERT_TRUE(expected.ok()) << expected.message();
  expect_matches(*ckpt, *expected);
  EXPECT_EQ(ckpt->shard_of("model.embed_tokens.weight"), "model.safetensors");
  EXPECT_EQ(ckpt->find("model.layers.4.mlp.up_proj.weight"), nullptr);
  EXPECT_EQ(ckpt->shard_of("nope"), "");

  const std::vector<std::string> names = ckpt->tensor_names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_TRUE(std::binary_search(names.begin(), names.end(), "lm_head.weight"));
}

TEST(Checkpoint, ShardedLookupAcrossShards) {
  TempDir dir;
  const SynthCheckpointOptions options = sharded_qwen();
  ASSERT_TRUE(write_synth_checkpoint(dir.path(), options).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  EXPECT_TRUE(ckpt->sharded());
  ASSERT_EQ(ckpt->shards().size(), 3u);

  Result<SynthCheckpoint> expected = make_synth_checkpoint(options);
  ASSERT_TRUE(expected.ok()) << expected.message();
  expect_matches(*ckpt, *expected);

  // Every shard holds something, and shards come in the order the (sorted) index first names them.
  std::set<std::string> used;
  for (const std::string& name : ckpt->tensor_names()) used.insert(ckpt->shard_of(name));
  EXPECT_EQ(used.size(), 3u);
  const std::string first = ckpt->tensor_names().front();
  EXPECT_EQ(fs::path(ckpt->shards().front()->source()).filename().string(), ckpt->shard_of(first));

  const ModelConfig& config = ckpt->config();
  EXPECT_EQ(config.kv_cache_layers(), (std::vector<int64_t>{3, 7}));
  ASSERT_TRUE(config.qsa.has_value());
  EXPECT_EQ(config.rotary_dim, 8);
  for (int64_t layer : config.kv_cache_layers()) {
    EXPECT_NE(ckpt->find(canonical_scale_key("model", layer, KvTensor::kK)), nullptr);
    EXPECT_NE(ckpt->find(canonical_scale_key("model", layer, KvTensor::kV)), nullptr);
  }
  EXPECT_EQ(ckpt->find("model.layers.0.self_attn.k_scale"), nullptr);
}

TEST(Checkpoint, ManyShardsAndDtypes) {
  for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
    TempDir dir;
    SynthCheckpointOptions options;
    options.dtype = dtype;
    options.n_layers = 2;
    options.n_shards = 5;
    options.tie_word_embeddings = true;
    ASSERT_TRUE(write_synth_checkpoint(dir.path(), options).ok());
    Result<Checkpoint> ckpt = Checkpoint::open(dir.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    EXPECT_EQ(ckpt->shards().size(), 5u);
    EXPECT_TRUE(ckpt->config().tie_word_embeddings);
    EXPECT_EQ(ckpt->find("lm_head.weight"), nullptr);
    const SafetensorsTensor* embed = ckpt->find("model.embed_tokens.weight");
    ASSERT_NE(embed, nullptr);
    EXPECT_EQ(embed->dtype, dtype);
    Result<SynthCheckpoint> expected = make_synth_checkpoint(options);
    ASSERT_TRUE(expected.ok());
    expect_matches(*ckpt, *expected);
  }
}

TEST(SynthCheckpoint, DeterministicPerSeed) {
  SynthCheckpointOptions options = sharded_qwen();
  Result<SynthCheckpoint> a = make_synth_checkpoint(options);
  Result<SynthCheckpoint> b = make_synth_checkpoint(options);
  options.seed = 8;
  Result<SynthCheckpoint> c = make_synth_checkpoint(options);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_EQ(a->tensors.size(), b->tensors.size());
  for (size_t i = 0; i < a->tensors.size(); ++i) EXPECT_EQ(a->tensors[i].data, b->tensors[i].data);
  EXPECT_NE(a->tensors[0].data, c->tensors[0].data);
  EXPECT_EQ(a->config_json, c->config_json);

  uint64_t bytes = 0;
  for (const SynthTensor& t : a->tensors) bytes += t.data.size();
  EXPECT_LT(bytes, 4u << 20);  // small by default
}

TEST(SynthCheckpoint, Qwen4ExpShapes) {
  Result<SynthCheckpoint> ckpt = make_synth_checkpoint(sharded_qwen());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  auto shape_of = [&](const std::string& name) {
    for (const SynthTensor& t : ckpt->tensors) {
      if (t.name == name) return t.shape;
    }
    ADD_FAILURE() << "missing " << name;
    return std::vector<int64_t>{};
  };
  EXPECT_EQ(shape_of("model.layers.3.self_attn.q_proj.weight"), (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(shape_of("model.layers.3.self_attn.k_proj.weight"), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(shape_of("model.layers.3.self_attn.indexer.index_qk_proj.weight"),
            (std::vector<int64_t>{160, 64}));
  EXPECT_EQ(shape_of("model.layers.3.self_attn.k_scale"), (std::vector<int64_t>{}));
  EXPECT_EQ(shape_of("model.layers.0.linear_attn.out_proj.weight"), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(shape_of("model.layers.0.linear_attn.A_log"), (std::vector<int64_t>{4}));

  Result<ModelConfig> config = parse_model_config(ckpt->config_json, "synth");
  ASSERT_TRUE(config.ok()) << config.message();
  EXPECT_EQ(config->model_type, "qwen4_exp_text");
  EXPECT_EQ(config->count_layers(LayerKind::kQsaAttention), 2);
  EXPECT_EQ(config->count_layers(LayerKind::kLinearAttention), 6);
}

TEST(SynthCheckpoint, RejectsBadOptions) {
  SynthCheckpointOptions options;
  options.n_kv_heads = 3;
  EXPECT_FALSE(make_synth_checkpoint(options).ok());
  options = {};
  options.dtype = DType::kI32;
  EXPECT_FALSE(make_synth_checkpoint(options).ok());
  options = {};
  options.n_shards = 10000;
  EXPECT_NE(make_synth_checkpoint(options).message().find("shards"), std::string::npos);
  options = {};
  options.n_layers = 0;
  EXPECT_FALSE(make_synth_checkpoint(options).ok());
  options = {};
  options.family = SynthFamily::kQwen4Exp;
  options.head_dim = 20;
  EXPECT_FALSE(make_synth_checkpoint(options).ok());
  EXPECT_FALSE(parse_synth_family("gpt2").ok());
  EXPECT_EQ(*parse_synth_family("qwen4exp"), SynthFamily::kQwen4Exp);
}

// ---- malformed checkpoints ----------------------------------------------------------------------

class CheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(write_synth_checkpoint(dir_.path(), sharded_qwen()).ok());
    index_ = json::parse(read_text(index_path()));
  }
  fs::path index_path() const { return dir_.path() / kSafetensorsIndexName; }
  void write_index(const json& index) { write_text(index_path(), index.dump(2)); }
  std::string open_error() {
    Result<Checkpoint> ckpt = Checkpoint::open(dir_.path());
    EXPECT_FALSE(ckpt.ok()) << "expected Checkpoint::open to fail";
    return ckpt.ok() ? std::string() : ckpt.message();
  }
  std::string shard_name(int k) const { return cat("model-0000", k, "-of-00003.safetensors"); }

  TempDir dir_;
  json index_;
};

#define EXPECT_HAS(message, needle) \
  EXPECT_NE((message).find(needle), std::string::npos) << "message: " << (message)

TEST_F(CheckpointErrors, IndexNotJson) {
  write_text(index_path(), "{\"weight_map\": {");
  std::string message = open_error();
  EXPECT_HAS(message, index_path().string());
  EXPECT_HAS(message, "invalid JSON at byte");
}

TEST_F(CheckpointErrors, IndexShape) {
  write_index(json::array());
  EXPECT_HAS(open_error(), "expected a JSON object");

  json no_map = index_;
  no_map.erase("weight_map");
  write_index(no_map);
  EXPECT_HAS(open_error(), "\"weight_map\" is missing");

  json map_list = index_;
  map_list["weight_map"] = json::array({"a", "b"});
  write_index(map_list);
  EXPECT_HAS(open_error(), "\"weight_map\" must be an object");

  json empty_map = index_;
  empty_map["weight_map"] = json::object();
  write_index(empty_map);
  EXPECT_HAS(open_error(), "\"weight_map\" is empty");

  json bad_metadata = index_;
  bad_metadata["metadata"] = "x";
  write_index(bad_metadata);
  EXPECT_HAS(open_error(), "\"metadata\" must be an object");

  json number_shard = index_;
  number_shard["weight_map"]["lm_head.weight"] = 3;
  write_index(number_shard);
  std::string message = open_error();
  EXPECT_HAS(message, "\"lm_head.weight\" must name a shard file");
}

TEST_F(CheckpointErrors, ShardNameOutsideDirectory) {
  for (const std::string& bad :
       {std::string("../") + shard_name(1), std::string("sub/") + shard_name(1), std::string(".."),
        std::string(""), std::string("/etc/passwd")}) {
    json index = index_;
    index["weight_map"]["lm_head.weight"] = bad;
    write_index(index);
    std::string message = open_error();
    EXPECT_HAS(message, "not a plain file name");
    EXPECT_HAS(message, "lm_head.weight");
  }
}

TEST_F(CheckpointErrors, MissingShard) {
  fs::remove(dir_.path() / shard_name(2));
  std::string message = open_error();
  EXPECT_HAS(message, shard_name(2));
  EXPECT_HAS(message, "does not exist");
}

TEST_F(CheckpointErrors, IndexNamesTensorMissingFromShard) {
  json index = index_;
  index["weight_map"]["model.layers.99.mlp.up_proj.weight"] = shard_name(1);
  write_index(index);
  std::string message = open_error();
  EXPECT_HAS(message, "\"model.layers.99.mlp.up_proj.weight\" is mapped to " + shard_name(1));
  EXPECT_HAS(message, "does not contain it");
}

TEST_F(CheckpointErrors, IndexNamesWrongShard) {
  json index = index_;
  const std::string actual = index["weight_map"]["model.embed_tokens.weight"];
  const std::string wrong = actual == shard_name(1) ? shard_name(2) : shard_name(1);
  index["weight_map"]["model.embed_tokens.weight"] = wrong;
  write_index(index);
  std::string message = open_error();
  EXPECT_HAS(message, "is mapped to " + wrong + " but is stored in " + actual);
}

TEST_F(CheckpointErrors, ShardTensorNotInIndex) {
  json index = index_;
  index["weight_map"].erase("lm_head.weight");
  write_index(index);
  std::string message = open_error();
  EXPECT_HAS(message, "\"lm_head.weight\"");
  EXPECT_HAS(message, "not listed in \"weight_map\"");
}

TEST_F(CheckpointErrors, TensorInTwoShards) {
  const std::vector<std::byte> data(4 * 64);
  const SafetensorsWriteTensor tensors[] = {
      {"lm_head.weight", DType::kF32, {64}, data},
      {"extra.weight", DType::kF32, {64}, data},
  };
  ASSERT_TRUE(write_safetensors(dir_.path() / "extra.safetensors", tensors).ok());
  json index = index_;
  index["weight_map"]["extra.weight"] = "extra.safetensors";
  write_index(index);
  std::string message = open_error();
  EXPECT_HAS(message, "\"lm_head.weight\" is stored in two shards");
  EXPECT_HAS(message, "extra.safetensors");
}

TEST_F(CheckpointErrors, TruncatedShard) {
  const fs::path shard = dir_.path() / shard_name(3);
  fs::resize_file(shard, fs::file_size(shard) - 10);
  std::string message = open_error();
  EXPECT_HAS(message, shard_name(3));
}

TEST_F(CheckpointErrors, ConfigProblems) {
  fs::remove(dir_.path() / "config.json");
  EXPECT_HAS(open_error(), "config.json");
  write_text(dir_.path() / "config.json", "{\"hidden_size\": 64,");
  EXPECT_HAS(open_error(), "config.json: invalid JSON");
}

TEST(CheckpointOpen, NoWeights) {
  TempDir dir;
  SynthCheckpointOptions options;
  ASSERT_TRUE(write_synth_checkpoint(dir.path(), options).ok());
  fs::remove(dir.path() / "model.safetensors");
  Result<Checkpoint> ckpt = Checkpoint::open(dir.path());
  ASSERT_FALSE(ckpt.ok());
  EXPECT_HAS(ckpt.message(), "no model.safetensors.index.json or model.safetensors found");
}

TEST(CheckpointOpen, NotADirectory) {
  TempDir dir;
  Result<Checkpoint> missing = Checkpoint::open(dir.path() / "absent");
  ASSERT_FALSE(missing.ok());
  EXPECT_HAS(missing.message(), "not found");

  write_text(dir.path() / "file", "x");
  Result<Checkpoint> file = Checkpoint::open(dir.path() / "file");
  ASSERT_FALSE(file.ok());
  EXPECT_HAS(file.message(), "not a directory");

  Result<Checkpoint> empty = Checkpoint::open(dir.path());
  ASSERT_FALSE(empty.ok());
  EXPECT_HAS(empty.message(), "config.json");
}

}  // namespace
}  // namespace e4kv
