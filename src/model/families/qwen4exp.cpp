#include "model/families/qwen4exp.h"

#include <algorithm>
#include <cstdio>

#include "core/checked.h"
#include "model/probe.h"
#include "model/weights.h"

namespace e4kv {

struct Qwen4ExpModel::Workspace {
  BackendBuffer e;       // [rows, hidden] act (the embeddings)
  BackendBuffer x;       // [rows, streams * hidden] act (the residual streams)
  BackendBuffer mix, y;  // [rows, hidden] act
  HyperConnectionWorkspace hc;
  std::optional<QsaAttentionWorkspace> qsa;
  std::optional<DeltaNetWorkspace> delta_net;
  MoeWorkspace moe;
  std::optional<PleWorkspace> ple;
  std::optional<PleStepBuffers> ple_step;
};

bool is_qwen4exp(const ModelConfig& config) {
  return config.qwen4exp.has_value();
}

Qwen4ExpModel::Qwen4ExpModel() = default;
Qwen4ExpModel::~Qwen4ExpModel() = default;

Result<std::unique_ptr<Qwen4ExpModel>> Qwen4ExpModel::load(const Checkpoint& ckpt, Backend& backend,
                                                           const ModelOptions& options) {
  const ModelConfig& config = ckpt.config();
  const std::string config_path = (ckpt.dir() / "config.json").string();
  if (!config.qwen4exp) {
    return Status::error(cat(config_path, ": not a Qwen4Exp config"));
  }
  const Qwen4ExpConfig& q = *config.qwen4exp;
  if (!backend.has_hybrid_ops()) {
    return Status::error(cat("the ", backend.name(),
                             " backend does not run the Qwen4Exp layers yet (GatedDeltaNet, QSA "
                             "indexer, MoE, hyper-connections, PLE); use --device cpu"));
  }
  if (q.hidden_act != "silu") {
    return Status::error(cat(config_path, ": hidden_act is \"", q.hidden_act,
                             "\"; the Qwen4Exp runtime implements silu (the family's only "
                             "activation in transformers 5.17)"));
  }
  const bool has_qsa = config.count_layers(LayerKind::kQsaAttention) > 0;
  for (size_t i = 0; i < config.layers.size(); ++i) {
    if (config.layers[i] != LayerKind::kQsaAttention &&
        config.layers[i] != LayerKind::kLinearAttention) {
      return Status::error(cat(config_path, ": layer ", i, " is ",
                               layer_kind_name(config.layers[i]),
                               "; Qwen4Exp layers are linear_attention or QSA attention"));
    }
  }
  if (has_qsa && options.block_size % config.qsa->ratio != 0) {
    return Status::option_error(
        "block_size",
        cat(options.block_size, " is not a multiple of indexer_compress_ratio ", config.qsa->ratio,
            " (", config_path, "): compressed index rows are paged with the main blocks"));
  }

  std::unique_ptr<Qwen4ExpModel> model(new Qwen4ExpModel());
  Qwen4ExpModel& m = *model;
  ModelCore& core = m.core_;
  E4KV_RETURN_IF_ERROR(core.init(ckpt, backend, options));
  const ModelLimits& limits = core.limits;
  E4KV_RETURN_IF_ERROR(core.load_rope_and_scales(ckpt));

  // ---- shapes ----
  const int64_t hidden = config.hidden_size;
  const int64_t vocab = config.vocab_size;
  const float eps = static_cast<float>(config.rms_norm_eps);
  m.hc_shape_ = HyperConnectionShape{hidden, q.hc_count, q.hc_lowrank, eps};
  if (has_qsa) {
    QsaAttentionShape& s = m.qsa_shape_;
    s.hidden = hidden;
    s.n_heads = config.n_heads;
    s.n_kv_heads = config.n_kv_heads;
    s.head_dim = config.head_dim;
    s.rotary_dim = core.rope.rotary_dim;
    s.n_index_heads = config.qsa->n_index_heads;
    s.index_dim = config.qsa->index_dim;
    s.budget = config.qsa->budget;
    s.ratio = config.qsa->ratio;
    s.bias = config.attention_bias;
    s.eps = eps;
  }
  DeltaNetShape& dn = m.delta_net_shape_;
  dn.hidden = hidden;
  dn.n_k_heads = q.linear_num_key_heads;
  dn.n_v_heads = q.linear_num_value_heads;
  dn.head_k_dim = q.linear_key_head_dim;
  dn.head_v_dim = q.linear_value_head_dim;
  dn.conv_kernel = q.linear_conv_kernel_dim;
  dn.sigmoid_gate = q.output_gate_type == "sigmoid";
  dn.eps = eps;
  MoeShape moe;
  moe.hidden = hidden;
  moe.n_experts = q.num_experts;
  moe.top_k = q.num_experts_per_tok;
  moe.inter = q.moe_intermediate_size;
  moe.shared_inter = q.shared_expert_intermediate_size;
  moe.norm_topk_prob = q.norm_topk_prob;
  PleShape& ps = m.ple_shape_;
  ps.hidden = hidden;
  ps.streams = q.hc_count;
  ps.embed_dim = q.ple_embed_dim > 0 ? q.ple_embed_dim : hidden;
  ps.conv_kernel = q.ple_conv_kernel_size;
  ps.dilation = q.ngram_size;
  ps.eps = eps;

  // ---- weights ----
  // The multimodal wrapper keeps the text model under model.language_model.
  const bool nested = ckpt.find("model.language_model.embed_tokens.weight") != nullptr;
  const std::string root = nested ? "model.language_model." : "model.";
  WeightLoader weights(ckpt, backend, "qwen4_exp");
  if (options.load_progress) weights.set_progress(options.load_progress);
  m.skipped_tensors_ = weights.skip_prefix("model.visual.") + weights.skip_prefix("mtp.");
  E4KV_ASSIGN_OR_RETURN(m.embed_, weights.load(root + "embed_tokens.weight", {vocab, hidden},
                                               "[vocab_size, hidden_size]"));
  int64_t ple_index = 0;
  m.layers_.resize(size_t(config.n_layers));
  for (int64_t i = 0; i < config.n_layers; ++i) {
    Layer& layer = m.layers_[size_t(i)];
    const std::string p = cat(root, "layers.", i, ".");
    if (q.has_ple(i)) {
      E4KV_ASSIGN_OR_RETURN(PleBlock ple,
                            PleBlock::load(ckpt, weights, p + "ple.", ps, q, vocab, ple_index++,
                                           options.ple_dtype, options.ple_cache.get()));
      layer.ple.emplace(std::move(ple));
    }
    E4KV_ASSIGN_OR_RETURN(layer.attn_hc,
                          HyperConnection::load(weights, p + "attn_hyper_connection.", m.hc_shape_,
                                                /*inject=*/true));
    if (config.layers[size_t(i)] == LayerKind::kQsaAttention) {
      E4KV_ASSIGN_OR_RETURN(
          QsaAttentionMixer qsa,
          QsaAttentionMixer::load(backend, weights, p + "self_attn.", m.qsa_shape_,
                                  core.rope.inv_freq.data(), options.tp));
      layer.qsa.emplace(std::move(qsa));
    } else {
      E4KV_ASSIGN_OR_RETURN(DeltaNetMixer mixer,
                            DeltaNetMixer::load(weights, p + "linear_attn.", dn, options.tp));
      layer.delta_net.emplace(std::move(mixer));
    }
    E4KV_ASSIGN_OR_RETURN(layer.mlp_hc, HyperConnection::load(weights, p + "mlp_hyper_connection.",
                                                              m.hc_shape_, /*inject=*/true));
    E4KV_ASSIGN_OR_RETURN(layer.moe, MoeFfn::load(weights, p + "mlp.", moe, options.tp));
  }
  E4KV_ASSIGN_OR_RETURN(HyperConnection final_mixer,
                        HyperConnection::load(weights, root + "hyper_connection_mixer.",
                                              m.hc_shape_, /*inject=*/false));
  m.final_mixer_.emplace(std::move(final_mixer));
  if (config.tie_word_embeddings) {
    if (weights.has("lm_head.weight")) weights.mark_used("lm_head.weight");
  } else {
    E4KV_ASSIGN_OR_RETURN(
        m.lm_head_, weights.load("lm_head.weight", {vocab, hidden}, "[vocab_size, hidden_size]"));
  }
  E4KV_RETURN_IF_ERROR(weights.check_all_used());
  // Under tensor parallelism the rank holds a share of the attention and linear-attention heads
  // (and of the experts): its caches, states and workspaces are sized by its share from here on.
  if (options.tp.split()) {
    if (has_qsa) {
      E4KV_ASSIGN_OR_RETURN(const HeadShare heads,
                            share_heads(config.n_heads, config.n_kv_heads, options.tp));
      m.qsa_shape_.n_heads = heads.q_count;
      m.qsa_shape_.n_kv_heads = heads.kv_count;
      core.config.n_heads = heads.q_count;
      core.config.n_kv_heads = heads.kv_count;
    }
    int64_t k_begin = 0, v_begin = 0;
    E4KV_ASSIGN_OR_RETURN(dn, m.delta_net_shape_.shard(options.tp, &k_begin, &v_begin));
    moe.shared_inter = options.tp.count(moe.shared_inter);
  }

  // ---- caches and state pools ----
  // One slot beyond the pool: the scratch slot of padding rows (ForwardBatch::pad_to).
  const int64_t slots = limits.max_seqs + 1;
  m.memory_.resize(m.layers_.size());
  for (size_t i = 0; i < m.layers_.size(); ++i) {
    Layer& layer = m.layers_[i];
    LayerMemory& mem = m.memory_[i];
    if (layer.qsa) {
      const QsaLayerCache view = m.qsa_cache(i);
      const size_t compressed_bytes = size_t(options.n_blocks + 1) *
                                      size_t(view.compressed.rows_per_block()) *
                                      size_t(view.compressed.index_dim) * 2;
      const size_t ring_bytes = size_t(slots * m.qsa_shape_.ratio * m.qsa_shape_.index_dim) * 2;
      for (auto [buffer, bytes] :
           {std::pair{&mem.kv, view.kv.geometry.total_bytes()},
            std::pair{&mem.compressed, compressed_bytes}, std::pair{&mem.rings, ring_bytes}}) {
        Result<BackendBuffer> allocated = backend.allocate(bytes);
        if (!allocated.ok()) {
          return Status::error(cat("caches of QSA layer ", i, " (", options.n_blocks,
                                   " blocks): ", allocated.message(),
                                   "; use a shorter max model length or fewer sequences"));
        }
        *buffer = std::move(allocated).value();
      }
    } else {
      E4KV_ASSIGN_OR_RETURN(DeltaNetState state, DeltaNetState::create(backend, dn, slots));
      mem.delta_net.emplace(std::move(state));
    }
    if (layer.ple) {
      E4KV_ASSIGN_OR_RETURN(PleState state, layer.ple->create_state(backend, slots));
      mem.ple.emplace(std::move(state));
    }
  }

  // ---- workspaces ----
  const int64_t width = m.hc_shape_.width();
  const BackendBuffer& head = m.lm_head_.empty() ? m.embed_ : m.lm_head_;
  E4KV_RETURN_IF_ERROR(core.create_step_and_head(width, head.data()));
  m.ws_ = std::make_unique<Workspace>();
  Workspace& ws = *m.ws_;
  const int64_t rows = limits.max_batch_tokens;
  const size_t act = backend.act_size();
  for (auto [buffer, bytes] :
       {std::pair{&ws.e, size_t(rows * hidden) * act}, std::pair{&ws.x, size_t(rows * width) * act},
        std::pair{&ws.mix, size_t(rows * hidden) * act},
        std::pair{&ws.y, size_t(rows * hidden) * act}}) {
    E4KV_ASSIGN_OR_RETURN(*buffer, backend.allocate(bytes));
  }
  E4KV_ASSIGN_OR_RETURN(ws.hc, HyperConnectionWorkspace::create(backend, m.hc_shape_, rows));
  if (has_qsa) {
    E4KV_ASSIGN_OR_RETURN(QsaAttentionWorkspace qsa,
                          QsaAttentionWorkspace::create(backend, m.qsa_shape_, rows));
    ws.qsa.emplace(std::move(qsa));
  }
  if (config.count_layers(LayerKind::kLinearAttention) > 0) {
    E4KV_ASSIGN_OR_RETURN(DeltaNetWorkspace delta, DeltaNetWorkspace::create(backend, dn, rows));
    ws.delta_net.emplace(std::move(delta));
  }
  E4KV_ASSIGN_OR_RETURN(ws.moe, MoeWorkspace::create(backend, moe, rows));
  if (!q.ple_layers.empty()) {
    const int64_t heads = (q.ngram_size - 1) * q.heads_per_ngram;
    E4KV_ASSIGN_OR_RETURN(PleWorkspace ple, PleWorkspace::create(backend, ps, rows));
    ws.ple.emplace(std::move(ple));
    E4KV_ASSIGN_OR_RETURN(PleStepBuffers step_buffers,
                          PleStepBuffers::create(backend, ps, heads, ple_index, rows));
    ws.ple_step.emplace(std::move(step_buffers));
  }
  Backend::HybridWorkspaceNeeds needs;
  needs.max_rows = rows;
  if (has_qsa) {
    needs.qsa_max_groups = limits.max_blocks_per_seq * (options.block_size / m.qsa_shape_.ratio);
    needs.rope_inv_freq = core.rope.inv_freq.data();
    needs.rotary_dim = core.rope.rotary_dim;
    needs.max_positions = limits.max_seq_tokens;
  }
  needs.moe_experts = moe.n_experts;
  needs.moe_top_k = moe.top_k;
  needs.moe_hidden = moe.hidden;
  needs.moe_inter = moe.inter;
  E4KV_RETURN_IF_ERROR(backend.reserve_hybrid_workspaces(needs));
  if (has_qsa) {
    // Every QSA layer attends with one shape over its selection: planned once per step.
    AttentionLayerShape shape;
    shape.head_dim = m.qsa_shape_.head_dim;
    shape.block_size = options.block_size;
    shape.dtype = options.kv_cache_dtype;
    shape.n_heads = m.qsa_shape_.n_heads;
    shape.n_kv_heads = m.qsa_shape_.n_kv_heads;
    shape.sel_width = m.qsa_shape_.sel_width();
    E4KV_RETURN_IF_ERROR(
        backend.reserve_attention(std::span(&shape, 1), rows, limits.max_seq_tokens));
  }
  return model;
}

QsaLayerCache Qwen4ExpModel::qsa_cache(size_t layer) const {
  QsaLayerCache cache;
  const LayerMemory* mem = layer < memory_.size() ? &memory_[layer] : nullptr;
  cache.kv = core_.kv_cache_view(mem != nullptr ? mem->kv.data() : nullptr, layer);
  cache.compressed.data = mem != nullptr ? mem->compressed.as<uint16_t>() : nullptr;
  cache.compressed.n_blocks = core_.options.n_blocks + 1;  // the scratch block last
  cache.compressed.block_size = core_.options.block_size;
  cache.compressed.ratio = qsa_shape_.ratio;
  cache.compressed.index_dim = qsa_shape_.index_dim;
  cache.rings.data = mem != nullptr ? mem->rings.as<uint16_t>() : nullptr;
  cache.rings.n_rings = core_.limits.max_seqs + 1;  // the scratch slot last
  cache.rings.cap = qsa_shape_.ratio;
  cache.rings.index_dim = qsa_shape_.index_dim;
  return cache;
}

ModelMemory Qwen4ExpModel::memory() const {
  ModelMemory memory;
  const int64_t act = int64_t(core_.backend->act_size());
  for (const Layer& layer : layers_) {
    if (layer.qsa) {
      const QsaAttentionShape& s = qsa_shape_;
      memory.bytes_per_token +=
          2 * s.kv_dim() * int64_t(kv_cache_elem_bytes(core_.options.kv_cache_dtype));
      // One FP16 index row per `ratio` tokens, rounded up per block (a partial group's row).
      memory.bytes_per_token += s.index_dim * 2 / s.ratio;
      memory.bytes_per_sequence += s.ratio * s.index_dim * 2;
    } else {
      memory.bytes_per_sequence +=
          delta_net_shape_.conv_state_elems() * act + delta_net_shape_.recurrent_state_elems() * 4;
    }
    if (layer.ple) {
      memory.bytes_per_sequence +=
          ple_shape_.conv_state_elems() * act + (ple_shape_.dilation - 1) * 4;
    }
  }
  return memory;
}

namespace {

// "1.50 GiB", "12.00 MiB", "3.00 KiB", "20 bytes".
std::string host_bytes_text(int64_t bytes) {
  char buf[64];
  const double b = double(bytes);
  if (bytes >= int64_t(1) << 30) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / double(int64_t(1) << 30));
  } else if (bytes >= int64_t(1) << 20) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", b / double(int64_t(1) << 20));
  } else if (bytes >= int64_t(1) << 10) {
    std::snprintf(buf, sizeof(buf), "%.2f KiB", b / 1024.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(bytes));
  }
  return buf;
}

}  // namespace

