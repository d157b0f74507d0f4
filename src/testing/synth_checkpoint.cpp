#include "testing/synth_checkpoint.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "e4kv/e4m3.h"
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
  // Quantized weights (SynthQuant) of a linear layer whose float weights would be uniform in
  // +-bound (Spec::bound = 1/sqrt(in)). Each group's scale is drawn so that its largest
  // dequantized value is bound * f, f uniform in [0.75, 1) (a group's range a little inside the
  // bound, as a round-to-nearest quantizer would set it from a group of uniform weights).
  kRandomBits,     // every bit random: AWQ qweight nibbles 0..15, NVFP4 E2M1 codes
  kAwqSymCodes,    // symmetric AWQ qweight: nibbles 1..15 (code 0 becomes 8): -7..7, mean 0
  kAwqZeros,       // AWQ qzeros: each nibble 7 or 8 (the zero point of a group centred on 0)
  kAwqScales,      // AWQ scales: (q - zero) spans [-8, 8], so scale = bound * f / 7.5
  kAwqSymScales,   // symmetric AWQ scales: q - 8 spans [-7, 7], so scale = bound * f / 7
  kNvfp4Scales,    // E4M3 group scales e4m3(448 * f): with the global scale below, max = bound * f
  kNvfp4Global,    // weight_global_scale 448 * 6 / bound (llm-compressor's from amax = bound)
  kOne,            // input_global_scale 1 (no activation calibration)
  kFp8Codes,       // E4M3 codes e4m3(448 * uniform)
  kFp8ScaleInv,    // weight_scale_inv bound * f / 448
};

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  Init init;
  DType dtype;
  float bound = 0.0f;  // quantized kinds: the float weight's bound 1/sqrt(in)
};

uint64_t spec_bytes(const Spec& spec) {
  uint64_t bytes = dtype_size(spec.dtype);
  for (int64_t d : spec.shape) bytes *= static_cast<uint64_t>(d);
  return bytes;
}

constexpr uint64_t kSplitmixStep = 0x9e3779b97f4a7c15ull;

// The stream state after `draws` draws: splitmix64 is a counter plus a mix, so a chunk of a tensor
// starts where it is without the draws before it.
uint64_t skip_draws(uint64_t state, uint64_t draws) {
  return state + draws * kSplitmixStep;
}

// 256 E4M3 codes indexed by a random byte: e4m3(lo + (hi - lo) * (byte + 0.5) / 256).
std::array<uint8_t, 256> e4m3_table(float lo, float hi) {
  std::array<uint8_t, 256> table{};
  for (int b = 0; b < 256; ++b) {
    const float x = lo + (hi - lo) * (static_cast<float>(b) + 0.5f) / 256.0f;
    table[size_t(b)] = e4m3_from_float_satfinite(x);
  }
  return table;
}

void store_u16(std::byte* dst, uint16_t v) {
  dst[0] = static_cast<std::byte>(v & 0xff);  // safetensors is little-endian
  dst[1] = static_cast<std::byte>(v >> 8);
}

