#include "testing/synth_checkpoint.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/ple_ngram.h"
#include "testing/synth_tokenizer.h"

namespace e4kv {
namespace {

using ordered_json = nlohmann::ordered_json;

constexpr int64_t kMaxLayers = 1000;
constexpr int64_t kMaxDim = 1 << 16;
constexpr int64_t kQsaInterval = 4;
constexpr int64_t kSynthPleHeads = 16;  // (ngram_size 3 - 1) * heads_per_ngram 8
constexpr int64_t kSynthPleConvKernel = 4;

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// One independent stream per tensor, so a tensor's values do not depend on which others exist.
uint64_t stream_seed(uint64_t seed, std::string_view name) {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : name) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ull;
  }
  uint64_t state = seed ^ hash;
  return splitmix64(state);
}

// Uniform in [-1, 1) with 24 bits of resolution (exact in fp32).
float uniform(uint64_t& state) {
  return static_cast<float>(splitmix64(state) >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

uint16_t f32_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t f32_to_f16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (abs < 0x38800000u) {
    // Below 2^-14: a subnormal half, round(|x| * 2^24) under the default nearest-even mode.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

enum class Init {
  kLinear,    // uniform * 1/sqrt(fan_in), fan_in = last dim
  kEmbed,     // uniform * 0.1
  kNormOne,   // 1 + 0.1 * uniform (weight form)
  kNormZero,  // 0.1 * uniform ((1 + w) form)
  kALog,      // log(uniform in [1, 16])
  kKvScale,   // positive, in [0.02, 0.04)
  kBias,      // 0.1 * uniform
  // Dense families: an embedding large next to the layers' outputs makes the next token depend on
  // the current one, so greedy runs of a random model vary instead of settling on one token. Tied
  // embeddings stay small: with logits x.E^T a large one makes the model repeat its input token.
  // (A tied random model still tends to settle on one token; tests that need varied greedy runs
  // use untied embeddings.)
  kEmbedDense,  // 0.7 * uniform (std 0.4)
  kEmbedTied,   // 0.1 * uniform
};

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  Init init;
  DType dtype;
};

SynthTensor make_tensor(const Spec& spec, uint64_t seed) {
  int64_t numel = 1;
  for (int64_t d : spec.shape) numel *= d;
  const int64_t fan_in = spec.shape.empty() ? 1 : spec.shape.back();
  const float linear_scale = 1.0f / std::sqrt(static_cast<float>(fan_in));
  uint64_t state = stream_seed(seed, spec.name);

  SynthTensor out;
  out.name = spec.name;
  out.dtype = spec.dtype;
  out.shape = spec.shape;
  out.data.resize(static_cast<size_t>(numel) * dtype_size(spec.dtype));
  for (int64_t i = 0; i < numel; ++i) {
    const float u = uniform(state);
    float value = 0.0f;
    switch (spec.init) {
      case Init::kLinear:
        value = u * linear_scale;
        break;
      case Init::kEmbed:
        value = 0.1f * u;
        break;
      case Init::kNormOne:
        value = 1.0f + 0.1f * u;
        break;
      case Init::kNormZero:
        value = 0.1f * u;
        break;
      case Init::kALog:
        value = std::log(8.5f + 7.5f * u);
        break;
      case Init::kKvScale:
        value = 0.03f + 0.01f * u;
        break;
      case Init::kBias:
        value = 0.1f * u;
        break;
      case Init::kEmbedDense:
        value = 0.7f * u;
        break;
      case Init::kEmbedTied:
        value = 0.1f * u;
        break;
    }
    std::byte* dst = out.data.data() + static_cast<size_t>(i) * dtype_size(spec.dtype);
    if (spec.dtype == DType::kF32) {
      std::memcpy(dst, &value, 4);
    } else {
      const uint16_t half = spec.dtype == DType::kF16 ? f32_to_f16(value) : f32_to_bf16(value);
      // safetensors is little-endian
      dst[0] = static_cast<std::byte>(half & 0xff);
      dst[1] = static_cast<std::byte>(half >> 8);
    }
  }
  return out;
}

Status check_size(std::string_view name, int64_t value, int64_t max = kMaxDim) {
  if (value <= 0 || value > max) {
    return Status::error(
        cat("synthetic checkpoint: ", name, " must be in [1, ", max, "], got ", value));
  }
  return ok_status();
}

Status validate(const SynthCheckpointOptions& o) {
  E4KV_RETURN_IF_ERROR(check_size("n_layers", o.n_layers, kMaxLayers));
  E4KV_RETURN_IF_ERROR(check_size("hidden_size", o.hidden_size));
  E4KV_RETURN_IF_ERROR(check_size("intermediate_size", o.intermediate_size));
  E4KV_RETURN_IF_ERROR(check_size("n_heads", o.n_heads));
  E4KV_RETURN_IF_ERROR(check_size("n_kv_heads", o.n_kv_heads));
  E4KV_RETURN_IF_ERROR(check_size("head_dim", o.head_dim));
  E4KV_RETURN_IF_ERROR(check_size("vocab_size", o.vocab_size, 1 << 20));
  E4KV_RETURN_IF_ERROR(check_size("n_shards", o.n_shards, 99999));
  if (o.n_heads % o.n_kv_heads != 0) {
    return Status::error(cat("synthetic checkpoint: n_heads (", o.n_heads,
                             ") must be a multiple of n_kv_heads (", o.n_kv_heads, ")"));
  }
  if (o.head_dim % 2 != 0) {
    return Status::error(cat("synthetic checkpoint: head_dim must be even, got ", o.head_dim));
  }
  if (o.dtype != DType::kF16 && o.dtype != DType::kBF16 && o.dtype != DType::kF32) {
    return Status::error(
        cat("synthetic checkpoint: dtype must be F16, BF16 or F32, got ", dtype_name(o.dtype)));
  }
  if (o.family == SynthFamily::kQwen4Exp) {
    E4KV_RETURN_IF_ERROR(check_size("index_heads", o.index_heads));
    E4KV_RETURN_IF_ERROR(check_size("index_dim", o.index_dim));
    E4KV_RETURN_IF_ERROR(check_size("index_budget", o.index_budget));
    E4KV_RETURN_IF_ERROR(check_size("index_ratio", o.index_ratio));
    E4KV_RETURN_IF_ERROR(check_size("linear_key_heads", o.linear_key_heads));
    E4KV_RETURN_IF_ERROR(check_size("linear_value_heads", o.linear_value_heads));
    E4KV_RETURN_IF_ERROR(check_size("linear_head_dim", o.linear_head_dim));
    E4KV_RETURN_IF_ERROR(check_size("linear_conv_kernel", o.linear_conv_kernel, 64));
    if (o.head_dim % 8 != 0) {
      return Status::error(cat("synthetic checkpoint: qwen4exp needs head_dim a multiple of 8 ",
                               "(partial_rotary_factor 0.25 gives an even rotary_dim), got ",
                               o.head_dim));
    }
    if (o.head_dim / 4 > o.index_dim) {
      return Status::error(cat("synthetic checkpoint: rotary_dim (", o.head_dim / 4,
                               ") must not exceed index_dim (", o.index_dim, ")"));
    }
    E4KV_RETURN_IF_ERROR(check_size("hc_count", o.hc_count, 16));
    E4KV_RETURN_IF_ERROR(check_size("hc_lowrank", o.hc_lowrank));
    E4KV_RETURN_IF_ERROR(check_size("n_experts", o.n_experts, 1024));
    E4KV_RETURN_IF_ERROR(check_size("experts_top_k", o.experts_top_k, o.n_experts));
    E4KV_RETURN_IF_ERROR(check_size("moe_intermediate_size", o.moe_intermediate_size));
    E4KV_RETURN_IF_ERROR(
        check_size("shared_expert_intermediate_size", o.shared_expert_intermediate_size));
    if (o.hc_count < 2) return Status::error("synthetic checkpoint: hc_count must be at least 2");
    if (o.ple_layer >= o.n_layers || o.ple_layer < -1) {
      return Status::error(
          cat("synthetic checkpoint: ple_layer ", o.ple_layer, " is not a layer (or -1 for none)"));
    }
    if (o.ple_layer >= 0 && o.hidden_size % kSynthPleHeads != 0) {
      return Status::error(cat("synthetic checkpoint: PLE needs hidden_size a multiple of ",
                               kSynthPleHeads, " (ple_embed_dim = hidden_size)"));
    }
    E4KV_RETURN_IF_ERROR(check_size("ple_ngram_base", o.ple_ngram_base, int64_t(1) << 24));
    if (o.index_budget % o.index_ratio != 0) {
      return Status::error(cat("synthetic checkpoint: index_budget (", o.index_budget,
                               ") must be a multiple of index_ratio (", o.index_ratio, ")"));
    }
  }
  if (o.with_tokenizer && o.vocab_size < kSynthTokenizerMinVocab) {
    return Status::error(cat("synthetic checkpoint: the synthetic tokenizer needs at least ",
                             kSynthTokenizerMinVocab, " ids, got vocab_size ", o.vocab_size));
  }
  if (o.rope_type != "default" && o.rope_type != "linear" && o.rope_type != "llama3" &&
      o.rope_type != "yarn") {
    return Status::error(cat("synthetic checkpoint: rope type \"", o.rope_type,
                             "\" is not one of default, linear, llama3, yarn"));
  }
  if (o.family == SynthFamily::kQwen4Exp && o.rope_type != "default") {
    return Status::error("synthetic checkpoint: qwen4exp uses the default rope type");
  }
  if (!(o.rope_theta > 1.0) || !(o.rope_factor >= 1.0) ||
      o.rope_original_max_position_embeddings <= 0) {
    return Status::error(
        "synthetic checkpoint: rope_theta must be > 1, rope_factor >= 1 and "
        "rope_original_max_position_embeddings > 0");
  }
  return ok_status();
}

bool is_qsa_layer(int64_t layer) {
  return (layer + 1) % kQsaInterval == 0;
}

std::string layer_name(int64_t layer, std::string_view suffix) {
  return cat("model.layers.", layer, ".", suffix);
}

// The PLE fields of the synthetic config (the hash geometry ple_hash_params reads).
Qwen4ExpConfig synth_qwen4exp_config(const SynthCheckpointOptions& o) {
  Qwen4ExpConfig q;
  q.ngram_size = 3;
  q.heads_per_ngram = kSynthPleHeads / 2;
  q.ngram_vocab_size_base = o.ple_ngram_base;
  return q;
}

// The Qwen4Exp layout (docs/qwen4exp_reference.md section 2), as save_pretrained writes it:
// experts per expert, the PLE table as one tensor (the runtime also reads shards).
std::vector<Spec> qwen4exp_specs(const SynthCheckpointOptions& o) {
  const DType w = o.dtype;
  const int64_t h = o.hidden_size;
  const int64_t width = o.hc_count * h;
  const int64_t q_dim = o.n_heads * o.head_dim;
  const int64_t kv_dim = o.n_kv_heads * o.head_dim;
  std::vector<Spec> specs;
  const auto hyper_connection = [&](const std::string& p, bool inject) {
    specs.push_back({p + "hc_norm.weight", {width}, Init::kNormZero, w});
    specs.push_back({p + "input_mix_weight_down.weight", {o.hc_lowrank, width}, Init::kLinear, w});
    specs.push_back({p + "input_mix_weight_up.weight", {width, o.hc_lowrank}, Init::kLinear, w});
    if (inject) {
      specs.push_back({p + "block_inject_weight.weight", {o.hc_count, width}, Init::kLinear, w});
    }
  };
  specs.push_back({"model.embed_tokens.weight", {o.vocab_size, h}, Init::kEmbedDense, w});
  for (int64_t i = 0; i < o.n_layers; ++i) {
    if (i == o.ple_layer) {
      const std::string p = layer_name(i, "ple.");
      const PleHashParams hash = ple_hash_params(synth_qwen4exp_config(o), o.vocab_size, 0);
      specs.push_back({p + "ple_embedding.ngram_embedding.weight",
                       {hash.n_rows, h / hash.n_heads()},
                       Init::kEmbedDense,
                       w});
      specs.push_back({p + "key_proj.weight", {width, h}, Init::kLinear, w});
      specs.push_back({p + "value_proj.weight", {h, h}, Init::kLinear, w});
      for (const char* norm : {"norm_key.weight", "norm_query.weight", "norm_conv.weight"}) {
        specs.push_back({p + norm, {width}, Init::kNormZero, w});
      }
      specs.push_back({p + "conv1d.weight", {width, 1, kSynthPleConvKernel}, Init::kLinear, w});
    }
    hyper_connection(layer_name(i, "attn_hyper_connection."), true);
    if (is_qsa_layer(i)) {
      // q_proj: [q_0, gate_0, q_1, gate_1, ...] per head (random either way).
      specs.push_back({layer_name(i, "self_attn.q_proj.weight"), {2 * q_dim, h}, Init::kLinear, w});
      specs.push_back({layer_name(i, "self_attn.k_proj.weight"), {kv_dim, h}, Init::kLinear, w});
      specs.push_back({layer_name(i, "self_attn.v_proj.weight"), {kv_dim, h}, Init::kLinear, w});
      specs.push_back({layer_name(i, "self_attn.o_proj.weight"), {h, q_dim}, Init::kLinear, w});
      specs.push_back({layer_name(i, "self_attn.q_norm.weight"), {o.head_dim}, Init::kNormZero, w});
      specs.push_back({layer_name(i, "self_attn.k_norm.weight"), {o.head_dim}, Init::kNormZero, w});
      specs.push_back({layer_name(i, "self_attn.indexer.index_qk_proj.weight"),
                       {(o.index_heads + 1) * o.index_dim, h},
                       Init::kLinear,
                       w});
      specs.push_back({layer_name(i, "self_attn.indexer.q_layernorm.weight"),
                       {o.index_dim},
                       Init::kNormZero,
                       w});
      specs.push_back({layer_name(i, "self_attn.indexer.k_layernorm.weight"),
                       {o.index_dim},
                       Init::kNormZero,
                       w});
      if (o.with_kv_scales) {
        specs.push_back({layer_name(i, "self_attn.k_scale"), {}, Init::kKvScale, DType::kF32});
        specs.push_back({layer_name(i, "self_attn.v_scale"), {}, Init::kKvScale, DType::kF32});
      }
    } else {
      const int64_t key_dim = o.linear_key_heads * o.linear_head_dim;
      const int64_t value_dim = o.linear_value_heads * o.linear_head_dim;
      const int64_t conv_dim = 2 * key_dim + value_dim;
      const int64_t nv = o.linear_value_heads;
      const std::string p = layer_name(i, "linear_attn.");
      specs.push_back({p + "in_proj_qkv.weight", {conv_dim, h}, Init::kLinear, w});
      specs.push_back({p + "in_proj_z.weight", {value_dim, h}, Init::kLinear, w});
      specs.push_back({p + "in_proj_b.weight", {nv, h}, Init::kLinear, w});
      specs.push_back({p + "in_proj_a.weight", {nv, h}, Init::kLinear, w});
      specs.push_back({p + "conv1d.weight", {conv_dim, 1, o.linear_conv_kernel}, Init::kLinear, w});
      specs.push_back({p + "dt_bias", {nv}, Init::kNormOne, w});
      specs.push_back({p + "A_log", {nv}, Init::kALog, w});
      specs.push_back({p + "norm.weight", {o.linear_head_dim}, Init::kNormOne, w});
      specs.push_back({p + "out_proj.weight", {h, value_dim}, Init::kLinear, w});
    }
    hyper_connection(layer_name(i, "mlp_hyper_connection."), true);
    const std::string m = layer_name(i, "mlp.");
    specs.push_back({m + "gate.weight", {o.n_experts, h}, Init::kLinear, w});
    for (int64_t e = 0; e < o.n_experts; ++e) {
      const std::string x = cat(m, "experts.", e, ".");
      specs.push_back({x + "gate_proj.weight", {o.moe_intermediate_size, h}, Init::kLinear, w});
      specs.push_back({x + "up_proj.weight", {o.moe_intermediate_size, h}, Init::kLinear, w});
      specs.push_back({x + "down_proj.weight", {h, o.moe_intermediate_size}, Init::kLinear, w});
    }
    const int64_t si = o.shared_expert_intermediate_size;
    specs.push_back({m + "shared_expert.gate_proj.weight", {si, h}, Init::kLinear, w});
    specs.push_back({m + "shared_expert.up_proj.weight", {si, h}, Init::kLinear, w});
    specs.push_back({m + "shared_expert.down_proj.weight", {h, si}, Init::kLinear, w});
    specs.push_back({m + "shared_expert_gate.weight", {1, h}, Init::kLinear, w});
  }
  hyper_connection("model.hyper_connection_mixer.", false);
  if (!o.tie_word_embeddings) {
    specs.push_back({"lm_head.weight", {o.vocab_size, h}, Init::kLinear, w});
  }
  return specs;
}

std::vector<Spec> tensor_specs(const SynthCheckpointOptions& o) {
  if (o.family == SynthFamily::kQwen4Exp) return qwen4exp_specs(o);
  const DType w = o.dtype;
  const int64_t h = o.hidden_size;
  const int64_t q_dim = o.n_heads * o.head_dim;
  const int64_t kv_dim = o.n_kv_heads * o.head_dim;
  const bool qwen = o.family == SynthFamily::kQwen4Exp;
  const Init norm = qwen ? Init::kNormZero : Init::kNormOne;
  const bool qkv_bias = o.family == SynthFamily::kQwen2;
  const bool qk_norm = o.family == SynthFamily::kQwen3;

  std::vector<Spec> specs;
  const Init embed = qwen                    ? Init::kEmbed
                     : o.tie_word_embeddings ? Init::kEmbedTied
                                             : Init::kEmbedDense;
  specs.push_back({"model.embed_tokens.weight", {o.vocab_size, h}, embed, w});
  for (int64_t i = 0; i < o.n_layers; ++i) {
    specs.push_back({layer_name(i, "input_layernorm.weight"), {h}, norm, w});
    if (!qwen || is_qsa_layer(i)) {
      // q_proj of a QSA layer also yields the output gate: [query; gate].
      specs.push_back({layer_name(i, "self_attn.q_proj.weight"),
                       {qwen ? 2 * q_dim : q_dim, h},
                       Init::kLinear,
                       w});
      specs.push_back({layer_name(i, "self_attn.k_proj.weight"), {kv_dim, h}, Init::kLinear, w});
      specs.push_back({layer_name(i, "self_attn.v_proj.weight"), {kv_dim, h}, Init::kLinear, w});
      specs.push_back({layer_name(i, "self_attn.o_proj.weight"), {h, q_dim}, Init::kLinear, w});
      if (qkv_bias) {
        specs.push_back({layer_name(i, "self_attn.q_proj.bias"), {q_dim}, Init::kBias, w});
        specs.push_back({layer_name(i, "self_attn.k_proj.bias"), {kv_dim}, Init::kBias, w});
        specs.push_back({layer_name(i, "self_attn.v_proj.bias"), {kv_dim}, Init::kBias, w});
      }
      if (qk_norm) {
        specs.push_back({layer_name(i, "self_attn.q_norm.weight"), {o.head_dim}, norm, w});
        specs.push_back({layer_name(i, "self_attn.k_norm.weight"), {o.head_dim}, norm, w});
      }
      if (qwen) {
        specs.push_back({layer_name(i, "self_attn.q_norm.weight"), {o.head_dim}, norm, w});
        specs.push_back({layer_name(i, "self_attn.k_norm.weight"), {o.head_dim}, norm, w});
        specs.push_back({layer_name(i, "self_attn.indexer.index_qk_proj.weight"),
                         {(o.index_heads + 1) * o.index_dim, h},
                         Init::kLinear,
                         w});
        specs.push_back(
            {layer_name(i, "self_attn.indexer.q_layernorm.weight"), {o.index_dim}, norm, w});
        specs.push_back(
            {layer_name(i, "self_attn.indexer.k_layernorm.weight"), {o.index_dim}, norm, w});
      }
      if (o.with_kv_scales) {
        specs.push_back({layer_name(i, "self_attn.k_scale"), {}, Init::kKvScale, DType::kF32});
        specs.push_back({layer_name(i, "self_attn.v_scale"), {}, Init::kKvScale, DType::kF32});
      }
    } else {
      const int64_t key_dim = o.linear_key_heads * o.linear_head_dim;
      const int64_t value_dim = o.linear_value_heads * o.linear_head_dim;
      const int64_t conv_dim = 2 * key_dim + value_dim;
      const int64_t nv = o.linear_value_heads;
      specs.push_back(
          {layer_name(i, "linear_attn.in_proj_qkv.weight"), {conv_dim, h}, Init::kLinear, w});
      specs.push_back(
          {layer_name(i, "linear_attn.in_proj_z.weight"), {value_dim, h}, Init::kLinear, w});
      specs.push_back({layer_name(i, "linear_attn.in_proj_b.weight"), {nv, h}, Init::kLinear, w});
      specs.push_back({layer_name(i, "linear_attn.in_proj_a.weight"), {nv, h}, Init::kLinear, w});
      specs.push_back({layer_name(i, "linear_attn.conv1d.weight"),
                       {conv_dim, 1, o.linear_conv_kernel},
                       Init::kLinear,
                       w});
      // A_log is kept in fp32 by the reference implementation.
      specs.push_back({layer_name(i, "linear_attn.A_log"), {nv}, Init::kALog, DType::kF32});
      specs.push_back({layer_name(i, "linear_attn.dt_bias"), {nv}, Init::kNormOne, w});
      specs.push_back(
          {layer_name(i, "linear_attn.norm.weight"), {o.linear_head_dim}, Init::kNormOne, w});
      specs.push_back(
          {layer_name(i, "linear_attn.out_proj.weight"), {h, value_dim}, Init::kLinear, w});
    }
    specs.push_back({layer_name(i, "post_attention_layernorm.weight"), {h}, norm, w});
    specs.push_back(
        {layer_name(i, "mlp.gate_proj.weight"), {o.intermediate_size, h}, Init::kLinear, w});
    specs.push_back(
        {layer_name(i, "mlp.up_proj.weight"), {o.intermediate_size, h}, Init::kLinear, w});
    specs.push_back(
        {layer_name(i, "mlp.down_proj.weight"), {h, o.intermediate_size}, Init::kLinear, w});
  }
  specs.push_back({"model.norm.weight", {h}, norm, w});
  if (!o.tie_word_embeddings) {
    specs.push_back({"lm_head.weight", {o.vocab_size, h}, Init::kLinear, w});
  }
  return specs;
}

std::string torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    default:
      return "float32";
  }
}