std::vector<std::string> Qwen4ExpModel::load_notes() const {
  std::vector<std::string> notes;
  if (skipped_tensors_ > 0) {
    notes.push_back(cat("skipped ", skipped_tensors_,
                        " checkpoint tensors of the vision tower and multi-token-prediction head "
                        "(the text model runs alone)"));
  }
  const PleTablesSummary ple = ple_tables();
  if (!ple.layers.empty()) {
    int64_t rows = 0;
    for (const PleTablesSummary::Layer& l : ple.layers) rows += l.n_rows;
    const std::string tables =
        cat("PLE n-gram tables: ", ple.layers.size(), " layer", ple.layers.size() == 1 ? "" : "s",
            ", ", rows, " rows x ", ple.dim, " values");
    if (ple.dtype == PleDtype::kE4m3) {
      char rel_l2[32];
      std::snprintf(rel_l2, sizeof(rel_l2), "%.4g", ple.error().rel_l2());
      notes.push_back(cat(tables, " in host memory as fp8_e4m3 with an FP32 scale per row, ",
                          host_bytes_text(ple.host_bytes), " (", ple.host_bytes,
                          " bytes; the checkpoint's ", dtype_name(ple.checkpoint_dtype), ": ",
                          host_bytes_text(ple.checkpoint_bytes),
                          "); relative L2 error of the decoded rows ", rel_l2));
    } else {
      notes.push_back(cat(tables, " read in place from the memory-mapped checkpoint (",
                          dtype_name(ple.checkpoint_dtype), ", ",
                          host_bytes_text(ple.checkpoint_bytes), " of host page cache)"));
    }
  }
  return notes;
}

