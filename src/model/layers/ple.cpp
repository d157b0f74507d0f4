#include "model/layers/ple.h"

#include <algorithm>

#include "core/half.h"

namespace e4kv {

Result<PleWorkspace> PleWorkspace::create(Backend& backend, const PleShape& shape, int64_t n_heads,
                                          int64_t max_rows) {
  PleWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  ws.ids.resize(n * size_t(n_heads));
  ws.emb_f32.resize(n * size_t(shape.embed_dim));
  if (backend.act_dtype() == DType::kF16) ws.emb_f16.resize(ws.emb_f32.size());
  struct Need {
    BackendBuffer* buffer;
    size_t elems;
  };
  for (const Need& need :
       {Need{&ws.emb, n * size_t(shape.embed_dim)}, Need{&ws.kn, n * size_t(shape.width())},
        Need{&ws.qn, n * size_t(shape.width())}, Need{&ws.gv, n * size_t(shape.width())},
        Need{&ws.conv, n * size_t(shape.width())}, Need{&ws.val, n * size_t(shape.hidden)}}) {
    E4KV_ASSIGN_OR_RETURN(*need.buffer, backend.allocate(std::max<size_t>(64, need.elems * act)));
  }
  return ws;
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
                                int64_t vocab_size, int64_t ple_index) {
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
  const int64_t w = shape.width();
  const int64_t d = shape.embed_dim;
  E4KV_ASSIGN_OR_RETURN(block.key_, weights.load(p + "key_proj.weight", {w, d},
                                                 "[hc_count * hidden_size, ple_embed_dim]"));
  E4KV_ASSIGN_OR_RETURN(block.value_, weights.load(p + "value_proj.weight", {shape.hidden, d},
                                                   "[hidden_size, ple_embed_dim]"));
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

Status PleBlock::forward(Backend& b, std::span<const int32_t> tokens, const SequenceRowsView& seqs,
                         void* x, PleState& state, PleWorkspace& ws) const {
  const PleShape& s = shape_;
  const int64_t n = int64_t(tokens.size());
  const int64_t n_heads = hash_.n_heads();
  const int64_t dh = table_.dim();
  const DType act = b.act_dtype();

  // ---- n-gram ids and table rows, on the host ----
  for (int64_t q = 0; q < seqs.n_seqs; ++q) {
    const int64_t begin = seqs.host_row_begin[q];
    const int64_t end = seqs.host_row_begin[q + 1];
    std::vector<int32_t>& history = state.history[size_t(seqs.host_state_slot[q])];
    ple_ngram_ids(hash_, eos_, tokens.subspan(size_t(begin), size_t(end - begin)), history,
                  ws.ids.data() + begin * n_heads);
  }
  for (int64_t i = 0; i < n * n_heads; ++i) {
    if (ws.ids[size_t(i)] < 0 || ws.ids[size_t(i)] >= table_.n_rows()) {
      return Status::error(cat("PLE: n-gram id ", ws.ids[size_t(i)], " outside the table's ",
                               table_.n_rows(),
                               " rows (the checkpoint's hash buffers and table "
                               "disagree)"));
    }
  }
  table_.gather(ws.ids.data(), n * n_heads, ws.emb_f32.data());  // [n, heads * dh] = [n, embed]
  const size_t elems = size_t(n * n_heads * dh);
  if (act == DType::kF32) {
    b.copy_from_host(ws.emb.data(), ws.emb_f32.data(), elems * 4);
  } else {
    for (size_t i = 0; i < elems; ++i) ws.emb_f16[i] = f32_to_f16(ws.emb_f32[i]);
    b.copy_from_host(ws.emb.data(), ws.emb_f16.data(), elems * 2);
  }

  // ---- the block ----
  const int64_t w = s.width();
  E4KV_RETURN_IF_ERROR(
      b.linear(ws.emb.data(), key_.data(), nullptr, n, s.embed_dim, w, ws.kn.data(), act));
  E4KV_RETURN_IF_ERROR(b.rms_norm_grouped(ws.kn.data(), norm_key_.data(), n, s.streams, s.hidden,
                                          s.eps, RmsNormForm::kOnePlusWeight, ws.kn.data()));
  E4KV_RETURN_IF_ERROR(b.linear(ws.emb.data(), value_.data(), nullptr, n, s.embed_dim, s.hidden,
                                ws.val.data(), act));
  E4KV_RETURN_IF_ERROR(b.rms_norm_grouped(x, norm_query_.data(), n, s.streams, s.hidden, s.eps,
                                          RmsNormForm::kOnePlusWeight, ws.qn.data()));
  E4KV_RETURN_IF_ERROR(
      b.ple_gate(ws.kn.data(), ws.qn.data(), ws.val.data(), n, s.streams, s.hidden, ws.gv.data()));
  // kn is free again: it holds the normalised conv input.
  E4KV_RETURN_IF_ERROR(b.rms_norm_grouped(ws.gv.data(), norm_conv_.data(), n, s.streams, s.hidden,
                                          s.eps, RmsNormForm::kOnePlusWeight, ws.kn.data()));
  E4KV_RETURN_IF_ERROR(b.conv1d_silu(ws.kn.data(), w, conv_.data(), s.conv_kernel, s.dilation,
                                     state.conv.data(), seqs, ws.conv.data()));
  E4KV_RETURN_IF_ERROR(b.add(ws.gv.data(), ws.conv.data(), n * w));
  return b.add(x, ws.gv.data(), n * w);
}

}  // namespace e4kv
