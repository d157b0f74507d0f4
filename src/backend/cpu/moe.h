// Sparse MoE block of the Qwen4Exp family: the CPU reference (the oracle) of its numeric pieces.
// Spec: docs/qwen4exp_reference.md sections 2.4, 6 and traps 12-14; source: transformers 5.17
// models/qwen4_exp/modeling_qwen4_exp.py, Qwen4ExpTextSparseMoeBlock (M:920-1000), and
// integrations/moe.py (MOE:377-481, the grouped_mm experts backend).
//
// The block over N tokens xf [N, H] (the hyper-connection mix), E experts, top-k:
//   logits  = xf Wrouter^T                                   [N, E]   (linear: not here)
//   ids, w  = top-k of softmax(logits), optionally renormalised         moe_route
//   routed  = sum_j w_j down_e(silu(gate_e xf) * up_e xf), e = ids_j    moe_experts
//   shared  = down_s(silu(xf Wg_s^T) * (xf Wu_s^T))                      (linears: not here)
//   out     = routed + sigmoid(xf wsg^T) * shared                       sigmoid_gated_add
//
// Numeric contract: every step is fp32, products and sums rounded to fp32 in the order stated per
// function (ISO C++ mode, no FMA contraction; exp from <cmath>). The expert projections go through
// OpenBLAS sgemm, whose reduction order over the hidden / intermediate dimension is its own: a
// CUDA kernel agrees with this reference to fp32 rounding, not bit for bit.
// Where HF (model dtype md = bf16 there, FP16 in e4kv) rounds, so the model code can follow:
//   - the router weights are rounded to md after the renormalisation (trap 12)        caller
//   - grouped_mm (the 5.17 default) forms each (token, j) product rnd(w_j * term_j) in md and sums
//     the k products in fp32 with one rounding; eager accumulates in md in expert-id order (§6).
//     This reference sums the k fp32 products in j order in fp32 (closest to grouped_mm).
//   - the shared gate sigmoid(.) and its product are md ops (trap 14)                 caller
#pragma once

#include <cstdint>

#include "quant/linear_view.h"

namespace e4kv {

// ---- router ------------------------------------------------------------------------------------
// For each token t: p = softmax of the fp32 logits row over ALL n_experts (m = the row max;
// e_i = exp(l_i - m); s = sum of e_i in index order; p_i = e_i / s), then the top_k experts by p
// descending, ties broken towards the lower expert id (HF leaves torch.topk's tie order
// unspecified, trap 9). Weights w_j = p_j, or with norm_topk_prob w_j = p_j / s_k with s_k the fp32
// sum of the chosen p_j in selection order (section 6; the router of M:920-1000).
// logits: [n_tokens, n_experts]; expert_ids: [n_tokens, top_k] (p descending);
// weights: [n_tokens, top_k]. Requires 0 < top_k <= n_experts. NaN logits give an unspecified
// (but deterministic) selection.
void moe_route(const float* logits, int64_t n_tokens, int64_t n_experts, int64_t top_k,
               bool norm_topk_prob, int32_t* expert_ids, float* weights);

// ---- routed experts ----------------------------------------------------------------------------
// Packed expert weights as transformers stores them after loading (section 2.4; per-expert
// checkpoint tensors are stacked over e, gate then up along dim 1).
struct MoeExpertsView {
  const float* gate_up = nullptr;  // [n_experts, 2 * inter, hidden]: rows 0..inter-1 = gate_proj,
                                   // rows inter..2*inter-1 = up_proj
  const float* down = nullptr;     // [n_experts, hidden, inter]
  int64_t n_experts = 0;
  int64_t hidden = 0;  // H
  int64_t inter = 0;   // I (moe_intermediate_size)
  // Quantized experts (quant/linear_view.h, host memory) instead of gate_up / down: expert e's
  // rows are dequantized (quant/dequantize.h) before its products, which then run as above.
  const LinearView* gate_up_q = nullptr;  // [n_experts * 2 * inter, hidden]
  const LinearView* down_q = nullptr;     // [n_experts * hidden, inter]
};

// moe_experts bounds its workspace (the k terms of every token of a chunk, fp32) to this many
// floats: tokens are processed in chunks of max(1, kMoeTermBufferFloats / (top_k * hidden)).
inline constexpr int64_t kMoeTermBufferFloats = int64_t(1) << 24;

// out[t] = sum over j < top_k of weights[t, j] * term[t, j], with
//   term[t, j] = down_e (silu(gate_e x_t) * (up_e x_t)),  e = expert_ids[t, j],
//   silu(g) = g / (1 + exp(-g)).
// Each term is computed fully in fp32: the tokens of a chunk are grouped by expert, and per
// expert one sgemm (OpenBLAS) forms gate and up over the packed [2 * inter, hidden] block, then
// act = silu(gate) * up, then one sgemm forms down. Then, per token, out = 0 and
// out += fl32(weights[t, j] * term[t, j]) for j = 0..top_k-1 in order: the sum order follows j,
// not the expert ids or the grouping. (The term values themselves can differ in the last bit with
// the size of an expert's group, as OpenBLAS picks kernels by shape.) A repeated expert id in a
// row contributes one term per occurrence.
// x: [n_tokens, hidden]; expert_ids, weights: [n_tokens, top_k] (as moe_route writes them);
// out: [n_tokens, hidden], overwritten, must not alias x.
void moe_experts(const MoeExpertsView& experts, const float* x, int64_t n_tokens,
                 const int32_t* expert_ids, const float* weights, int64_t top_k, float* out);

// ---- shared expert gate ------------------------------------------------------------------------
// out[t, i] += sigmoid(gate_logits[t]) * y[t, i], sigmoid(z) = 1 / (1 + exp(-z)), in fp32: the
// product is rounded, then added (section 6, trap 14; the gate is the 1-wide shared_expert_gate
// linear).
// out, y: [n_tokens, dim] (out = the routed sum, y = the shared expert's output);
// gate_logits: [n_tokens].
void sigmoid_gated_add(float* out, const float* y, const float* gate_logits, int64_t n_tokens,
                       int64_t dim);

}  // namespace e4kv
