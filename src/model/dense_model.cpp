#include "model/dense_model.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/file_io.h"
#include "kv/block_allocator.h"
#include "kv/scale_keys.h"

namespace e4kv {

struct DenseModel::Layer {
  BackendBuffer input_norm;  // [hidden]
  BackendBuffer q, k, v, o;  // [n_heads * head_dim, hidden], [kv_dim, hidden] x2, [hidden, q_dim]
  BackendBuffer q_bias, k_bias, v_bias, o_bias;  // [q_dim], [kv_dim] x2, [hidden]; empty if none
  BackendBuffer q_norm, k_norm;                  // [head_dim]; Qwen3 only
  BackendBuffer post_norm;                       // [hidden]
  BackendBuffer gate, up, down;  // [intermediate, hidden] x2, [hidden, intermediate]
};

struct DenseModel::Scratch {
  // Per-batch metadata, built on the host.
  BackendBuffer ids;          // [n_rows] int32
  BackendBuffer row_seq;      // [n_rows] int32
  BackendBuffer row_pos;      // [n_rows] int32
  BackendBuffer slots;        // [n_rows] int64
  BackendBuffer cos, sin;     // [n_rows, rotary_dim / 2] fp32
  BackendBuffer logit_rows;   // [n_logits] int32
  BackendBuffer seq_lens;     // [n_seqs] int32
  BackendBuffer block_table;  // [n_seqs, max_blocks] int32
  BackendBuffer non_finite;   // [2] unsigned long long
  // Activations.
  BackendBuffer x, h, o;        // [n_rows, hidden] act
  BackendBuffer q, k, v;        // [n_rows, q_dim | kv_dim] act
  BackendBuffer q16, k16, v16;  // [n_rows, q_dim | kv_dim] FP16 bits
  BackendBuffer attn;           // [n_rows, q_dim] fp32
  BackendBuffer attn_act;       // [n_rows, q_dim] act (only when act is not fp32)
  BackendBuffer gate, up;       // [n_rows, intermediate] act
  BackendBuffer xs;             // [n_logits, hidden] act
  BackendBuffer logits;         // [n_logits, vocab] fp32
};

namespace {

using json = nlohmann::json;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += cat(i == 0 ? "" : ", ", shape[i]);
  return out + "]";
}

// Reads the fields of config.json that ModelConfig does not keep (activation, MLP bias).
Status check_dense_extras(const Checkpoint& ckpt) {
  const std::filesystem::path path = ckpt.dir() / "config.json";
  E4KV_ASSIGN_OR_RETURN(const std::string text, read_file(path));
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!root.is_object()) return Status::error(cat(path.string(), ": not a JSON object"));
  const json* object = &root;
  if (root.contains("text_config") && root["text_config"].is_object()) {
    object = &root["text_config"];
  }
  for (const char* key : {"hidden_act", "hidden_activation"}) {
    auto it = object->find(key);
    if (it == object->end() || it->is_null()) continue;
    if (!it->is_string() || it->get<std::string>() != "silu") {
      return Status::error(
          cat(path.string(), ": \"", key, "\" is ", it->dump(),
              "; the dense runtime implements the SiLU-gated MLP (\"silu\") only"));
    }
  }
  auto bias = object->find("mlp_bias");
  if (bias != object->end() && bias->is_boolean() && bias->get<bool>()) {
    return Status::error(
        cat(path.string(), ": \"mlp_bias\" is true; the dense runtime has no MLP biases"));
  }
  return ok_status();
}

size_t round_up_bytes(size_t bytes) {
  return std::max<size_t>(64, bytes);
}

}  // namespace

std::string_view dense_family_name(DenseFamily family) {
  switch (family) {
    case DenseFamily::kLlama:
      return "llama";
    case DenseFamily::kMistral:
      return "mistral";
    case DenseFamily::kQwen2:
      return "qwen2";
    case DenseFamily::kQwen3:
      return "qwen3";
  }
  return "";
}

