// Quantized MoE experts (see quant_moe.cuh). Per pass of rows, four launches and no host
// synchronisation, as moe_experts_f16 (moe.cu) does with FP16 weights:
//   1. moe_group_pairs: the (row, j) pairs grouped by expert, in tiles of kRows pairs;
//   2. gate/up: one CTA per (tile, 8 intermediate columns), one launch over every expert's tiles
//      (the grid is the worst case over any routing; CTAs past the device's tile count exit).
//      A warp owns one intermediate column c: gate row c and up row inter + c of expert e, so
//      silu(gate) * up forms in registers and is rounded to FP16 into act [n_pairs, inter] (group
//      order), as the dense path rounds it;
//   3. down: one CTA per (tile, 16 hidden columns) over act rows; the epilogue scales by the
//      pair's router weight (one fp32 product, as the reference) into terms [n_pairs, hidden] at
//      the pair's own index, so the j order of the sum is kept;
//   4. moe_combine_terms: out[row] = FP16(the sum over j from 0).
// The projections are quant_gemv.cuh's lane work over the tile's gathered x rows, the weight rows
// taken at the expert's offset in the stacked view. kRows (pairs per tile) is chosen on the host
// from the average pairs per non-empty expert (1, 2, 4 or 8): a decode step with one pair per
// expert does no work for padding rows, and each weight byte of an expert is read once per tile.
// note: prefill with hundreds of pairs per expert reads an expert's weights once per 8 pairs (L2
// takes most of it); the tensor-core kernel described in quant_linear.cu would take 64-pair tiles.
#include "backend/cuda/quant_moe.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/quant_gemv.cuh"
#include "backend/cuda/quant_linear.cuh"

namespace e4kv::cuda {
namespace {

using quant::kGemvThreads;
using quant::kGemvWarps;

struct MoeParams {
  quant::QuantWeight w;    // gate/up: [n_experts * 2 * inter, hidden]; down: [n_experts * hidden,
                           // inter]
  const uint16_t* a;       // gate/up: x [rows, hidden]; down: act [n_pairs, inter] (group order)
  const int32_t* offsets;  // [n_experts + 1]
  const int32_t* n_tiles;  // [1]
  const int32_t* tiles;    // [n_tiles, 2]
  const int32_t* perm;     // [n_pairs]
  const float* pair_weights;  // [n_pairs]
  uint16_t* act;              // [n_pairs, inter] FP16
  float* terms;               // [n_pairs, hidden] fp32, by pair index
  int32_t hidden;
  int32_t inter;
  int32_t top_k;
  int32_t tile_rows;  // pairs per tile of the grouping (<= the kernel's kRows)
};

constexpr int kOutPerWarp = 2;  // gate/up: the gate and the up row of one column; down: 2 columns

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

// F: the lane work (quant_gemv.cuh), Format<format> or the Exact<format> fallback.
template <class F, bool kGateUp, int kRows>
__global__ void __launch_bounds__(kGemvThreads)
    quant_moe_kernel(const __grid_constant__ MoeParams p) {
  enter_dependent_grid();
  const int tile = int(blockIdx.x);
  if (tile >= *p.n_tiles) return;  // the whole CTA: before any barrier
  __shared__ __align__(16) float xs[kRows * quant::x_stage_stride<F>()];
  __shared__ const uint16_t* x_rows[kRows];
  __shared__ int32_t s_pair[kRows];
  const int expert = p.tiles[2 * tile];
  const int group_row0 = p.offsets[expert] + p.tiles[2 * tile + 1];
  const int rows = min(min(kRows, p.tile_rows), p.offsets[expert + 1] - group_row0);
  const int tid = int(threadIdx.x);
  if (tid < kRows) {
    const int pair = tid < rows ? p.perm[group_row0 + tid] : -1;
    s_pair[tid] = pair;
    if (tid >= rows) {
      x_rows[tid] = nullptr;
    } else if (kGateUp) {
      x_rows[tid] = p.a + int64_t(pair / p.top_k) * p.hidden;
    } else {
      x_rows[tid] = p.a + int64_t(group_row0 + tid) * p.inter;
    }
  }  // read after gemv_rows' first barrier
  const int warp = tid >> 5;
  const int lane = tid & 31;
  int64_t w_rows[kOutPerWarp];
  int col;
  if constexpr (kGateUp) {
    col = int(blockIdx.y) * kGemvWarps + warp;  // intermediate column
    const int64_t base = int64_t(expert) * 2 * p.inter;
    w_rows[0] = col < p.inter ? base + col : -1;            // gate
    w_rows[1] = col < p.inter ? base + p.inter + col : -1;  // up
  } else {
    col = (int(blockIdx.y) * kGemvWarps + warp) * kOutPerWarp;  // hidden column
#pragma unroll
    for (int o = 0; o < kOutPerWarp; ++o) {
      w_rows[o] = col + o < p.hidden ? int64_t(expert) * p.hidden + col + o : -1;
    }
  }
  float acc[kOutPerWarp][kRows];
  quant::gemv_rows<F, kRows, kOutPerWarp>(p.w, w_rows, x_rows, xs, acc);

  if constexpr (kGateUp) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (lane != r || r >= rows || col >= p.inter) continue;
      const float v = silu(acc[0][r]) * acc[1][r];
      reinterpret_cast<__half*>(p.act)[int64_t(group_row0 + r) * p.inter + col] =
          __float2half_rn(v);
    }
  } else {
#pragma unroll
    for (int o = 0; o < kOutPerWarp; ++o) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (lane != o * kRows + r || r >= rows || w_rows[o] < 0) continue;
        const int pair = s_pair[r];
        p.terms[int64_t(pair) * p.hidden + col + o] = p.pair_weights[pair] * acc[o][r];
      }
    }
  }
}

