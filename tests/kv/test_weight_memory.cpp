// weight_memory (kv/weight_memory.h) on hand-made checkpoints of the three quantized formats (AWQ,
// compressed-tensors NVFP4, FP8 block) and of a Qwen4Exp with MoE, shared expert, DeltaNet and a
// sharded PLE table: the device bytes of every kind, the PLE host bytes and the skipped tensors
// equal the sums computed here from each tensor's shape and the formats' canonical layouts.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "kv/weight_memory.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::TempDir;
using testing_support::write_text;

// A tensor with zero bytes of the right size (weight_memory reads headers only).
struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};

Tensor tensor(std::string name, DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {std::move(name), dtype, std::move(shape),
          std::vector<std::byte>(size_t(n) * dtype_size(dtype))};
}

void write_checkpoint(const fs::path& dir, const std::string& config,
                      const std::vector<Tensor>& tensors) {
  fs::create_directories(dir);
  write_text(dir / "config.json", config);
  std::vector<SafetensorsWriteTensor> views;
  for (const Tensor& t : tensors) views.push_back({t.name, t.dtype, t.shape, t.data});
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", views).ok());
}

// A one-layer Llama of hidden 256 (4 heads of 64, 2 KV heads), MLP 384, vocab 256.
std::string llama_config(const std::string& quantization_config) {
  return R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 384, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256,
    "max_position_embeddings": 262144, "quantization_config": )" +
         quantization_config + "}";
}

constexpr int64_t kHidden = 256, kInter = 384, kVocab = 256;
struct Linear {
  const char* name;
  int64_t out, in;
  bool attention;
};
const Linear kLinears[] = {{"self_attn.q_proj", 256, kHidden, true},
                           {"self_attn.k_proj", 128, kHidden, true},
                           {"self_attn.v_proj", 128, kHidden, true},
                           {"self_attn.o_proj", kHidden, 256, true},
                           {"mlp.gate_proj", kInter, kHidden, false},
                           {"mlp.up_proj", kInter, kHidden, false},
                           {"mlp.down_proj", kHidden, kInter, false}};

// Embeddings (BF16 embed_tokens, F32 lm_head: both FP16 on the device), three F32 norms and the
// K/V scales (host) of the dense model; adds the expected bytes.
void add_dense_rest(std::vector<Tensor>& t, int64_t& embeddings, int64_t& other) {
  t.push_back(tensor("model.embed_tokens.weight", DType::kBF16, {kVocab, kHidden}));
  t.push_back(tensor("lm_head.weight", DType::kF32, {kVocab, kHidden}));
  embeddings = 2 * (kVocab * kHidden * 2);
  for (const char* norm : {"model.layers.0.input_layernorm.weight",
                           "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"}) {
    t.push_back(tensor(norm, DType::kF32, {kHidden}));
  }
  other = 3 * kHidden * 2;
  t.push_back(tensor("model.layers.0.self_attn.k_scale", DType::kF32, {}));
  t.push_back(tensor("model.layers.0.self_attn.v_scale", DType::kF32, {}));
}

void expect_kinds(const WeightMemory& m, int64_t embeddings, int64_t attention, int64_t mlp,
                  int64_t other) {
  EXPECT_EQ(m.device_bytes[size_t(WeightKind::kEmbeddings)], embeddings);
  EXPECT_EQ(m.device_bytes[size_t(WeightKind::kAttention)], attention);
  EXPECT_EQ(m.device_bytes[size_t(WeightKind::kMlp)], mlp);
  EXPECT_EQ(m.device_bytes[size_t(WeightKind::kOther)], other);
  EXPECT_EQ(m.device_bytes[size_t(WeightKind::kDeltaNet)], 0);
  EXPECT_EQ(m.device_bytes[size_t(WeightKind::kMoeExperts)], 0);
  EXPECT_EQ(m.device_bytes[size_t(WeightKind::kSharedExpert)], 0);
  EXPECT_EQ(m.device_total(), embeddings + attention + mlp + other);
  EXPECT_EQ(m.ple_rows, 0);
}