Result<DenseModelSpec> dense_model_spec(const ModelConfig& config) {
  struct Known {
    const char* architecture;
    const char* model_type;
    DenseFamily family;
  };
  static constexpr Known kKnown[] = {
      {"LlamaForCausalLM", "llama", DenseFamily::kLlama},
      {"MistralForCausalLM", "mistral", DenseFamily::kMistral},
      {"Qwen2ForCausalLM", "qwen2", DenseFamily::kQwen2},
      {"Qwen3ForCausalLM", "qwen3", DenseFamily::kQwen3},
  };
  const Known* found = nullptr;
  for (const Known& known : kKnown) {
    if (config.architecture.empty() ? config.model_type == known.model_type
                                    : config.architecture == known.architecture) {
      found = &known;
    }
  }
  if (found == nullptr) {
    const std::string what = config.architecture.empty()
                                 ? cat("model_type \"", config.model_type, "\"")
                                 : cat("architecture \"", config.architecture, "\"");
    return Status::error(cat("config.json: ", what,
                             " is not supported by the dense runtime; supported: "
                             "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                             "Qwen3ForCausalLM"));
  }
  DenseModelSpec spec;
  spec.family = found->family;
  switch (spec.family) {
    case DenseFamily::kLlama:
    case DenseFamily::kQwen3:
      spec.qkv_bias = config.attention_bias;
      spec.o_bias = config.attention_bias;
      spec.qk_norm = spec.family == DenseFamily::kQwen3;
      break;
    case DenseFamily::kMistral:
      break;
    case DenseFamily::kQwen2:
      spec.qkv_bias = true;
      break;
  }
  return spec;
}

DenseModel::~DenseModel() = default;

Result<std::unique_ptr<DenseModel>> DenseModel::load(const Checkpoint& ckpt, Backend& backend,
                                                     const DenseModelOptions& options) {
  const ModelConfig& config = ckpt.config();
  const std::string config_path = (ckpt.dir() / "config.json").string();
  E4KV_ASSIGN_OR_RETURN(DenseModelSpec spec, dense_model_spec(config));
  E4KV_RETURN_IF_ERROR(check_dense_extras(ckpt));
  if (config.intermediate_size <= 0) {
    return Status::error(cat(config_path, ": \"intermediate_size\" is required"));
  }

  std::unique_ptr<DenseModel> model(new DenseModel());
  model->config_ = config;
  model->spec_ = spec;
  model->backend_ = &backend;
  DenseModelOptions& opts = model->options_;
  opts = options;
  E4KV_RETURN_IF_ERROR(validate_block_size(opts.block_size));
  if (opts.n_blocks <= 0 || opts.n_blocks > std::numeric_limits<int32_t>::max()) {
    return Status::error(cat("the KV cache needs 1 to 2^31 - 1 blocks, got ", opts.n_blocks));
  }
  if (opts.max_model_len <= 0) opts.max_model_len = config.max_position_embeddings;
  if (opts.max_model_len <= 0) {
    return Status::option_error("max_model_len",
                                cat("not given, and ", config_path,
                                    " has no \"max_position_embeddings\"; give it explicitly"));
  }

  for (size_t i = 0; i < config.layers.size(); ++i) {
    const LayerKind kind = config.layers[i];
    if (kind == LayerKind::kQsaAttention || kind == LayerKind::kLinearAttention) {
      return Status::error(cat(config_path, ": layer ", i, " is ", layer_kind_name(kind),
                               "; the dense runtime runs full-attention layers only"));
    }
    if (kind == LayerKind::kSlidingAttention) {
      // A window covering the whole context is full attention; anything smaller is not done.
      if (*config.sliding_window < opts.max_model_len) {
        return Status::option_error(
            "max_model_len", cat(opts.max_model_len, " is longer than the sliding window of ",
                                 *config.sliding_window, " tokens of layer ", i, " (", config_path,
                                 "); the dense runtime attends to the full context only: give ",
                                 *config.sliding_window, " or less"));
      }
    }
  }
  E4KV_ASSIGN_OR_RETURN(model->rope_, make_rope_table(config));
  E4KV_ASSIGN_OR_RETURN(model->kv_scales_,
                        load_kv_scales(ckpt, opts.kv_cache_dtype, opts.kv_scales_mode));

  // ---- weights ----
  const int64_t hidden = config.hidden_size;
  const int64_t q_dim = config.n_heads * config.head_dim;
  const int64_t kv_dim = config.n_kv_heads * config.head_dim;
  const int64_t inter = config.intermediate_size;
  const int64_t vocab = config.vocab_size;
  std::set<std::string, std::less<>> used;

  auto load_tensor = [&](const std::string& name, std::vector<int64_t> shape,
                         const char* meaning) -> Result<BackendBuffer> {
    const SafetensorsTensor* tensor = ckpt.find(name);
    if (tensor == nullptr) {
      return Status::error(cat(ckpt.dir().string(), ": tensor ", name, " is missing (a ",
                               dense_family_name(spec.family), " checkpoint needs it)"));
    }
    if (tensor->shape != shape) {
      return Status::error(cat(ckpt.dir().string(), ": tensor ", name, " has shape ",
                               shape_text(tensor->shape), " but config.json implies ",
                               shape_text(shape), " (", meaning,
                               "); the checkpoint and its config.json disagree"));
    }
    used.insert(name);
    Result<BackendBuffer> buffer = backend.upload_weight(*tensor);
    if (!buffer.ok()) return Status::error(cat(ckpt.dir().string(), ": ", buffer.message()));
    return buffer;
  };

  E4KV_ASSIGN_OR_RETURN(model->embed_, load_tensor("model.embed_tokens.weight", {vocab, hidden},
                                                   "[vocab_size, hidden_size]"));
  model->layers_.resize(static_cast<size_t>(config.n_layers));
  for (int64_t i = 0; i < config.n_layers; ++i) {
    Layer& layer = model->layers_[size_t(i)];
    const std::string p = cat("model.layers.", i, ".");
    E4KV_ASSIGN_OR_RETURN(layer.input_norm,
                          load_tensor(p + "input_layernorm.weight", {hidden}, "[hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(layer.q, load_tensor(p + "self_attn.q_proj.weight", {q_dim, hidden},
                                               "[num_attention_heads * head_dim, hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(layer.k, load_tensor(p + "self_attn.k_proj.weight", {kv_dim, hidden},
                                               "[num_key_value_heads * head_dim, hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(layer.v, load_tensor(p + "self_attn.v_proj.weight", {kv_dim, hidden},
                                               "[num_key_value_heads * head_dim, hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(layer.o, load_tensor(p + "self_attn.o_proj.weight", {hidden, q_dim},
                                               "[hidden_size, num_attention_heads * head_dim]"));
    if (spec.qkv_bias) {
      E4KV_ASSIGN_OR_RETURN(layer.q_bias, load_tensor(p + "self_attn.q_proj.bias", {q_dim},
                                                      "[num_attention_heads * head_dim]"));
      E4KV_ASSIGN_OR_RETURN(layer.k_bias, load_tensor(p + "self_attn.k_proj.bias", {kv_dim},
                                                      "[num_key_value_heads * head_dim]"));
      E4KV_ASSIGN_OR_RETURN(layer.v_bias, load_tensor(p + "self_attn.v_proj.bias", {kv_dim},
                                                      "[num_key_value_heads * head_dim]"));
    }
    if (spec.o_bias) {
      E4KV_ASSIGN_OR_RETURN(layer.o_bias,
                            load_tensor(p + "self_attn.o_proj.bias", {hidden}, "[hidden_size]"));
    }
    if (spec.qk_norm) {
      E4KV_ASSIGN_OR_RETURN(layer.q_norm, load_tensor(p + "self_attn.q_norm.weight",
                                                      {config.head_dim}, "[head_dim]"));
      E4KV_ASSIGN_OR_RETURN(layer.k_norm, load_tensor(p + "self_attn.k_norm.weight",
                                                      {config.head_dim}, "[head_dim]"));
    }
    E4KV_ASSIGN_OR_RETURN(layer.post_norm, load_tensor(p + "post_attention_layernorm.weight",
                                                       {hidden}, "[hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(layer.gate, load_tensor(p + "mlp.gate_proj.weight", {inter, hidden},
                                                  "[intermediate_size, hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(layer.up, load_tensor(p + "mlp.up_proj.weight", {inter, hidden},
                                                "[intermediate_size, hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(layer.down, load_tensor(p + "mlp.down_proj.weight", {hidden, inter},
                                                  "[hidden_size, intermediate_size]"));
  }
  E4KV_ASSIGN_OR_RETURN(model->final_norm_,
                        load_tensor("model.norm.weight", {hidden}, "[hidden_size]"));
  const bool has_lm_head = ckpt.find("lm_head.weight") != nullptr;
  if (config.tie_word_embeddings) {
    // Tied: the output projection is the embedding (as transformers ties them on load).
    if (has_lm_head) used.insert("lm_head.weight");
  } else if (!has_lm_head) {
    return Status::error(cat(ckpt.dir().string(),
                             ": tensor lm_head.weight is missing and config.json has "
                             "tie_word_embeddings false; set it true if the output projection is "
                             "the embedding"));
  } else {
    E4KV_ASSIGN_OR_RETURN(model->lm_head_, load_tensor("lm_head.weight", {vocab, hidden},
                                                       "[vocab_size, hidden_size]"));
  }

  // Anything else in the checkpoint is a part of the model this runtime would silently skip.
  std::vector<std::string> unexpected;
  for (const std::string& name : ckpt.tensor_names()) {
    if (used.count(name) != 0 || parse_scale_key(name)) continue;
    if (std::string_view(name).ends_with(".rotary_emb.inv_freq")) continue;  // recomputed
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(5, unexpected.size()); ++i) {
      list += cat(i == 0 ? "" : ", ", unexpected[i]);
    }
    if (unexpected.size() > 5) list += cat(", ... (", unexpected.size(), " in all)");
    return Status::error(cat(ckpt.dir().string(), ": tensors the ", dense_family_name(spec.family),
                             " dense runtime does not use (a config.json mismatch or an "
                             "unsupported variant): ",
                             list));
  }

  // ---- KV cache: one buffer per layer ----
  KvCacheGeometry geometry;
  geometry.n_blocks = opts.n_blocks;
  geometry.block_size = opts.block_size;
  geometry.n_kv_heads = config.n_kv_heads;
  geometry.head_dim = config.head_dim;
  geometry.dtype = opts.kv_cache_dtype;
  const std::optional<int64_t> layer_cache_bytes =
      checked_product({geometry.n_blocks, 2, geometry.block_size, geometry.n_kv_heads,
                       geometry.head_dim, int64_t(kv_cache_elem_bytes(geometry.dtype))});
  if (!layer_cache_bytes || !checked_mul(*layer_cache_bytes, config.n_layers)) {
    return Status::error(cat("a KV cache of ", opts.n_blocks, " blocks of ", opts.block_size,
                             " tokens needs more than 2^63 bytes; use a shorter max model length"));
  }
  for (int64_t i = 0; i < config.n_layers; ++i) {
    Result<BackendBuffer> cache = backend.allocate(geometry.total_bytes());
    if (!cache.ok()) {
      return Status::error(cat("KV cache of layer ", i, " (", opts.n_blocks, " blocks, ",
                               geometry.total_bytes(), " bytes): ", cache.message(),
                               "; use a shorter max model length"));
    }
    model->caches_.push_back(std::move(cache).value());
  }
  model->scratch_ = std::make_unique<Scratch>();
  return model;
}

Status DenseModel::validate(const ForwardBatch& batch) const {
  const size_t n = batch.token_ids.size();
  if (n == 0) return Status::error("forward: the batch has no rows");
  if (batch.row_seq.size() != n || batch.row_pos.size() != n) {
    return Status::error(cat("forward: ", n, " token ids but ", batch.row_seq.size(),
                             " row sequences and ", batch.row_pos.size(), " row positions"));
  }
  if (batch.seqs.empty()) return Status::error("forward: the batch has no sequences");
  const int64_t bs = options_.block_size;
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const BlockTable* table = batch.seqs[s];
    if (table == nullptr) return Status::error(cat("forward: sequence ", s, " has no block table"));
    if (table->n_tokens > static_cast<int64_t>(table->blocks.size()) * bs) {
      return Status::error(cat("forward: sequence ", s, " holds ", table->n_tokens, " tokens in ",
                               table->blocks.size(), " blocks of ", bs));
    }
    if (table->n_tokens > options_.max_model_len) {
      return Status::error(cat("forward: sequence ", s, " has ", table->n_tokens,
                               " tokens, more than the max model length ", options_.max_model_len));
    }
    for (int32_t block : table->blocks) {
      if (block < 0 || block >= options_.n_blocks) {
        return Status::error(cat("forward: sequence ", s, " names block ", block, " outside [0, ",
                                 options_.n_blocks, ")"));
      }
    }
  }
  for (size_t r = 0; r < n; ++r) {
    const int32_t id = batch.token_ids[r];
    if (id < 0 || id >= config_.vocab_size) {
      return Status::error(cat("token id ", id, " (row ", r, ") is outside the vocabulary [0, ",
                               config_.vocab_size, ")"));
    }
    const int32_t seq = batch.row_seq[r];
    if (seq < 0 || static_cast<size_t>(seq) >= batch.seqs.size()) {
      return Status::error(
          cat("forward: row ", r, " names sequence ", seq, " of ", batch.seqs.size()));
    }
    const int32_t pos = batch.row_pos[r];
    if (pos < 0 || pos >= batch.seqs[size_t(seq)]->n_tokens) {
      return Status::error(cat("forward: row ", r, " has position ", pos, " outside sequence ", seq,
                               "'s ", batch.seqs[size_t(seq)]->n_tokens, " tokens"));
    }
  }
  for (int32_t row : batch.logit_rows) {
    if (row < 0 || static_cast<size_t>(row) >= n) {
      return Status::error(cat("forward: logit row ", row, " outside the ", n, " rows"));
    }
  }
  return ok_status();
}

