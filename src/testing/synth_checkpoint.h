// Synthetic Hugging Face checkpoints with deterministic pseudo-random weights, for tests, demos and
// benchmarks: a dense Llama model or a Qwen4Exp model in transformers' layout (QSA every 4th layer,
// GatedDeltaNet otherwise, hyper-connections, MoE with a shared expert, optional PLE) that the
// runtime loads, with plain or quantized linear weights (AWQ, NVFP4, FP8 blocks in the public
// tools' layouts, scripts/quantize_checkpoint.py). Weights come from splitmix64 with a fixed seed,
// one counter-based stream per tensor, so two calls with the same options produce identical bytes
// and any part of a tensor can be generated on its own (the streaming writer's threads do).
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

// Quantized linear weights, generated directly as random codes and scales (no float weights are
// made and quantized): the dequantized values have about the magnitude of the float initialiser's
// (uniform in +-1/sqrt(fan_in)), so a model's activations stay as sane as with float weights.
enum class SynthQuant {
  kNone,
  kAwq,       // AutoAWQ GEMM: qweight I32 [in, out/8], qzeros I32 [in/G, out/8], scales F16 [in/G, out]
  kNvfp4,     // compressed-tensors nvfp4-pack-quantized: weight_packed, weight_scale, global scales
  kFp8Block,  // FP8 E4M3 weight [out, in] + weight_scale_inv F32 [ceil(out/B), ceil(in/B)]
};
// Which linear modules are quantized.
enum class SynthQuantScope {
  kAllLinear,  // the decoder layers' projections scripts/quantize_checkpoint.py quantizes
  kExperts,    // only mlp.experts.E.{gate,up,down}_proj (Qwen4Exp), everything else dense
};

// "none" | "awq" | "nvfp4" | "fp8-block"; "all-linear" | "experts".
Result<SynthQuant> parse_synth_quant(std::string_view name);
Result<SynthQuantScope> parse_synth_quant_scope(std::string_view name);

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

  // Quantized weights. quant_group: AWQ's group size (32, 64 or 128) or FP8's block size (rows and
  // columns); unused for NVFP4 (16). quant_zero_point: AWQ only (false: symmetric, no qzeros).
  // A module whose shape the format cannot pack stays dense and is listed as not converted, as the
  // tools do.
  SynthQuant quant = SynthQuant::kNone;
  SynthQuantScope quant_scope = SynthQuantScope::kAllLinear;
  int64_t quant_group = 128;
  bool quant_zero_point = true;

  // > 0: shards of at most this many bytes of tensor data in file order (a larger tensor gets a
  // shard of its own), as save_pretrained's max_shard_size does; n_shards is then ignored.
  uint64_t max_shard_bytes = 0;
  // Threads of write_synth_checkpoint; 0: one per hardware thread. The bytes do not depend on it.
  int n_threads = 0;
};

// The published Qwen4Exp text model's shape (48 layers, hidden 2048, 24 q / 2 KV heads x 256,
// DeltaNet 16 key / 32 value heads x 128, indexer 4 x 128 with budget 2048 and ratio 4,
// hyper-connections 4 x rank 320, 512 experts of width 512 with top-10 and a shared expert of 512,
// vocab 248320), with PLE on layer 0 over a small n-gram table, FP16 weights, shards of 4 GB and
// room for 64 GiB.
SynthCheckpointOptions published_qwen4exp_options();

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

// The checkpoint's tensors and files without their data: what write_synth_checkpoint writes.
struct SynthPlanTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  size_t shard = 0;
};
struct SynthPlan {
  std::string config_json;
  std::vector<SynthPlanTensor> tensors;  // in file order
  std::vector<std::string> shard_names;
  uint64_t total_bytes = 0;  // tensor data, all shards
};

// Validates the options (positive sizes, heads divisible by kv heads, a supported dtype, 1 <=
// shards <= tensor count, a quantization the loader reads, at most max_total_bytes, ...) and lays
// out the checkpoint; generates nothing.
Result<SynthPlan> plan_synth_checkpoint(const SynthCheckpointOptions& options);

// The plan as text: bytes by tensor kind (the name with layer and expert numbers as *), dtype and
// shape, then by part of the model, then the total and the shards.
std::string format_synth_plan(const SynthPlan& plan);

// Builds the whole checkpoint in memory (small checkpoints: tests).
Result<SynthCheckpoint> make_synth_checkpoint(const SynthCheckpointOptions& options);

// Writes the checkpoint into `dir` (created if needed): config.json, the safetensors file(s), when
// sharded model.safetensors.index.json, and with_tokenizer the tokenizer files. Streams: each
// shard is sized up front and n_threads threads generate chunks of a few MiB straight into it,
// so memory stays bounded whatever the checkpoint's size; the files are byte for byte what
// write_safetensors makes of make_synth_checkpoint(options). Each shard is written under a
// temporary name and renamed when complete.
Status write_synth_checkpoint(const std::filesystem::path& dir,
                              const SynthCheckpointOptions& options);

}  // namespace e4kv
