// The small FP16 ops of the hybrid (Qwen4Exp) layers on the GPU: grouped and gated RMSNorm, the
// hyper-connection mixers, the GatedDeltaNet gates, the shared-expert gate, the PLE gate and the
// dilated causal conv with its per-sequence state. fp32 math, FP16 ("act") in and out, one launch
// each on the given stream. Host-only header. The contracts are Backend's (backend/backend.h); the
// CPU references (the oracle) are backend/cpu/hyper_connection.h, gated_delta_net.h, moe.h and
// ple.h. Every launcher returns without launching when there is no work (n_rows = 0 and the like).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/backend.h"
#include "core/rms_norm_form.h"

namespace e4kv::cuda {

// Grouped RMSNorm: each group row x[r, g, :] normalised over dim with gain weight[g * dim + i]
// (kWeight) or 1 + weight[g * dim + i] (kOnePlusWeight).
// x, out: [n_rows, n_groups, dim] FP16 (out may alias x); weight: [n_groups * dim] FP16
void rms_norm_grouped_f16(const uint16_t* x, const uint16_t* weight, int64_t n_rows,
                          int64_t n_groups, int64_t dim, float eps, RmsNormForm form, uint16_t* out,
                          cudaStream_t stream);

// out[i] = silu(x[i] * scale). x, out: [n] FP16 (may alias)
void silu_scaled_f16(const uint16_t* x, int64_t n, float scale, uint16_t* out, cudaStream_t stream);

// mix[r, i] = (sum over s of sigmoid(up[r, s, i]) * xn[r, s, i]) / n_streams.
// up, xn: [n_rows, n_streams, hidden] FP16; mix: [n_rows, hidden] FP16 (must not overlap up, xn)
void hc_mix_f16(const uint16_t* up, const uint16_t* xn, int64_t n_rows, int64_t n_streams,
                int64_t hidden, uint16_t* mix, cudaStream_t stream);

// x[r, s, :] += 2 * sigmoid(inj[r, s] / n_streams) * y[r, :].
// x: [n_rows, n_streams, hidden] FP16, in place; y: [n_rows, hidden] FP16; inj: [n_rows,
// n_streams] FP16 (neither overlaps x)
void hc_inject_f16(uint16_t* x, const uint16_t* y, const uint16_t* inj, int64_t n_rows,
                   int64_t n_streams, int64_t hidden, cudaStream_t stream);

// x[r, s, :] = e[r, :] for every stream (a bit copy). e: [n_rows, hidden] FP16;
// x: [n_rows, n_streams, hidden] FP16 (must not overlap e)
void hc_expand_f16(const uint16_t* e, int64_t n_rows, int64_t n_streams, int64_t hidden,
                   uint16_t* x, cudaStream_t stream);

// Depthwise causal conv (taps `dilation` apart) + SiLU over each sequence's rows, carrying the last
// (kernel - 1) * dilation inputs of each sequence in its state slot (ple.h dilated_conv1d_silu per
// sequence; the state values are bit copies of inputs, so a run split anywhere equals the whole).
// x, out: [n_rows, channels] FP16 (no alias; row r of sequence s in [row_begin[s],
// row_begin[s+1])); weight: [channels, kernel] FP16; states: [n_slots, (kernel - 1) * dilation,
// channels] FP16, oldest input first, updated in place (may be null when kernel = 1); seqs: device
// row_begin and state_slot (start_pos is not read), first_row and end_row for the launch. Limits
// (conv1d_silu_f16_supported): kernel <= 16, (kernel - 1) * dilation <= 64.
inline constexpr int64_t kConv1dMaxKernel = 16;
inline constexpr int64_t kConv1dMaxState = 64;
bool conv1d_silu_f16_supported(int64_t kernel, int64_t dilation);
void conv1d_silu_f16(const uint16_t* x, int64_t channels, const uint16_t* weight, int64_t kernel,
                     int64_t dilation, uint16_t* states, const SequenceRowsView& seqs,
                     uint16_t* out, cudaStream_t stream);

// g = -exp(a_log[h]) * softplus(a + dt_bias[h]) (softplus(s) = s for s > 20), beta = sigmoid(b).
// a, b: [n_rows, n_heads] FP16; a_log, dt_bias: [n_heads] FP16; g, beta: [n_rows, n_heads] fp32
void gated_delta_gates_f16(const uint16_t* a, const uint16_t* b, const uint16_t* a_log,
                           const uint16_t* dt_bias, int64_t n_rows, int64_t n_heads, float* g,
                           float* beta, cudaStream_t stream);

// out = (weight * (x / rms(x))) * act(z) per row, act = silu or sigmoid (sigmoid_gate); fp32
// inside, one FP16 rounding at the end (gated_rms_norm with md = kF32, rounded).
// x, z, out: [n_rows, dim] FP16 (out may alias x or z); weight: [dim] FP16
void gated_rms_norm_f16(const uint16_t* x, const uint16_t* z, const uint16_t* weight,
                        int64_t n_rows, int64_t dim, float eps, bool sigmoid_gate, uint16_t* out,
                        cudaStream_t stream);

// out[r, :] += sigmoid(gate[r]) * y[r, :]. out, y: [n_rows, dim] FP16 (no overlap);
// gate: [n_rows] fp32
void sigmoid_gated_add_f16(uint16_t* out, const uint16_t* y, const float* gate, int64_t n_rows,
                           int64_t dim, cudaStream_t stream);

// PLE gate: g = kn[r, s, :] . qn[r, s, :] / sqrt(hidden), g = sign(g) sqrt(max(|g|, 1e-6)),
// out[r, s, :] = sigmoid(g) * val[r, :].
// kn, qn, out: [n_rows, n_streams, hidden] FP16 (out may alias kn or qn); val: [n_rows, hidden]
// FP16 (must not overlap out)
void ple_gate_f16(const uint16_t* kn, const uint16_t* qn, const uint16_t* val, int64_t n_rows,
                  int64_t n_streams, int64_t hidden, uint16_t* out, cudaStream_t stream);

}  // namespace e4kv::cuda