Status DenseModel::ensure_scratch(int64_t n_rows, int64_t n_logits, int64_t n_seqs,
                                  int64_t max_blocks) {
  Scratch& s = *scratch_;
  Backend& b = *backend_;
  auto ensure = [&b](BackendBuffer& buffer, size_t bytes) -> Status {
    bytes = round_up_bytes(bytes);
    if (buffer.bytes() >= bytes) return ok_status();
    const size_t grown = std::max(bytes, 2 * buffer.bytes());
    buffer.reset();
    E4KV_ASSIGN_OR_RETURN(buffer, b.allocate(grown));
    return ok_status();
  };
  const size_t n = static_cast<size_t>(n_rows);
  const size_t m = static_cast<size_t>(std::max<int64_t>(1, n_logits));
  const size_t act = b.act_size();
  const size_t hidden = size_t(config_.hidden_size);
  const size_t q_dim = size_t(config_.n_heads * config_.head_dim);
  const size_t kv_dim = size_t(config_.n_kv_heads * config_.head_dim);
  const size_t inter = size_t(config_.intermediate_size);
  const size_t half = size_t(rope_.rotary_dim / 2);
  E4KV_RETURN_IF_ERROR(ensure(s.ids, n * 4));
  E4KV_RETURN_IF_ERROR(ensure(s.row_seq, n * 4));
  E4KV_RETURN_IF_ERROR(ensure(s.row_pos, n * 4));
  E4KV_RETURN_IF_ERROR(ensure(s.slots, n * 8));
  E4KV_RETURN_IF_ERROR(ensure(s.cos, n * half * 4));
  E4KV_RETURN_IF_ERROR(ensure(s.sin, n * half * 4));
  E4KV_RETURN_IF_ERROR(ensure(s.logit_rows, m * 4));
  E4KV_RETURN_IF_ERROR(ensure(s.seq_lens, size_t(n_seqs) * 4));
  E4KV_RETURN_IF_ERROR(ensure(s.block_table, size_t(n_seqs * max_blocks) * 4));
  E4KV_RETURN_IF_ERROR(ensure(s.non_finite, 2 * sizeof(unsigned long long)));
  E4KV_RETURN_IF_ERROR(ensure(s.x, n * hidden * act));
  E4KV_RETURN_IF_ERROR(ensure(s.h, n * hidden * act));
  E4KV_RETURN_IF_ERROR(ensure(s.o, n * hidden * act));
  E4KV_RETURN_IF_ERROR(ensure(s.q, n * q_dim * act));
  E4KV_RETURN_IF_ERROR(ensure(s.k, n * kv_dim * act));
  E4KV_RETURN_IF_ERROR(ensure(s.v, n * kv_dim * act));
  E4KV_RETURN_IF_ERROR(ensure(s.q16, n * q_dim * 2));
  E4KV_RETURN_IF_ERROR(ensure(s.k16, n * kv_dim * 2));
  E4KV_RETURN_IF_ERROR(ensure(s.v16, n * kv_dim * 2));
  E4KV_RETURN_IF_ERROR(ensure(s.attn, n * q_dim * 4));
  if (b.act_dtype() != DType::kF32) E4KV_RETURN_IF_ERROR(ensure(s.attn_act, n * q_dim * act));
  E4KV_RETURN_IF_ERROR(ensure(s.gate, n * inter * act));
  E4KV_RETURN_IF_ERROR(ensure(s.up, n * inter * act));
  E4KV_RETURN_IF_ERROR(ensure(s.xs, m * hidden * act));
  E4KV_RETURN_IF_ERROR(ensure(s.logits, m * size_t(config_.vocab_size) * 4));
  return ok_status();
}