PleTablesSummary Qwen4ExpModel::ple_tables() const {
  PleTablesSummary summary;
  summary.dtype = core_.options.ple_dtype;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!layers_[i].ple) continue;
    const PleTable& table = layers_[i].ple->table();
    summary.checkpoint_dtype = table.dtype();
    summary.dim = table.dim();
    summary.checkpoint_bytes += table.checkpoint_bytes();
    summary.host_bytes += table.owned_bytes();
    summary.layers.push_back({int64_t(i), table.n_rows(), table.e4m3_error()});
  }
  return summary;
}

Result<int32_t> Qwen4ExpModel::allocate_sequence() {
  E4KV_ASSIGN_OR_RETURN(const int32_t slot, core_.slots.allocate());
  reset_state(slot);
  return slot;
}

Status Qwen4ExpModel::begin_sequence(int32_t slot) {
  E4KV_RETURN_IF_ERROR(core_.slots.acquire(slot));
  reset_state(slot);
  return ok_status();
}

void Qwen4ExpModel::reset_state(int32_t slot) {
  Backend& b = *core_.backend;
  const Qwen4ExpConfig& q = *core_.config.qwen4exp;
  for (size_t i = 0; i < layers_.size(); ++i) {
    LayerMemory& mem = memory_[i];
    if (layers_[i].qsa) {
      const size_t ring_bytes = size_t(qsa_shape_.ratio * qsa_shape_.index_dim) * 2;
      b.fill_zero(mem.rings.as<std::byte>() + size_t(slot) * ring_bytes, ring_bytes);
    }
    if (mem.delta_net) mem.delta_net->reset(b, delta_net_shape_, slot);
    if (mem.ple) {
      mem.ple->reset(b, ple_shape_, slot, q.ngram_size, *q.eos_token_id);
    }
  }
}