// Bytes [b0, b1) of the tensor `spec` into dst (dst[0] is byte b0). b0 is a multiple of 8 (so of
// every element size, and of the 8 bytes one draw gives the byte-wise kinds). Element i of a tensor
// is made from draw i of its stream (byte-wise kinds: bytes 8j..8j+7 from draw j), so any range
// gives the same bytes as the whole tensor.
void fill(const Spec& spec, uint64_t seed, uint64_t b0, uint64_t b1, std::byte* dst) {
  E4KV_ASSERT(b0 % 8 == 0 && b0 <= b1, "synthetic checkpoint: unaligned chunk");
  const uint64_t base = stream_seed(seed, spec.name);
  const Init init = spec.init;
  if (init == Init::kRandomBits || init == Init::kAwqSymCodes || init == Init::kFp8Codes ||
      init == Init::kNvfp4Scales) {
    static const std::array<uint8_t, 256> fp8_codes = e4m3_table(-kE4m3Max, kE4m3Max);
    static const std::array<uint8_t, 256> group_scales =
        e4m3_table(0.75f * kE4m3Max, kE4m3Max);
    const std::array<uint8_t, 256>* table = init == Init::kFp8Codes     ? &fp8_codes
                                            : init == Init::kNvfp4Scales ? &group_scales
                                                                         : nullptr;
    uint64_t state = skip_draws(base, b0 / 8);
    for (uint64_t b = b0; b < b1; b += 8) {
      uint64_t word = splitmix64(state);
      if (init == Init::kAwqSymCodes) {
        // A nibble with no bit set gets bit 3: code 0 (-8) becomes 8 (0).
        constexpr uint64_t kLowBits = 0x1111111111111111ull;
        const uint64_t any = (word | (word >> 1) | (word >> 2) | (word >> 3)) & kLowBits;
        word |= (~any & kLowBits) << 3;
      }
      std::byte* out = dst + (b - b0);
      if (table == nullptr && b + 8 <= b1 && std::endian::native == std::endian::little) {
        std::memcpy(out, &word, 8);  // byte k is bits 8k..8k+7: the little-endian layout
        continue;
      }
      const uint64_t n = std::min<uint64_t>(8, b1 - b);
      for (uint64_t k = 0; k < n; ++k, word >>= 8) {
            const uint8_t byte = static_cast<uint8_t>(word & 0xff);
        out[k] = static_cast<std::byte>(table != nullptr ? (*table)[byte] : byte);
      }
    }
    return;
  }

  const size_t elem = dtype_size(spec.dtype);
  const uint64_t i0 = b0 / elem;
  const uint64_t i1 = b1 / elem;
  uint64_t state = skip_draws(base, i0);
  if (init == Init::kAwqZeros) {
    for (uint64_t i = i0; i < i1; ++i) {
      const uint64_t bits = splitmix64(state);
      uint32_t word = 0;
      for (int n = 0; n < 8; ++n) word |= (7u + uint32_t((bits >> n) & 1)) << (4 * n);
      std::memcpy(dst + (i - i0) * 4, &word, 4);
    }
    return;
  }
  // Every other kind is value = offset + scale * u (u uniform in [-1, 1)), or a function of it.
  const int64_t fan_in = spec.shape.empty() ? 1 : spec.shape.back();
  float scale = 0.0f;
  float offset = 0.0f;
  switch (init) {
    case Init::kLinear:
      scale = 1.0f / std::sqrt(static_cast<float>(fan_in));
      break;
    case Init::kEmbed:
    case Init::kNormZero:
    case Init::kBias:
    case Init::kEmbedTied:
      scale = 0.1f;
      break;
    case Init::kNormOne:
      offset = 1.0f;
      scale = 0.1f;
      break;
    case Init::kALog:  // log(8.5 + 7.5 u), below
      offset = 8.5f;
      scale = 7.5f;
      break;
    case Init::kKvScale:
      offset = 0.03f;
      scale = 0.01f;
      break;
    case Init::kEmbedDense:
      scale = 0.7f;
      break;
    case Init::kAwqScales:  // bound * f / 7.5, f = 0.875 + 0.125 u
      offset = spec.bound * 0.875f / 7.5f;
      scale = spec.bound * 0.125f / 7.5f;
      break;
    case Init::kAwqSymScales:
      offset = spec.bound * 0.875f / 7.0f;
      scale = spec.bound * 0.125f / 7.0f;
      break;
    case Init::kFp8ScaleInv:
      offset = spec.bound * 0.875f / kE4m3Max;
      scale = spec.bound * 0.125f / kE4m3Max;
      break;
    case Init::kNvfp4Global:
      offset = kE4m3Max * 6.0f / spec.bound;
      break;
    case Init::kOne:
      offset = 1.0f;
      break;
    default:
      E4KV_ASSERT(false, "synthetic checkpoint: unhandled initialiser");
  }
  const bool log = init == Init::kALog;
  for (uint64_t i = i0; i < i1; ++i) {
    const float u = uniform(state);
    float value = offset + scale * u;
    if (log) value = std::log(value);
    std::byte* out = dst + (i - i0) * elem;
    if (spec.dtype == DType::kF32) {
      std::memcpy(out, &value, 4);
    } else {
      store_u16(out, spec.dtype == DType::kF16 ? f32_to_f16(value) : f32_to_bf16(value));
    }
  }
}

