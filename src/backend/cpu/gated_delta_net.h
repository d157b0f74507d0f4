// GatedDeltaNet (linear attention) numeric ops of the Qwen4Exp family: the CPU reference (the
// oracle). Spec: docs/qwen4exp_reference.md sections 3.4 and 5; source: transformers 5.17
// models/qwen4_exp/modeling_qwen4_exp.py ("M:" line numbers below).
//
// One sequence at a time, token-major host fp32 arrays, per layer:
//   u = x Wqkv^T [T, C], z [T, nV, dv], a, b [T, nV]            (projections: not here)
//   y = silu(causal depthwise conv(u)), split q | k | v            causal_conv1d_*    M:211-252
//   g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)     gated_delta_gates  M:579-581
//   o = gated delta rule over (q, k, v, g, beta), fp32 state       gated_delta_rule_* M:262-459
//   o = rms(o) * w * act(z)                                        gated_rms_norm     M:180-196
//
// Math (per value head j, with q/k head j / (nV / nK): HF repeat_interleave, M:582-584):
//   conv:   y_t[c] = silu(sum_{i<W} w[c, i] * u_{t-W+1+i}[c]), u before the sequence = 0
//   l2norm: x / sqrt(sum x^2 + 1e-6)                                       (M:256-259)
//   rule:   q^ = l2norm(q) / sqrt(dk), k^ = l2norm(k)
//           S  = exp(g_t) S;  S += k^ (beta_t (v_t - S^T k^))^T;  o_t = S^T q^   (read after write)
//   norm:   out = (w * (x / sqrt(mean x^2 + eps))) * act(z),  act = silu (or sigmoid by config)
//
// Numeric contract: every step is fp32 (products and sums rounded to fp32 in the order written in
// the .cpp; ISO C++ mode, no FMA contraction; exp/log1p/sqrt from <cmath>). The recurrent state is
// fp32 [nV, dk, dv] and is never rounded, as in HF.
// Where HF (model dtype md = bf16 there, FP16 in e4kv) rounds, so the model code can follow:
//   - u, z, a, b are md (linear outputs).                                     caller
//   - conv: rnd(conv sum), then rnd(silu(.)) (M:242-250, conv in md).         `md` argument
//   - beta = rnd(sigmoid(b)) (M:579, md op); g stays fp32 (M:581), computed from
//     md-valued A_log and dt_bias when the checkpoint is loaded in md.        caller
//   - l2norm, scaling, the whole delta rule and the state are fp32 (M:300-310, M:420-430);
//     the rule's output is rounded to md once (M:395, M:458).                 caller
//   - gated norm: rnd(x * r), then rnd(w * .) (w is an md parameter), then the
//     fp32 product with act(fp32 z), then rnd (M:187-196).                    `md` argument
// The functions that take `md` round at HF's inner points and round their output; DType::kF32
// means no rounding anywhere (the pure fp32 reference).
//
// Known HF differences between its two delta-rule paths, mirrored here: the chunked form scales
// q by multiplying with fl32(dk^-0.5) (M:309-310), the recurrent form divides by fl32(sqrt(dk))
// (M:430); for dk = 128 the two can differ in the last bit. HF runs the chunked form for every
// call except a single token with an existing state (M:587). Chunks start at the first token of
// each call, so splitting a prefill changes fp32 rounding only.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace e4kv {

// l2norm epsilon, hard-coded by HF (M:256, M:306-307, M:426-427), inside the square root.
inline constexpr float kGatedDeltaL2NormEps = 1e-6f;
// HF's default chunk size of torch_chunk_gated_delta_rule (M:269).
inline constexpr int64_t kGatedDeltaChunkSize = 64;

// Activation of the gated norm's gate: config.output_gate_type or hidden_act (M:500, only these
// two are accepted by the config).
enum class GateActivation { kSilu, kSigmoid };

// ---- causal depthwise conv1d + SiLU -----------------------------------------------------------
// x: [n_tokens, channels] pre-conv inputs u (the in_proj_qkv output rows of this call)
// weight: [channels, kernel_size] (checkpoint conv1d.weight [channels, 1, kernel_size] with the
//   unit dim dropped, as HF's weight.squeeze(1); the conv has no bias, M:486)
// state: [kernel_size - 1, channels] the sequence's last kernel_size - 1 inputs, oldest first
//   (zeros at sequence start); updated in place to the last kernel_size - 1 inputs after this call
//   (HF keeps kernel_size of them, CU:1083; the oldest is never read)
// out: [n_tokens, channels] = silu(conv), must not alias x
// md: kF32 (no rounding) or the model dtype (kF16 / kBF16): the conv sum and the silu output are
//   rounded to it (x, weight and state are expected to hold md values then)
// The activation is HF's config.hidden_act (M:478, M:544, M:556; "silu" by default, C:114); this
// op implements silu only. The prefill form covers any n_tokens >= 0; the decode form is the same
// computation for one token written as HF's causal_conv1d_update (M:212-228), and agrees with it
// bit for bit.
void causal_conv1d_silu_prefill(const float* x, int64_t n_tokens, int64_t channels,
                                const float* weight, int64_t kernel_size, float* state, float* out,
                                DType md = DType::kF32);