template <class F, bool kGateUp>
void launch_rows(int tile_rows, const MoeParams& p, const dim3& grid, cudaStream_t stream) {
  const LaunchDims dims{grid, dim3(kGemvThreads)};
  switch (tile_rows) {
    case 1:
      launch_kernel(quant_moe_kernel<F, kGateUp, 1>, dims, stream, p);
      break;
    case 2:
      launch_kernel(quant_moe_kernel<F, kGateUp, 2>, dims, stream, p);
      break;
    case 4:
      launch_kernel(quant_moe_kernel<F, kGateUp, 4>, dims, stream, p);
      break;
    default:
      launch_kernel(quant_moe_kernel<F, kGateUp, quant::kGemvMaxRows>, dims, stream, p);
      break;
  }
}

template <WeightFormat kFormat, bool kGateUp>
void launch_format(bool fast, int tile_rows, const MoeParams& p, const dim3& grid,
                   cudaStream_t stream) {
  if (fast) {
    launch_rows<quant::Format<kFormat>, kGateUp>(tile_rows, p, grid, stream);
  } else {
    // Odd shapes only (small test models): the grouping's tiles hold at most 8 pairs.
    launch_kernel(quant_moe_kernel<quant::Exact<kFormat>, kGateUp, quant::kGemvMaxRows>,
                  LaunchDims{grid, dim3(kGemvThreads)}, stream, p);
  }
}

template <bool kGateUp>
void launch_projection(const LinearView& w, int tile_rows, const MoeParams& p, const dim3& grid,
                       cudaStream_t stream) {
  const bool fast = quant_weight_fast_path(w);
  switch (w.format) {
    case WeightFormat::kW4:
      launch_format<WeightFormat::kW4, kGateUp>(fast, tile_rows, p, grid, stream);
      break;
    case WeightFormat::kNvfp4:
      launch_format<WeightFormat::kNvfp4, kGateUp>(fast, tile_rows, p, grid, stream);
      break;
    case WeightFormat::kFp8Block:
      launch_format<WeightFormat::kFp8Block, kGateUp>(fast, tile_rows, p, grid, stream);
      break;
    case WeightFormat::kDense:
      launch_format<WeightFormat::kDense, kGateUp>(fast, tile_rows, p, grid, stream);
      break;
  }
}

