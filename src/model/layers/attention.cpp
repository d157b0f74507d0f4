#include "model/layers/attention.h"

#include "model/workspace.h"

namespace e4kv {

Result<AttentionWorkspace> AttentionWorkspace::create(Backend& backend, int64_t q_dim,
                                                      int64_t kv_dim, int64_t proj_cols,
                                                      int64_t max_rows) {
  AttentionWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  const size_t q = size_t(q_dim);
  const size_t kv = size_t(kv_dim);
  E4KV_RETURN_IF_ERROR(allocate_buffers(
      backend, {{&ws.proj, n * size_t(proj_cols) * act}, {&ws.attn, n * q * 4}}));
  if (backend.act_dtype() != DType::kF16) {
    E4KV_RETURN_IF_ERROR(allocate_buffers(
        backend, {{&ws.q16, n * q * 2}, {&ws.k16, n * kv * 2}, {&ws.v16, n * kv * 2}}));
  }
  if (backend.act_dtype() != DType::kF32) {
    E4KV_RETURN_IF_ERROR(allocate_buffers(backend, {{&ws.attn_act, n * q * act}}));
  }
  return ws;
}

AttentionRows AttentionRows::in(AttentionWorkspace& ws, DType act, void* q, void* k, void* v) {
  AttentionRows r{q, k, v};
  const bool f16 = act == DType::kF16;
  r.q16 = f16 ? static_cast<uint16_t*>(q) : ws.q16.as<uint16_t>();
  r.k16 = f16 ? static_cast<uint16_t*>(k) : ws.k16.as<uint16_t>();
  r.v16 = f16 ? static_cast<uint16_t*>(v) : ws.v16.as<uint16_t>();
  return r;
}

Status write_kv_rows(Backend& b, const StepContext& ctx, const KvCacheView& cache,
                     const AttentionHeads& h, const void* q_norm, const void* k_norm,
                     RmsNormForm form, const AttentionRows& rows, unsigned long long* non_finite,
                     KvWriteStats* stats) {
  const int64_t n = ctx.n_rows();
  const int64_t q_dim = h.n_heads * h.head_dim;
  const int64_t kv_dim = h.n_kv_heads * h.head_dim;
  const DType act = b.act_dtype();
  if (q_norm != nullptr) {
    E4KV_RETURN_IF_ERROR(
        b.rms_norm(rows.q, q_norm, n * h.n_heads, h.head_dim, h.eps, form, rows.q));
    E4KV_RETURN_IF_ERROR(
        b.rms_norm(rows.k, k_norm, n * h.n_kv_heads, h.head_dim, h.eps, form, rows.k));
  }
  const bool k_follows_q =
      static_cast<char*>(rows.k) == static_cast<char*>(rows.q) + size_t(q_dim) * b.act_size();
  if (n == 1 && k_follows_q) {  // one row: q and k heads are one run of heads at one position
    E4KV_RETURN_IF_ERROR(b.rope_neox(rows.q, ctx.cos(), ctx.sin(), n, h.n_heads + h.n_kv_heads,
                                     h.head_dim, h.rotary_dim));
  } else {
    E4KV_RETURN_IF_ERROR(
        b.rope_neox(rows.q, ctx.cos(), ctx.sin(), n, h.n_heads, h.head_dim, h.rotary_dim));
    E4KV_RETURN_IF_ERROR(
        b.rope_neox(rows.k, ctx.cos(), ctx.sin(), n, h.n_kv_heads, h.head_dim, h.rotary_dim));
  }
  if (static_cast<void*>(rows.q16) != rows.q) {
    E4KV_RETURN_IF_ERROR(b.convert(rows.q, act, rows.q16, DType::kF16, n * q_dim));
    E4KV_RETURN_IF_ERROR(b.convert(rows.k, act, rows.k16, DType::kF16, n * kv_dim));
    E4KV_RETURN_IF_ERROR(b.convert(rows.v, act, rows.v16, DType::kF16, n * kv_dim));
  }
  return b.cache_write(cache, rows.k16, rows.v16, ctx.slots(), n, non_finite, stats);
}

Status project_attention_output(Backend& b, int64_t n, int64_t q_dim, int64_t hidden,
                                AttentionWorkspace& ws, const LinearView& o, const void* o_bias,
                                void* out) {
  const DType act = b.act_dtype();
  const void* attn_in = ws.attn.data();
  if (act != DType::kF32) {
    E4KV_RETURN_IF_ERROR(
        b.convert(ws.attn.data(), DType::kF32, ws.attn_act.data(), act, n * q_dim));
    attn_in = ws.attn_act.data();
  }
  E4KV_ASSERT(o.in == q_dim && o.out == hidden, "project_attention_output: o has another shape");
  return b.linear(attn_in, o, o_bias, n, out, act);
}

Result<AttentionShape::Share> AttentionShape::shard(const TpShard& tp,
                                                    AttentionShape& local) const {
  local = *this;
  Share share;
  if (!tp.split()) return share;
  E4KV_ASSIGN_OR_RETURN(const HeadShare heads, share_heads(n_heads, n_kv_heads, tp));
  local.n_heads = heads.q_count;
  local.n_kv_heads = heads.kv_count;
  share.q_head_begin = heads.q_begin;
  share.kv_head_begin = heads.kv_begin;
  local.o_bias = o_bias && tp.rank == 0;
  return share;
}

Result<AttentionMixer> AttentionMixer::load(WeightLoader& weights, const std::string& p,
                                            const AttentionShape& shape, const TpShard& tp) {
  AttentionMixer m;
  E4KV_ASSIGN_OR_RETURN(const AttentionShape::Share share, shape.shard(tp, m.shape_));
  const AttentionShape& local = m.shape_;
  const int64_t hidden = shape.hidden;
  const int64_t q_dim = shape.q_dim();
  const int64_t kv_dim = shape.kv_dim();
  const int64_t d = shape.head_dim;
  // This rank's rows of q and of k/v, and its columns of o.
  const LinearSlice o_cols{LinearSlice::Dim::kColumns, share.q_head_begin * d, local.q_dim()};
  const bool split = tp.split();
  const std::vector<RowRange> q_rows =
      split ? std::vector<RowRange>{{share.q_head_begin * d, local.q_dim()}}
            : std::vector<RowRange>{};
  const std::vector<RowRange> kv_rows =
      split ? std::vector<RowRange>{{share.kv_head_begin * d, local.kv_dim()}}
            : std::vector<RowRange>{};
  const bool bias = shape.qkv_bias;
  E4KV_ASSIGN_OR_RETURN(
      m.qkv_,
      FusedProjection::load(
          weights, hidden,
          {{p + "q_proj", q_dim, "[num_attention_heads * head_dim, hidden_size]", q_rows, bias},
           {p + "k_proj", kv_dim, "[num_key_value_heads * head_dim, hidden_size]", kv_rows, bias},
           {p + "v_proj", kv_dim, "[num_key_value_heads * head_dim, hidden_size]", kv_rows,
            bias}}));
  E4KV_ASSIGN_OR_RETURN(m.o_, weights.load_linear(p + "o_proj", hidden, q_dim,
                                                  "[hidden_size, num_attention_heads * head_dim]",
                                                  split ? o_cols : LinearSlice{}));
  if (local.o_bias) {
    E4KV_ASSIGN_OR_RETURN(m.o_bias_, weights.load(p + "o_proj.bias", {hidden}, "[hidden_size]"));
  } else if (shape.o_bias) {
    weights.mark_used(p + "o_proj.bias");  // rank 0 adds it to the sum
  }
  if (shape.qk_norm) {
    E4KV_ASSIGN_OR_RETURN(m.q_norm_,
                          weights.load(p + "q_norm.weight", {shape.head_dim}, "[head_dim]"));
    E4KV_ASSIGN_OR_RETURN(m.k_norm_,
                          weights.load(p + "k_norm.weight", {shape.head_dim}, "[head_dim]"));
  }
  return m;
}

Status AttentionMixer::forward(Backend& b, const StepContext& ctx, const KvCacheView& cache,
                               const void* x, void* out, AttentionWorkspace& ws,
                               unsigned long long* non_finite, KvWriteStats* stats) const {
  const AttentionShape& s = shape_;
  const int64_t n = ctx.n_rows();
  const int64_t q_dim = s.q_dim();
  const DType act = b.act_dtype();
  E4KV_RETURN_IF_ERROR(qkv_.forward(b, x, n, ws.proj.data(), act));
  const size_t elt = b.act_size();
  const AttentionRows rows =
      AttentionRows::in(ws, act, qkv_.part(ws.proj.data(), n, 0, elt),
                        qkv_.part(ws.proj.data(), n, 1, elt), qkv_.part(ws.proj.data(), n, 2, elt));
  const AttentionHeads heads{s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim, s.eps};
  // q_norm_ and k_norm_ are empty (nullptr) without qk_norm.
  E4KV_RETURN_IF_ERROR(write_kv_rows(b, ctx, cache, heads, q_norm_.data(), k_norm_.data(),
                                     s.qk_norm_form, rows, non_finite, stats));

  PagedAttentionParams params;
  params.cache = cache;
  params.block_table = ctx.block_table();
  params.rows = ctx.rows();
  params.n_heads = s.n_heads;
  params.q = rows.q16;
  params.out = ws.attn.as<float>();
  E4KV_RETURN_IF_ERROR(b.paged_attention(params));
  return project_attention_output(b, n, q_dim, s.hidden, ws, o_.view(), o_bias_.data(), out);
}

}  // namespace e4kv
