#include "model/layers/qsa_attention.h"

#include <algorithm>

namespace e4kv {

Result<QsaAttentionWorkspace> QsaAttentionWorkspace::create(Backend& backend,
                                                            const QsaAttentionShape& shape,
                                                            int64_t max_rows) {
  QsaAttentionWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  const size_t q = size_t(shape.q_dim());
  const size_t kv = size_t(shape.kv_dim());
  const size_t iq = size_t(shape.index_q_dim());
  const size_t ik = size_t(shape.index_dim);
  struct Need {
    BackendBuffer* buffer;
    size_t bytes;
  };
  for (const Need& need :
       {Need{&ws.q, n * q * act}, Need{&ws.gate, n * q * act}, Need{&ws.k, n * kv * act},
        Need{&ws.v, n * kv * act}, Need{&ws.iq, n * iq * act}, Need{&ws.ik, n * ik * act},
        Need{&ws.q16, n * q * 2}, Need{&ws.gate16, n * q * 2}, Need{&ws.k16, n * kv * 2},
        Need{&ws.v16, n * kv * 2}, Need{&ws.iq16, n * iq * 2}, Need{&ws.ik16, n * ik * 2},
        Need{&ws.attn, n * q * 4}, Need{&ws.sel_tokens, n * size_t(shape.sel_width()) * 4},
        Need{&ws.sel_counts, n * 4}}) {
    E4KV_ASSIGN_OR_RETURN(*need.buffer, backend.allocate(std::max<size_t>(64, need.bytes)));
  }
  if (backend.act_dtype() != DType::kF32) {
    E4KV_ASSIGN_OR_RETURN(ws.attn_act, backend.allocate(std::max<size_t>(64, n * q * act)));
  }
  return ws;
}

Result<QsaAttentionMixer> QsaAttentionMixer::load(Backend& backend, WeightLoader& weights,
                                                  const std::string& p,
                                                  const QsaAttentionShape& shape,
                                                  const double* inv_freq) {
  QsaAttentionMixer m;
  m.shape_ = shape;
  m.inv_freq_ = inv_freq;
  const int64_t h = shape.hidden;
  const int64_t d = shape.head_dim;
  // q_proj rows are [q_0, gate_0, q_1, gate_1, ...] in blocks of head_dim: regroup them into
  // [q_0 .. q_{n-1}, gate_0 .. gate_{n-1}] so that q and gate are two plain projections.
  std::vector<int64_t> order;
  for (int64_t head = 0; head < shape.n_heads; ++head) order.push_back(2 * head);
  for (int64_t head = 0; head < shape.n_heads; ++head) order.push_back(2 * head + 1);
  E4KV_ASSIGN_OR_RETURN(
      m.q_gate_,
      weights.load_row_blocks(p + "q_proj.weight", {2 * shape.q_dim(), h},
                              "[2 * num_attention_heads * head_dim, hidden_size]", d, order));
  E4KV_ASSIGN_OR_RETURN(m.k_, weights.load(p + "k_proj.weight", {shape.kv_dim(), h},
                                           "[num_key_value_heads * head_dim, hidden_size]"));
  E4KV_ASSIGN_OR_RETURN(m.v_, weights.load(p + "v_proj.weight", {shape.kv_dim(), h},
                                           "[num_key_value_heads * head_dim, hidden_size]"));
  E4KV_ASSIGN_OR_RETURN(m.o_, weights.load(p + "o_proj.weight", {h, shape.q_dim()},
                                           "[hidden_size, num_attention_heads * head_dim]"));
  if (shape.bias) {
    E4KV_ASSIGN_OR_RETURN(
        m.q_gate_bias_, weights.load_row_blocks(p + "q_proj.bias", {2 * shape.q_dim()},
                                                "[2 * num_attention_heads * head_dim]", d, order));
    E4KV_ASSIGN_OR_RETURN(m.k_bias_, weights.load(p + "k_proj.bias", {shape.kv_dim()},
                                                  "[num_key_value_heads * head_dim]"));
    E4KV_ASSIGN_OR_RETURN(m.v_bias_, weights.load(p + "v_proj.bias", {shape.kv_dim()},
                                                  "[num_key_value_heads * head_dim]"));
    E4KV_ASSIGN_OR_RETURN(m.o_bias_, weights.load(p + "o_proj.bias", {h}, "[hidden_size]"));
  }
  E4KV_ASSIGN_OR_RETURN(m.q_norm_, weights.load(p + "q_norm.weight", {d}, "[head_dim]"));
  E4KV_ASSIGN_OR_RETURN(m.k_norm_, weights.load(p + "k_norm.weight", {d}, "[head_dim]"));
  const int64_t di = shape.index_dim;
  E4KV_ASSIGN_OR_RETURN(
      m.index_qk_,
      weights.load(p + "indexer.index_qk_proj.weight", {(shape.n_index_heads + 1) * di, h},
                   "[(indexer_n_heads + 1) * indexer_head_dim, hidden_size]"));
  E4KV_ASSIGN_OR_RETURN(m.index_q_norm_,
                        weights.load(p + "indexer.q_layernorm.weight", {di}, "[indexer_head_dim]"));
  E4KV_ASSIGN_OR_RETURN(BackendBuffer k_norm,
                        weights.load(p + "indexer.k_layernorm.weight", {di}, "[indexer_head_dim]"));
  E4KV_ASSIGN_OR_RETURN(m.index_k_norm16_, backend.allocate(size_t(di) * 2));
  E4KV_RETURN_IF_ERROR(backend.convert(k_norm.data(), backend.act_dtype(), m.index_k_norm16_.data(),
                                       DType::kF16, di));
  backend.synchronize();
  return m;
}

Status QsaAttentionMixer::forward(Backend& b, const StepContext& ctx, const QsaLayerCache& cache,
                                  const void* x, void* out, QsaAttentionWorkspace& ws,
                                  unsigned long long* non_finite, KvWriteStats* stats) const {
  const QsaAttentionShape& s = shape_;
  const int64_t n = ctx.n_rows();
  const DType act = b.act_dtype();
  const size_t act_size = b.act_size();
  const int64_t di = s.index_dim;

  // ---- indexer: queries, raw keys -> rings and compressed rows ----
  const std::byte* index_qk = index_qk_.as<std::byte>();
  E4KV_RETURN_IF_ERROR(
      b.linear(x, index_qk, nullptr, n, s.hidden, s.index_q_dim(), ws.iq.data(), act));
  E4KV_RETURN_IF_ERROR(b.linear(x, index_qk + size_t(s.index_q_dim() * s.hidden) * act_size,
                                nullptr, n, s.hidden, di, ws.ik.data(), act));
  E4KV_RETURN_IF_ERROR(b.rms_norm(ws.iq.data(), index_q_norm_.data(), n * s.n_index_heads, di,
                                  s.eps, RmsNormForm::kOnePlusWeight, ws.iq.data()));
  E4KV_RETURN_IF_ERROR(
      b.rope_neox(ws.iq.data(), ctx.cos(), ctx.sin(), n, s.n_index_heads, di, s.rotary_dim));
  E4KV_RETURN_IF_ERROR(
      b.convert(ws.iq.data(), act, ws.iq16.data(), DType::kF16, n * s.index_q_dim()));
  E4KV_RETURN_IF_ERROR(b.convert(ws.ik.data(), act, ws.ik16.data(), DType::kF16, n * di));
  IndexerKeyNormRope norm_rope;
  norm_rope.norm_weight = index_k_norm16_.as<uint16_t>();
  norm_rope.eps = s.eps;
  norm_rope.rotary_dim = s.rotary_dim;
  norm_rope.inv_freq = inv_freq_;
  E4KV_RETURN_IF_ERROR(b.qsa_indexer_write(cache.compressed, cache.rings, ws.ik16.as<uint16_t>(),
                                           ctx.sequences(), ctx.block_table(), norm_rope));

  // ---- q, gate, k, v -> the cache ----
  const std::byte* q_gate = q_gate_.as<std::byte>();
  const size_t gate_offset = size_t(s.q_dim() * s.hidden) * act_size;
  const std::byte* q_gate_bias = q_gate_bias_.as<std::byte>();
  const size_t gate_bias_offset = size_t(s.q_dim()) * act_size;
  E4KV_RETURN_IF_ERROR(b.linear(x, q_gate, q_gate_bias, n, s.hidden, s.q_dim(), ws.q.data(), act));
  E4KV_RETURN_IF_ERROR(b.linear(x, q_gate + gate_offset,
                                q_gate_bias == nullptr ? nullptr : q_gate_bias + gate_bias_offset,
                                n, s.hidden, s.q_dim(), ws.gate.data(), act));
  E4KV_RETURN_IF_ERROR(
      b.linear(x, k_.data(), k_bias_.data(), n, s.hidden, s.kv_dim(), ws.k.data(), act));
  E4KV_RETURN_IF_ERROR(
      b.linear(x, v_.data(), v_bias_.data(), n, s.hidden, s.kv_dim(), ws.v.data(), act));
  E4KV_RETURN_IF_ERROR(b.rms_norm(ws.q.data(), q_norm_.data(), n * s.n_heads, s.head_dim, s.eps,
                                  RmsNormForm::kOnePlusWeight, ws.q.data()));
  E4KV_RETURN_IF_ERROR(b.rms_norm(ws.k.data(), k_norm_.data(), n * s.n_kv_heads, s.head_dim, s.eps,
                                  RmsNormForm::kOnePlusWeight, ws.k.data()));
  E4KV_RETURN_IF_ERROR(
      b.rope_neox(ws.q.data(), ctx.cos(), ctx.sin(), n, s.n_heads, s.head_dim, s.rotary_dim));
  E4KV_RETURN_IF_ERROR(
      b.rope_neox(ws.k.data(), ctx.cos(), ctx.sin(), n, s.n_kv_heads, s.head_dim, s.rotary_dim));
  E4KV_RETURN_IF_ERROR(b.convert(ws.q.data(), act, ws.q16.data(), DType::kF16, n * s.q_dim()));
  E4KV_RETURN_IF_ERROR(
      b.convert(ws.gate.data(), act, ws.gate16.data(), DType::kF16, n * s.q_dim()));
  E4KV_RETURN_IF_ERROR(b.convert(ws.k.data(), act, ws.k16.data(), DType::kF16, n * s.kv_dim()));
  E4KV_RETURN_IF_ERROR(b.convert(ws.v.data(), act, ws.v16.data(), DType::kF16, n * s.kv_dim()));
  E4KV_RETURN_IF_ERROR(b.cache_write(cache.kv, ws.k16.as<uint16_t>(), ws.v16.as<uint16_t>(),
                                     ctx.slots(), n, non_finite, stats));

  // ---- selection and sparse attention ----
  QsaSelectionConfig select;
  select.budget = s.budget;
  select.n_index_heads = s.n_index_heads;
  QueryBatchView rows = ctx.rows();
  E4KV_RETURN_IF_ERROR(b.qsa_select(select, cache.compressed, ctx.block_table(), rows,
                                    ws.iq16.as<uint16_t>(), ws.sel_tokens.as<int32_t>(),
                                    ws.sel_counts.as<int32_t>()));
  rows.sel_tokens = ws.sel_tokens.as<int32_t>();
  rows.sel_counts = ws.sel_counts.as<int32_t>();
  rows.sel_width = s.sel_width();
  PagedAttentionParams params;
  params.cache = cache.kv;
  params.block_table = ctx.block_table();
  params.rows = rows;
  params.n_heads = s.n_heads;
  params.q = ws.q16.as<uint16_t>();
  params.gate = ws.gate16.as<uint16_t>();
  params.out = ws.attn.as<float>();
  E4KV_RETURN_IF_ERROR(b.paged_attention(params));
  const void* attn_in = ws.attn.data();
  if (act != DType::kF32) {
    E4KV_RETURN_IF_ERROR(
        b.convert(ws.attn.data(), DType::kF32, ws.attn_act.data(), act, n * s.q_dim()));
    attn_in = ws.attn_act.data();
  }
  return b.linear(attn_in, o_.data(), o_bias_.data(), n, s.q_dim(), s.hidden, out, act);
}

}  // namespace e4kv