SynthTensor make_tensor(const Spec& spec, uint64_t seed) {
  SynthTensor out;
  out.name = spec.name;
  out.dtype = spec.dtype;
  out.shape = spec.shape;
  out.data.resize(spec_bytes(spec));
  fill(spec, seed, 0, out.data.size(), out.data.data());
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
  if (o.quant == SynthQuant::kAwq && o.quant_group != 32 && o.quant_group != 64 &&
      o.quant_group != 128) {
    return Status::error(cat("synthetic checkpoint: AWQ group size must be 32, 64 or 128 (what ",
                             "e4kv loads), got ", o.quant_group));
  }
  if (o.quant == SynthQuant::kFp8Block) {
    E4KV_RETURN_IF_ERROR(check_size("FP8 block size", o.quant_group));
  }
  if (!o.quant_zero_point && o.quant != SynthQuant::kAwq) {
    return Status::error("synthetic checkpoint: symmetric codes (no zero point) are AWQ's only");
  }
  if (o.quant != SynthQuant::kNone && o.quant_scope == SynthQuantScope::kExperts &&
      o.family != SynthFamily::kQwen4Exp) {
    return Status::error(cat("synthetic checkpoint: a ", synth_family_name(o.family),
                             " checkpoint has no experts; quantize all linear layers instead"));
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

// config.json's quantization_config with exactly the keys scripts/quantize_checkpoint.py (and the
// tools it follows) writes; not_converted: the linear modules left dense, sorted.
ordered_json quantization_config(const SynthCheckpointOptions& o,
                                 const std::vector<std::string>& not_converted) {
  ordered_json q;
  if (o.quant == SynthQuant::kAwq) {
    q["quant_method"] = "awq";
    q["bits"] = 4;
    q["group_size"] = o.quant_group;
    q["zero_point"] = o.quant_zero_point;
    q["version"] = "gemm";
    q["modules_to_not_convert"] = not_converted;
    return q;
  }
  if (o.quant == SynthQuant::kFp8Block) {
    q["quant_method"] = "fp8";
    q["fmt"] = "e4m3";
    q["activation_scheme"] = "dynamic";
    q["weight_block_size"] = {o.quant_group, o.quant_group};
    q["modules_to_not_convert"] = not_converted;
    return q;
  }
  // llm-compressor's NVFP4 preset as it serializes (every QuantizationArgs field written).
  const auto args = [](const ordered_json& dynamic) {
    ordered_json a;
    a["actorder"] = nullptr;
    a["block_structure"] = nullptr;
    a["dynamic"] = dynamic;
    a["group_size"] = 16;
    a["num_bits"] = 4;
    a["observer"] = "minmax";
    a["observer_kwargs"] = ordered_json::object();
    a["strategy"] = "tensor_group";
    a["symmetric"] = true;
    a["type"] = "float";
    return a;
  };
  ordered_json group;
  group["format"] = "nvfp4-pack-quantized";
  group["input_activations"] = args("local");
  group["output_activations"] = nullptr;
  group["targets"] = {"Linear"};
  group["weights"] = args(false);
  q["config_groups"] = {{"group_0", group}};
  q["format"] = "nvfp4-pack-quantized";
  q["global_compression_ratio"] = nullptr;
  q["ignore"] = not_converted;
  q["kv_cache_scheme"] = nullptr;
  q["quant_method"] = "compressed-tensors";
  q["quantization_status"] = "compressed";
  q["sparsity_config"] = ordered_json::object();
  q["transform_config"] = ordered_json::object();
  return q;
}

std::string config_json(const SynthCheckpointOptions& o,
                        const std::vector<std::string>& not_converted) {
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
  if (o.quant != SynthQuant::kNone) config["quantization_config"] = quantization_config(o, not_converted);
  return config.dump(2) + "\n";
}

bool ends_with_any(std::string_view name, std::initializer_list<std::string_view> suffixes) {
  for (std::string_view suffix : suffixes) {
    if (name.ends_with(suffix)) return true;
  }
  return false;
}

// The modules scripts/quantize_checkpoint.py quantizes (its QUANTIZED_MODULE), or only the routed
// experts; module: the name without ".weight".
bool in_quant_scope(std::string_view module, SynthQuantScope scope) {
  if (!module.starts_with("model.layers.")) return false;
  const bool expert = module.find(".mlp.experts.") != std::string_view::npos &&
                      ends_with_any(module, {".gate_proj", ".up_proj", ".down_proj"});
  if (scope == SynthQuantScope::kExperts) return expert;
  return expert ||
         ends_with_any(module, {".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj",
                                ".self_attn.o_proj", ".self_attn.indexer.index_qk_proj",
                                ".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj",
                                ".mlp.shared_expert.gate_proj", ".mlp.shared_expert.up_proj",
                                ".mlp.shared_expert.down_proj", ".linear_attn.in_proj_qkv",
                                ".linear_attn.in_proj_z", ".linear_attn.out_proj"});
}

// A 2-D weight the tools see as a Linear (not an embedding, a norm or a convolution): listed as
// not converted when left dense.
bool linear_like(const Spec& spec) {
  if (!spec.name.ends_with(".weight") || spec.shape.size() != 2) return false;
  const std::string_view module(spec.name.data(), spec.name.size() - 7);
  const std::string_view last = module.substr(module.rfind('.') + 1);
  return module.find("embed") == std::string_view::npos && !last.ends_with("norm");
}

// Whether the format can pack a weight [out, in] (the loader's conditions).
bool quant_fits(const SynthCheckpointOptions& o, int64_t out, int64_t in) {
  switch (o.quant) {
    case SynthQuant::kAwq:
      return in % o.quant_group == 0 && out % 8 == 0;
    case SynthQuant::kNvfp4:
      return in % 16 == 0;
    default:
      return true;
  }
}

// Replaces each float weight in the quantization scope by the format's tensors; returns the linear
// modules left dense (with lm_head, which the tools always keep dense), sorted.
std::vector<std::string> quantize_specs(const SynthCheckpointOptions& o, std::vector<Spec>& specs) {
  std::vector<std::string> not_converted;
  if (o.quant == SynthQuant::kNone) return not_converted;
  std::vector<Spec> out;
  out.reserve(specs.size() * 3);
  for (Spec& spec : specs) {
    const bool linear = linear_like(spec);
    const std::string module = linear ? spec.name.substr(0, spec.name.size() - 7) : std::string();
    if (!linear || spec.init != Init::kLinear || !in_quant_scope(module, o.quant_scope) ||
        !quant_fits(o, spec.shape[0], spec.shape[1])) {
      if (linear) not_converted.push_back(module);
      out.push_back(std::move(spec));
      continue;
    }
    const int64_t rows = spec.shape[0];
    const int64_t cols = spec.shape[1];
    const float bound = 1.0f / std::sqrt(static_cast<float>(cols));
    const std::string& m = module;
    switch (o.quant) {
      case SynthQuant::kAwq: {
        const int64_t g = o.quant_group;
        const bool zp = o.quant_zero_point;
        out.push_back({m + ".qweight",
                       {cols, rows / 8},
                       zp ? Init::kRandomBits : Init::kAwqSymCodes,
                       DType::kI32,
                       bound});
        if (zp) {
          out.push_back({m + ".qzeros", {cols / g, rows / 8}, Init::kAwqZeros, DType::kI32, bound});
        }
        out.push_back({m + ".scales",
                       {cols / g, rows},
                       zp ? Init::kAwqScales : Init::kAwqSymScales,
                       DType::kF16,
                       bound});
        break;
      }
      case SynthQuant::kNvfp4:
        out.push_back({m + ".weight_packed", {rows, cols / 2}, Init::kRandomBits, DType::kU8, bound});
        out.push_back(
            {m + ".weight_scale", {rows, cols / 16}, Init::kNvfp4Scales, DType::kF8E4M3, bound});
        out.push_back({m + ".weight_global_scale", {1}, Init::kNvfp4Global, DType::kF32, bound});
        out.push_back({m + ".input_global_scale", {1}, Init::kOne, DType::kF32, bound});
        break;
      case SynthQuant::kFp8Block: {
        const int64_t b = o.quant_group;
        out.push_back({m + ".weight", {rows, cols}, Init::kFp8Codes, DType::kF8E4M3, bound});
        out.push_back({m + ".weight_scale_inv",
                       {(rows + b - 1) / b, (cols + b - 1) / b},
                       Init::kFp8ScaleInv,
                       DType::kF32,
                       bound});
        break;
      }
      case SynthQuant::kNone:
        break;
    }
  }
  specs = std::move(out);
  not_converted.emplace_back("lm_head");
  std::sort(not_converted.begin(), not_converted.end());
  not_converted.erase(std::unique(not_converted.begin(), not_converted.end()), not_converted.end());
  return not_converted;
}

// Contiguous shards balanced by bytes; every shard gets at least one tensor.
std::vector<size_t> assign_shards(const std::vector<uint64_t>& sizes, size_t n_shards) {
  uint64_t total = 0;
  for (uint64_t size : sizes) total += size;
  std::vector<size_t> shard_of(sizes.size());
  uint64_t before = 0;
  size_t prev = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint64_t mid = before + sizes[i] / 2;
    size_t s = total == 0 ? 0 : static_cast<size_t>(mid * n_shards / total);
    s = std::clamp(s, prev, i == 0 ? size_t{0} : prev + 1);
    s = std::max(s, n_shards - std::min(n_shards, sizes.size() - i));
    shard_of[i] = s;
    prev = s;
    before += sizes[i];
  }
  return shard_of;
}

// Shards of at most max_bytes in file order, a larger tensor alone (save_pretrained's rule).
std::vector<size_t> assign_shards_by_size(const std::vector<uint64_t>& sizes, uint64_t max_bytes) {
  std::vector<size_t> shard_of(sizes.size());
  size_t shard = 0;
  uint64_t filled = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (filled > 0 && filled + sizes[i] > max_bytes) {
      ++shard;
      filled = 0;
    }
    shard_of[i] = shard;
    filled += sizes[i];
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

// The whole checkpoint without its data.
struct Layout {
  std::string config_json;
  std::vector<Spec> specs;
  std::vector<uint64_t> bytes;   // per spec
  std::vector<size_t> shard_of;  // per spec
  std::vector<std::string> shard_names;
  uint64_t total = 0;
};

Result<Layout> lay_out(const SynthCheckpointOptions& o) {
  E4KV_RETURN_IF_ERROR(validate(o));
  Layout layout;
  layout.specs = tensor_specs(o);
  const std::vector<std::string> not_converted = quantize_specs(o, layout.specs);
  layout.config_json = config_json(o, not_converted);
  layout.bytes.reserve(layout.specs.size());
  for (const Spec& spec : layout.specs) {
    layout.bytes.push_back(spec_bytes(spec));
    layout.total += layout.bytes.back();
  }
  if (layout.total > o.max_total_bytes) {
    return Status::error(cat("synthetic checkpoint: ", layout.total,
                             " bytes of weights is more than the ", o.max_total_bytes,
                             " allowed; use smaller sizes"));
  }
  size_t n_shards = static_cast<size_t>(o.n_shards);
  if (o.max_shard_bytes > 0) {
    layout.shard_of = assign_shards_by_size(layout.bytes, o.max_shard_bytes);
    n_shards = layout.shard_of.empty() ? 1 : layout.shard_of.back() + 1;
  } else if (n_shards > layout.specs.size()) {
    return Status::error(cat("synthetic checkpoint: ", o.n_shards, " shards for only ",
                             layout.specs.size(),
                             " tensors; every shard needs at least one tensor"));
  } else if (n_shards > 1) {
    layout.shard_of = assign_shards(layout.bytes, n_shards);
  }
  if (n_shards == 1) {
    layout.shard_of.assign(layout.specs.size(), 0);
    layout.shard_names.emplace_back("model.safetensors");
  } else {
    for (size_t k = 0; k < n_shards; ++k) layout.shard_names.push_back(shard_file_name(k, n_shards));
  }
  return layout;
}

// A safetensors header (length field and JSON padded with spaces to 8 bytes) for the tensors
// `members` of the layout, byte for byte what write_safetensors builds with nlohmann's dump(); the
// JSON is assembled here because an ordered_json object looks keys up linearly, too slow for the
// hundreds of thousands of tensors of a large MoE checkpoint.
std::string shard_header(const Layout& layout, const std::vector<size_t>& members) {
  std::string json = R"({"__metadata__":{"format":"pt"})";
  uint64_t offset = 0;
  for (size_t i : members) {
    const Spec& spec = layout.specs[i];
    json += ',';
    json += nlohmann::json(spec.name).dump();
    json += R"(:{"dtype":")";
    json += dtype_name(spec.dtype);
    json += R"(","shape":[)";
    for (size_t d = 0; d < spec.shape.size(); ++d) {
      if (d > 0) json += ',';
      json += std::to_string(spec.shape[d]);
    }
    json += cat(R"(],"data_offsets":[)", offset, ",", offset + layout.bytes[i], "]}");
    offset += layout.bytes[i];
  }
  json += '}';
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t length = json.size();
  for (int b = 0; b < 8; ++b, length >>= 8) out[size_t(b)] = static_cast<char>(length & 0xff);
  return out + json;
}

// model.safetensors.index.json as transformers writes it (total_size in the metadata, weight_map
// sorted by tensor name), in nlohmann's dump(2) form; by hand for the reason above.
std::string index_json(const Layout& layout) {
  std::vector<size_t> order(layout.specs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return layout.specs[a].name < layout.specs[b].name; });
  std::string text = cat("{\n  \"metadata\": {\n    \"total_size\": ", layout.total,
                         "\n  },\n  \"weight_map\": {");
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    text += k == 0 ? "\n    " : ",\n    ";
    text += nlohmann::json(layout.specs[i].name).dump();
    text += ": ";
    text += nlohmann::json(layout.shard_names[layout.shard_of[i]]).dump();
  }
  text += "\n  }\n}\n";
  return text;
}

