#include "model/layers/attention.h"

#include "model/workspace.h"

namespace e4kv {

Result<AttentionWorkspace> AttentionWorkspace::create(Backend& backend, int64_t q_dim,
                                                      int64_t kv_dim, int64_t max_rows) {
  AttentionWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  const size_t q = size_t(q_dim);
  const size_t kv = size_t(kv_dim);
  E4KV_RETURN_IF_ERROR(allocate_buffers(backend, {{&ws.q, n * q * act},
                                                  {&ws.k, n * kv * act},
                                                  {&ws.v, n * kv * act},
                                                  {&ws.q16, n * q * 2},
                                                  {&ws.k16, n * kv * 2},
                                                  {&ws.v16, n * kv * 2},
                                                  {&ws.attn, n * q * 4}}));
  if (backend.act_dtype() != DType::kF32) {
    E4KV_RETURN_IF_ERROR(allocate_buffers(backend, {{&ws.attn_act, n * q * act}}));
  }
  return ws;
}

Status write_kv_rows(Backend& b, const StepContext& ctx, const KvCacheView& cache,
                     const AttentionHeads& h, const void* q_norm, const void* k_norm,
                     RmsNormForm form, AttentionWorkspace& ws, unsigned long long* non_finite,
                     KvWriteStats* stats) {
  const int64_t n = ctx.n_rows();
  const int64_t q_dim = h.n_heads * h.head_dim;
  const int64_t kv_dim = h.n_kv_heads * h.head_dim;
  const DType act = b.act_dtype();
  if (q_norm != nullptr) {
    E4KV_RETURN_IF_ERROR(
        b.rms_norm(ws.q.data(), q_norm, n * h.n_heads, h.head_dim, h.eps, form, ws.q.data()));
    E4KV_RETURN_IF_ERROR(
        b.rms_norm(ws.k.data(), k_norm, n * h.n_kv_heads, h.head_dim, h.eps, form, ws.k.data()));
  }
  E4KV_RETURN_IF_ERROR(
      b.rope_neox(ws.q.data(), ctx.cos(), ctx.sin(), n, h.n_heads, h.head_dim, h.rotary_dim));
  E4KV_RETURN_IF_ERROR(
      b.rope_neox(ws.k.data(), ctx.cos(), ctx.sin(), n, h.n_kv_heads, h.head_dim, h.rotary_dim));
  E4KV_RETURN_IF_ERROR(b.convert(ws.q.data(), act, ws.q16.data(), DType::kF16, n * q_dim));
  E4KV_RETURN_IF_ERROR(b.convert(ws.k.data(), act, ws.k16.data(), DType::kF16, n * kv_dim));
  E4KV_RETURN_IF_ERROR(b.convert(ws.v.data(), act, ws.v16.data(), DType::kF16, n * kv_dim));
  return b.cache_write(cache, ws.k16.as<uint16_t>(), ws.v16.as<uint16_t>(), ctx.slots(), n,
                       non_finite, stats);
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
  const LinearSlice q_rows{LinearSlice::Dim::kRows, share.q_head_begin * d, local.q_dim()};
  const LinearSlice kv_rows{LinearSlice::Dim::kRows, share.kv_head_begin * d, local.kv_dim()};
  const LinearSlice o_cols{LinearSlice::Dim::kColumns, share.q_head_begin * d, local.q_dim()};
  const bool split = tp.split();
  E4KV_ASSIGN_OR_RETURN(m.q_, weights.load_linear(p + "q_proj", q_dim, hidden,
                                                  "[num_attention_heads * head_dim, hidden_size]",
                                                  split ? q_rows : LinearSlice{}));
  E4KV_ASSIGN_OR_RETURN(m.k_, weights.load_linear(p + "k_proj", kv_dim, hidden,
                                                  "[num_key_value_heads * head_dim, hidden_size]",
                                                  split ? kv_rows : LinearSlice{}));
  E4KV_ASSIGN_OR_RETURN(m.v_, weights.load_linear(p + "v_proj", kv_dim, hidden,
                                                  "[num_key_value_heads * head_dim, hidden_size]",
                                                  split ? kv_rows : LinearSlice{}));
  E4KV_ASSIGN_OR_RETURN(m.o_, weights.load_linear(p + "o_proj", hidden, q_dim,
                                                  "[hidden_size, num_attention_heads * head_dim]",
                                                  split ? o_cols : LinearSlice{}));
  if (shape.qkv_bias) {
    E4KV_ASSIGN_OR_RETURN(m.q_bias_, weights.load_rows(p + "q_proj.bias", {q_dim},
                                                       "[num_attention_heads * head_dim]",
                                                       q_rows.begin, q_rows.count));
    E4KV_ASSIGN_OR_RETURN(m.k_bias_, weights.load_rows(p + "k_proj.bias", {kv_dim},
                                                       "[num_key_value_heads * head_dim]",
                                                       kv_rows.begin, kv_rows.count));
    E4KV_ASSIGN_OR_RETURN(m.v_bias_, weights.load_rows(p + "v_proj.bias", {kv_dim},
                                                       "[num_key_value_heads * head_dim]",
                                                       kv_rows.begin, kv_rows.count));
  }
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
  E4KV_RETURN_IF_ERROR(
      b.linear(x, q_.view(), q_bias_.data(), n, ws.q.data(), act));
  E4KV_RETURN_IF_ERROR(
      b.linear(x, k_.view(), k_bias_.data(), n, ws.k.data(), act));
  E4KV_RETURN_IF_ERROR(
      b.linear(x, v_.view(), v_bias_.data(), n, ws.v.data(), act));
  const AttentionHeads heads{s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim, s.eps};
  // q_norm_ and k_norm_ are empty (nullptr) without qk_norm.
  E4KV_RETURN_IF_ERROR(write_kv_rows(b, ctx, cache, heads, q_norm_.data(), k_norm_.data(),
                                     s.qk_norm_form, ws, non_finite, stats));

  PagedAttentionParams params;
  params.cache = cache;
  params.block_table = ctx.block_table();
  params.rows = ctx.rows();
  params.n_heads = s.n_heads;
  params.q = ws.q16.as<uint16_t>();
  params.out = ws.attn.as<float>();
  E4KV_RETURN_IF_ERROR(b.paged_attention(params));
  return project_attention_output(b, n, q_dim, s.hidden, ws, o_.view(), o_bias_.data(), out);
}

}  // namespace e4kv