std::string config_json(const SynthCheckpointOptions& o) {
  ordered_json config;
  const bool qwen = o.family == SynthFamily::kQwen4Exp;
  const char* architecture = "LlamaForCausalLM";
  const char* model_type = "llama";
  switch (o.family) {
    case SynthFamily::kLlama:
      break;
    case SynthFamily::kQwen4Exp:
      architecture = "Qwen4ExpForCausalLM";
      model_type = "qwen4_exp_text";
      break;
    case SynthFamily::kMistral:
      architecture = "MistralForCausalLM";
      model_type = "mistral";
      break;
    case SynthFamily::kQwen2:
      architecture = "Qwen2ForCausalLM";
      model_type = "qwen2";
      break;
    case SynthFamily::kQwen3:
      architecture = "Qwen3ForCausalLM";
      model_type = "qwen3";
      break;
  }
  config["architectures"] = {architecture};
  config["model_type"] = model_type;
  config["vocab_size"] = o.vocab_size;
  config["hidden_size"] = o.hidden_size;
  config["intermediate_size"] = o.intermediate_size;
  config["num_hidden_layers"] = o.n_layers;
  config["num_attention_heads"] = o.n_heads;
  config["num_key_value_heads"] = o.n_kv_heads;
  config["head_dim"] = o.head_dim;
  config["hidden_act"] = "silu";
  config["rms_norm_eps"] = 1e-6;
  config["max_position_embeddings"] = 4096;
  config["tie_word_embeddings"] = o.tie_word_embeddings;
  config["attention_bias"] = false;
  config["dtype"] = torch_dtype_name(o.dtype);
  if (qwen) {
    ordered_json layer_types = ordered_json::array();
    for (int64_t i = 0; i < o.n_layers; ++i) {
      layer_types.push_back(is_qsa_layer(i) ? "qwen_sparse_attention" : "linear_attention");
    }
    config["layer_types"] = layer_types;
    config["full_attention_interval"] = kQsaInterval;
    config["linear_num_key_heads"] = o.linear_key_heads;
    config["linear_num_value_heads"] = o.linear_value_heads;
    config["linear_key_head_dim"] = o.linear_head_dim;
    config["linear_value_head_dim"] = o.linear_head_dim;
    config["linear_conv_kernel_dim"] = o.linear_conv_kernel;
    config["indexer_n_heads"] = o.index_heads;
    config["indexer_kv_heads"] = 1;
    config["indexer_head_dim"] = o.index_dim;
    config["indexer_budget"] = o.index_budget;
    config["indexer_compress_ratio"] = o.index_ratio;
    config["hc_count"] = o.hc_count;
    config["hc_lowrank"] = o.hc_lowrank;
    config["num_experts"] = o.n_experts;
    config["num_experts_per_tok"] = o.experts_top_k;
    config["moe_intermediate_size"] = o.moe_intermediate_size;
    config["shared_expert_intermediate_size"] = o.shared_expert_intermediate_size;
    config["norm_topk_prob"] = true;
    // The synthetic tokenizer's <|endoftext|> (its special tokens are the last three ids).
    config["eos_token_id"] = o.vocab_size - 3;
    if (o.ple_layer >= 0) {
      config["ple_layer_ids"] = {o.ple_layer + 1};
      config["ple_embed_dim"] = o.hidden_size;
      config["ple_conv_kernel_size"] = kSynthPleConvKernel;
      config["ngram_size"] = 3;
      config["heads_per_ngram"] = kSynthPleHeads / 2;
      config["ngram_vocab_size_base"] = o.ple_ngram_base;
    }
    config["rope_parameters"] = {
        {"rope_type", "default"}, {"rope_theta", 10000000.0}, {"partial_rotary_factor", 0.25}};
  } else {
    config["rope_theta"] = o.rope_theta;
    if (o.rope_type == "default") {
      config["rope_scaling"] = nullptr;
    } else {
      ordered_json scaling = {{"rope_type", o.rope_type}, {"factor", o.rope_factor}};
      if (o.rope_type == "llama3") {
        scaling["low_freq_factor"] = 1.0;
        scaling["high_freq_factor"] = 4.0;
      }
      if (o.rope_type == "yarn") {
        scaling["beta_fast"] = 32.0;
        scaling["beta_slow"] = 1.0;
      }
      if (o.rope_type == "llama3" || o.rope_type == "yarn") {
        scaling["original_max_position_embeddings"] = o.rope_original_max_position_embeddings;
      }
      config["rope_scaling"] = std::move(scaling);
    }
    if (o.family == SynthFamily::kMistral) {
      // Every layer slides over a window as long as the whole context: full attention in effect.
      config["sliding_window"] = 4096;
    }
    if (o.family == SynthFamily::kQwen2) {
      config["use_sliding_window"] = false;
      config["sliding_window"] = nullptr;
      config["max_window_layers"] = o.n_layers;
    }
  }
  return config.dump(2) + "\n";
}