// Writes `size` bytes at `offset`, whatever pwrite takes at a time.
Status pwrite_all(int fd, const std::byte* data, uint64_t size, uint64_t offset,
                  const std::string& what) {
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::error(cat(what, ": cannot write: ", std::strerror(errno)));
    data += n;
    size -= uint64_t(n);
    offset += uint64_t(n);
  }
  return ok_status();
}

// Bytes each thread generates at a time: a multiple of 8 (fill's alignment), small enough that
// the threads' buffers stay a few tens of MiB, large enough that a write is worth its call.
constexpr uint64_t kChunkBytes = uint64_t(4) << 20;

// The shard files, each under a temporary name until it is complete: sized up front, the header
// written, then every tensor's chunks generated by the threads and written at their offsets.
Status write_shards(const std::filesystem::path& dir, const Layout& layout, uint64_t seed,
                    int n_threads) {
  const size_t n_shards = layout.shard_names.size();
  std::vector<std::vector<size_t>> members(n_shards);
  for (size_t i = 0; i < layout.specs.size(); ++i) members[layout.shard_of[i]].push_back(i);

  struct Item {
    size_t shard;
    size_t tensor;
    uint64_t begin, end;  // bytes of the tensor
    uint64_t offset;      // in the file
  };
  std::vector<std::vector<Item>> shard_items(n_shards);
  std::vector<std::filesystem::path> partial(n_shards);
  std::vector<int> fds(n_shards, -1);
  auto close_all = [&](bool remove) {
    for (size_t k = 0; k < n_shards; ++k) {
      if (fds[k] >= 0) ::close(fds[k]);
      fds[k] = -1;
      std::error_code ec;
      if (remove && !partial[k].empty()) std::filesystem::remove(partial[k], ec);
    }
  };
  for (size_t k = 0; k < n_shards; ++k) {
    partial[k] = dir / cat(".", layout.shard_names[k], ".partial");
    fds[k] = ::open(partial[k].c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fds[k] < 0) {
      const Status error = Status::error(
          cat(partial[k].string(), ": cannot create: ", std::strerror(errno)));
      close_all(true);
      return error;
    }
    const std::string header = shard_header(layout, members[k]);
    uint64_t offset = header.size();
    for (size_t i : members[k]) {
      for (uint64_t b = 0; b < layout.bytes[i]; b += kChunkBytes) {
        shard_items[k].push_back({k, i, b, std::min(layout.bytes[i], b + kChunkBytes), offset + b});
      }
      offset += layout.bytes[i];
    }
    Status st = ::ftruncate(fds[k], static_cast<off_t>(offset)) == 0
                    ? ok_status()
                    : Status::error(cat(partial[k].string(), ": cannot size it to ", offset,
                                        " bytes: ", std::strerror(errno)));
    if (st.ok()) {
      st = pwrite_all(fds[k], reinterpret_cast<const std::byte*>(header.data()), header.size(), 0,
                      partial[k].string());
    }
    if (!st.ok()) {
      close_all(true);
      return st;
    }
  }

  // The shards' chunks in turn: a write holds its file's lock (tmpfs, most file systems), so
  // threads spread over the shards write at once where threads on one file would queue.
  std::vector<Item> items;
  for (size_t round = 0, left = 1; left > 0; ++round) {
    left = 0;
    for (const std::vector<Item>& list : shard_items) {
      if (round < list.size()) items.push_back(list[round]);
      left += round + 1 < list.size() ? 1 : 0;
    }
  }
  shard_items.clear();

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  Status error = ok_status();
  auto work = [&] {
    std::vector<std::byte> buffer(kChunkBytes);
    for (size_t n = next++; n < items.size() && !failed; n = next++) {
      const Item& item = items[n];
      fill(layout.specs[item.tensor], seed, item.begin, item.end, buffer.data());
      Status st = pwrite_all(fds[item.shard], buffer.data(), item.end - item.begin, item.offset,
                             partial[item.shard].string());
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!failed.exchange(true)) error = st;
      }
    }
  };
  size_t threads = n_threads > 0 ? size_t(n_threads) : size_t(std::thread::hardware_concurrency());
  threads = std::clamp<size_t>(threads, 1, std::max<size_t>(1, items.size()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (failed) {
    close_all(true);
    return error;
  }
  for (size_t k = 0; k < n_shards; ++k) {
    if (::fsync(fds[k]) != 0) {
      const Status st = Status::error(cat(partial[k].string(), ": cannot sync: ", std::strerror(errno)));
      close_all(true);
      return st;
    }
  }
  close_all(false);
  for (size_t k = 0; k < n_shards; ++k) {
    std::error_code ec;
    std::filesystem::rename(partial[k], dir / layout.shard_names[k], ec);
    if (ec) {
      for (size_t j = k; j < n_shards; ++j) std::filesystem::remove(partial[j], ec);
      return Status::error(cat(partial[k].string(), ": cannot move into place: ", ec.message()));
    }
  }
  return ok_status();
}

// The part of the model a tensor belongs to, for the plan's summary.
std::string_view model_part(std::string_view name) {
  if (name.find(".mlp.experts.") != std::string_view::npos) return "routed experts";
  if (name.find(".mlp.shared_expert") != std::string_view::npos) return "shared expert";
  if (name.find(".mlp.gate.") != std::string_view::npos) return "router";
  if (name.find("hyper_connection") != std::string_view::npos) return "hyper-connections";
  if (name.find(".self_attn.") != std::string_view::npos) return "attention";
  if (name.find(".linear_attn.") != std::string_view::npos) return "linear attention";
  if (name.find(".ple.") != std::string_view::npos) return "PLE";
  if (name.find(".mlp.") != std::string_view::npos) return "MLP";
  if (name.find("embed_tokens") != std::string_view::npos) return "embedding";
  if (name.starts_with("lm_head")) return "lm_head";
  return "norms and other";
}

// The name with every numeric component (layer, expert) written as *.
std::string tensor_kind(std::string_view name) {
  std::string kind;
  size_t begin = 0;
  while (begin <= name.size()) {
    const size_t end = std::min(name.find('.', begin), name.size());
    const std::string_view part = name.substr(begin, end - begin);
    const bool number = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
      return c >= '0' && c <= '9';
    });
    if (!kind.empty()) kind += '.';
    kind += number ? std::string_view("*") : part;
    begin = end + 1;
  }
  return kind;
}

