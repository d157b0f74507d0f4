#include "model/layers/qsa_attention.h"

#include "model/workspace.h"

namespace e4kv {

Result<QsaAttentionWorkspace> QsaAttentionWorkspace::create(Backend& backend,
                                                            const QsaAttentionShape& shape,
                                                            int64_t max_rows) {
  QsaAttentionWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  const size_t q = size_t(shape.q_dim());
  const size_t iq = size_t(shape.index_q_dim());
  const size_t ik = size_t(shape.index_dim);
  E4KV_ASSIGN_OR_RETURN(
      ws.heads, AttentionWorkspace::create(backend, shape.q_dim(), shape.kv_dim(), max_rows));
  E4KV_RETURN_IF_ERROR(
      allocate_buffers(backend, {{&ws.gate, n * q * act},
                                 {&ws.iq, n * iq * act},
                                 {&ws.ik, n * ik * act},
                                 {&ws.gate16, n * q * 2},
                                 {&ws.iq16, n * iq * 2},
                                 {&ws.ik16, n * ik * 2},
                                 {&ws.sel_tokens, n * size_t(shape.sel_width()) * 4},
                                 {&ws.sel_counts, n * 4}}));
  return ws;
}

Result<QsaAttentionMixer> QsaAttentionMixer::load(Backend& backend, WeightLoader& weights,
                                                  const std::string& p,
                                                  const QsaAttentionShape& shape,
                                                  const double* inv_freq, const TpShard& tp) {
  QsaAttentionMixer m;
  m.shape_ = shape;
  m.inv_freq_ = inv_freq;
  const int64_t h = shape.hidden;
  const int64_t d = shape.head_dim;
  // This rank's heads (all of them without tensor parallelism); the indexer is replicated.
  HeadShare heads{0, shape.n_heads, 0, shape.n_kv_heads};
  if (tp.split()) {
    E4KV_ASSIGN_OR_RETURN(heads, share_heads(shape.n_heads, shape.n_kv_heads, tp));
  }
  m.shape_.n_heads = heads.q_count;
  m.shape_.n_kv_heads = heads.kv_count;
  // q_proj rows are [q_0, gate_0, q_1, gate_1, ...] in blocks of head_dim: regroup this rank's
  // into [q_0 .. q_{n-1}, gate_0 .. gate_{n-1}] so that q and gate are two plain projections.
  std::vector<int64_t> order;
  for (int64_t head = heads.q_begin; head < heads.q_begin + heads.q_count; ++head) {
    order.push_back(2 * head);
  }
  for (int64_t head = heads.q_begin; head < heads.q_begin + heads.q_count; ++head) {
    order.push_back(2 * head + 1);
  }
  const LinearSlice kv_rows = tp.split() ? LinearSlice{LinearSlice::Dim::kRows,
                                                       heads.kv_begin * d, heads.kv_count * d}
                                         : LinearSlice{};
  const LinearSlice o_cols = tp.split() ? LinearSlice{LinearSlice::Dim::kColumns,
                                                      heads.q_begin * d, heads.q_count * d}
                                        : LinearSlice{};
  E4KV_ASSIGN_OR_RETURN(
      m.q_gate_,
      weights.load_linear_row_blocks(p + "q_proj", 2 * shape.q_dim(), h,
                                     "[2 * num_attention_heads * head_dim, hidden_size]", d, order));
  E4KV_ASSIGN_OR_RETURN(m.k_, weights.load_linear(p + "k_proj", shape.kv_dim(), h,
                                                  "[num_key_value_heads * head_dim, hidden_size]",
                                                  kv_rows));
  E4KV_ASSIGN_OR_RETURN(m.v_, weights.load_linear(p + "v_proj", shape.kv_dim(), h,
                                                  "[num_key_value_heads * head_dim, hidden_size]",
                                                  kv_rows));
  E4KV_ASSIGN_OR_RETURN(m.o_, weights.load_linear(p + "o_proj", h, shape.q_dim(),
                                                  "[hidden_size, num_attention_heads * head_dim]",
                                                  o_cols));
  if (shape.bias) {
    std::vector<RowRange> bias_blocks;
    for (int64_t block : order) bias_blocks.push_back({block * d, d});
    E4KV_ASSIGN_OR_RETURN(m.q_gate_bias_,
                          weights.load_row_ranges(p + "q_proj.bias", {2 * shape.q_dim()},
                                                  "[2 * num_attention_heads * head_dim]",
                                                  bias_blocks));
    E4KV_ASSIGN_OR_RETURN(m.k_bias_, weights.load_rows(p + "k_proj.bias", {shape.kv_dim()},
                                                       "[num_key_value_heads * head_dim]",
                                                       heads.kv_begin * d, heads.kv_count * d));
    E4KV_ASSIGN_OR_RETURN(m.v_bias_, weights.load_rows(p + "v_proj.bias", {shape.kv_dim()},
                                                       "[num_key_value_heads * head_dim]",
                                                       heads.kv_begin * d, heads.kv_count * d));
    if (tp.rank == 0) {
      E4KV_ASSIGN_OR_RETURN(m.o_bias_, weights.load(p + "o_proj.bias", {h}, "[hidden_size]"));
    } else {
      weights.mark_used(p + "o_proj.bias");  // rank 0 adds it to the sum
    }
  }
  E4KV_ASSIGN_OR_RETURN(m.q_norm_, weights.load(p + "q_norm.weight", {d}, "[head_dim]"));
  E4KV_ASSIGN_OR_RETURN(m.k_norm_, weights.load(p + "k_norm.weight", {d}, "[head_dim]"));
  const int64_t di = shape.index_dim;
  E4KV_ASSIGN_OR_RETURN(
      m.index_qk_,
      weights.load_linear(p + "indexer.index_qk_proj", (shape.n_index_heads + 1) * di, h,
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
  E4KV_RETURN_IF_ERROR(
      b.linear(x, index_qk_.rows(0, s.index_q_dim()), nullptr, n, ws.iq.data(), act));
  E4KV_RETURN_IF_ERROR(
      b.linear(x, index_qk_.rows(s.index_q_dim(), di), nullptr, n, ws.ik.data(), act));
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
  const std::byte* q_gate_bias = q_gate_bias_.as<std::byte>();
  const size_t gate_bias_offset = size_t(s.q_dim()) * act_size;
  AttentionWorkspace& h = ws.heads;
  E4KV_RETURN_IF_ERROR(
      b.linear(x, q_gate_.rows(0, s.q_dim()), q_gate_bias, n, h.q.data(), act));
  E4KV_RETURN_IF_ERROR(b.linear(x, q_gate_.rows(s.q_dim(), s.q_dim()),
                                q_gate_bias == nullptr ? nullptr : q_gate_bias + gate_bias_offset,
                                n, ws.gate.data(), act));
  E4KV_RETURN_IF_ERROR(
      b.linear(x, k_.view(), k_bias_.data(), n, h.k.data(), act));
  E4KV_RETURN_IF_ERROR(
      b.linear(x, v_.view(), v_bias_.data(), n, h.v.data(), act));
  E4KV_RETURN_IF_ERROR(
      b.convert(ws.gate.data(), act, ws.gate16.data(), DType::kF16, n * s.q_dim()));
  const AttentionHeads heads{s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim, s.eps};
  E4KV_RETURN_IF_ERROR(write_kv_rows(b, ctx, cache.kv, heads, q_norm_.data(), k_norm_.data(),
                                     RmsNormForm::kOnePlusWeight, h, non_finite, stats));

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
  params.q = h.q16.as<uint16_t>();
  params.gate = ws.gate16.as<uint16_t>();
  params.out = h.attn.as<float>();
  E4KV_RETURN_IF_ERROR(b.paged_attention(params));
  return project_attention_output(b, n, s.q_dim(), s.hidden, h, o_.view(), o_bias_.data(), out);
}

}  // namespace e4kv
