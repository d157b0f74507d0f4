// The parts of a Hugging Face config.json that e4kv needs: architecture, attention geometry, layer
// kinds (dense / QSA / sliding / linear), QSA indexer geometry and RoPE.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "quant/quant_config.h"

namespace e4kv {

enum class LayerKind {
  kFullAttention,  // dense causal attention, main KV cache
  kQsaAttention,   // full attention with the QSA indexer (Qwen4Exp), main KV cache + indexer caches
  kSlidingAttention,  // windowed attention, main KV cache
  kLinearAttention,   // recurrent state (Gated DeltaNet), no KV cache
};

std::string_view layer_kind_name(LayerKind kind);
inline bool layer_has_kv_cache(LayerKind kind) {
  return kind != LayerKind::kLinearAttention;
}

struct RopeConfig {
  std::string type = "default";  // default | linear | dynamic | llama3 | yarn | longrope | ...
  double theta = 10000.0;
  double factor = 1.0;
  double partial_rotary_factor = 1.0;
  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // llama3 / yarn / dynamic: the pre-extension context length
  std::optional<int64_t> original_max_position_embeddings;
  // yarn
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  std::optional<double> attention_factor;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  bool truncate = true;  // yarn: round the correction range to whole dims (transformers' default)
};

struct QsaConfig {
  int64_t n_index_heads = 0;     // indexer_n_heads
  int64_t n_index_kv_heads = 0;  // indexer_kv_heads (must be 1)
  int64_t index_dim = 0;         // indexer_head_dim
  int64_t budget = 0;            // indexer_budget: tokens selected from complete groups
  int64_t ratio = 0;             // indexer_compress_ratio: tokens per compressed group

  int64_t topk_groups() const { return ratio > 0 ? budget / ratio : 0; }
};

// The Qwen4Exp family's own fields (transformers' Qwen4ExpTextConfig), with the defaults its class
// declares (docs/qwen4exp_reference.md section 1).
struct Qwen4ExpConfig {
  std::string hidden_act = "silu";
  std::string output_gate_type = "silu";  // the DeltaNet output gate: "silu" or "sigmoid"
  // Hyper-connections: hc_count residual streams, a mixer of rank hc_lowrank.
  int64_t hc_count = 4;
  int64_t hc_lowrank = 320;
  // GatedDeltaNet (linear_attention layers).
  int64_t linear_conv_kernel_dim = 4;
  int64_t linear_key_head_dim = 128;
  int64_t linear_value_head_dim = 128;
  int64_t linear_num_key_heads = 16;
  int64_t linear_num_value_heads = 32;  // a multiple of linear_num_key_heads
  // MoE (every layer's ffn): num_experts_per_tok of num_experts, plus a gated shared expert.
  int64_t num_experts = 512;
  int64_t num_experts_per_tok = 10;
  int64_t moe_intermediate_size = 512;
  int64_t shared_expert_intermediate_size = 512;
  bool norm_topk_prob = true;
  // PLE (hashed n-gram embeddings) on the layers in ple_layers.
  std::vector<int64_t> ple_layers;  // zero-based, increasing (config: one-based ple_layer_ids)
  int64_t ple_embed_dim = 0;        // default hidden_size
  int64_t ple_conv_kernel_size = 4;
  int64_t ngram_size = 3;
  int64_t heads_per_ngram = 8;
  int64_t ngram_vocab_size_base = 20000000;
  int64_t make_ngram_vocab_size_divisible_by = 128;
  int64_t seed = 1234;
  int64_t split_ngram_parts = 512;
  std::optional<int64_t> eos_token_id;  // the first when config.json gives a list
  // image_token_id / video_token_id of the multimodal wrapper (top level of config.json): image
  // and video inputs are not run (the vision tower is skipped), so prompts holding them are
  // refused.
  std::vector<int64_t> media_token_ids;

  bool has_ple(int64_t layer) const;
};

struct ModelConfig {
  std::string architecture;         // first entry of "architectures" (may be empty)
  std::string model_type;           // of the text model when the config nests one
  bool nested_text_config = false;  // fields came from "text_config"

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // 0 when the model has none (pure MoE)
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // head_dim * partial_rotary_factor
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  std::string torch_dtype;  // "bfloat16", "float16", ... as written ("dtype" or "torch_dtype")
  std::optional<int64_t> sliding_window;

  RopeConfig rope;
  std::optional<QsaConfig> qsa;   // present when the model has QSA layers
  std::optional<Qwen4ExpConfig> qwen4exp;  // present for the Qwen4Exp family
  std::vector<LayerKind> layers;  // size n_layers
  QuantConfig quant;              // the weights' quantization (quant/quant_config.h)

  int64_t count_layers(LayerKind kind) const;
  // Indices of layers that own a main KV cache (in order).
  std::vector<int64_t> kv_cache_layers() const;
};

// Parses config.json text. `source` names the file in error messages; every error names it and the
// field path ("text_config.head_dim"), and invalid JSON names the byte, line and column.
// - Text model: read from "text_config" when present (multimodal wrappers); "architectures",
//   "tie_word_embeddings" and "dtype"/"torch_dtype" fall back to the top level. A JSON null reads
//   as an absent field.
// - Required: hidden_size, num_hidden_layers, num_attention_heads, vocab_size. Defaults:
//   num_key_value_heads = num_attention_heads, head_dim = hidden_size / num_attention_heads.
// - RoPE: v5 "rope_parameters" (rope_theta inside; falls back to a top-level rope_theta; the
//   per-layer-type form uses its "full_attention" entry) or v4 "rope_theta" + "rope_scaling"
//   ("rope_type" or legacy "type"). linear/dynamic/yarn/llama3 need factor >= 1; llama3 also needs
//   low/high_freq_factor and original_max_position_embeddings. "partial_rotary_factor" may be top
//   level or in rope_parameters (both: they must agree); rotary_dim must be an even integer in
//   (0, head_dim].
// - Layer kinds: "layer_types" (length num_hidden_layers; unknown names are errors naming the
//   index), else "full_attention_interval" (layer i is full attention when (i + 1) % interval == 0,
//   linear otherwise; the Qwen4Exp family defaults to 4), else sliding attention where a window is
//   active (sliding_window set and use_sliding_window not false: layers from max_window_layers on
//   when given, else all, as transformers v4 Qwen2 / Mistral do), else full attention.
// - For the Qwen4Exp family (model_type qwen4_exp*, outer or text), full-attention layers are QSA
//   layers, as are the spellings releases use for them (qwen_sparse_attention,
//   deepseek_sparse_attention, hybrid_indexed); its own fields fill `qwen4exp` and are checked as
//   transformers checks them (hc_count > 1, 0 < num_experts_per_tok <= num_experts, positive MoE
//   sizes, output gate silu or sigmoid, PLE ids in [1, num_hidden_layers], ple_embed_dim a
//   multiple of (ngram_size - 1) * heads_per_ngram, eos_token_id set when PLE is on), plus
//   linear_num_value_heads a multiple of linear_num_key_heads. With any QSA layer the five indexer_* fields are required: positive, indexer_kv_heads
//   == 1, budget % compress_ratio == 0, rotary_dim <= indexer_head_dim; one error lists every
//   missing or bad field.
Result<ModelConfig> parse_model_config(std::string_view json_text, const std::string& source);

// Reads and parses `dir/config.json`.
Result<ModelConfig> load_model_config(const std::filesystem::path& model_dir);

}  // namespace e4kv