Status Qwen4ExpModel::free_sequence(int32_t slot) {
  return core_.slots.release(slot);
}

Status Qwen4ExpModel::copy_sequence_state(int32_t src_slot, int32_t dst_slot) {
  E4KV_RETURN_IF_ERROR(core_.slots.copy(src_slot, dst_slot));
  Backend& b = *core_.backend;
  const BlockCopy copy[1] = {{src_slot, dst_slot}};
  const int64_t n_slots = core_.limits.max_seqs + 1;
  for (size_t i = 0; i < layers_.size(); ++i) {
    LayerMemory& mem = memory_[i];
    if (layers_[i].qsa) {
      const size_t ring_bytes = size_t(qsa_shape_.ratio * qsa_shape_.index_dim) * 2;
      E4KV_RETURN_IF_ERROR(b.copy_blocks(mem.rings.data(), n_slots, ring_bytes, copy));
    }
    if (mem.delta_net) {
      E4KV_RETURN_IF_ERROR(mem.delta_net->copy(b, delta_net_shape_, src_slot, dst_slot, n_slots));
    }
    if (mem.ple) E4KV_RETURN_IF_ERROR(mem.ple->copy(b, ple_shape_, src_slot, dst_slot, n_slots));
  }
  return ok_status();
}

Status Qwen4ExpModel::copy_blocks(std::span<const BlockCopy> copies) {
  if (copies.empty()) return ok_status();
  Backend& b = *core_.backend;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!layers_[i].qsa) continue;
    const QsaLayerCache cache = qsa_cache(i);
    E4KV_RETURN_IF_ERROR(b.copy_blocks(cache.kv.data, cache.kv.geometry.n_blocks,
                                       cache.kv.geometry.block_bytes(), copies));
    const size_t compressed_block_bytes =
        size_t(cache.compressed.rows_per_block() * cache.compressed.index_dim) * 2;
    E4KV_RETURN_IF_ERROR(b.copy_blocks(cache.compressed.data, cache.compressed.n_blocks,
                                       compressed_block_bytes, copies));
  }
  return ok_status();
}

