// Sparse MoE of the Qwen4Exp family on the GPU: the router (softmax, top-k, renormalisation) and
// the routed experts as grouped GEMMs, FP16 activations and weights, fp32 math. The contracts are
// the CPU reference's (backend/cpu/moe.h), which is the oracle of tests/cuda/test_moe_cuda.cu.
// Nothing here synchronises with the host or allocates: the expert ids stay on the device and the
// experts' scratch lives in the caller's workspace, so a decode step can be captured in a CUDA
// graph. Host-only header (no CUDA include beyond the stream type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/status.h"

namespace e4kv::cuda {

// Largest n_experts of both ops, and largest top_k of moe_route_f16.
inline constexpr int64_t kMoeMaxExperts = 1024;
inline constexpr int64_t kMoeMaxTopK = 32;

// moe_route (backend/cpu/moe.h) over FP16 logits widened to fp32: per row p = softmax over all
// n_experts, the top_k experts by p descending (ties to the lower id), weights p or, with
// norm_topk_prob, p / (the sum of the chosen p in selection order). p may differ from the CPU's in
// its last bits (the softmax sum is a tree here), so experts whose p lie within a few ulps may be
// chosen in the other order; exact ties are broken like the CPU's.
// logits: [n_rows, n_experts] FP16; ids: [n_rows, top_k] int32; weights: [n_rows, top_k] fp32.
// Limits: 1 <= top_k <= min(n_experts, kMoeMaxTopK), n_experts <= kMoeMaxExperts.
// Returns an error for shapes outside the limits; launch failures are fatal.
Status moe_route_f16(const uint16_t* logits, int64_t n_rows, int64_t n_experts, int64_t top_k,
                     bool norm_topk_prob, int32_t* ids, float* weights, cudaStream_t stream);

// The same router over fp32 logits (the model computes the router projection in fp32 so that
// near-equal experts are ordered as a full-precision model orders them).
Status moe_route_f32(const float* logits, int64_t n_rows, int64_t n_experts, int64_t top_k,
                     bool norm_topk_prob, int32_t* ids, float* weights, cudaStream_t stream);

// Bytes of workspace moe_experts_f16 needs to take max_rows rows in one pass (it takes more rows in
// passes of as many rows as the workspace holds). Size it once at load for the largest batch.
size_t moe_experts_workspace_bytes(int64_t max_rows, int64_t top_k, int64_t n_experts,
                                   int64_t hidden, int64_t inter);

// moe_experts (backend/cpu/moe.h): out[r] = sum over j < top_k, in j order from 0, of
// fl32(weights[r, j] * term[r, j]), term = down_e(silu(gate_e x_r) * up_e x_r), e = ids[r, j],
// rounded once to FP16. The projections run on tensor cores (FP16 products, fp32 sums in the
// tensor core's order); silu(gate) * up is rounded to FP16 before the down projection (as an FP16
// model does), so results agree with the CPU reference to about 1e-3 relative L2, not bit for bit.
// An id outside [0, n_experts) contributes nothing (the CPU reference asserts).
// x: [n_rows, hidden] FP16; gate_up: [n_experts, 2 * inter, hidden] FP16, gate rows first;
// down: [n_experts, hidden, inter] FP16; ids, weights: [n_rows, top_k] (as moe_route_f16 writes
// them, on the device); out: [n_rows, hidden] FP16, overwritten, must not alias x.
// workspace: device memory of workspace_bytes, 16-byte aligned, at least
// moe_experts_workspace_bytes(1, ...); its contents are scratch.
// Limits: hidden and inter multiples of 8, x, gate_up, down and out 16-byte aligned,
// n_experts <= kMoeMaxExperts, n_rows * top_k <= 2^30. Returns an error for shapes outside the
// limits or a workspace too small for one row; launch failures are fatal.
Status moe_experts_f16(const uint16_t* x, const uint16_t* gate_up, const uint16_t* down,
                       int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                       const float* weights, int64_t n_rows, int64_t top_k, uint16_t* out,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream);

// moe_route_f32 (logits [n_rows, n_experts] fp32, writing ids and weights) followed by
// moe_experts_f16 on its result and, with shared_y [n_rows, hidden] FP16 (8-byte aligned) and
// shared_gate [n_rows] fp32 (both or neither), sigmoid_gated_add_f16(out, shared_y, shared_gate):
// the same results bit for bit, in fewer launches (a decode step, n_rows <= 8 in one pass of the
// workspace, routes inside the experts' grouping launch; the gated add is part of the combine).
// The limits of the parts.
Status moe_route_experts_f16(const float* logits, bool norm_topk_prob, const uint16_t* x,
                             const uint16_t* gate_up, const uint16_t* down, int64_t n_experts,
                             int64_t hidden, int64_t inter, int32_t* ids, float* weights,
                             int64_t n_rows, int64_t top_k, uint16_t* out, const uint16_t* shared_y,
                             const float* shared_gate, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream);

// moe_route_experts_f16 with the shared expert's MLP run among the routed experts instead of its
// output given: its weights shared_gate_up [2 inter, hidden] (gate rows, then up rows) and
// shared_down [hidden, inter] FP16 (16-byte aligned), its gate logits shared_gate [n_rows] fp32.
// It is one more pair of every row (expert n_experts, ids and weights [n_rows, top_k + 1]: the
// routed top_k, then n_experts with weight 1), its gate and up sums, act and output rounded to
// FP16 where the dense MLP (gate/up linear, silu_mul, down linear) rounds them, then added as
// sigmoid_gated_add adds shared_y: the separate path's result up to the order of the projections'
// sums. Decode steps only: n_rows <= 8, n_experts + 1 <= kMoeMaxExperts, top_k + 1 <= kMoeMaxTopK.
Status moe_route_experts_shared_f16(const float* logits, bool norm_topk_prob, const uint16_t* x,
                                    const uint16_t* gate_up, const uint16_t* down,
                                    int64_t n_experts, int64_t hidden, int64_t inter, int32_t* ids,
                                    float* weights, int64_t n_rows, int64_t top_k, uint16_t* out,
                                    const uint16_t* shared_gate_up, const uint16_t* shared_down,
                                    const float* shared_gate, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream);
// Rows up to which moe_route_experts_shared_f16 runs.
inline constexpr int64_t kMoeSharedInExpertsMaxRows = 8;

// The pieces of moe_experts_f16 that the quantized experts (quant_moe.cuh) share.
// Tiles of tile_rows pairs over any routing of n_pairs pairs to n_experts experts (the grid of a
// grouped GEMM, whose CTAs past the device tile count exit).
int64_t moe_max_tiles(int64_t n_pairs, int64_t n_experts, int64_t tile_rows);
// Groups the pairs a = row * top_k + j of ids [n_pairs] by expert, stably: offsets [n_experts + 1]
// (group e is perm[offsets[e] .. offsets[e + 1])), perm [n_pairs], n_tiles [1] and tiles
// [moe_max_tiles, 2] (expert, first row of the tile within the group). Ids outside [0, n_experts)
// are left out. One launch; n_experts <= kMoeMaxExperts, n_pairs <= 2^30.
void moe_group_pairs(const int32_t* ids, int64_t n_pairs, int64_t n_experts, int64_t tile_rows,
                     int32_t* offsets, int32_t* n_tiles, int32_t* tiles, int32_t* perm,
                     cudaStream_t stream);
// out[row] = FP16(sum over j < top_k, from 0 in j order, of terms[row * top_k + j]), skipping ids
// outside [0, n_experts). terms: [n_rows * top_k, hidden] fp32; out: [n_rows, hidden] FP16,
// 8-byte aligned; hidden a multiple of 4.
void moe_combine_terms(const float* terms, const int32_t* ids, int64_t n_rows, int64_t top_k,
                       int64_t n_experts, int64_t hidden, uint16_t* out, cudaStream_t stream);

}  // namespace e4kv::cuda
