// The routed experts of a MoE layer over quantized expert weights (quant/linear_weight.h) on the
// GPU: the contract of moe_experts_f16 (moe.cuh; backend/cpu/moe.h is the oracle), with gate_up
// and down as LinearViews whose rows stack the experts. Nothing here allocates or synchronises:
// the scratch lives in the caller's workspace (sized at load), so a step can be captured in a CUDA
// graph. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/status.h"
#include "quant/linear_view.h"

namespace e4kv::cuda {

// Bytes of workspace quant_moe_experts needs to take max_rows rows in one pass (more rows run in
// passes of as many rows as the workspace holds).
size_t quant_moe_workspace_bytes(int64_t max_rows, int64_t top_k, int64_t n_experts, int64_t hidden,
                                 int64_t inter);

// out[r] = FP16(sum over j < top_k, in j order, of fl32(weights[r, j] * term[r, j])), term =
// down_e(FP16(silu(gate_e x_r) * up_e x_r)), e = ids[r, j]; ids outside [0, n_experts) contribute
// nothing. The projections dequantize in registers (quant_gemv.cuh), fp32 products and sums.
// x: [n_rows, hidden] FP16, 8-byte aligned; gate_up: [n_experts * 2 * inter, hidden] (expert e's
// gate rows, then its up rows, after expert e - 1's); down: [n_experts * hidden, inter]; each
// view kW4, kNvfp4, kFp8Block or FP16 kDense as quant_weight_supported (quant_linear.cuh) takes;
// ids, weights: [n_rows, top_k] on the device; out: [n_rows, hidden] FP16, 8-byte aligned, not
// aliasing x. workspace: 16-byte aligned, at least quant_moe_workspace_bytes(1, ...).
// Errors: shapes or weights the kernels do not take, a workspace below one row.
Status quant_moe_experts(const uint16_t* x, const LinearView& gate_up, const LinearView& down,
                         int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                         const float* weights, int64_t n_rows, int64_t top_k, uint16_t* out,
                         void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace e4kv::cuda