Status Qwen4ExpModel::prepare(const ForwardBatch& batch) {
  Backend& b = *core_.backend;
  Workspace& ws = *ws_;
  const ModelConfig& c = core_.config;
  E4KV_RETURN_IF_ERROR(core_.build_step(batch));
  E4KV_RETURN_IF_ERROR(core_.step->build_sequences(batch, core_.slots));
  for (size_t r = 0; r < batch.token_ids.size(); ++r) {
    const int64_t id = batch.token_ids[r];
    const std::vector<int64_t>& media = c.qwen4exp->media_token_ids;
    if (std::find(media.begin(), media.end(), id) != media.end()) {
      return Status::error(cat("token id ", id, " (row ", r,
                               ") is an image or video placeholder; e4kv runs the text model of "
                               "Qwen4Exp only (the vision tower is not loaded): give text input"));
    }
  }
  if (!ws.ple_step) return ok_status();
  // PLE: every layer's n-gram rows, gathered on the host and uploaded in one copy. The n-gram
  // histories advance here: a failure leaves them undefined, as a failed forward does.
  const StepContext& step = *core_.step;
  const int64_t n = step.n_rows();
  PleStepBuffers& ple = *ws.ple_step;
  int64_t ple_index = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (!layers_[l].ple) continue;
    Status status =
        layers_[l].ple->prepare(step.host_ids(), step.host_seq_row_begin(), step.host_seq_slots(),
                                *memory_[l].ple, ple.ids.data(), ple.emb_f32.data(), b.act_dtype(),
                                ple.host_rows(ple_index++, n, b.act_size()));
    if (!status.ok()) {
      for (int32_t slot : batch.seq_slots) core_.slots.poison(slot);
      return status;
    }
  }
  ple.upload(b, n);
  return ok_status();
}