// x, out: [channels] one token; weight, state, md as above.
void causal_conv1d_silu_decode(const float* x, int64_t channels, const float* weight,
                               int64_t kernel_size, float* state, float* out,
                               DType md = DType::kF32);

// ---- q/k normalisation and gates --------------------------------------------------------------
// out_r = x_r / sqrt(sum_i x_r[i]^2 + eps) per row, as HF: inv = 1 / sqrt(ss + eps) (fp32, ss
// summed in index order), out = x * inv. x, out: [n_rows, dim] (out may alias x).
void l2norm_rows(const float* x, int64_t n_rows, int64_t dim, float* out,
                 float eps = kGatedDeltaL2NormEps);

// Per token t and value head h (M:579-581, all fp32):
//   g[t, h]    = -exp(a_log[h]) * softplus(a[t, h] + dt_bias[h]),
//                softplus(s) = s > 20 ? s : log1p(exp(s))  (PyTorch's defaults beta 1, threshold
//                20)
//   beta[t, h] = sigmoid(b[t, h]) = 1 / (1 + exp(-b))       (HF rounds it to md: the caller's)
// a, b, g, beta: [n_tokens, n_v_heads]; a_log, dt_bias: [n_v_heads] (checkpoint A_log, dt_bias)
void gated_delta_gates(const float* a, const float* b, const float* a_log, const float* dt_bias,
                       int64_t n_tokens, int64_t n_v_heads, float* g, float* beta);

// ---- the gated delta rule ----------------------------------------------------------------------
struct GatedDeltaRuleParams {
  int64_t n_tokens = 0;
  int64_t n_k_heads = 0;   // q/k heads (nK)
  int64_t n_v_heads = 0;   // value heads (nV), a multiple of n_k_heads; head j reads q/k head
                           // j / (nV / nK)
  int64_t head_k_dim = 0;  // dk
  int64_t head_v_dim = 0;  // dv
  // HF's use_qk_l2norm_in_kernel (the model passes true, M:596, M:609): q and k rows are
  // l2-normalised inside. With false, q and k are used as given. q is scaled by 1/sqrt(dk) always.
  bool qk_l2norm = true;
  const float* q = nullptr;     // [n_tokens, n_k_heads, head_k_dim] (the conv output's q part)
  const float* k = nullptr;     // [n_tokens, n_k_heads, head_k_dim]
  const float* v = nullptr;     // [n_tokens, n_v_heads, head_v_dim]
  const float* g = nullptr;     // [n_tokens, n_v_heads] log decay (<= 0 for the model)
  const float* beta = nullptr;  // [n_tokens, n_v_heads]
  // [n_v_heads, head_k_dim, head_v_dim] fp32: in, the state before the first token (zeros at
  // sequence start); out, the state after the last one. HF's recurrent_states[0] for batch row 0.
  float* state = nullptr;
  float* out = nullptr;  // [n_tokens, n_v_heads, head_v_dim]
};

// One token at a time (HF's torch_recurrent_gated_delta_rule, M:400-459), for any n_tokens:
//   S = S * exp(g); m = sum_d S[d, :] * k^[d]; delta = (v - m) * beta; S = S + k^ (x) delta;
//   o = sum_d S[d, :] * q^[d],  q^ = q / fl32(sqrt(dk)).
void gated_delta_rule_recurrent(const GatedDeltaRuleParams& params);

// Chunks of chunk_size tokens from the first token of this call (HF's torch_chunk_gated_delta_rule,
// M:263-396; its zero padding of the last chunk is a no-op and is not materialised). Per chunk,
// with gamma_i = cumulative sum of g inside the chunk (in order), D_ij = exp(gamma_i - gamma_j),
// q^ = q * fl32(dk^-0.5):
//   A_ij = (beta_i k_i . k_j) D_ij for j < i                   (HF's diagonal is ignored: unit)
//   U    = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k exp(gamma))   (forward substitution)
//   V'   = U - W S
//   O_i  = exp(gamma_i) q^_i S + sum_{j <= i} (q^_i . k_j) D_ij V'_j
//   S    = exp(gamma_last) S + sum_j (k_j exp(gamma_last - gamma_j)) (x) V'_j
// Equal to the recurrent form up to fp32 rounding.
void gated_delta_rule_chunked(const GatedDeltaRuleParams& params,
                              int64_t chunk_size = kGatedDeltaChunkSize);

// ---- output norm -------------------------------------------------------------------------------
// Qwen4ExpTextRMSNormGated (M:180-196), per row r of dim values:
//   r_inv = 1 / sqrt(sum x^2 / dim + eps);  n = rnd(x * r_inv);  p = rnd(weight * n);
//   out = rnd(p * act(z)),  act(z) = z / (1 + exp(-z)) (silu) or 1 / (1 + exp(-z)) (sigmoid)
// rnd = rounding to md (identity for kF32). The weight is the plain weight (ones-initialised, not
// 1 + w), shared by all value heads. x: [n_rows, dim] rows of the delta rule's output (one per
// token and value head); z: [n_rows, dim] the in_proj_z rows; weight: [dim]; out: [n_rows, dim]
// (may alias x or z).
void gated_rms_norm(const float* x, const float* z, const float* weight, int64_t n_rows,
                    int64_t dim, float eps, GateActivation activation, float* out,
                    DType md = DType::kF32);

}  // namespace e4kv