TEST(WeightMemory, AwqCountsPackedWeightsScalesAndWidenedZeros) {
  TempDir tmp;
  constexpr int64_t kGroup = 128;
  std::vector<Tensor> t;
  int64_t embeddings = 0, other = 0, attention = 0, mlp = 0;
  add_dense_rest(t, embeddings, other);
  for (const Linear& l : kLinears) {
    const std::string p = std::string("model.layers.0.") + l.name;
    // AWQ: qweight [in, out / 8] I32, qzeros [in / group, out / 8] I32, scales [in / group, out].
    t.push_back(tensor(p + ".qweight", DType::kI32, {l.in, l.out / 8}));
    t.push_back(tensor(p + ".qzeros", DType::kI32, {l.in / kGroup, l.out / 8}));
    t.push_back(tensor(p + ".scales", DType::kF16, {l.in / kGroup, l.out}));
    // Canonical: 4 bits per weight, one byte per zero, FP16 scales.
    const int64_t bytes = l.out * l.in / 2 + l.out * (l.in / kGroup) * (1 + 2);
    (l.attention ? attention : mlp) += bytes;
  }
  write_checkpoint(tmp.path(), llama_config(R"({"quant_method": "awq", "bits": 4,
                     "group_size": 128, "zero_point": true, "version": "gemm"})"),
                   t);
  Result<WeightMemory> m = weight_memory(tmp.path());
  ASSERT_TRUE(m.ok()) << m.message();
  EXPECT_EQ(m->quantization, "awq");
  // q: 256 * 256 / 2 + 256 * 2 * 3 = 32768 + 1536; the four attention projections in all:
  EXPECT_EQ(attention, (256 + 128 + 128 + 256) * 256 / 2 + (256 + 128 + 128 + 256) * 2 * 3);
  expect_kinds(*m, embeddings, attention, mlp, other);
  EXPECT_EQ(m->tensors[size_t(WeightKind::kAttention)], 12);
}

TEST(WeightMemory, Nvfp4CountsPackedWeightsE4m3ScalesAndOneGlobalPerRow) {
  TempDir tmp;
  std::vector<Tensor> t;
  int64_t embeddings = 0, other = 0, attention = 0, mlp = 0;
  add_dense_rest(t, embeddings, other);
  for (const Linear& l : kLinears) {
    const std::string p = std::string("model.layers.0.") + l.name;
    t.push_back(tensor(p + ".weight_packed", DType::kU8, {l.out, l.in / 2}));
    t.push_back(tensor(p + ".weight_scale", DType::kF8E4M3, {l.out, l.in / 16}));
    t.push_back(tensor(p + ".weight_global_scale", DType::kF32, {1}));
    t.push_back(tensor(p + ".input_global_scale", DType::kF32, {1}));
    // The global scale is held once per output row (quant/linear_weight.h); the activations'
    // is not used (weight-only).
    (l.attention ? attention : mlp) += l.out * l.in / 2 + l.out * l.in / 16 + l.out * 4;
  }
  write_checkpoint(tmp.path(), llama_config(R"({"quant_method": "compressed-tensors",
                     "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {"weights":
                     {"num_bits": 4, "type": "float", "group_size": 16}}}})"),
                   t);
  Result<WeightMemory> m = weight_memory(tmp.path());
  ASSERT_TRUE(m.ok()) << m.message();
  EXPECT_EQ(m->quantization, "compressed-tensors nvfp4-pack-quantized");
  expect_kinds(*m, embeddings, attention, mlp, other);
}

TEST(WeightMemory, Fp8BlockExpandsItsScalesToOneRowPerOutputRow) {
  TempDir tmp;
  std::vector<Tensor> t;
  int64_t embeddings = 0, other = 0, attention = 0, mlp = 0;
  add_dense_rest(t, embeddings, other);
  for (const Linear& l : kLinears) {
    const std::string p = std::string("model.layers.0.") + l.name;
    const int64_t row_blocks = (l.out + 127) / 128, col_blocks = (l.in + 127) / 128;
    t.push_back(tensor(p + ".weight", DType::kF8E4M3, {l.out, l.in}));
    t.push_back(tensor(p + ".weight_scale_inv", DType::kF32, {row_blocks, col_blocks}));
    (l.attention ? attention : mlp) += l.out * l.in + l.out * col_blocks * 4;
  }
  write_checkpoint(tmp.path(), llama_config(R"({"quant_method": "fp8", "fmt": "e4m3",
                     "weight_block_size": [128, 128]})"),
                   t);
  Result<WeightMemory> m = weight_memory(tmp.path());
  ASSERT_TRUE(m.ok()) << m.message();
  EXPECT_EQ(m->quantization, "fp8");
  // down_proj: 256 x 384 E4M3 + 256 rows x 3 column blocks of FP32 scales.
  EXPECT_EQ(mlp, 2 * (384 * 256 + 384 * 2 * 4) + (256 * 384 + 256 * 3 * 4));
  expect_kinds(*m, embeddings, attention, mlp, other);

  // Block scales without their weight.
  TempDir bad;
  write_checkpoint(bad.path(),
                   llama_config(R"({"quant_method": "fp8", "weight_block_size": [128, 128]})"),
                   {tensor("model.layers.0.mlp.up_proj.weight_scale_inv", DType::kF32, {1, 1})});
  Result<WeightMemory> e = weight_memory(bad.path());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.message().find("model.layers.0.mlp.up_proj.weight_scale_inv"), std::string::npos)
      << e.message();
}