Status Qwen4ExpModel::run_layers(const ForwardBatch& batch) {
  Backend& b = *core_.backend;
  Workspace& ws = *ws_;
  const StepContext& step = *core_.step;
  const int64_t n = step.n_rows();
  const int64_t hidden = core_.config.hidden_size;
  unsigned long long* non_finite = core_.head->non_finite();
  core_.head->begin_step(b);
  int64_t ple_index = 0;

  core_.mark("embed");
  E4KV_RETURN_IF_ERROR(b.gather_rows(embed_.data(), step.ids(), n, hidden, ws.e.data()));
  E4KV_RETURN_IF_ERROR(b.hc_expand(ws.e.data(), n, hc_shape_.streams, hidden, ws.x.data()));
  // The last block's injection, left for the next block's mix (which applies it inside its own
  // launches where the backend fuses the mix: one launch fewer per block).
  HcPending pending;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    LayerMemory& mem = memory_[l];
    if (layer.ple) {
      E4KV_RETURN_IF_ERROR(HyperConnection::apply_pending(b, n, ws.x.data(), pending, hc_shape_));
      pending = {};
      core_.mark("ple");
      E4KV_RETURN_IF_ERROR(
          layer.ple->forward(b, n, ws.ple_step->device_rows(ple_index++, n, b.act_size()),
                             step.sequences(), ws.x.data(), *mem.ple, *ws.ple));
    }
    core_.mark("hyper_connection");
    E4KV_RETURN_IF_ERROR(layer.attn_hc.mix(b, n, ws.x.data(), ws.mix.data(), ws.hc, pending));
    core_.mark(layer.qsa ? "qsa" : "delta_net");
    if (layer.qsa) {
      probe_attention_input(b, batch.probe, int64_t(l), ws.mix.data(),
                            size_t(n * hidden) * dtype_size(b.act_dtype()));
      E4KV_RETURN_IF_ERROR(layer.qsa->forward(b, step, qsa_cache(l), ws.mix.data(), ws.y.data(),
                                              *ws.qsa, non_finite,
                                              core_.kv_stats.sink(int64_t(l), batch.purpose)));
      probe_attention_output(b, batch.probe, int64_t(l), ws.qsa->heads.attn.as<float>(), n,
                             qsa_shape_.q_dim());
      probe_qsa_selection(b, batch.probe, int64_t(l), ws.qsa->sel_tokens.as<int32_t>(),
                          ws.qsa->sel_counts.as<int32_t>(), n, qsa_shape_.sel_width());
    } else {
      E4KV_RETURN_IF_ERROR(layer.delta_net->forward(b, n, step.sequences(), ws.mix.data(),
                                                    ws.y.data(), *mem.delta_net, *ws.delta_net));
    }
    E4KV_RETURN_IF_ERROR(core_.options.tp.all_reduce(b, ws.y.data(), n * hidden));
    core_.mark("hyper_connection");
    pending = layer.attn_hc.defer_inject(ws.y.data(), ws.hc);
    E4KV_RETURN_IF_ERROR(layer.mlp_hc.mix(b, n, ws.x.data(), ws.mix.data(), ws.hc, pending));
    core_.mark("moe");
    E4KV_RETURN_IF_ERROR(layer.moe.forward(b, n, ws.mix.data(), ws.y.data(), ws.moe));
    E4KV_RETURN_IF_ERROR(core_.options.tp.all_reduce(b, ws.y.data(), n * hidden));
    core_.mark("hyper_connection");
    pending = layer.mlp_hc.defer_inject(ws.y.data(), ws.hc);
  }
  // The logits head reads x (its rows, then the final mixer): the last injection lands first.
  return HyperConnection::apply_pending(b, n, ws.x.data(), pending, hc_shape_);
}