// Contiguous shards balanced by bytes; every shard gets at least one tensor.
std::vector<size_t> assign_shards(const std::vector<SynthTensor>& tensors, size_t n_shards) {
  uint64_t total = 0;
  for (const SynthTensor& t : tensors) total += t.data.size();
  std::vector<size_t> shard_of(tensors.size());
  uint64_t before = 0;
  size_t prev = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t mid = before + tensors[i].data.size() / 2;
    size_t s = total == 0 ? 0 : static_cast<size_t>(mid * n_shards / total);
    s = std::clamp(s, prev, i == 0 ? size_t{0} : prev + 1);
    s = std::max(s, n_shards - std::min(n_shards, tensors.size() - i));
    shard_of[i] = s;
    prev = s;
    before += tensors[i].data.size();
  }
  return shard_of;
}

std::string shard_file_name(size_t k, size_t n) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buffer;
}

Status write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::error(cat(path.string(), ": cannot open for writing"));
  out << text;
  out.close();
  if (!out) return Status::error(cat(path.string(), ": write failed"));
  return ok_status();
}

}  // namespace

Result<SynthFamily> parse_synth_family(std::string_view name) {
  if (name == "llama") return SynthFamily::kLlama;
  if (name == "qwen4exp") return SynthFamily::kQwen4Exp;
  if (name == "mistral") return SynthFamily::kMistral;
  if (name == "qwen2") return SynthFamily::kQwen2;
  if (name == "qwen3") return SynthFamily::kQwen3;
  return Status::error(cat("unknown synthetic model family \"", name,
                           "\"; expected llama, mistral, qwen2, qwen3 or qwen4exp"));
}

