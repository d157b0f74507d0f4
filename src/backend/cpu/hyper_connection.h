// Hyper-connections of the Qwen4Exp family: the CPU reference (the oracle) of the elementwise and
// per-row pieces between the block's linear layers. Spec: docs/qwen4exp_reference.md sections 3.1,
// 3.2, 3.3, 3.4 and 8.1; source: transformers 5.17 models/qwen4_exp/modeling_qwen4_exp.py,
// GatedResidual (M:1003-1031) and the decoder layer (M:1273-1310).
//
// The residual X holds S streams of width H per token: [n_rows, S * H], stream s = features
// [s * H, (s + 1) * H). One block (attn_hyper_connection or mlp_hyper_connection), per row:
//   X   = hc_expand(e)                       every stream a copy of the embedding   (model start)
//   Xn  = rms_norm_grouped(X, hc_norm.weight, S groups of H, kOnePlusWeight)
//   d   = Xn Wdown^T                         [r]       input_mix_weight_down  (linear: not here)
//   a   = silu_scaled(d, 1 / S)              silu(d / S)
//   u   = a Wup^T                            [S * H]   input_mix_weight_up    (linear: not here)
//   mix = hc_mix(u, Xn)                      mean over s of sigmoid(u_s) * Xn_s, [H]
//   l   = Xn Winj^T                          [S]       block_inject_weight    (linear: not here)
//   y   = mixer(mix) or MoE(mix)             [H]
//   X   = hc_inject(X, y, l)                 X_s += 2 sigmoid(l_s / S) * y   (the UN-normalised X)
// The final hyper_connection_mixer (section 8.1) is the same block up to mix, without injection.
//
// Numeric contract: every function is fp32, products and sums rounded to fp32 in the order stated
// per function (ISO C++ mode, no FMA contraction; exp and sqrt from <cmath>).
// Where HF (model dtype md = bf16 there, FP16 in e4kv) rounds, so the model code can follow
// (section 3.2; all these are the caller's, none of the functions here rounds to md):
//   - the grouped norm is fp32 inside with one rounding at the end;
//   - rnd(Xn Wdown^T), then rnd(. / S), then rnd(silu(.)); HF divides by S where silu_scaled
//     multiplies by scale: the same value when S is a power of two (S = 4 in the released config)
//     and scale = 1 / S;
//   - m = rnd(sigmoid(u)), rnd(m_s * Xn_s), the mean over s in fp32 with one rounding;
//   - inj = rnd(2 * rnd(sigmoid(rnd(l) / S))), X_s = rnd(X_s + rnd(y * inj_s)).
#pragma once

#include <cstdint>

#include "core/rms_norm_form.h"

namespace e4kv {

// Grouped RMSNorm (Qwen4ExpTextRMSNorm with groups, section 3.4): x is [n_rows, n_groups, dim] and
// each group row is normalised over its own dim:
//   ss = sum_i x_i^2 in fp32 in index order; r = 1 / sqrt(ss / dim + eps);
//   out_i = fl32(x_i * r) * gain_i, gain_i = weight[g * dim + i] (RmsNormForm::kWeight) or
//   fl32(1 + weight[g * dim + i]) (kOnePlusWeight, the hc_norm form).
// The same arithmetic as the CPU backend's rms_norm (cpu_backend.cpp) and core/norm_rope.h's
// rms_norm_row_f16 before its FP16 rounding: n_groups = 1 agrees with the backend bit for bit.
// x, out: [n_rows, n_groups * dim] (out may alias x); weight: [n_groups * dim].
void rms_norm_grouped(const float* x, const float* weight, int64_t n_rows, int64_t n_groups,
                      int64_t dim, float eps, RmsNormForm form, float* out);

// out[i] = silu(fl32(x[i] * scale)), silu(v) = v / (1 + exp(-v)). x, out: [n] (out may alias x).
// The block's activation of the down projection with scale = 1 / S.
void silu_scaled(const float* x, int64_t n, float scale, float* out);

// Input mixer: mix[r, i] = (sum over s < n_streams of fl32(sigmoid(up_logits[r, s * hidden + i]) *
// xn[r, s * hidden + i])) / n_streams, the sum in s order in fp32 from the s = 0 product,
// sigmoid(v) = 1 / (1 + exp(-v)).
// up_logits (u, the up projection's output), xn (the normalised streams): [n_rows, n_streams *
// hidden]; mix: [n_rows, hidden].
void hc_mix(const float* up_logits, const float* xn, int64_t n_rows, int64_t n_streams,
            int64_t hidden, float* mix);

// Injection: x[r, s * hidden + i] += fl32(inj_s * y[r, i]) with
// inj_s = 2 * sigmoid(fl32(inj_logits[r, s] / n_streams)) (in (0, 2); the factor 2 is exact).
// x: [n_rows, n_streams * hidden] the un-normalised residual, updated in place;
// y: [n_rows, hidden] the mixer or MoE output; inj_logits: [n_rows, n_streams] (Xn Winj^T).
void hc_inject(float* x, const float* y, const float* inj_logits, int64_t n_rows, int64_t n_streams,
               int64_t hidden);

// Streams from the embedding (section 3.1): x[r, s * hidden + i] = e[r, i] for every s.
// e: [n_rows, hidden]; x: [n_rows, n_streams * hidden], must not overlap e.
void hc_expand(const float* e, int64_t n_rows, int64_t n_streams, int64_t hidden, float* x);

}  // namespace e4kv