std::string gigabytes(uint64_t bytes) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3f GB", double(bytes) / 1e9);
  return buffer;
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

Result<SynthQuant> parse_synth_quant(std::string_view name) {
  if (name == "none") return SynthQuant::kNone;
  if (name == "awq") return SynthQuant::kAwq;
  if (name == "nvfp4") return SynthQuant::kNvfp4;
  if (name == "fp8-block") return SynthQuant::kFp8Block;
  return Status::error(
      cat("unknown weight quantization \"", name, "\"; expected none, awq, nvfp4 or fp8-block"));
}

Result<SynthQuantScope> parse_synth_quant_scope(std::string_view name) {
  if (name == "all-linear") return SynthQuantScope::kAllLinear;
  if (name == "experts") return SynthQuantScope::kExperts;
  return Status::error(
      cat("unknown quantization scope \"", name, "\"; expected all-linear or experts"));
}

SynthCheckpointOptions published_qwen4exp_options() {
  SynthCheckpointOptions o;
  o.family = SynthFamily::kQwen4Exp;
  o.n_layers = 48;
  o.hidden_size = 2048;
  o.n_heads = 24;
  o.n_kv_heads = 2;
  o.head_dim = 256;
  o.vocab_size = 248320;
  o.index_heads = 4;
  o.index_dim = 128;
  o.index_budget = 2048;
  o.index_ratio = 4;
  o.linear_key_heads = 16;
  o.linear_value_heads = 32;
  o.linear_head_dim = 128;
  o.linear_conv_kernel = 4;
  o.hc_count = 4;
  o.hc_lowrank = 320;
  o.n_experts = 512;
  o.experts_top_k = 10;
  o.moe_intermediate_size = 512;
  o.shared_expert_intermediate_size = 512;
  o.ple_layer = 0;
  o.ple_ngram_base = 1000;
  o.dtype = DType::kF16;
  o.max_shard_bytes = 4000000000ull;
  o.max_total_bytes = uint64_t(64) << 30;
  return o;
}