std::string_view synth_family_name(SynthFamily family) {
  switch (family) {
    case SynthFamily::kLlama:
      return "llama";
    case SynthFamily::kQwen4Exp:
      return "qwen4exp";
    case SynthFamily::kMistral:
      return "mistral";
    case SynthFamily::kQwen2:
      return "qwen2";
    case SynthFamily::kQwen3:
      return "qwen3";
  }
  return "";
}

Result<SynthCheckpoint> make_synth_checkpoint(const SynthCheckpointOptions& options) {
  E4KV_RETURN_IF_ERROR(validate(options));
  const std::vector<Spec> specs = tensor_specs(options);
  uint64_t total = 0;
  for (const Spec& spec : specs) {
    uint64_t bytes = dtype_size(spec.dtype);
    for (int64_t d : spec.shape) bytes *= static_cast<uint64_t>(d);
    total += bytes;
  }
  if (total > options.max_total_bytes) {
    return Status::error(cat("synthetic checkpoint: ", total, " bytes of weights is more than the ",
                             options.max_total_bytes, " allowed; use smaller sizes"));
  }
  if (static_cast<size_t>(options.n_shards) > specs.size()) {
    return Status::error(cat("synthetic checkpoint: ", options.n_shards, " shards for only ",
                             specs.size(), " tensors; every shard needs at least one tensor"));
  }

  SynthCheckpoint ckpt;
  ckpt.config_json = config_json(options);
  ckpt.tensors.reserve(specs.size());
  for (const Spec& spec : specs) ckpt.tensors.push_back(make_tensor(spec, options.seed));
  const size_t n_shards = static_cast<size_t>(options.n_shards);
  if (n_shards == 1) {
    ckpt.shard_of.assign(ckpt.tensors.size(), 0);
    ckpt.shard_names.emplace_back("model.safetensors");
  } else {
    ckpt.shard_of = assign_shards(ckpt.tensors, n_shards);
    for (size_t k = 0; k < n_shards; ++k) ckpt.shard_names.push_back(shard_file_name(k, n_shards));
  }
  return ckpt;
}

