#include "model/families/dense.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/file_io.h"
#include "core/json.h"
#include "kv/block_allocator.h"
#include "model/probe.h"
#include "model/weights.h"

namespace e4kv {

struct DenseModel::Workspace {
  BackendBuffer x, h, o;  // [rows, hidden] act
  AttentionWorkspace attention;
  MlpWorkspace mlp;
};

namespace {

using json = nlohmann::json;

// Reads the fields of config.json that ModelConfig does not keep (activation, MLP bias).
Status check_dense_extras(const Checkpoint& ckpt) {
  const std::filesystem::path path = ckpt.dir() / "config.json";
  E4KV_ASSIGN_OR_RETURN(const std::string text, read_file(path));
  E4KV_ASSIGN_OR_RETURN(const json root, parse_json(text, path.string()));
  if (!root.is_object()) return Status::error(cat(path.string(), ": not a JSON object"));
  const json* object = &root;
  if (const auto text_config = root.find("text_config");
      text_config != root.end() && text_config->is_object()) {
    object = &*text_config;
  }
  for (const char* key : {"hidden_act", "hidden_activation"}) {
    auto it = object->find(key);
    if (it == object->end() || it->is_null()) continue;
    if (!it->is_string() || it->get<std::string>() != "silu") {
      return Status::error(
          cat(path.string(), ": \"", key, "\" is ", json_excerpt(*it),
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

DenseModel::DenseModel() = default;
DenseModel::~DenseModel() = default;

Result<std::unique_ptr<DenseModel>> DenseModel::load(const Checkpoint& ckpt, Backend& backend,
                                                     const ModelOptions& options) {
  const ModelConfig& config = ckpt.config();
  const std::string config_path = (ckpt.dir() / "config.json").string();
  E4KV_ASSIGN_OR_RETURN(DenseModelSpec spec, dense_model_spec(config));
  E4KV_RETURN_IF_ERROR(check_dense_extras(ckpt));
  if (config.intermediate_size <= 0) {
    return Status::error(cat(config_path, ": \"intermediate_size\" is required"));
  }

  std::unique_ptr<DenseModel> model(new DenseModel());
  ModelCore& core = model->core_;
  model->spec_ = spec;
  E4KV_RETURN_IF_ERROR(core.init(ckpt, backend, options));
  const ModelLimits& limits = core.limits;

  for (size_t i = 0; i < config.layers.size(); ++i) {
    const LayerKind kind = config.layers[i];
    if (kind == LayerKind::kQsaAttention || kind == LayerKind::kLinearAttention) {
      return Status::error(cat(config_path, ": layer ", i, " is ", layer_kind_name(kind),
                               "; the dense runtime runs full-attention layers only"));
    }
    if (kind == LayerKind::kSlidingAttention) {
      // A window covering the whole context is full attention; anything smaller is not done.
      if (*config.sliding_window < limits.max_model_len) {
        return Status::option_error(
            "max_model_len", cat(limits.max_model_len, " is longer than the sliding window of ",
                                 *config.sliding_window, " tokens of layer ", i, " (", config_path,
                                 "); the dense runtime attends to the full context only: give ",
                                 *config.sliding_window, " or less"));
      }
    }
  }
  E4KV_RETURN_IF_ERROR(core.load_rope_and_scales(ckpt));

  // ---- weights ----
  const int64_t hidden = config.hidden_size;
  const int64_t vocab = config.vocab_size;
  WeightLoader weights(ckpt, backend, std::string(dense_family_name(spec.family)));
  if (options.load_progress) weights.set_progress(options.load_progress);
  AttentionShape attention;
  attention.hidden = hidden;
  attention.n_heads = config.n_heads;
  attention.n_kv_heads = config.n_kv_heads;
  attention.head_dim = config.head_dim;
  attention.rotary_dim = core.rope.rotary_dim;
  attention.qkv_bias = spec.qkv_bias;
  attention.o_bias = spec.o_bias;
  attention.qk_norm = spec.qk_norm;
  attention.eps = static_cast<float>(config.rms_norm_eps);

  E4KV_ASSIGN_OR_RETURN(model->embed_, weights.load("model.embed_tokens.weight", {vocab, hidden},
                                                    "[vocab_size, hidden_size]"));
  model->layers_.reserve(static_cast<size_t>(config.n_layers));
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const std::string p = cat("model.layers.", i, ".");
    E4KV_ASSIGN_OR_RETURN(BackendBuffer input_norm,
                          weights.load(p + "input_layernorm.weight", {hidden}, "[hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(AttentionMixer mixer,
                          AttentionMixer::load(weights, p + "self_attn.", attention, options.tp));
    E4KV_ASSIGN_OR_RETURN(
        BackendBuffer post_norm,
        weights.load(p + "post_attention_layernorm.weight", {hidden}, "[hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(DenseMlp mlp,
                          DenseMlp::load(weights, p + "mlp.", hidden, config.intermediate_size,
                                         "intermediate_size", options.tp));
    model->layers_.push_back(
        Layer{std::move(input_norm), std::move(mixer), std::move(post_norm), std::move(mlp)});
  }
  E4KV_ASSIGN_OR_RETURN(model->final_norm_,
                        weights.load("model.norm.weight", {hidden}, "[hidden_size]"));
  if (config.tie_word_embeddings) {
    // Tied: the output projection is the embedding (as transformers ties them on load).
    if (weights.has("lm_head.weight")) weights.mark_used("lm_head.weight");
  } else if (!weights.has("lm_head.weight")) {
    return Status::error(cat(ckpt.dir().string(),
                             ": tensor lm_head.weight is missing and config.json has "
                             "tie_word_embeddings false; set it true if the output projection is "
                             "the embedding"));
  } else {
    E4KV_ASSIGN_OR_RETURN(model->lm_head_, weights.load("lm_head.weight", {vocab, hidden},
                                                        "[vocab_size, hidden_size]"));
  }
  // Anything else in the checkpoint is a part of the model this runtime would silently skip.
  E4KV_RETURN_IF_ERROR(weights.check_all_used());
  // Under tensor parallelism the rank holds a share of the heads and channels: its cache, memory
  // and workspaces are sized by its share from here on.
  if (options.tp.split()) {
    AttentionShape local;
    E4KV_RETURN_IF_ERROR(attention.shard(options.tp, local).status());
    attention = local;
    core.config.n_heads = local.n_heads;
    core.config.n_kv_heads = local.n_kv_heads;
    core.config.intermediate_size = options.tp.count(config.intermediate_size);
  }

  // ---- KV cache: one buffer per layer ----
  const KvCacheGeometry geometry = model->cache_view(0).geometry;
  const std::optional<int64_t> layer_cache_bytes =
      checked_product({geometry.n_blocks, 2, geometry.block_size, geometry.n_kv_heads,
                       geometry.head_dim, int64_t(kv_cache_elem_bytes(geometry.dtype))});
  if (!layer_cache_bytes || !checked_mul(*layer_cache_bytes, config.n_layers)) {
    return Status::error(cat("a KV cache of ", options.n_blocks, " blocks of ", options.block_size,
                             " tokens needs more than 2^63 bytes; use a shorter max model length"));
  }
  for (int64_t i = 0; i < config.n_layers; ++i) {
    Result<BackendBuffer> cache = backend.allocate(geometry.total_bytes());
    if (!cache.ok()) {
      return Status::error(cat("KV cache of layer ", i, " (", options.n_blocks, " blocks, ",
                               geometry.total_bytes(), " bytes): ", cache.message(),
                               "; use a shorter max model length"));
    }
    model->caches_.push_back(std::move(cache).value());
  }

  // ---- workspaces, for the limits ----
  const BackendBuffer& head = model->lm_head_.empty() ? model->embed_ : model->lm_head_;
  E4KV_RETURN_IF_ERROR(core.create_step_and_head(hidden, head.data()));
  model->ws_ = std::make_unique<Workspace>();
  Workspace& ws = *model->ws_;
  const size_t rows = size_t(limits.max_batch_tokens);
  const size_t act = backend.act_size();
  for (BackendBuffer* buffer : {&ws.x, &ws.h, &ws.o}) {
    E4KV_ASSIGN_OR_RETURN(*buffer, backend.allocate(rows * size_t(hidden) * act));
  }
  E4KV_ASSIGN_OR_RETURN(ws.attention,
                        AttentionWorkspace::create(backend, attention.q_dim(), attention.kv_dim(),
                                                   attention.q_dim() + 2 * attention.kv_dim(),
                                                   limits.max_batch_tokens));
  E4KV_ASSIGN_OR_RETURN(ws.mlp, MlpWorkspace::create(backend, core.config.intermediate_size,
                                                     limits.max_batch_tokens));
  // Every layer attends with one shape: its launches are planned once per step.
  AttentionLayerShape shape;
  shape.head_dim = geometry.head_dim;
  shape.block_size = geometry.block_size;
  shape.dtype = geometry.dtype;
  shape.n_heads = attention.n_heads;
  shape.n_kv_heads = attention.n_kv_heads;
  E4KV_RETURN_IF_ERROR(backend.reserve_attention(std::span(&shape, 1), limits.max_batch_tokens,
                                                 limits.max_seq_tokens));
  return model;
}

Status DenseModel::copy_blocks(std::span<const BlockCopy> copies) {
  if (copies.empty()) return ok_status();
  for (size_t layer = 0; layer < caches_.size(); ++layer) {
    const KvCacheView cache = cache_view(layer);
    E4KV_RETURN_IF_ERROR(core_.backend->copy_blocks(cache.data, cache.geometry.n_blocks,
                                                    cache.geometry.block_bytes(), copies));
  }
  return ok_status();
}

KvCacheView DenseModel::cache_view(size_t layer) const {
  return core_.kv_cache_view(layer < caches_.size() ? caches_[layer].data() : nullptr, layer);
}

ModelMemory DenseModel::memory() const {
  // Every layer's K and V rows; no per-sequence state.
  ModelMemory memory;
  const ModelConfig& c = core_.config;
  memory.bytes_per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim *
                           int64_t(kv_cache_elem_bytes(core_.options.kv_cache_dtype));
  return memory;
}

Status DenseModel::prepare(const ForwardBatch& batch) {
  return core_.build_step(batch);
}

Status DenseModel::run_layers(const ForwardBatch& batch) {
  Backend& b = *core_.backend;
  Workspace& ws = *ws_;
  const ModelConfig& c = core_.config;
  const LogitsHead& head = *core_.head;
  const StepContext& step = *core_.step;
  const int64_t n = step.n_rows();
  const int64_t hidden = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  head.begin_step(b);

  core_.mark("embed");
  E4KV_RETURN_IF_ERROR(b.gather_rows(embed_.data(), step.ids(), n, hidden, ws.x.data()));
  // Each residual add runs with the norm after it (add_rms_norm); the last layer's add stays
  // plain (the head norms only the rows it projects).
  if (!layers_.empty()) {
    core_.mark("attention");
    E4KV_RETURN_IF_ERROR(b.rms_norm(ws.x.data(), layers_[0].input_norm.data(), n, hidden, eps,
                                    RmsNormForm::kWeight, ws.h.data()));
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    probe_attention_input(b, batch.probe, int64_t(l), ws.h.data(),
                          size_t(n * hidden) * dtype_size(b.act_dtype()));
    E4KV_RETURN_IF_ERROR(layer.attention.forward(b, step, cache_view(l), ws.h.data(), ws.o.data(),
                                                 ws.attention, head.non_finite(),
                                                 core_.kv_stats.sink(int64_t(l), batch.purpose)));
    probe_attention_output(b, batch.probe, int64_t(l), ws.attention.attn.as<float>(), n,
                           layer.attention.shape().q_dim());
    E4KV_RETURN_IF_ERROR(core_.options.tp.all_reduce(b, ws.o.data(), n * hidden));
    core_.mark("mlp");
    E4KV_RETURN_IF_ERROR(b.add_rms_norm(ws.x.data(), ws.o.data(), layer.post_norm.data(), n, hidden,
                                        eps, RmsNormForm::kWeight, ws.h.data()));
    E4KV_RETURN_IF_ERROR(layer.mlp.forward(b, n, ws.h.data(), ws.o.data(), ws.mlp));
    E4KV_RETURN_IF_ERROR(core_.options.tp.all_reduce(b, ws.o.data(), n * hidden));
    if (l + 1 < layers_.size()) {
      core_.mark("attention");
      E4KV_RETURN_IF_ERROR(b.add_rms_norm(ws.x.data(), ws.o.data(),
                                          layers_[l + 1].input_norm.data(), n, hidden, eps,
                                          RmsNormForm::kWeight, ws.h.data()));
    } else {
      E4KV_RETURN_IF_ERROR(b.add(ws.x.data(), ws.o.data(), n * hidden));
    }
  }
  return ok_status();
}

Status DenseModel::run_device(const ForwardBatch& batch) {
  Backend& b = *core_.backend;
  const int64_t hidden = core_.config.hidden_size;
  const float eps = static_cast<float>(core_.config.rms_norm_eps);
  E4KV_RETURN_IF_ERROR(run_layers(batch));
  const LogitsHead::FinalNorm final_norm = [&](const void* in, int64_t m, void* out) {
    return b.rms_norm(in, final_norm_.data(), m, hidden, eps, RmsNormForm::kWeight, out);
  };
  return core_.head->logits(b, *core_.step, ws_->x.data(), final_norm, core_.profiler).status();
}

Result<DeviceLogits> DenseModel::finish_step(const ForwardBatch& batch, const Status& device) {
  E4KV_RETURN_IF_ERROR(device);
  E4KV_RETURN_IF_ERROR(core_.head->check_non_finite(*core_.backend));
  return core_.head->output(int64_t(batch.logit_rows.size()));
}

}  // namespace e4kv
