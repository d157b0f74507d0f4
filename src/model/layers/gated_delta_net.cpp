#include "model/layers/gated_delta_net.h"

#include <algorithm>

#include "model/workspace.h"

namespace e4kv {

Result<DeltaNetWorkspace> DeltaNetWorkspace::create(Backend& backend, const DeltaNetShape& shape,
                                                    int64_t max_rows) {
  DeltaNetWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  const size_t proj_cols = size_t(shape.conv_dim() + shape.v_dim() + 2 * shape.n_v_heads);
  E4KV_RETURN_IF_ERROR(allocate_buffers(backend, {{&ws.proj, n * proj_cols * act},
                                                  {&ws.y, n * size_t(shape.conv_dim()) * act},
                                                  {&ws.o, n * size_t(shape.v_dim()) * act},
                                                  {&ws.g, n * size_t(shape.n_v_heads) * 4},
                                                  {&ws.beta, n * size_t(shape.n_v_heads) * 4}}));
  return ws;
}

Result<DeltaNetState> DeltaNetState::create(Backend& backend, const DeltaNetShape& shape,
                                            int64_t n_slots) {
  DeltaNetState state;
  E4KV_ASSIGN_OR_RETURN(state.conv,
                        backend.allocate(std::max<size_t>(
                            64, size_t(n_slots * shape.conv_state_elems()) * backend.act_size())));
  E4KV_ASSIGN_OR_RETURN(
      state.recurrent,
      backend.allocate(std::max<size_t>(64, size_t(n_slots * shape.recurrent_state_elems()) * 4)));
  return state;
}

void DeltaNetState::reset(Backend& backend, const DeltaNetShape& shape, int32_t slot) {
  const size_t conv_bytes = size_t(shape.conv_state_elems()) * backend.act_size();
  const size_t rec_bytes = size_t(shape.recurrent_state_elems()) * 4;
  backend.fill_zero(conv.as<std::byte>() + size_t(slot) * conv_bytes, conv_bytes);
  backend.fill_zero(recurrent.as<std::byte>() + size_t(slot) * rec_bytes, rec_bytes);
}

Status DeltaNetState::copy(Backend& backend, const DeltaNetShape& shape, int32_t src, int32_t dst,
                           int64_t n_slots) {
  const BlockCopy pair[1] = {{src, dst}};
  const size_t conv_bytes = size_t(shape.conv_state_elems()) * backend.act_size();
  const size_t rec_bytes = size_t(shape.recurrent_state_elems()) * 4;
  E4KV_RETURN_IF_ERROR(backend.copy_blocks(conv.data(), n_slots, conv_bytes, pair));
  return backend.copy_blocks(recurrent.data(), n_slots, rec_bytes, pair);
}

Result<DeltaNetShape> DeltaNetShape::shard(const TpShard& tp, int64_t* k_begin,
                                           int64_t* v_begin) const {
  DeltaNetShape local = *this;
  *k_begin = 0;
  *v_begin = 0;
  if (!tp.split()) return local;
  if (n_k_heads % tp.size != 0) {
    return Status::error(cat("tensor parallel size ", tp.size, " does not split ", n_k_heads,
                             " linear-attention key heads evenly; choose a size that divides "
                             "them"));
  }
  // Value head h reads key head h / (n_v / n_k): contiguous shares of both stay paired.
  local.n_k_heads = n_k_heads / tp.size;
  local.n_v_heads = n_v_heads / tp.size;
  *k_begin = tp.begin(n_k_heads);
  *v_begin = tp.begin(n_v_heads);
  return local;
}

Result<DeltaNetMixer> DeltaNetMixer::load(WeightLoader& weights, const std::string& p,
                                          const DeltaNetShape& shape, const TpShard& tp) {
  DeltaNetMixer m;
  int64_t kb = 0, vb = 0;
  E4KV_ASSIGN_OR_RETURN(m.shape_, shape.shard(tp, &kb, &vb));
  const DeltaNetShape& local = m.shape_;
  const int64_t h = shape.hidden;
  const int64_t nv = shape.n_v_heads;
  const int64_t dk = shape.head_k_dim;
  const int64_t dv = shape.head_v_dim;
  // The conv channels (and in_proj_qkv's rows) are q | k | v: this rank's part of each.
  const std::vector<RowRange> channels = {{kb * dk, local.k_dim()},
                                          {shape.k_dim() + kb * dk, local.k_dim()},
                                          {2 * shape.k_dim() + vb * dv, local.v_dim()}};
  const std::vector<RowRange> v_rows =
      tp.split() ? std::vector<RowRange>{{vb * dv, local.v_dim()}} : std::vector<RowRange>{};
  const std::vector<RowRange> head_rows =
      tp.split() ? std::vector<RowRange>{{vb, local.n_v_heads}} : std::vector<RowRange>{};
  const LinearSlice out_cols = tp.split() ? LinearSlice{LinearSlice::Dim::kColumns, vb * dv,
                                                        local.v_dim()}
                                          : LinearSlice{};
  E4KV_ASSIGN_OR_RETURN(
      m.in_, FusedProjection::load(
                 weights, h,
                 {{p + "in_proj_qkv", shape.conv_dim(),
                   "[2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * "
                   "linear_value_head_dim, hidden_size]",
                   channels},
                  {p + "in_proj_z", shape.v_dim(),
                   "[linear_num_value_heads * linear_value_head_dim, hidden_size]", v_rows},
                  {p + "in_proj_b", nv, "[linear_num_value_heads, hidden_size]", head_rows},
                  {p + "in_proj_a", nv, "[linear_num_value_heads, hidden_size]", head_rows}}));
  E4KV_ASSIGN_OR_RETURN(m.conv_,
                        weights.load_row_ranges(p + "conv1d.weight",
                                                {shape.conv_dim(), 1, shape.conv_kernel},
                                                "[conv channels, 1, linear_conv_kernel_dim]",
                                                channels));
  E4KV_ASSIGN_OR_RETURN(m.dt_bias_, weights.load_rows(p + "dt_bias", {nv},
                                                      "[linear_num_value_heads]", vb,
                                                      local.n_v_heads));
  E4KV_ASSIGN_OR_RETURN(m.a_log_, weights.load_rows(p + "A_log", {nv}, "[linear_num_value_heads]",
                                                    vb, local.n_v_heads));
  E4KV_ASSIGN_OR_RETURN(
      m.norm_, weights.load(p + "norm.weight", {shape.head_v_dim}, "[linear_value_head_dim]"));
  E4KV_ASSIGN_OR_RETURN(m.out_, weights.load_linear(p + "out_proj", h, shape.v_dim(),
                                                    "[hidden_size, linear_num_value_heads * "
                                                    "linear_value_head_dim]",
                                                    out_cols));
  return m;
}

Status DeltaNetMixer::forward(Backend& b, int64_t n, const SequenceRowsView& seqs, const void* x,
                              void* out, DeltaNetState& state, DeltaNetWorkspace& ws) const {
  const DeltaNetShape& s = shape_;
  const DType act = b.act_dtype();
  const int64_t c = s.conv_dim();
  const size_t elt = b.act_size();
  void* proj = ws.proj.data();
  E4KV_RETURN_IF_ERROR(in_.forward(b, x, n, proj, act));
  const void* u = in_.part(proj, n, 0, elt);
  const void* z = in_.part(proj, n, 1, elt);
  const void* beta_in = in_.part(proj, n, 2, elt);
  const void* decay_in = in_.part(proj, n, 3, elt);
  E4KV_RETURN_IF_ERROR(b.conv1d_silu(u, c, conv_.data(), s.conv_kernel, 1,
                                     state.conv.data(), seqs, ws.y.data()));
  E4KV_ASSIGN_OR_RETURN(
      const bool fused,
      b.gated_delta_rule_raw_gates(ws.y.data(), decay_in, beta_in, a_log_.data(), dt_bias_.data(),
                                   s.n_k_heads, s.n_v_heads, s.head_k_dim, s.head_v_dim,
                                   state.recurrent.as<float>(), seqs, ws.o.data()));
  if (!fused) {
    E4KV_RETURN_IF_ERROR(b.gated_delta_gates(decay_in, beta_in, a_log_.data(), dt_bias_.data(), n,
                                             s.n_v_heads, ws.g.as<float>(),
                                             ws.beta.as<float>()));
    E4KV_RETURN_IF_ERROR(b.gated_delta_rule(ws.y.data(), ws.g.as<float>(), ws.beta.as<float>(),
                                            s.n_k_heads, s.n_v_heads, s.head_k_dim, s.head_v_dim,
                                            state.recurrent.as<float>(), seqs, ws.o.data()));
  }
  E4KV_RETURN_IF_ERROR(b.gated_rms_norm(ws.o.data(), z, norm_.data(), n * s.n_v_heads,
                                        s.head_v_dim, s.eps, s.sigmoid_gate, ws.o.data()));
  return b.linear(ws.o.data(), out_.view(), nullptr, n, out, act);
}

}  // namespace e4kv
