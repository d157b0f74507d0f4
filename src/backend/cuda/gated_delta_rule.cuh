// The gated delta rule of GatedDeltaNet (linear attention) on the GPU: Backend::gated_delta_rule
// (backend/backend.h) with FP16 activations, against the CPU reference gated_delta_rule_recurrent /
// _chunked (backend/cpu/gated_delta_net.h). Host-only header (no CUDA include beyond the stream
// type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/backend.h"
#include "core/status.h"

namespace e4kv::cuda {

// The largest head_k_dim the kernel takes: a CTA keeps all key rows of its state columns in
// registers (at most 8 warps x 32 rows).
inline constexpr int64_t kGatedDeltaRuleMaxHeadKDim = 256;

// For each sequence s (rows [row_begin[s], row_begin[s + 1]), state slot state_slot[s]) and value
// head j (q/k head j / (n_v_heads / n_k_heads)), token by token in row order:
//   q^ = l2norm(q) / sqrt(dk), k^ = l2norm(k)   (eps 1e-6 inside the sqrt)
//   S = exp(g) S;  S += k^ (beta (v - S^T k^))^T;  o = S^T q^
// All fp32; o is rounded to FP16 once. The recurrent walk is used for every sequence (prefill
// too): it equals the CPU's chunked form up to fp32 rounding, and start_pos does not change the
// result (the state is used as given: zeros at a sequence's start are the caller's).
//   qkv: [n_rows, 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim] FP16 bits, q | k | v
//        contiguous in each row (the conv output)
//   g, beta: [n_rows, n_v_heads] fp32 (log decay, write strength)
//   states: [n_slots, n_v_heads, head_k_dim, head_v_dim] fp32, updated in place (slots of
//        sequences with no rows, and slots no sequence names, are not touched)
//   seqs: device row_begin [n_seqs + 1], state_slot [n_seqs] (start_pos unused); max_seq_rows
//        picks the path (1 or 0: decode; more: prefill, correct for any rows) and a call with
//        first_row == end_row returns without a launch
//   out: [n_rows, n_v_heads, head_v_dim] FP16 bits
// Limits: n_k_heads, n_v_heads >= 1, n_v_heads a multiple of n_k_heads, 1 <= head_k_dim <=
// kGatedDeltaRuleMaxHeadKDim, head_v_dim >= 1, distinct slots for the sequences of one call.
// Returns an error Status naming the limit for shapes outside them; launch failures are fatal.
Status gated_delta_rule_f16(const uint16_t* qkv, const float* g, const float* beta,
                            int64_t n_k_heads, int64_t n_v_heads, int64_t head_k_dim,
                            int64_t head_v_dim, float* states, const SequenceRowsView& seqs,
                            uint16_t* out, cudaStream_t stream);

// The same with the gates computed in the kernel from their raw inputs, as
// gated_delta_gates_f16 (hybrid_ops.cuh) computes them: g = -exp(a_log) softplus(a + dt_bias),
// beta = sigmoid(b) with the same fp32 operations, so the result equals gates-then-rule bit for
// bit. a, b: [n_rows, n_v_heads] FP16; a_log, dt_bias: [n_v_heads] FP16.
Status gated_delta_rule_raw_gates_f16(const uint16_t* qkv, const uint16_t* a, const uint16_t* b,
                                      const uint16_t* a_log, const uint16_t* dt_bias,
                                      int64_t n_k_heads, int64_t n_v_heads, int64_t head_k_dim,
                                      int64_t head_v_dim, float* states,
                                      const SequenceRowsView& seqs, uint16_t* out,
                                      cudaStream_t stream);

}  // namespace e4kv::cuda
