#include "backend/backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/check.h"

namespace e4kv {
namespace {

Status no_hybrid_op(const Backend& backend, const char* op) {
  return Status::error(cat(backend.name(), " backend: ", op,
                           " (an op of the hybrid Qwen4Exp layers) is not implemented on this "
                           "backend; run the model with --device cpu"));
}

}  // namespace

Status validate_block_copies(int64_t n_blocks, std::span<const BlockCopy> copies) {
  for (const BlockCopy& c : copies) {
    if (c.src < 0 || c.src >= n_blocks || c.dst < 0 || c.dst >= n_blocks || c.src == c.dst) {
      return Status::error(cat("copy_blocks: block copy ", c.src, " -> ", c.dst,
                               " is outside the pool of ", n_blocks, " blocks or onto itself"));
    }
  }
  return ok_status();
}

void set_sequence_launch_facts(SequenceRowsView& view, const int32_t* host_row_begin,
                               const int64_t* host_start_pos) {
  view.first_row = view.n_seqs > 0 ? host_row_begin[0] : 0;
  view.end_row = view.n_seqs > 0 ? host_row_begin[view.n_seqs] : 0;
  view.max_seq_rows = 0;
  view.max_end_pos = 0;
  for (int64_t s = 0; s < view.n_seqs; ++s) {
    const int64_t rows = host_row_begin[s + 1] - host_row_begin[s];
    view.max_seq_rows = std::max(view.max_seq_rows, rows);
    view.max_end_pos = std::max(view.max_end_pos, host_start_pos[s] + rows);
  }
}

// Plain host memory (a CPU backend's staging needs nothing more); 64-byte aligned as allocate().
Result<HostBuffer> Backend::allocate_host(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void* data = std::aligned_alloc(64, rounded);
  if (data == nullptr) {
    return Status::error(cat(name(), ": cannot allocate ", bytes, " bytes of host memory"));
  }
  std::memset(data, 0, rounded);
  return HostBuffer(this, data, bytes);
}

void Backend::release_host(void* data) {
  std::free(data);
}

Status Backend::add_rms_norm(void* x, const void* y, const void* weight, int64_t n_rows,
                             int64_t dim, float eps, RmsNormForm form, void* out) {
  E4KV_RETURN_IF_ERROR(add(x, y, n_rows * dim));
  return rms_norm(x, weight, n_rows, dim, eps, form, out);
}

Status Backend::rms_norm_grouped(const void*, const void*, int64_t, int64_t, int64_t, float,
                                 RmsNormForm, void*) {
  return no_hybrid_op(*this, "rms_norm_grouped");
}
Status Backend::silu_scaled(const void*, int64_t, float, void*) {
  return no_hybrid_op(*this, "silu_scaled");
}
Status Backend::hc_mix(const void*, const void*, int64_t, int64_t, int64_t, void*) {
  return no_hybrid_op(*this, "hc_mix");
}
Status Backend::hc_inject(void*, const void*, const void*, int64_t, int64_t, int64_t) {
  return no_hybrid_op(*this, "hc_inject");
}
Status Backend::hc_expand(const void*, int64_t, int64_t, int64_t, void*) {
  return no_hybrid_op(*this, "hc_expand");
}
Status Backend::conv1d_silu(const void*, int64_t, const void*, int64_t, int64_t, void*,
                            const SequenceRowsView&, void*) {
  return no_hybrid_op(*this, "conv1d_silu");
}
Status Backend::gated_delta_gates(const void*, const void*, const void*, const void*, int64_t,
                                  int64_t, float*, float*) {
  return no_hybrid_op(*this, "gated_delta_gates");
}
Status Backend::gated_delta_rule(const void*, const float*, const float*, int64_t, int64_t, int64_t,
                                 int64_t, float*, const SequenceRowsView&, void*) {
  return no_hybrid_op(*this, "gated_delta_rule");
}
Status Backend::gated_rms_norm(const void*, const void*, const void*, int64_t, int64_t, float, bool,
                               void*) {
  return no_hybrid_op(*this, "gated_rms_norm");
}
Status Backend::qsa_indexer_write(const IndexerCompressedView&, const IndexerRingView&,
                                  const uint16_t*, const SequenceRowsView&, const BlockTableView&,
                                  const IndexerKeyNormRope&) {
  return no_hybrid_op(*this, "qsa_indexer_write");
}
Status Backend::qsa_select(const QsaSelectionConfig&, const IndexerCompressedView&,
                           const BlockTableView&, const QueryBatchView&, const uint16_t*, int32_t*,
                           int32_t*) {
  return no_hybrid_op(*this, "qsa_select");
}
Status Backend::moe_route(const float*, int64_t, int64_t, int64_t, bool, int32_t*, float*) {
  return no_hybrid_op(*this, "moe_route");
}
Status Backend::moe_experts(const void*, const void*, const void*, int64_t, int64_t, int64_t,
                            const int32_t*, const float*, int64_t, int64_t, void*) {
  return no_hybrid_op(*this, "moe_experts");
}
Status Backend::sigmoid_gated_add(void*, const void*, const void*, int64_t, int64_t) {
  return no_hybrid_op(*this, "sigmoid_gated_add");
}
Status Backend::ple_gate(const void*, const void*, const void*, int64_t, int64_t, int64_t, void*) {
  return no_hybrid_op(*this, "ple_gate");
}

Status Backend::linear(const void* x, const LinearView& w, const void* bias, int64_t n, void* y,
                       DType y_dtype) {
  if (w.dense()) return linear(x, w.data, bias, n, w.in, w.out, y, y_dtype);
  return linear_quantized(x, w, bias, n, y, y_dtype);
}
Status Backend::linear_quantized(const void*, const LinearView& w, const void*, int64_t, void*,
                                 DType) {
  return Status::error(
      cat(name(), ": ", weight_format_name(w.format), " weights do not run on this backend"));
}
Status Backend::moe_experts(const void* x, const LinearView& gate_up, const LinearView& down,
                            int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                            const float* weights, int64_t n_rows, int64_t top_k, void* out) {
  E4KV_ASSERT(gate_up.out == n_experts * 2 * inter && gate_up.in == hidden &&
                  down.out == n_experts * hidden && down.in == inter,
              "moe_experts: the expert weights do not have the stated shape");
  if (gate_up.dense() && down.dense()) {
    return moe_experts(x, gate_up.data, down.data, n_experts, hidden, inter, ids, weights, n_rows,
                       top_k, out);
  }
  return moe_experts_quantized(x, gate_up, down, n_experts, hidden, inter, ids, weights, n_rows,
                               top_k, out);
}
Status Backend::moe_local_ids(int32_t*, int64_t, int64_t, int64_t, int64_t) {
  return Status::error(cat(name(),
                           ": expert parallelism (moe_local_ids) does not run on this "
                           "backend yet"));
}
Status Backend::moe_route_experts(const float* logits, bool norm_topk_prob, const void* x,
                                  const LinearView& gate_up, const LinearView& down,
                                  int64_t n_experts, int64_t hidden, int64_t inter, int32_t* ids,
                                  float* weights, int64_t n_rows, int64_t top_k, void* out,
                                  const void* shared_y, const float* shared_gate) {
  E4KV_ASSERT((shared_y == nullptr) == (shared_gate == nullptr),
              "moe_route_experts: shared_y and shared_gate go together");
  E4KV_RETURN_IF_ERROR(moe_route(logits, n_rows, n_experts, top_k, norm_topk_prob, ids, weights));
  E4KV_RETURN_IF_ERROR(
      moe_experts(x, gate_up, down, n_experts, hidden, inter, ids, weights, n_rows, top_k, out));
  if (shared_y == nullptr) return ok_status();
  return sigmoid_gated_add(out, shared_y, shared_gate, n_rows, hidden);
}

Status Backend::moe_experts_quantized(const void*, const LinearView& gate_up, const LinearView&,
                                      int64_t, int64_t, int64_t, const int32_t*, const float*,
                                      int64_t, int64_t, void*) {
  return Status::error(cat(name(), ": ", weight_format_name(gate_up.format),
                           " expert weights do not run on this backend"));
}

}  // namespace e4kv