Result<std::vector<float>> DenseModel::forward(const ForwardBatch& batch) {
  E4KV_RETURN_IF_ERROR(validate(batch));
  Backend& b = *backend_;
  const ModelConfig& c = config_;
  const int64_t n = static_cast<int64_t>(batch.token_ids.size());
  const int64_t m = static_cast<int64_t>(batch.logit_rows.size());
  const int64_t n_seqs = static_cast<int64_t>(batch.seqs.size());
  const int64_t bs = options_.block_size;
  const int64_t hidden = c.hidden_size;
  const int64_t q_dim = c.n_heads * c.head_dim;
  const int64_t kv_dim = c.n_kv_heads * c.head_dim;
  const int64_t inter = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // ---- per-batch metadata on the host ----
  std::vector<int64_t> slots(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    const BlockTable& table = *batch.seqs[size_t(batch.row_seq[size_t(r)])];
    slots[size_t(r)] = slot_for_position(table, batch.row_pos[size_t(r)], bs);
  }
  std::vector<int32_t> seq_lens(static_cast<size_t>(n_seqs));
  for (int64_t s = 0; s < n_seqs; ++s) {
    seq_lens[size_t(s)] = static_cast<int32_t>(batch.seqs[size_t(s)]->n_tokens);
  }
  const BlockTableBatch tables(batch.seqs);
  const BlockTableView host_tables = tables.view();
  const int64_t max_blocks = std::max<int64_t>(1, host_tables.max_blocks_per_seq);
  const size_t half = static_cast<size_t>(rope_.rotary_dim / 2);
  std::vector<float> cos(static_cast<size_t>(n) * half);
  std::vector<float> sin(static_cast<size_t>(n) * half);
  rope_cos_sin_rows(rope_, batch.row_pos, cos.data(), sin.data());
  QueryBatchView host_rows;  // the attention rows on the host, for the backend's planning
  host_rows.n_rows = n;
  host_rows.row_seq = batch.row_seq.data();
  host_rows.row_pos = batch.row_pos.data();
  host_rows.seq_lens = seq_lens.data();

  E4KV_RETURN_IF_ERROR(ensure_scratch(n, m, n_seqs, max_blocks));
  Scratch& s = *scratch_;
  b.copy_from_host(s.ids.data(), batch.token_ids.data(), size_t(n) * 4);
  b.copy_from_host(s.row_seq.data(), batch.row_seq.data(), size_t(n) * 4);
  b.copy_from_host(s.row_pos.data(), batch.row_pos.data(), size_t(n) * 4);
  b.copy_from_host(s.slots.data(), slots.data(), size_t(n) * 8);
  b.copy_from_host(s.cos.data(), cos.data(), cos.size() * 4);
  b.copy_from_host(s.sin.data(), sin.data(), sin.size() * 4);
  if (m > 0) b.copy_from_host(s.logit_rows.data(), batch.logit_rows.data(), size_t(m) * 4);
  b.copy_from_host(s.seq_lens.data(), seq_lens.data(), size_t(n_seqs) * 4);
  if (host_tables.max_blocks_per_seq > 0) {
    b.copy_from_host(s.block_table.data(), host_tables.blocks,
                     size_t(n_seqs * host_tables.max_blocks_per_seq) * 4);
  }
  b.fill_zero(s.non_finite.data(), 2 * sizeof(unsigned long long));

  // ---- layers ----
  E4KV_RETURN_IF_ERROR(b.gather_rows(embed_.data(), s.ids.as<int32_t>(), n, hidden, s.x.data()));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& w = layers_[l];
    E4KV_RETURN_IF_ERROR(b.rms_norm(s.x.data(), w.input_norm.data(), n, hidden, eps,
                                    RmsNormForm::kWeight, s.h.data()));
    E4KV_RETURN_IF_ERROR(b.linear(s.h.data(), w.q.data(), w.q_bias.data(), n, hidden, q_dim,
                                  s.q.data(), b.act_dtype()));
    E4KV_RETURN_IF_ERROR(b.linear(s.h.data(), w.k.data(), w.k_bias.data(), n, hidden, kv_dim,
                                  s.k.data(), b.act_dtype()));
    E4KV_RETURN_IF_ERROR(b.linear(s.h.data(), w.v.data(), w.v_bias.data(), n, hidden, kv_dim,
                                  s.v.data(), b.act_dtype()));
    if (spec_.qk_norm) {
      E4KV_RETURN_IF_ERROR(b.rms_norm(s.q.data(), w.q_norm.data(), n * c.n_heads, c.head_dim, eps,
                                      RmsNormForm::kWeight, s.q.data()));
      E4KV_RETURN_IF_ERROR(b.rms_norm(s.k.data(), w.k_norm.data(), n * c.n_kv_heads, c.head_dim,
                                      eps, RmsNormForm::kWeight, s.k.data()));
    }
    E4KV_RETURN_IF_ERROR(b.rope_neox(s.q.data(), s.cos.as<float>(), s.sin.as<float>(), n, c.n_heads,
                                     c.head_dim, rope_.rotary_dim));
    E4KV_RETURN_IF_ERROR(b.rope_neox(s.k.data(), s.cos.as<float>(), s.sin.as<float>(), n,
                                     c.n_kv_heads, c.head_dim, rope_.rotary_dim));
    E4KV_RETURN_IF_ERROR(
        b.convert(s.q.data(), b.act_dtype(), s.q16.data(), DType::kF16, n * q_dim));
    E4KV_RETURN_IF_ERROR(
        b.convert(s.k.data(), b.act_dtype(), s.k16.data(), DType::kF16, n * kv_dim));
    E4KV_RETURN_IF_ERROR(
        b.convert(s.v.data(), b.act_dtype(), s.v16.data(), DType::kF16, n * kv_dim));

    KvCacheView cache;
    cache.data = caches_[l].data();
    cache.geometry.n_blocks = options_.n_blocks;
    cache.geometry.block_size = bs;
    cache.geometry.n_kv_heads = c.n_kv_heads;
    cache.geometry.head_dim = c.head_dim;
    cache.geometry.dtype = options_.kv_cache_dtype;
    if (options_.kv_cache_dtype == KvCacheDtype::kE4m3) {
      cache.k_scale = kv_scales_.k_scale[l];
      cache.v_scale = kv_scales_.v_scale[l];
    }
    E4KV_RETURN_IF_ERROR(b.cache_write(cache, s.k16.as<uint16_t>(), s.v16.as<uint16_t>(),
                                       s.slots.as<int64_t>(), n,
                                       s.non_finite.as<unsigned long long>()));

    PagedAttentionParams params;
    params.cache = cache;
    params.block_table = {s.block_table.as<int32_t>(), n_seqs, max_blocks};
    params.rows.n_rows = n;
    params.rows.row_seq = s.row_seq.as<int32_t>();
    params.rows.row_pos = s.row_pos.as<int32_t>();
    params.rows.seq_lens = s.seq_lens.as<int32_t>();
    params.n_heads = c.n_heads;
    params.q = s.q16.as<uint16_t>();
    params.out = s.attn.as<float>();
    E4KV_RETURN_IF_ERROR(b.paged_attention(params, host_rows));
    void* attn_in = s.attn.data();
    if (b.act_dtype() != DType::kF32) {
      E4KV_RETURN_IF_ERROR(
          b.convert(s.attn.data(), DType::kF32, s.attn_act.data(), b.act_dtype(), n * q_dim));
      attn_in = s.attn_act.data();
    }
    E4KV_RETURN_IF_ERROR(b.linear(attn_in, w.o.data(), w.o_bias.data(), n, q_dim, hidden,
                                  s.o.data(), b.act_dtype()));
    E4KV_RETURN_IF_ERROR(b.add(s.x.data(), s.o.data(), n * hidden));

    E4KV_RETURN_IF_ERROR(b.rms_norm(s.x.data(), w.post_norm.data(), n, hidden, eps,
                                    RmsNormForm::kWeight, s.h.data()));
    E4KV_RETURN_IF_ERROR(b.linear(s.h.data(), w.gate.data(), nullptr, n, hidden, inter,
                                  s.gate.data(), b.act_dtype()));
    E4KV_RETURN_IF_ERROR(
        b.linear(s.h.data(), w.up.data(), nullptr, n, hidden, inter, s.up.data(), b.act_dtype()));
    E4KV_RETURN_IF_ERROR(b.silu_mul(s.gate.data(), s.up.data(), s.gate.data(), n * inter));
    E4KV_RETURN_IF_ERROR(b.linear(s.gate.data(), w.down.data(), nullptr, n, inter, hidden,
                                  s.o.data(), b.act_dtype()));
    E4KV_RETURN_IF_ERROR(b.add(s.x.data(), s.o.data(), n * hidden));
  }

  // ---- logits of the rows asked ----
  std::vector<float> logits(static_cast<size_t>(m * c.vocab_size));
  if (m > 0) {
    E4KV_RETURN_IF_ERROR(
        b.gather_rows(s.x.data(), s.logit_rows.as<int32_t>(), m, hidden, s.xs.data()));
    E4KV_RETURN_IF_ERROR(b.rms_norm(s.xs.data(), final_norm_.data(), m, hidden, eps,
                                    RmsNormForm::kWeight, s.xs.data()));
    const void* head = lm_head_.empty() ? embed_.data() : lm_head_.data();
    E4KV_RETURN_IF_ERROR(b.linear(s.xs.data(), head, nullptr, m, hidden, c.vocab_size,
                                  s.logits.data(), DType::kF32));
    b.copy_to_host(logits.data(), s.logits.data(), logits.size() * sizeof(float));
  }
  unsigned long long non_finite[2] = {0, 0};
  b.copy_to_host(non_finite, s.non_finite.data(), sizeof(non_finite));
  if (non_finite[0] != 0 || non_finite[1] != 0) {
    return Status::error(cat("forward: ", non_finite[0], " non-finite K and ", non_finite[1],
                             " non-finite V values reached the KV cache (inf or NaN "
                             "activations: the weights or the input overflow FP16)"));
  }
  return logits;
}

}  // namespace e4kv