Status Qwen4ExpModel::run_device(const ForwardBatch& batch) {
  Backend& b = *core_.backend;
  Workspace& ws = *ws_;
  E4KV_RETURN_IF_ERROR(run_layers(batch));
  // No final RMSNorm: the final mixer's norm is it.
  const LogitsHead::FinalNorm final_mix = [&](const void* in, int64_t m, void* out) {
    return final_mixer_->mix(b, m, in, out, ws.hc);
  };
  return core_.head->logits(b, *core_.step, ws.x.data(), final_mix, core_.profiler).status();
}

Result<DeviceLogits> Qwen4ExpModel::finish_step(const ForwardBatch& batch, const Status& device) {
  // run_device changed the sequences' states: a failure leaves them undefined.
  if (!device.ok()) {
    for (int32_t slot : batch.seq_slots) core_.slots.poison(slot);
    return device;
  }
  core_.step->commit_sequences(core_.slots);
  E4KV_RETURN_IF_ERROR(core_.head->check_non_finite(*core_.backend));
  return core_.head->output(int64_t(batch.logit_rows.size()));
}

std::string Qwen4ExpModel::input_token_problem(int32_t id) const {
  const std::vector<int64_t>& media = core_.config.qwen4exp->media_token_ids;
  if (std::find(media.begin(), media.end(), int64_t(id)) == media.end()) return {};
  return cat("id ", id,
             " is an image or video placeholder; e4kv runs the text model of Qwen4Exp only (the "
             "vision tower is not loaded): give text input");
}

}  // namespace e4kv