Status write_synth_checkpoint(const std::filesystem::path& dir,
                              const SynthCheckpointOptions& options) {
  E4KV_ASSIGN_OR_RETURN(SynthCheckpoint ckpt, make_synth_checkpoint(options));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::error(cat(dir.string(), ": cannot create directory: ", ec.message()));

  E4KV_RETURN_IF_ERROR(write_text(dir / "config.json", ckpt.config_json));
  const std::map<std::string, std::string> metadata{{"format", "pt"}};
  for (size_t k = 0; k < ckpt.shard_names.size(); ++k) {
    std::vector<SafetensorsWriteTensor> shard;
    for (size_t i = 0; i < ckpt.tensors.size(); ++i) {
      if (ckpt.shard_of[i] != k) continue;
      const SynthTensor& t = ckpt.tensors[i];
      shard.push_back({t.name, t.dtype, t.shape, std::span<const std::byte>(t.data)});
    }
    E4KV_RETURN_IF_ERROR(write_safetensors(dir / ckpt.shard_names[k], shard, metadata));
  }
  if (ckpt.shard_names.size() > 1) {
    // Like transformers: total_size in the metadata, weight_map sorted by tensor name.
    uint64_t total = 0;
    std::map<std::string, std::string> sorted;
    for (size_t i = 0; i < ckpt.tensors.size(); ++i) {
      total += ckpt.tensors[i].data.size();
      sorted.emplace(ckpt.tensors[i].name, ckpt.shard_names[ckpt.shard_of[i]]);
    }
    ordered_json weight_map = ordered_json::object();
    for (const auto& [name, shard] : sorted) weight_map[name] = shard;
    ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = std::move(weight_map);
    E4KV_RETURN_IF_ERROR(write_text(dir / "model.safetensors.index.json", index.dump(2) + "\n"));
  }
  if (options.with_tokenizer) E4KV_RETURN_IF_ERROR(write_synth_tokenizer(dir, options.vocab_size));
  return ok_status();
}

}  // namespace e4kv
