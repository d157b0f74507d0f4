#include "model/layers/qsa_attention.h"

#include "model/workspace.h"

namespace e4kv {

Result<QsaAttentionWorkspace> QsaAttentionWorkspace::create(Backend& backend,
                                                            const QsaAttentionShape& shape,
                                                            int64_t max_rows) {
  QsaAttentionWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t q = size_t(shape.q_dim());
  const size_t iq = size_t(shape.index_q_dim());
  const size_t ik = size_t(shape.index_dim);
  const int64_t proj_cols =
      2 * shape.q_dim() + 2 * shape.kv_dim() + shape.index_q_dim() + shape.index_dim;
  E4KV_ASSIGN_OR_RETURN(ws.heads, AttentionWorkspace::create(backend, shape.q_dim(),
                                                             shape.kv_dim(), proj_cols, max_rows));
  E4KV_RETURN_IF_ERROR(
      allocate_buffers(backend, {{&ws.sel_tokens, n * size_t(shape.sel_width()) * 4},
                                 {&ws.sel_counts, n * 4}}));
  if (backend.act_dtype() != DType::kF16) {
    E4KV_RETURN_IF_ERROR(allocate_buffers(
        backend, {{&ws.gate16, n * q * 2}, {&ws.iq16, n * iq * 2}, {&ws.ik16, n * ik * 2}}));
  }
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
  // q_proj rows are [q_0, gate_0, q_1, gate_1, ...] in blocks of head_dim: this rank's q blocks
  // make the q part, its gate blocks the gate part.
  std::vector<RowRange> q_blocks, gate_blocks;
  for (int64_t head = heads.q_begin; head < heads.q_begin + heads.q_count; ++head) {
    q_blocks.push_back({2 * head * d, d});
    gate_blocks.push_back({(2 * head + 1) * d, d});
  }
  const std::vector<RowRange> kv_rows =
      tp.split() ? std::vector<RowRange>{{heads.kv_begin * d, heads.kv_count * d}}
                 : std::vector<RowRange>{};
  const LinearSlice o_cols = tp.split() ? LinearSlice{LinearSlice::Dim::kColumns,
                                                      heads.q_begin * d, heads.q_count * d}
                                        : LinearSlice{};
  const int64_t di = shape.index_dim;
  const int64_t iq = shape.index_q_dim();
  const std::string q_meaning = "[2 * num_attention_heads * head_dim, hidden_size]";
  const std::string kv_meaning = "[num_key_value_heads * head_dim, hidden_size]";
  const std::string index_meaning = "[(indexer_n_heads + 1) * indexer_head_dim, hidden_size]";
  const bool bias = shape.bias;
  E4KV_ASSIGN_OR_RETURN(
      m.proj_, FusedProjection::load(
                   weights, h,
                   {{p + "q_proj", 2 * shape.q_dim(), q_meaning, q_blocks, bias},
                    {p + "k_proj", shape.kv_dim(), kv_meaning, kv_rows, bias},
                    {p + "v_proj", shape.kv_dim(), kv_meaning, kv_rows, bias},
                    {p + "q_proj", 2 * shape.q_dim(), q_meaning, gate_blocks, bias},
                    {p + "indexer.index_qk_proj", iq + di, index_meaning, {{0, iq}}, false},
                    {p + "indexer.index_qk_proj", iq + di, index_meaning, {{iq, di}}, false}}));
  E4KV_ASSIGN_OR_RETURN(m.o_, weights.load_linear(p + "o_proj", h, shape.q_dim(),
                                                  "[hidden_size, num_attention_heads * head_dim]",
                                                  o_cols));
  if (shape.bias) {
    if (tp.rank == 0) {
      E4KV_ASSIGN_OR_RETURN(m.o_bias_, weights.load(p + "o_proj.bias", {h}, "[hidden_size]"));
    } else {
      weights.mark_used(p + "o_proj.bias");  // rank 0 adds it to the sum
    }
  }
  E4KV_ASSIGN_OR_RETURN(m.q_norm_, weights.load(p + "q_norm.weight", {d}, "[head_dim]"));
  E4KV_ASSIGN_OR_RETURN(m.k_norm_, weights.load(p + "k_norm.weight", {d}, "[head_dim]"));
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

  // ---- every projection: q, k, v, gate, the indexer's queries and raw key ----
  AttentionWorkspace& h = ws.heads;
  void* proj = h.proj.data();
  E4KV_RETURN_IF_ERROR(proj_.forward(b, x, n, proj, act));
  const bool f16 = act == DType::kF16;
  void* gate = proj_.part(proj, n, 3, act_size);
  void* iq = proj_.part(proj, n, 4, act_size);
  void* ik = proj_.part(proj, n, 5, act_size);
  uint16_t* gate16 = f16 ? static_cast<uint16_t*>(gate) : ws.gate16.as<uint16_t>();
  uint16_t* iq16 = f16 ? static_cast<uint16_t*>(iq) : ws.iq16.as<uint16_t>();
  uint16_t* ik16 = f16 ? static_cast<uint16_t*>(ik) : ws.ik16.as<uint16_t>();

  // ---- indexer: queries, raw keys -> rings and compressed rows ----
  E4KV_RETURN_IF_ERROR(b.rms_norm(iq, index_q_norm_.data(), n * s.n_index_heads, di, s.eps,
                                  RmsNormForm::kOnePlusWeight, iq));
  E4KV_RETURN_IF_ERROR(b.rope_neox(iq, ctx.cos(), ctx.sin(), n, s.n_index_heads, di, s.rotary_dim));
  if (!f16) {
    E4KV_RETURN_IF_ERROR(b.convert(iq, act, iq16, DType::kF16, n * s.index_q_dim()));
    E4KV_RETURN_IF_ERROR(b.convert(ik, act, ik16, DType::kF16, n * di));
  }
  IndexerKeyNormRope norm_rope;
  norm_rope.norm_weight = index_k_norm16_.as<uint16_t>();
  norm_rope.eps = s.eps;
  norm_rope.rotary_dim = s.rotary_dim;
  norm_rope.inv_freq = inv_freq_;
  E4KV_RETURN_IF_ERROR(b.qsa_indexer_write(cache.compressed, cache.rings, ik16, ctx.sequences(),
                                           ctx.block_table(), norm_rope));

  // ---- q, k, v -> the cache ----
  if (!f16) E4KV_RETURN_IF_ERROR(b.convert(gate, act, gate16, DType::kF16, n * s.q_dim()));
  const AttentionRows qkv =
      AttentionRows::in(h, act, proj_.part(proj, n, 0, act_size), proj_.part(proj, n, 1, act_size),
                        proj_.part(proj, n, 2, act_size));
  const AttentionHeads heads{s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim, s.eps};
  E4KV_RETURN_IF_ERROR(write_kv_rows(b, ctx, cache.kv, heads, q_norm_.data(), k_norm_.data(),
                                     RmsNormForm::kOnePlusWeight, qkv, non_finite, stats));

  // ---- selection and sparse attention ----
  QsaSelectionConfig select;
  select.budget = s.budget;
  select.n_index_heads = s.n_index_heads;
  QueryBatchView rows = ctx.rows();
  E4KV_RETURN_IF_ERROR(b.qsa_select(select, cache.compressed, ctx.block_table(), rows,
                                    iq16, ws.sel_tokens.as<int32_t>(),
                                    ws.sel_counts.as<int32_t>()));
  rows.sel_tokens = ws.sel_tokens.as<int32_t>();
  rows.sel_counts = ws.sel_counts.as<int32_t>();
  rows.sel_width = s.sel_width();
  PagedAttentionParams params;
  params.cache = cache.kv;
  params.block_table = ctx.block_table();
  params.rows = rows;
  params.n_heads = s.n_heads;
  params.q = qkv.q16;
  params.gate = gate16;
  params.out = h.attn.as<float>();
  E4KV_RETURN_IF_ERROR(b.paged_attention(params));
  return project_attention_output(b, n, s.q_dim(), s.hidden, h, o_.view(), o_bias_.data(), out);
}

}  // namespace e4kv
