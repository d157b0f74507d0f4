// Small synthetic Hugging Face checkpoints with deterministic pseudo-random weights, for tests and
// demos: a dense Llama model or a Qwen4Exp model in transformers' layout (QSA every 4th layer,
// GatedDeltaNet otherwise, hyper-connections, MoE with a shared expert, optional PLE) that the
// runtime loads. Weights come from splitmix64 with a fixed seed, so two calls with the same options
// produce identical bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace e4kv {

enum class SynthFamily {
  kLlama,     // LlamaForCausalLM: dense GQA, every layer full attention
  kQwen4Exp,  // Qwen4ExpForCausalLM text model: layer i is QSA when (i + 1) % 4 == 0, else linear
  kMistral,   // MistralForCausalLM: as Llama, with a sliding window of max_position_embeddings
  kQwen2,     // Qwen2ForCausalLM: as Llama, with q/k/v_proj biases
  kQwen3,     // Qwen3ForCausalLM: as Llama, with per-head q_norm / k_norm before RoPE
};

// "llama" | "qwen4exp" | "mistral" | "qwen2" | "qwen3".
Result<SynthFamily> parse_synth_family(std::string_view name);
std::string_view synth_family_name(SynthFamily family);

struct SynthCheckpointOptions {
  SynthFamily family = SynthFamily::kLlama;
  int64_t n_layers = 4;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 128;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 2;
  int64_t head_dim = 32;
  int64_t vocab_size = 256;
  DType dtype = DType::kBF16;  // F16, BF16 or F32 for the weights; K/V scales are always F32
  int64_t n_shards = 1;        // 1: model.safetensors; more: model-0000k-of-0000n + index
  bool tie_word_embeddings = false;
  bool with_kv_scales = false;  // canonical self_attn.{k,v}_scale F32 scalars on KV-cache layers
  // write_synth_checkpoint also writes the synthetic tokenizer (testing/synth_tokenizer.h:
  // tokenizer.json, tokenizer_config.json); needs vocab_size >= kSynthTokenizerMinVocab.
  bool with_tokenizer = false;
  uint64_t seed = 0;
  // Refuse to make more bytes of weights than this (the benchmarks raise it; 1 GiB by default).
  uint64_t max_total_bytes = uint64_t(1) << 30;

  // Dense families: the RoPE of config.json. "default" (rope_scaling null), "linear" (factor),
  // "llama3" (factor, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings) or
  // "yarn" (factor, beta_fast 32, beta_slow 1, original_max_position_embeddings).
  // max_position_embeddings is 4096; keep rope_original_max_position_embeddings * rope_factor at
  // 4096 so yarn's factor reads the same whichever of the two a reader takes.
  std::string rope_type = "default";
  double rope_theta = 500000.0;
  double rope_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 1024;

  // Qwen4Exp only: the QSA indexer (DESIGN.md section 4) and the linear-attention geometry.
  int64_t index_heads = 4;
  int64_t index_dim = 32;
  int64_t index_budget = 64;
  int64_t index_ratio = 4;
  int64_t linear_key_heads = 2;
  int64_t linear_value_heads = 4;
  int64_t linear_head_dim = 16;
  int64_t linear_conv_kernel = 4;
  // Qwen4Exp only: hyper-connections, the MoE ffn of every layer, and PLE on one layer.
  int64_t hc_count = 4;
  int64_t hc_lowrank = 16;
  int64_t n_experts = 8;
  int64_t experts_top_k = 2;
  int64_t moe_intermediate_size = 32;
  int64_t shared_expert_intermediate_size = 32;
  int64_t ple_layer = -1;         // zero-based layer with PLE; -1: none
  int64_t ple_ngram_base = 1000;  // ngram_vocab_size_base: small, so the n-gram table is small
};

struct SynthTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};

struct SynthCheckpoint {
  std::string config_json;           // config.json text
  std::vector<SynthTensor> tensors;  // in file order
  // shard_of[i]: index of the shard holding tensors[i]; shard_names[k]: its file name.
  std::vector<size_t> shard_of;
  std::vector<std::string> shard_names;
};

// Validates the options (positive sizes, heads divisible by kv heads, a supported dtype, 1 <=
// shards
// <= tensor count, ...) and builds the whole checkpoint in memory.
Result<SynthCheckpoint> make_synth_checkpoint(const SynthCheckpointOptions& options);

// Writes make_synth_checkpoint(options) into `dir` (created if needed): config.json, the
// safetensors file(s), when sharded model.safetensors.index.json, and with_tokenizer the
// tokenizer files.
Status write_synth_checkpoint(const std::filesystem::path& dir,
                              const SynthCheckpointOptions& options);

}  // namespace e4kv
