// The hyper-connection block's input mix for a few rows (decode steps) in two launches instead of
// six: the grouped (1 + w) RMSNorm of the streams, the down projection, silu(. / S), the up
// projection, the sigmoid-weighted mean over the streams and, for a layer block, the injection
// logits (model/layers/hyper_connection.h gives the block; the CPU references are
// backend/cpu/hyper_connection.h's and the linear's). Each intermediate is rounded to FP16 where
// the unfused ops store it (the normalised streams, the projections' outputs, the activation), so
// the two paths differ only by the order of their fp32 sums.
//
//   launch 1 (one warp per (output, stream) pair, 8 warps a CTA holding 8 / streams outputs): each
//            warp computes its stream's 1 / rms for every row, reads its slice of the down or
//            injection weight row (hidden values) once, normalises the rows' slices on the fly
//            and dots them; the CTA sums the streams' partial dots in shared memory, then the
//            down projection's outputs go through silu(. / S) into an fp32 scratch and the
//            injection logits to `inj`. No row is staged: a decode step's mix is latency-bound,
//            and this keeps ~1300 warps' weight loads in flight instead of ~320.
//   launch 2 (one warp per hidden column, 8 a CTA): the up projection's S logits of the column from
//            the scratch, the normalised inputs recomputed from x, the mean written to `mix`
// The weights are read once per step (each row after the first reads them from registers or L2).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace e4kv::cuda {

inline constexpr int64_t kHcFusedMaxRows = 8;

// Whether the fused form takes this shape: n_rows <= kHcFusedMaxRows, streams dividing 8, hidden
// and rank multiples of 8, rank <= 1024.
bool hc_mix_fused_supported(int64_t n_rows, int64_t streams, int64_t hidden, int64_t rank);
// The fp32 scratch the launches pass between them: n_rows * (rank + streams) floats.
size_t hc_mix_fused_scratch_bytes(int64_t n_rows, int64_t streams, int64_t rank);

// x: [n_rows, streams * hidden] FP16; norm_weight: [streams * hidden]; down: [rank, streams *
// hidden]; up: [streams * hidden, rank]; inject: [streams, streams * hidden] or null (the final
// mixer); mix: [n_rows, hidden] FP16; inj: [n_rows, streams] FP16 (null when inject is);
// scratch: hc_mix_fused_scratch_bytes, 16-byte aligned. Every pointer 16-byte aligned.
// pending_y [n_rows, hidden] and pending_inj [n_rows, streams] (both or neither; pending_inj not
// inj): the previous block's injection, not yet applied. Both launches read x as hc_inject would
// leave it (FP16(x + fl(2 sigmoid(inj / S) y)), hybrid_ops.cu's operations) and launch 2 writes
// that back into x, so the separate hc_inject launch is saved.
// Which pair of kernels runs the mix: kLoadFirst (the default: every load issued before its first
// use, the norm and the dot in one pass over x with the normalised stream kept in fp32 inside the
// dot, so a warp waits for memory once per pass instead of once per load; on an H100 it took the
// Qwen4Exp benchmark checkpoint's hyper-connections from 2.74 to 2.06 ms a batch-1 step and from
// 11.9 to 6.8 ms at batch 8) or kWarpPerSlice (launch 1 and 2 as above; the backend uses it with
// E4KV_HC_MIX_KERNELS=warp-per-slice, for A/B runs).
enum class HcMixKernels { kWarpPerSlice, kLoadFirst };

void hc_mix_fused_f16(uint16_t* x, const uint16_t* norm_weight, const uint16_t* down,
                      const uint16_t* up, const uint16_t* inject, int64_t n_rows, int64_t streams,
                      int64_t hidden, int64_t rank, float eps, uint16_t* mix, uint16_t* inj,
                      void* scratch, const uint16_t* pending_y, const uint16_t* pending_inj,
                      cudaStream_t stream, HcMixKernels kernels = HcMixKernels::kLoadFirst);

}  // namespace e4kv::cuda
