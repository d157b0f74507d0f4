// The GatedDeltaNet mixer of Qwen4Exp's linear_attention layers (docs/qwen4exp_reference.md
// section 5), x: [n_rows, hidden] act (the hyper-connection mix):
//   u = x Wqkv^T; z = x Wz^T; b = x Wb^T; a = x Wa^T
//   y = silu(causal depthwise conv(u)) with the sequence's conv window; q | k | v = y
//   g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b)
//   o = gated delta rule (fp32 state per sequence and value head)
//   out = (gated RMSNorm(o, z)) Wout^T
// Per-sequence state (at the sequence's slot): the last kernel - 1 conv inputs [kernel - 1, C]
// act and the recurrent state [nV, dk, dv] fp32.
#pragma once

#include <cstdint>
#include <string>

#include "backend/backend.h"
#include "core/status.h"
#include "model/tp_shard.h"
#include "model/layers/fused_projection.h"
#include "model/weights.h"

namespace e4kv {

struct DeltaNetShape {
  int64_t hidden = 0;
  int64_t n_k_heads = 0;
  int64_t n_v_heads = 0;
  int64_t head_k_dim = 0;
  int64_t head_v_dim = 0;
  int64_t conv_kernel = 4;
  bool sigmoid_gate = false;  // output_gate_type "sigmoid" (else silu)
  float eps = 1e-6f;

  int64_t k_dim() const { return n_k_heads * head_k_dim; }
  int64_t v_dim() const { return n_v_heads * head_v_dim; }
  int64_t conv_dim() const { return 2 * k_dim() + v_dim(); }
  int64_t conv_state_elems() const { return (conv_kernel - 1) * conv_dim(); }
  int64_t recurrent_state_elems() const { return n_v_heads * head_k_dim * head_v_dim; }

  // Tensor parallelism: this rank's N-th of the key heads and of the value heads (which stay
  // paired); k_begin, v_begin: its first key and value head. Errors: heads that do not split.
  Result<DeltaNetShape> shard(const TpShard& tp, int64_t* k_begin, int64_t* v_begin) const;
};

struct DeltaNetWorkspace {
  BackendBuffer proj;     // the input projections' parts (FusedProjection): u [rows, conv_dim],
                          // z [rows, v_dim], b and a [rows, n_v_heads] act
  BackendBuffer y;        // [rows, conv_dim] act
  BackendBuffer o;        // [rows, v_dim] act
  BackendBuffer g, beta;  // [rows, n_v_heads] fp32

  static Result<DeltaNetWorkspace> create(Backend& backend, const DeltaNetShape& shape,
                                          int64_t max_rows);
};

// One layer's per-sequence state pools.
struct DeltaNetState {
  BackendBuffer conv;       // [slots, kernel - 1, conv_dim] act
  BackendBuffer recurrent;  // [slots, n_v_heads, head_k_dim, head_v_dim] fp32

  static Result<DeltaNetState> create(Backend& backend, const DeltaNetShape& shape,
                                      int64_t n_slots);
  // Zeroes the state of `slot` (a new sequence).
  void reset(Backend& backend, const DeltaNetShape& shape, int32_t slot);
  // Slot `dst` becomes a copy of slot `src` (a forked sequence); slots in [0, n_slots).
  Status copy(Backend& backend, const DeltaNetShape& shape, int32_t src, int32_t dst,
              int64_t n_slots);
};

class DeltaNetMixer {
 public:
  // prefix: "model.layers.0.linear_attn.".
  static Result<DeltaNetMixer> load(WeightLoader& weights, const std::string& prefix,
                                    const DeltaNetShape& shape,
                                      const TpShard& tp = {});

  // x, out: [n, hidden] act; seqs: the rows of each sequence and its state slot.
  Status forward(Backend& backend, int64_t n, const SequenceRowsView& seqs, const void* x,
                 void* out, DeltaNetState& state, DeltaNetWorkspace& ws) const;

  const DeltaNetShape& shape() const { return shape_; }

 private:
  DeltaNetShape shape_;
  FusedProjection in_;  // in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  LinearWeight out_;
  BackendBuffer conv_, dt_bias_, a_log_, norm_;
};

}  // namespace e4kv