Result<SynthPlan> plan_synth_checkpoint(const SynthCheckpointOptions& options) {
  E4KV_ASSIGN_OR_RETURN(Layout layout, lay_out(options));
  SynthPlan plan;
  plan.config_json = std::move(layout.config_json);
  plan.shard_names = std::move(layout.shard_names);
  plan.total_bytes = layout.total;
  plan.tensors.reserve(layout.specs.size());
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    Spec& spec = layout.specs[i];
    plan.tensors.push_back(
        {std::move(spec.name), spec.dtype, std::move(spec.shape), layout.bytes[i], layout.shard_of[i]});
  }
  return plan;
}

std::string format_synth_plan(const SynthPlan& plan) {
  struct Kind {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    bool same_shape = true;
    uint64_t count = 0;
    uint64_t bytes = 0;
  };
  std::vector<Kind> kinds;
  std::map<std::pair<std::string, DType>, size_t> kind_index;
  std::vector<std::pair<std::string, uint64_t>> parts;
  std::map<std::string, size_t, std::less<>> part_index;
  for (const SynthPlanTensor& t : plan.tensors) {
    std::string kind = tensor_kind(t.name);
    auto [it, added] = kind_index.try_emplace({kind, t.dtype}, kinds.size());
    if (added) kinds.push_back({std::move(kind), t.dtype, t.shape});
    Kind& k = kinds[it->second];
    k.same_shape = k.same_shape && k.shape == t.shape;
    ++k.count;
    k.bytes += t.bytes;
    const std::string_view part = model_part(t.name);
    auto [p, part_added] = part_index.try_emplace(std::string(part), parts.size());
    if (part_added) parts.emplace_back(std::string(part), 0);
    parts[p->second].second += t.bytes;
  }
  std::string text = "bytes by tensor kind (* = every layer / expert):\n";
  char line[512];
  for (const Kind& k : kinds) {
    std::string shape = "[";
    for (size_t d = 0; d < k.shape.size(); ++d) shape += cat(d > 0 ? ", " : "", k.shape[d]);
    shape = k.same_shape ? shape + "]" : std::string("(shapes vary)");
    std::snprintf(line, sizeof(line), "  %-66s %7s %-16s x%-7llu %16llu  %s\n", k.name.c_str(),
                  std::string(dtype_name(k.dtype)).c_str(), shape.c_str(),
                  static_cast<unsigned long long>(k.count),
                  static_cast<unsigned long long>(k.bytes), gigabytes(k.bytes).c_str());
    text += line;
  }
  text += "bytes by part of the model:\n";
  for (const auto& [part, bytes] : parts) {
    std::snprintf(line, sizeof(line), "  %-20s %16llu  %s  %5.1f%%\n", part.c_str(),
                  static_cast<unsigned long long>(bytes), gigabytes(bytes).c_str(),
                  plan.total_bytes > 0 ? 100.0 * double(bytes) / double(plan.total_bytes) : 0.0);
    text += line;
  }
  std::snprintf(line, sizeof(line), "total: %zu tensors, %llu bytes (%s) in %zu file%s\n",
                plan.tensors.size(), static_cast<unsigned long long>(plan.total_bytes),
                gigabytes(plan.total_bytes).c_str(), plan.shard_names.size(),
                plan.shard_names.size() == 1 ? "" : "s");
  text += line;
  return text;
}

