#include "model/layers/ple.h"

#include <algorithm>
#include <utility>

#include "core/half.h"
#include "model/workspace.h"

namespace e4kv {

Result<PleWorkspace> PleWorkspace::create(Backend& backend, const PleShape& shape,
                                          int64_t max_rows) {
  PleWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  E4KV_RETURN_IF_ERROR(allocate_buffers(
      backend, {{&ws.key_value, n * size_t(shape.width() + shape.hidden) * act},
                {&ws.qn, n * size_t(shape.width()) * act},
                {&ws.gv, n * size_t(shape.width()) * act},
                {&ws.conv, n * size_t(shape.width()) * act}}));
  return ws;
}

Result<PleStepBuffers> PleStepBuffers::create(Backend& backend, const PleShape& shape,
                                              int64_t n_heads, int64_t n_layers, int64_t max_rows) {
  PleStepBuffers buffers;
  buffers.n_layers = n_layers;
  buffers.embed_dim = shape.embed_dim;
  const size_t n = size_t(max_rows);
  buffers.ids.resize(n * size_t(n_heads));
  buffers.emb_f32.resize(n * size_t(shape.embed_dim));
  const size_t bytes =
      std::max<size_t>(64, size_t(n_layers) * n * size_t(shape.embed_dim) * backend.act_size());
  E4KV_ASSIGN_OR_RETURN(buffers.staging, backend.allocate_host(bytes));
  E4KV_ASSIGN_OR_RETURN(buffers.emb, backend.allocate(bytes));
  return buffers;
}

void PleState::reset(Backend& backend, const PleShape& shape, int32_t slot, int64_t ngram_size,
                     int64_t eos) {
  const size_t bytes = size_t(shape.conv_state_elems()) * backend.act_size();
  backend.fill_zero(conv.as<std::byte>() + size_t(slot) * bytes, bytes);
  history[size_t(slot)] = ple_history_init(ngram_size, eos);
}

Status PleState::copy(Backend& backend, const PleShape& shape, int32_t src, int32_t dst,
                      int64_t n_slots) {
  const BlockCopy pair[1] = {{src, dst}};
  const size_t bytes = size_t(shape.conv_state_elems()) * backend.act_size();
  E4KV_RETURN_IF_ERROR(backend.copy_blocks(conv.data(), n_slots, bytes, pair));
  history[size_t(dst)] = history[size_t(src)];
  return ok_status();
}

Result<PleBlock> PleBlock::load(const Checkpoint& ckpt, WeightLoader& weights, const std::string& p,
                                const PleShape& shape, const Qwen4ExpConfig& config,
                                int64_t vocab_size, int64_t ple_index, PleDtype ple_dtype,
                                PleE4m3Cache* cache) {
  PleBlock block;
  block.shape_ = shape;
  block.eos_ = *config.eos_token_id;
  block.hash_ = ple_hash_params(config, vocab_size, ple_index);
  const std::string emb = p + "ple_embedding.";
  E4KV_ASSIGN_OR_RETURN(std::vector<std::string> buffers,
                        ple_read_hash_buffers(ckpt, emb, block.hash_));
  for (const std::string& name : buffers) weights.mark_used(name);
  const int64_t n_heads = block.hash_.n_heads();
  if (shape.embed_dim % n_heads != 0) {
    return Status::error(cat(ckpt.dir().string(), ": ple_embed_dim ", shape.embed_dim,
                             " is not a multiple of the ", n_heads, " n-gram hash heads"));
  }
  E4KV_ASSIGN_OR_RETURN(block.table_,
                        PleTable::open(ckpt, emb, block.hash_.n_rows, shape.embed_dim / n_heads));
  for (const std::string& name : block.table_.used_names()) weights.mark_used(name);
  if (ple_dtype == PleDtype::kE4m3) E4KV_RETURN_IF_ERROR(block.table_.to_e4m3(ckpt, emb, cache));
  const int64_t w = shape.width();
  const int64_t d = shape.embed_dim;
  E4KV_ASSIGN_OR_RETURN(
      block.key_value_,
      FusedProjection::load(
          weights, d,
          {{p + "key_proj", w, "[hc_count * hidden_size, ple_embed_dim]"},
           {p + "value_proj", shape.hidden, "[hidden_size, ple_embed_dim]"}}));
  E4KV_ASSIGN_OR_RETURN(block.norm_key_,
                        weights.load(p + "norm_key.weight", {w}, "[hc_count * hidden_size]"));
  E4KV_ASSIGN_OR_RETURN(block.norm_query_,
                        weights.load(p + "norm_query.weight", {w}, "[hc_count * hidden_size]"));
  E4KV_ASSIGN_OR_RETURN(block.norm_conv_,
                        weights.load(p + "norm_conv.weight", {w}, "[hc_count * hidden_size]"));
  E4KV_ASSIGN_OR_RETURN(block.conv_,
                        weights.load(p + "conv1d.weight", {w, 1, shape.conv_kernel},
                                     "[hc_count * hidden_size, 1, ple_conv_kernel_size]"));
  return block;
}

Result<PleState> PleBlock::create_state(Backend& backend, int64_t n_slots) const {
  PleState state;
  E4KV_ASSIGN_OR_RETURN(state.conv,
                        backend.allocate(std::max<size_t>(
                            64, size_t(n_slots * shape_.conv_state_elems()) * backend.act_size())));
  state.history.assign(size_t(n_slots), ple_history_init(hash_.ngram_size, eos_));
  return state;
}

Status PleBlock::prepare(std::span<const int32_t> tokens, std::span<const int32_t> row_begin,
                         std::span<const int32_t> slots, PleState& state, int64_t* ids,
                         float* emb_f32, DType act, void* emb) const {
  const int64_t n = int64_t(tokens.size());
  const int64_t n_heads = hash_.n_heads();
  for (size_t q = 0; q < slots.size(); ++q) {
    const int64_t begin = row_begin[q];
    const int64_t end = row_begin[q + 1];
    std::vector<int32_t>& history = state.history[size_t(slots[q])];
    ple_ngram_ids(hash_, eos_, tokens.subspan(size_t(begin), size_t(end - begin)), history,
                  ids + begin * n_heads);
  }
  for (int64_t i = 0; i < n * n_heads; ++i) {
    if (ids[i] < 0 || ids[i] >= table_.n_rows()) {
      return Status::error(cat("PLE: n-gram id ", ids[i], " outside the table's ", table_.n_rows(),
                               " rows (the checkpoint's hash buffers and table disagree)"));
    }
  }
  table_.gather(ids, n * n_heads, emb_f32);  // [n, heads * dh] = [n, embed]
  const size_t elems = size_t(n * n_heads * table_.dim());
  if (act == DType::kF32) {
    std::copy(emb_f32, emb_f32 + elems, static_cast<float*>(emb));
  } else {
    uint16_t* out = static_cast<uint16_t*>(emb);
    for (size_t i = 0; i < elems; ++i) out[i] = f32_to_f16(emb_f32[i]);
  }
  return ok_status();
}

Status PleBlock::forward(Backend& b, int64_t n, const void* emb, const SequenceRowsView& seqs,
                         void* x, PleState& state, PleWorkspace& ws) const {
  const PleShape& s = shape_;
  const DType act = b.act_dtype();
  const int64_t w = s.width();
  E4KV_RETURN_IF_ERROR(key_value_.forward(b, emb, n, ws.key_value.data(), act));
  void* kn = key_value_.part(ws.key_value.data(), n, 0, b.act_size());
  const void* val = key_value_.part(ws.key_value.data(), n, 1, b.act_size());
  E4KV_RETURN_IF_ERROR(b.rms_norm_grouped(kn, norm_key_.data(), n, s.streams, s.hidden, s.eps,
                                          RmsNormForm::kOnePlusWeight, kn));
  E4KV_RETURN_IF_ERROR(b.rms_norm_grouped(x, norm_query_.data(), n, s.streams, s.hidden, s.eps,
                                          RmsNormForm::kOnePlusWeight, ws.qn.data()));
  E4KV_RETURN_IF_ERROR(
      b.ple_gate(kn, ws.qn.data(), val, n, s.streams, s.hidden, ws.gv.data()));
  // kn is free again: it holds the normalised conv input.
  E4KV_RETURN_IF_ERROR(b.rms_norm_grouped(ws.gv.data(), norm_conv_.data(), n, s.streams, s.hidden,
                                          s.eps, RmsNormForm::kOnePlusWeight, kn));
  E4KV_RETURN_IF_ERROR(b.conv1d_silu(kn, w, conv_.data(), s.conv_kernel, s.dilation,
                                     state.conv.data(), seqs, ws.conv.data()));
  E4KV_RETURN_IF_ERROR(b.add(ws.gv.data(), ws.conv.data(), n * w));
  return b.add(x, ws.gv.data(), n * w);
}

}  // namespace e4kv