constexpr size_t kWorkspaceAlign = 256;

size_t align_up(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Byte offsets in the workspace of one pass of `rows` rows.
struct WorkspaceLayout {
  size_t offsets = 0;  // int32 [n_experts + 1]
  size_t n_tiles = 0;  // int32 [1]
  size_t tiles = 0;    // int32 [max tiles, 2] (bounded for 1-pair tiles, which have the most)
  size_t perm = 0;     // int32 [n_pairs]
  size_t act = 0;      // FP16 [n_pairs, inter]
  size_t terms = 0;    // fp32 [n_pairs, hidden]
  size_t total = 0;
};

WorkspaceLayout workspace_layout(int64_t rows, int64_t top_k, int64_t n_experts, int64_t hidden,
                                 int64_t inter) {
  const int64_t n_pairs = rows * top_k;
  WorkspaceLayout l;
  size_t at = 0;
  const auto take = [&at](size_t bytes) {
    const size_t offset = at;
    at += align_up(bytes);
    return offset;
  };
  l.offsets = take(size_t(n_experts + 1) * 4);
  l.n_tiles = take(4);
  l.tiles = take(size_t(moe_max_tiles(n_pairs, n_experts, 1)) * 8);
  l.perm = take(size_t(n_pairs) * 4);
  l.act = take(size_t(n_pairs * inter) * 2);
  l.terms = take(size_t(n_pairs * hidden) * 4);
  l.total = at;
  return l;
}

bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

size_t quant_moe_workspace_bytes(int64_t max_rows, int64_t top_k, int64_t n_experts, int64_t hidden,
                                 int64_t inter) {
  return workspace_layout(std::max<int64_t>(max_rows, 1), std::max<int64_t>(top_k, 1),
                          std::max<int64_t>(n_experts, 1), std::max<int64_t>(hidden, 0),
                          std::max<int64_t>(inter, 0))
      .total;
}

Status quant_moe_experts(const uint16_t* x, const LinearView& gate_up, const LinearView& down,
                         int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                         const float* weights, int64_t n_rows, int64_t top_k, uint16_t* out,
                         void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  constexpr int64_t kMaxPairs = int64_t(1) << 30;
  constexpr int64_t kMaxGridY = 65535;
  if (n_experts < 1 || n_experts > kMoeMaxExperts || hidden < 1 || inter < 1 || top_k < 1 ||
      n_rows < 0 || n_rows > kMaxPairs / top_k ||
      (inter + kGemvWarps - 1) / kGemvWarps > kMaxGridY ||
      (hidden + 2 * kGemvWarps - 1) / (2 * kGemvWarps) > kMaxGridY) {
    return Status::error(cat("cuda moe_experts: unsupported shape n_experts=", n_experts,
                             " hidden=", hidden, " inter=", inter, " top_k=", top_k,
                             " n_rows=", n_rows, " (need n_experts <= ", kMoeMaxExperts,
                             ", n_rows * top_k <= 2^30)"));
  }
  if (gate_up.out != n_experts * 2 * inter || gate_up.in != hidden ||
      down.out != n_experts * hidden || down.in != inter) {
    return Status::error(cat("cuda moe_experts: expert weights gate_up [", gate_up.out, ", ",
                             gate_up.in, "] and down [", down.out, ", ", down.in,
                             "] do not match n_experts=", n_experts, " hidden=", hidden,
                             " inter=", inter));
  }
  E4KV_RETURN_IF_ERROR(quant_weight_supported(gate_up, "cuda moe_experts gate_up"));
  E4KV_RETURN_IF_ERROR(quant_weight_supported(down, "cuda moe_experts down"));
  if (n_rows == 0) return ok_status();
  if (x == nullptr || ids == nullptr || weights == nullptr || out == nullptr ||
      workspace == nullptr) {
    return Status::error("cuda moe_experts: null input, output or workspace");
  }
  if (!aligned(x, 8) || !aligned(out, 8) || !aligned(workspace, 16)) {
    return Status::error("cuda moe_experts: x and out must be 8-byte, workspace 16-byte aligned");
  }
  if (static_cast<const void*>(x) == static_cast<const void*>(out)) {
    return Status::error("cuda moe_experts: out must not alias x");
  }
  // The most rows per pass that the workspace holds (the layout grows with the rows).
  int64_t lo = 0;
  int64_t hi = n_rows;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (workspace_layout(mid, top_k, n_experts, hidden, inter).total <= workspace_bytes) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t pass_rows = lo;
  if (pass_rows == 0) {
    return Status::error(cat("cuda moe_experts: workspace of ", workspace_bytes,
                             " bytes is below the ",
                             quant_moe_workspace_bytes(1, top_k, n_experts, hidden, inter),
                             " bytes of one row (quant_moe_workspace_bytes)"));
  }

  auto* base = static_cast<unsigned char*>(workspace);
  for (int64_t r0 = 0; r0 < n_rows; r0 += pass_rows) {
    const int64_t rows = std::min(pass_rows, n_rows - r0);
    const int64_t n_pairs = rows * top_k;
    const WorkspaceLayout l = workspace_layout(rows, top_k, n_experts, hidden, inter);
    auto* offsets = reinterpret_cast<int32_t*>(base + l.offsets);
    auto* n_tiles = reinterpret_cast<int32_t*>(base + l.n_tiles);
    auto* tiles = reinterpret_cast<int32_t*>(base + l.tiles);
    auto* perm = reinterpret_cast<int32_t*>(base + l.perm);
    const int32_t* pass_ids = ids + r0 * top_k;

    // Pairs per non-empty expert, on average at most (the routing is on the device): the tile
    // height that wastes no rows when every expert gets one pair (decode).
    const int64_t per_expert =
        (n_pairs + std::min(n_pairs, n_experts) - 1) / std::min(n_pairs, n_experts);
    const int tile_rows = per_expert <= 1 ? 1 : per_expert <= 2 ? 2 : per_expert <= 4 ? 4 : 8;
    moe_group_pairs(pass_ids, n_pairs, n_experts, tile_rows, offsets, n_tiles, tiles, perm, stream);

    MoeParams p{};
    p.offsets = offsets;
    p.n_tiles = n_tiles;
    p.tiles = tiles;
    p.perm = perm;
    p.pair_weights = weights + r0 * top_k;
    p.act = reinterpret_cast<uint16_t*>(base + l.act);
    p.terms = reinterpret_cast<float*>(base + l.terms);
    p.hidden = int32_t(hidden);
    p.inter = int32_t(inter);
    p.top_k = int32_t(top_k);
    p.tile_rows = tile_rows;
    const auto grid_x = unsigned(moe_max_tiles(n_pairs, n_experts, tile_rows));

    MoeParams gate = p;
    gate.w = quant::quant_weight(gate_up);
    gate.a = x + r0 * hidden;
    launch_projection<true>(gate_up, tile_rows, gate,
                            dim3(grid_x, unsigned((inter + kGemvWarps - 1) / kGemvWarps)), stream);
    MoeParams proj = p;
    proj.w = quant::quant_weight(down);
    proj.a = p.act;
    launch_projection<false>(down, tile_rows, proj,
                             dim3(grid_x, unsigned((hidden + kOutPerWarp * kGemvWarps - 1) /
                                                   (kOutPerWarp * kGemvWarps))),
                             stream);
    moe_combine_terms(p.terms, pass_ids, rows, top_k, n_experts, hidden, out + r0 * hidden, stream);
  }
  return ok_status();
}

}  // namespace e4kv::cuda