Result<SynthCheckpoint> make_synth_checkpoint(const SynthCheckpointOptions& options) {
  E4KV_ASSIGN_OR_RETURN(Layout layout, lay_out(options));
  SynthCheckpoint ckpt;
  ckpt.config_json = std::move(layout.config_json);
  ckpt.tensors.reserve(layout.specs.size());
  for (const Spec& spec : layout.specs) ckpt.tensors.push_back(make_tensor(spec, options.seed));
  ckpt.shard_of = std::move(layout.shard_of);
  ckpt.shard_names = std::move(layout.shard_names);
  return ckpt;
}

Status write_synth_checkpoint(const std::filesystem::path& dir,
                              const SynthCheckpointOptions& options) {
  E4KV_ASSIGN_OR_RETURN(const Layout layout, lay_out(options));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::error(cat(dir.string(), ": cannot create directory: ", ec.message()));

  E4KV_RETURN_IF_ERROR(write_text(dir / "config.json", layout.config_json));
  E4KV_RETURN_IF_ERROR(write_shards(dir, layout, options.seed, options.n_threads));
  if (layout.shard_names.size() > 1) {
    E4KV_RETURN_IF_ERROR(write_text(dir / "model.safetensors.index.json", index_json(layout)));
  }
  if (options.with_tokenizer) E4KV_RETURN_IF_ERROR(write_synth_tokenizer(dir, options.vocab_size));
  return ok_status();
}

}  // namespace e4kv