TEST(WeightMemory, Qwen4ExpKindsPleTableAndSkippedTensors) {
  TempDir tmp;
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kQwen4Exp;
  synth.n_layers = 4;
  synth.ple_layer = 1;
  Result<SynthCheckpoint> made = make_synth_checkpoint(synth);
  ASSERT_TRUE(made.ok()) << made.message();
  const std::vector<Tensor> t = {
      tensor("model.embed_tokens.weight", DType::kBF16, {64, 16}),
      tensor("model.layers.0.linear_attn.in_proj_qkvz.weight", DType::kF8E4M3, {32, 16}),
      tensor("model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv", DType::kF32, {1, 1}),
      tensor("model.layers.0.linear_attn.A_log", DType::kF32, {4}),
      tensor("model.layers.3.self_attn.q_proj.weight", DType::kBF16, {32, 16}),
      tensor("model.layers.3.self_attn.k_scale", DType::kF32, {}),
      tensor("model.layers.0.mlp.experts.gate_up_proj", DType::kBF16, {8, 64, 16}),
      tensor("model.layers.0.mlp.gate.weight", DType::kF32, {8, 16}),
      tensor("model.layers.0.mlp.shared_expert.down_proj.weight", DType::kBF16, {16, 32}),
      tensor("model.layers.0.mlp.shared_expert_gate.weight", DType::kBF16, {1, 16}),
      tensor("model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight", DType::kBF16,
             {100, 8}),
      tensor("model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight", DType::kBF16,
             {60, 8}),
      tensor("model.layers.1.ple.ple_embedding.layer_multipliers", DType::kI64, {3}),
      tensor("model.layers.1.ple.key_proj.weight", DType::kBF16, {64, 16}),
      tensor("model.norm.weight", DType::kBF16, {16}),
      tensor("mtp.fc.weight", DType::kBF16, {4, 4}),
      tensor("model.visual.patch_embed.weight", DType::kBF16, {4, 4}),
  };
  write_checkpoint(tmp.path(), made->config_json, t);
  Result<WeightMemory> m = weight_memory(tmp.path());
  ASSERT_TRUE(m.ok()) << m.message();
  EXPECT_EQ(m->quantization, "none");
  EXPECT_EQ(m->device_bytes[size_t(WeightKind::kEmbeddings)], 64 * 16 * 2);
  EXPECT_EQ(m->device_bytes[size_t(WeightKind::kDeltaNet)], 32 * 16 + 32 * 1 * 4 + 4 * 2);
  EXPECT_EQ(m->device_bytes[size_t(WeightKind::kAttention)], 32 * 16 * 2);
  EXPECT_EQ(m->device_bytes[size_t(WeightKind::kMoeExperts)], 8 * 64 * 16 * 2 + 8 * 16 * 2);
  EXPECT_EQ(m->device_bytes[size_t(WeightKind::kSharedExpert)], 16 * 32 * 2 + 16 * 2);
  EXPECT_EQ(m->device_bytes[size_t(WeightKind::kMlp)], 0);
  EXPECT_EQ(m->device_bytes[size_t(WeightKind::kOther)], 64 * 16 * 2 + 16 * 2);
  EXPECT_EQ(m->skipped_tensors, 2);
  EXPECT_EQ(m->ple_rows, 160);
  EXPECT_EQ(m->ple_values, 160 * 8);
  EXPECT_EQ(m->ple_checkpoint_bytes, 160 * 8 * 2);
  EXPECT_EQ(m->ple_e4m3_bytes(), 160 * 8 + 160 * 4);
}

}  // namespace
}  // namespace e4kv
