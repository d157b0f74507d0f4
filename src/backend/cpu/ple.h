// PLE block (hashed n-gram embeddings) numeric ops of the Qwen4Exp family: the CPU reference (the
// oracle). Spec: docs/qwen4exp_reference.md section 7.4 (traps 18, 19); source: transformers 5.17
// models/qwen4_exp/modeling_qwen4_exp.py M:1216-1255. The n-gram ids and the table are
// model/ple_ngram.h.
//
// One sequence at a time, token-major host fp32 arrays; per PLE layer, with S streams of H:
//   emb [T, Pd] (table rows)  kn = norm_key(emb Wkey^T), val = emb Wval^T,  (projections, norms:
//   qn = norm_query(X)                                                       not here)
//   gv = sigmoid(signed_sqrt(kn_s . qn_s / sqrt(H))) * val   per stream      ple_gate
//   out = gv + silu(dilated causal conv(norm_conv(gv)))                      dilated_conv1d_silu
// The conv's state is the last (kernel - 1) * dilation normalised inputs of the sequence
// (HF's conv_states[1], M:1201, M:1216-1233); dilation is config.ngram_size, not 1 (trap 19).
//
// Numeric contract: fp32 throughout, sums in index order, ISO C++ mode (no FMA contraction);
// exp and sqrt from <cmath>. HF runs these steps in the model dtype (rounding each product and the
// gate's sum, section 7.4); the caller rounds where it needs HF's md behaviour. Note: CUDA torch
// divides an fp32 tensor by a Python scalar as a multiplication by its fp32 reciprocal; the gate
// here divides, as written in the source (the two can differ in the last bit).
#pragma once

#include <cstdint>

namespace e4kv {

// The clamp of the gate's signed square root (M:1247, trap 18): magnitude only, g = 0 stays 0.
inline constexpr float kPleGateMinMagnitude = 1e-6f;

// For each row r and stream s (M:1244-1249):
//   g = (sum_{i < hidden} kn[r, s*hidden + i] * qn[r, s*hidden + i]) / fl32(sqrt(hidden))
//   g = sign(g) * sqrt(max(|g|, 1e-6))                          (sign(0) = 0, so g = 0 -> 0)
//   out[r, s*hidden + i] = sigmoid(g) * val[r, i],  sigmoid(g) = 1 / (1 + exp(-g))
// kn, qn, out: [n_rows, n_streams * hidden] (the normed keys and queries viewed [S, H]);
// val: [n_rows, hidden], broadcast over the streams. out may alias kn or qn, not val.
void ple_gate(const float* kn, const float* qn, const float* val, int64_t n_rows, int64_t n_streams,
              int64_t hidden, float* out);

// Depthwise causal conv with dilation, then SiLU, carrying its state across calls (M:1216-1233):
//   y_t[c] = silu(sum_{k < kernel} w[c, k] * x_{t - (kernel - 1 - k) * dilation}[c]),
//   inputs before the sequence start = 0, silu(v) = v / (1 + exp(-v)); the sum adds k = 0 first.
// x: [n_tokens, channels] the conv inputs of this call (norm_conv's output rows)
// weight: [channels, kernel] (checkpoint conv1d.weight [channels, 1, kernel] with the unit dim
//   dropped; no bias)
// state: [(kernel - 1) * dilation, channels] the sequence's last (kernel - 1) * dilation inputs,
//   oldest first (zeros at sequence start); updated in place to the last ones of [state | x]
// out: [n_tokens, channels], must not alias x
// Any n_tokens >= 0, including fewer tokens than the state holds; a run split anywhere equals the
// whole run bit for bit. With dilation 1 it is causal_conv1d_silu_prefill of
// backend/cpu/gated_delta_net.h (md kF32) bit for bit.
void dilated_conv1d_silu(const float* x, int64_t n_tokens, int64_t channels, const float* weight,
                         int64_t kernel, int64_t dilation, float* state, float* out);

}  // namespace e4kv
