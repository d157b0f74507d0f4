// Sparse MoE on the GPU (see moe.cuh): the router and the routed experts as grouped GEMMs.
//
// Router: one warp per row. The FP16 logits are widened into shared memory, then softmax in fp32
// (warp max, exp, warp sum in a tree, one IEEE division per expert), then top_k rounds of a warp
// argmax over the experts not yet chosen, ordered by (p descending, id ascending) with a NaN p
// below every number, so the order is total and all lanes agree. Lane j keeps the j-th choice; the
// renormalisation sums the chosen p in selection order by shuffles, as the CPU does.
//
// Experts, per pass of rows (as many as the workspace holds; all of them when it is sized by
// moe_experts_workspace_bytes for the batch), four launches and no host synchronisation:
//   1. group (one CTA of 1024 threads): counts the (row, j) pairs of each expert in shared memory,
//      scans the counts over the experts (one expert per thread: n_experts <= 1024) into the group
//      offsets and the tile table (expert, first group row) of every tile of kRows pairs, and
//      writes the permutation that lists the pairs grouped by expert, stably (increasing row, then
//      j): chunks of 1024 pairs, where each warp ranks its lanes among equal ids with
//      __match_any_sync and the warps take their places from the per-expert cursor one after
//      another (a barrier each: an estimated 1-2K cycles per 1024 pairs, not measured).
//   2. gate/up GEMM: one CTA per (tile of an expert's pairs, kW/2 intermediate columns), grid
//      sized for the worst case over any routing (at most P / kRows + min(E, P) tiles); CTAs past
//      the device tile count exit. The CTA gathers its pairs' x rows (A) and the matching gate and
//      up rows of the expert (B: kW/2 of each), so silu(gate) * up is formed in registers; the
//      product is rounded to FP16 into act [P, inter] in group order.
//   3. down GEMM: the same grid over kW hidden columns; A = the tile's act rows (contiguous), B =
//      the expert's down rows; the epilogue scales by the pair's weight (one fp32 product, as the
//      reference rounds it) and writes terms [P, hidden] fp32 at the pair's own index (row * top_k
//      + j), so no order is lost.
//   4. combine: out[row] = FP16(sum over j of terms[row, j], from 0 in j order), skipping ids
//      outside [0, n_experts).
// With a few pairs per expert on average (<= kVecMaxPairsPerExpert: decode), 2 and 3 are instead
// warp-per-weight-row kernels over tiles of up to 8 pairs (see "few pairs per expert" below).
// GEMM tiles: 4 warps; FP16 mma.sync m16n8k16 with fp32 accumulation (two m16n8k8 below sm_80),
// operands through ldmatrix from shared memory rows padded by 16 bytes (conflict-free); two
// shared-memory stages, the next stage's 16-byte global loads held in registers during the math.
// Rows past the group, columns past the output and k past the reduction are zero-filled, so any
// hidden and inter that are multiples of 8 work. Two tile shapes: kRows 16 x kW 64 x k 64 when an
// expert gets few pairs on average (decode: the weights are read once, split over many CTAs), and
// 64 x 128 x 32 otherwise (each weight tile serves 64 pairs).
// note: correctness first, nothing timed yet. Neither GEMM uses cp.async, swizzled layouts or
// split-K; the group kernel is one CTA (fine for decode; for long prefill chunks its serial scatter
// may want a multi-CTA count / scan / scatter).
// Limits: n_experts <= 1024; hidden, inter multiples of 8; 16-byte aligned operands;
// n_rows * top_k <= 2^30. Instructions: ldmatrix, mma.sync (sm_75+), __match_any_sync (sm_70+).
#include "backend/cuda/moe.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"

namespace e4kv::cuda {
namespace {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

__device__ __forceinline__ float h2f(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}

// ---- router ------------------------------------------------------------------------------------

constexpr int kRouteWarps = 4;

struct RouteParams {
  const uint16_t* logits;   // [n_rows, n_experts] FP16, or
  const float* logits_f32;  // [n_rows, n_experts] fp32 (when not null)
  int64_t n_rows;
  int32_t n_experts;
  int32_t top_k;
  bool norm_topk_prob;
  int32_t* ids;    // [n_rows, out_k]
  float* weights;  // [n_rows, out_k]
  // top_k, or top_k + 1 when the shared expert runs among the experts: column top_k of every row
  // is then expert n_experts (the shared one) with weight 1 (its gate is applied in the combine).
  int32_t out_k;
};

// The selection order: a larger key, then a lower id. key is p, or -1 for a NaN p (p >= 0 else).
__device__ __forceinline__ bool route_before(float key_a, int id_a, float key_b, int id_b) {
  return key_a > key_b || (key_a == key_b && id_a < id_b);
}

// Routes `row` (< p.n_rows) with one warp; prob: n_experts floats of the warp's shared memory.
__device__ __forceinline__ void route_row(const RouteParams& p, int64_t row, float* prob,
                                          int lane) {
  const int n = p.n_experts;
  const uint16_t* logits = p.logits != nullptr ? p.logits + row * n : nullptr;
  const float* logits_f32 = p.logits_f32 != nullptr ? p.logits_f32 + row * n : nullptr;
  float row_max = -INFINITY;
  for (int e = lane; e < n; e += 32) {
    const float v = logits_f32 != nullptr ? logits_f32[e] : h2f(logits[e]);
    prob[e] = v;
    row_max = fmaxf(row_max, v);
  }
  for (int off = 16; off > 0; off /= 2) {
    row_max = fmaxf(row_max, __shfl_xor_sync(kFullMask, row_max, off));
  }
  float sum = 0.0f;
  for (int e = lane; e < n; e += 32) {
    const float ex = expf(prob[e] - row_max);
    prob[e] = ex;
    sum += ex;
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(kFullMask, sum, off);
  for (int e = lane; e < n; e += 32) prob[e] = prob[e] / sum;
  __syncwarp();  // lane j reads the chosen p of other lanes below

  uint32_t chosen = 0;  // bit t: expert lane + 32 t is taken
  int my_id = 0;        // lane j < top_k: the j-th choice
  float my_weight = 0.0f;
  for (int j = 0; j < p.top_k; ++j) {
    int best = -1;
    float best_key = -2.0f;  // below every key
    for (int t = 0, e = lane; e < n; ++t, e += 32) {
      if ((chosen >> t) & 1u) continue;
      const float v = prob[e];
      const float key = v == v ? v : -1.0f;
      if (key > best_key) {  // strict: the lower id stays on ties
        best = e;
        best_key = key;
      }
    }
    for (int off = 16; off > 0; off /= 2) {
      const int other = __shfl_xor_sync(kFullMask, best, off);
      const float other_key = __shfl_xor_sync(kFullMask, best_key, off);
      if (route_before(other_key, other, best_key, best)) {
        best = other;
        best_key = other_key;
      }
    }
    // best >= 0: an unchosen expert remains (top_k <= n_experts) and beats the sentinel.
    if ((best & 31) == lane) chosen |= 1u << (best >> 5);
    if (lane == j) {
      my_id = best;
      my_weight = prob[best];
    }
  }
  if (p.norm_topk_prob) {
    float chosen_sum = 0.0f;
    for (int j = 0; j < p.top_k; ++j) chosen_sum += __shfl_sync(kFullMask, my_weight, j);
    my_weight = my_weight / chosen_sum;
  }
  if (lane < p.top_k) {
    p.ids[row * p.out_k + lane] = my_id;
    p.weights[row * p.out_k + lane] = my_weight;
  } else if (lane < p.out_k) {
    p.ids[row * p.out_k + lane] = n;
    p.weights[row * p.out_k + lane] = 1.0f;
  }
}

__global__ void __launch_bounds__(kRouteWarps * 32)
    moe_route_kernel(const __grid_constant__ RouteParams p) {
  enter_dependent_grid();
  extern __shared__ float route_smem[];  // [kRouteWarps, n_experts]
  const int lane = int(threadIdx.x) & 31;
  const int warp = int(threadIdx.x) >> 5;
  const int64_t row = int64_t(blockIdx.x) * kRouteWarps + warp;
  if (row >= p.n_rows) return;
  route_row(p, row, route_smem + warp * p.n_experts, lane);
}

// ---- grouping ----------------------------------------------------------------------------------

constexpr int kGroupThreads = 1024;
static_assert(kMoeMaxExperts <= kGroupThreads, "the group kernel scans one expert per thread");

struct GroupParams {
  const int32_t* ids;  // [n_pairs] (the pass's [rows, top_k])
  int32_t n_pairs;
  int32_t n_experts;
  int32_t tile_rows;  // pairs per GEMM tile
  int32_t* offsets;   // [n_experts + 1]: group e is [offsets[e], offsets[e + 1]) of perm
  int32_t* n_tiles;   // [1]
  int32_t* tiles;     // [n_tiles, 2]: (expert, first row of the tile within the group)
  int32_t* perm;      // [offsets[n_experts]]: pair indices grouped by expert, increasing within
  // kRoute: the router first, one warp per row (route.n_rows <= kRouteGroupMaxRows), writing the
  // ids this kernel then groups (route.ids == ids).
  RouteParams route;
};

// Rows the group kernel routes itself (its prologue's shared memory: rows x n_experts floats).
constexpr int kRouteGroupMaxRows = 8;

// Inclusive warp scan of two values at once.
__device__ __forceinline__ void warp_scan2(int& a, int& b, int lane) {
  for (int off = 1; off < 32; off *= 2) {
    const int up_a = __shfl_up_sync(kFullMask, a, off);
    const int up_b = __shfl_up_sync(kFullMask, b, off);
    if (lane >= off) {
      a += up_a;
      b += up_b;
    }
  }
}

template <bool kRoute>
__global__ void __launch_bounds__(kGroupThreads)
    moe_group_kernel(const __grid_constant__ GroupParams p) {
  enter_dependent_grid();
  if constexpr (kRoute) {
    // The router of a decode step in the same launch: warp w routes row w; its global writes are
    // visible to the whole CTA after the barrier.
    extern __shared__ float route_prob[];  // [route.n_rows, n_experts]
    const int warp = int(threadIdx.x) >> 5;
    if (warp < p.route.n_rows) {
      route_row(p.route, warp, route_prob + warp * p.route.n_experts, int(threadIdx.x) & 31);
    }
    __syncthreads();
  }
  __shared__ int32_t s_count[kGroupThreads];  // per expert: the count, then the next free slot
  __shared__ int32_t s_tile_start[kGroupThreads + 1];  // per expert: its first tile; the total
  __shared__ int32_t s_warp_total[2][32];
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  s_count[tid] = 0;
  __syncthreads();
  for (int a = tid; a < p.n_pairs; a += kGroupThreads) {
    const int e = p.ids[a];
    if (unsigned(e) < unsigned(p.n_experts)) atomicAdd(&s_count[e], 1);
  }
  __syncthreads();

  // Exclusive scans over the experts of the pair counts and of the tile counts.
  const int count = s_count[tid];  // 0 past n_experts
  const int n_tile = (count + p.tile_rows - 1) / p.tile_rows;
  int pairs_before = count;
  int tiles_before = n_tile;
  warp_scan2(pairs_before, tiles_before, lane);
  if (lane == 31) {
    s_warp_total[0][warp] = pairs_before;
    s_warp_total[1][warp] = tiles_before;
  }
  __syncthreads();
  if (warp == 0) {
    const int own_pairs = s_warp_total[0][lane];
    const int own_tiles = s_warp_total[1][lane];
    int pairs = own_pairs;
    int tiles = own_tiles;
    warp_scan2(pairs, tiles, lane);
    s_warp_total[0][lane] = pairs - own_pairs;
    s_warp_total[1][lane] = tiles - own_tiles;
  }
  __syncthreads();
  pairs_before += s_warp_total[0][warp] - count;
  tiles_before += s_warp_total[1][warp] - n_tile;
  if (tid < p.n_experts) p.offsets[tid] = pairs_before;
  s_count[tid] = pairs_before;  // the cursor (this thread alone read the count)
  s_tile_start[tid] = tiles_before;
  if (tid == kGroupThreads - 1) {  // the counts past n_experts are 0: these are the totals
    p.offsets[p.n_experts] = pairs_before + count;
    *p.n_tiles = tiles_before + n_tile;
    s_tile_start[kGroupThreads] = tiles_before + n_tile;
  }
  __syncthreads();

  // Tile t belongs to the last expert whose first tile is <= t (experts before it with the same
  // first tile, and past n_experts, have none).
  for (int t = tid; t < s_tile_start[kGroupThreads]; t += kGroupThreads) {
    int lo = 0;
    int hi = kGroupThreads - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_tile_start[mid] <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    p.tiles[2 * t] = lo;
    p.tiles[2 * t + 1] = (t - s_tile_start[lo]) * p.tile_rows;
  }

  // Stable scatter: chunks of 1024 pairs; inside a chunk warp w places its 32 pairs in turn w.
  const unsigned lanes_before = (1u << lane) - 1u;
  for (int base = 0; base < p.n_pairs; base += kGroupThreads) {
    const int a = base + tid;
    const int e = a < p.n_pairs ? p.ids[a] : -1;
    const bool valid = unsigned(e) < unsigned(p.n_experts);
    const unsigned peers = __match_any_sync(kFullMask, valid ? e : -1);
    const int rank = __popc(peers & lanes_before);
    const int busy_warps = min(kGroupThreads / 32, (p.n_pairs - base + 31) / 32);
    for (int w = 0; w < busy_warps; ++w) {
      if (warp == w && valid) {
        const int leader = __ffs(int(peers)) - 1;
        int slot = 0;
        if (lane == leader) {
          slot = s_count[e];
          s_count[e] = slot + __popc(peers);
        }
        slot = __shfl_sync(peers, slot, leader);
        p.perm[slot + rank] = a;
      }
      __syncthreads();
    }
  }
}

// ---- grouped GEMMs -----------------------------------------------------------------------------

// A tile: kRows pairs x kW weight rows, kK of the reduction per stage, 4 warps.
template <int kRows_, int kW_, int kK_>
struct TileShape {
  static constexpr int kThreads = 128;
  static constexpr int kRows = kRows_;
  static constexpr int kW = kW_;
  static constexpr int kK = kK_;
  static constexpr int kLd =
      kK + 8;  // shared row stride in halfs: +16 bytes, ldmatrix conflict-free
  static constexpr int kWarpsM = kRows >= 32 ? 2 : 1;
  static constexpr int kWarpsN = 4 / kWarpsM;
  static constexpr int kMTiles = kRows / (16 * kWarpsM);  // m16 tiles per warp
  static constexpr int kWarpW = kW / kWarpsN;             // weight rows per warp
  static constexpr int kNTiles = kWarpW / 8;              // n8 tiles per warp
  static constexpr int kChunks = kK / 8;                  // 16-byte chunks per row and stage
  static constexpr int kALoads = (kRows * kChunks + kThreads - 1) / kThreads;
  static constexpr int kBLoads = (kW * kChunks + kThreads - 1) / kThreads;
  static constexpr int kStageHalfs = (kRows + kW) * kLd;
  static_assert(kMTiles >= 1 && kNTiles % 2 == 0 && kK % 16 == 0, "bad tile shape");
};
using SmallTile = TileShape<16, 64, 64>;
using LargeTile = TileShape<64, 128, 32>;

struct GemmParams {
  const uint16_t* a;  // gate/up: x [rows, hidden]; down: act [n_pairs, inter] (group order)
  const uint16_t* w;  // gate/up: gate_up [n_experts, 2 * inter, hidden]; down: [n_experts, hidden,
                      // inter]
  const int32_t* offsets;     // [n_experts + 1]
  const int32_t* n_tiles;     // [1]
  const int32_t* tiles;       // [n_tiles, 2]
  const int32_t* perm;        // [n_pairs]
  const float* pair_weights;  // [n_pairs] (down)
  uint16_t* act;              // [n_pairs, inter] FP16 (gate/up output)
  float* terms;               // [n_pairs, hidden] fp32, by pair index (down output)
  int32_t hidden;
  int32_t inter;
  int32_t top_k;  // pairs per row (the shared expert's among them when it runs here)
  // The shared expert as expert `shared_expert` (the routed experts' count; -1: none), its weights
  // at shared_w (gate/up: [2 * inter, hidden]; down: [hidden, inter]). Its gate and up sums and
  // its down output are rounded to FP16 as the dense MLP rounds them, and its term is not
  // weighted (warp-per-row kernels only).
  const uint16_t* shared_w;
  int32_t shared_expert;
};

// c += a (16x16) * b (16x8), FP16 in, fp32 accumulate.
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
#if E4KV_DEVICE_ARCH >= 800
  mma_m16n8k16(c, a[0], a[1], a[2], a[3], b0, b1);
#else
  mma_m16n8k8(c, a[0], a[1], b0);
  mma_m16n8k8(c, a[2], a[3], b1);
#endif
}

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

// kGateUp: act = FP16(silu(x gate_e^T) * (x up_e^T)); else terms[pair] = weight * (act down_e^T).
template <class S, bool kGateUp>
__global__ void __launch_bounds__(S::kThreads)
    moe_gemm_kernel(const __grid_constant__ GemmParams p) {
  enter_dependent_grid();
  const int tile = int(blockIdx.x);
  if (tile >= *p.n_tiles) return;
  __shared__ __align__(16) uint16_t smem[2 * S::kStageHalfs];  // stages of [kRows + kW][kLd]
  __shared__ int32_t s_pair[S::kRows];                         // pair index per tile row

  const int expert = p.tiles[2 * tile];
  const int m0 = p.tiles[2 * tile + 1];
  const int group_row0 = p.offsets[expert] + m0;  // the tile's first row in group order
  const int rows = min(S::kRows, p.offsets[expert + 1] - group_row0);
  const int reduce = kGateUp ? p.hidden : p.inter;
  constexpr int kCols = kGateUp ? S::kW / 2 : S::kW;  // output columns per CTA
  const int n0 = int(blockIdx.y) * kCols;
  const int tid = int(threadIdx.x);
  for (int r = tid; r < S::kRows; r += S::kThreads) {
    s_pair[r] = r < rows ? p.perm[group_row0 + r] : -1;
  }
  __syncthreads();

  // Global sources of this thread's 16-byte chunks (nullptr: zero-fill) and their offsets in a
  // stage; the chunk's k within the stage is 8 * (idx % kChunks).
  const uint16_t* a_src[S::kALoads];
  int a_dst[S::kALoads];
  int a_k[S::kALoads];
#pragma unroll
  for (int i = 0; i < S::kALoads; ++i) {
    const int idx = tid + i * S::kThreads;
    const int r = idx / S::kChunks;
    a_k[i] = 8 * (idx % S::kChunks);
    a_dst[i] = idx < S::kRows * S::kChunks ? r * S::kLd + a_k[i] : -1;
    a_src[i] = nullptr;
    if (a_dst[i] >= 0 && r < rows) {
      a_src[i] = kGateUp ? p.a + int64_t(s_pair[r] / p.top_k) * p.hidden
                         : p.a + int64_t(group_row0 + r) * p.inter;
    }
  }
  const uint16_t* b_src[S::kBLoads];
  int b_dst[S::kBLoads];
  int b_k[S::kBLoads];
#pragma unroll
  for (int i = 0; i < S::kBLoads; ++i) {
    const int idx = tid + i * S::kThreads;
    const int r = idx / S::kChunks;
    b_k[i] = 8 * (idx % S::kChunks);
    b_dst[i] = idx < S::kW * S::kChunks ? (S::kRows + r) * S::kLd + b_k[i] : -1;
    b_src[i] = nullptr;
    if (b_dst[i] < 0) continue;
    if constexpr (kGateUp) {
      const int col = r < S::kW / 2 ? n0 + r : n0 + r - S::kW / 2;  // intermediate column
      const int64_t w_row = r < S::kW / 2 ? col : p.inter + col;    // gate rows, then up rows
      if (col < p.inter) b_src[i] = p.w + (int64_t(expert) * 2 * p.inter + w_row) * p.hidden;
    } else {
      const int col = n0 + r;  // hidden column
      if (col < p.hidden) b_src[i] = p.w + (int64_t(expert) * p.hidden + col) * p.inter;
    }
  }

  uint4 a_reg[S::kALoads];
  uint4 b_reg[S::kBLoads];
  const auto load_stage = [&](int k0) {
#pragma unroll
    for (int i = 0; i < S::kALoads; ++i) {
      const int k = k0 + a_k[i];
      a_reg[i] = a_src[i] != nullptr && k < reduce
                     ? __ldg(reinterpret_cast<const uint4*>(a_src[i] + k))
                     : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < S::kBLoads; ++i) {
      const int k = k0 + b_k[i];
      b_reg[i] = b_src[i] != nullptr && k < reduce
                     ? __ldg(reinterpret_cast<const uint4*>(b_src[i] + k))
                     : make_uint4(0, 0, 0, 0);
    }
  };
  const auto store_stage = [&](uint16_t* stage) {
#pragma unroll
    for (int i = 0; i < S::kALoads; ++i) {
      if (a_dst[i] >= 0) *reinterpret_cast<uint4*>(stage + a_dst[i]) = a_reg[i];
    }
#pragma unroll
    for (int i = 0; i < S::kBLoads; ++i) {
      if (b_dst[i] >= 0) *reinterpret_cast<uint4*>(stage + b_dst[i]) = b_reg[i];
    }
  };

  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int warp_m = warp / S::kWarpsN;
  const int warp_n = warp % S::kWarpsN;
  constexpr int kHalf = S::kNTiles / 2;
  // The tile's weight row of n8 tile ni of this warp. gate/up: the first half of the warp's n8
  // tiles are gate rows, the second half the up rows of the same intermediate columns.
  const auto w_row = [&](int ni) {
    if constexpr (kGateUp) {
      return (ni < kHalf ? 0 : S::kW / 2) + warp_n * (S::kWarpW / 2) + (ni % kHalf) * 8;
    } else {
      return warp_n * S::kWarpW + ni * 8;
    }
  };

  float acc[S::kMTiles][S::kNTiles][4];
#pragma unroll
  for (int mi = 0; mi < S::kMTiles; ++mi) {
#pragma unroll
    for (int ni = 0; ni < S::kNTiles; ++ni) {
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.0f;
    }
  }

  const int n_stages = (reduce + S::kK - 1) / S::kK;
  load_stage(0);
  store_stage(smem);
  __syncthreads();
  for (int kt = 0; kt < n_stages; ++kt) {
    const bool more = kt + 1 < n_stages;
    if (more) load_stage((kt + 1) * S::kK);  // in flight during the math below
    const uint16_t* stage = smem + (kt & 1) * S::kStageHalfs;
    const uint16_t* stage_w = stage + S::kRows * S::kLd;
#pragma unroll
    for (int kk = 0; kk < S::kK; kk += 16) {
      uint32_t a_frag[S::kMTiles][4];
#pragma unroll
      for (int mi = 0; mi < S::kMTiles; ++mi) {
        const int r = (warp_m * S::kMTiles + mi) * 16 + (lane & 15);
        ldmatrix_x4(a_frag[mi], stage + r * S::kLd + kk + (lane >> 4) * 8);
      }
#pragma unroll
      for (int ni = 0; ni < S::kNTiles; ni += 2) {
        // Matrices: (ni, k 0-7), (ni, k 8-15), (ni + 1, k 0-7), (ni + 1, k 8-15).
        const int q = lane >> 3;
        const int r = w_row(ni + (q >> 1)) + (lane & 7);
        uint32_t b_frag[4];
        ldmatrix_x4(b_frag, stage_w + r * S::kLd + kk + (q & 1) * 8);
#pragma unroll
        for (int mi = 0; mi < S::kMTiles; ++mi) {
          mma_16x8x16(acc[mi][ni], a_frag[mi], b_frag[0], b_frag[1]);
          mma_16x8x16(acc[mi][ni + 1], a_frag[mi], b_frag[2], b_frag[3]);
        }
      }
    }
    if (more) store_stage(smem + ((kt + 1) & 1) * S::kStageHalfs);
    __syncthreads();
  }

  // Accumulator fragment q of (mi, ni): tile row group + 8 * (q / 2), column 2 * (lane % 4) + q
  // % 2.
  const int group = lane >> 2;
  const int col_in_n8 = 2 * (lane & 3);
#pragma unroll
  for (int mi = 0; mi < S::kMTiles; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (warp_m * S::kMTiles + mi) * 16 + group + 8 * h;
      if (r >= rows) continue;
      if constexpr (kGateUp) {
        uint16_t* act_row = p.act + int64_t(group_row0 + r) * p.inter;
#pragma unroll
        for (int t = 0; t < kHalf; ++t) {
          const int col = n0 + warp_n * (S::kWarpW / 2) + t * 8 + col_in_n8;
          if (col >= p.inter) continue;  // inter is even: col + 1 < inter too
          const float v0 = silu(acc[mi][t][2 * h]) * acc[mi][t + kHalf][2 * h];
          const float v1 = silu(acc[mi][t][2 * h + 1]) * acc[mi][t + kHalf][2 * h + 1];
          *reinterpret_cast<__half2*>(act_row + col) = __floats2half2_rn(v0, v1);
        }
      } else {
        const int pair = s_pair[r];
        const float weight = p.pair_weights[pair];
        float* term_row = p.terms + int64_t(pair) * p.hidden;
#pragma unroll
        for (int ni = 0; ni < S::kNTiles; ++ni) {
          const int col = n0 + warp_n * S::kWarpW + ni * 8 + col_in_n8;
          if (col >= p.hidden) continue;
          *reinterpret_cast<float2*>(term_row + col) =
              make_float2(weight * acc[mi][ni][2 * h], weight * acc[mi][ni][2 * h + 1]);
        }
      }
    }
  }
}

// ---- few pairs per expert: warp-per-weight-row kernels ------------------------------------------
// Decode steps give most experts one pair, where a 16-row MMA tile is 15/16 padding and its
// two-stage pipeline keeps ~16 KB of weights in flight per SM (a step's MoE ran at a third of the
// copy rate). These kernels take tiles of up to kVecRows pairs (the same group / tile table) and
// give each weight row to a warp: every lane issues all its 16-byte loads of a 2048-element
// stretch of its rows before using any (8 KB in flight per warp, 64 KB per CTA), the x or act rows
// come through the read-only cache, and no barrier is taken. fp32 products and sums as the MMA
// path (another order), the same FP16 rounding of act and the same epilogues.
// The grid is the CTAs resident at once (occupancy x SMs, at most one item per warp) and each warp
// walks the items (tile, weight row) strided by the grid's warps, the rows of a tile next to each
// other. One item per warp would take a decode step 640 CTAs, 2.4 waves at 2 CTAs per SM, each
// wave waiting for memory anew and the last one a third full.

constexpr int kVecRows = 8;        // pairs per tile
constexpr int kVecWarps = 8;       // warps per CTA
constexpr int kVecChunks = 8;      // gate/up: 16-byte loads per lane per weight row and pass
constexpr int kVecDownCols = 4;    // down: hidden columns (weight rows) per warp
constexpr int kVecDownChunks = 2;  // down: 16-byte loads per lane per weight row and pass
// Pairs per non-empty expert, on average, up to which moe_experts_f16 takes these kernels.
constexpr int64_t kVecMaxPairsPerExpert = 4;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// acc += the 8 products of two 16-byte FP16 chunks.
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w};
  const uint32_t xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&wv[i]));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&xv[i]));
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

struct VecTile {
  int expert;
  int group_row0;  // the tile's first row in group order
  int rows;
};

__device__ __forceinline__ VecTile vec_tile(const GemmParams& p, int tile) {
  VecTile t;
  t.expert = p.tiles[2 * tile];
  t.group_row0 = p.offsets[t.expert] + p.tiles[2 * tile + 1];
  t.rows = min(kVecRows, p.offsets[t.expert + 1] - t.group_row0);
  return t;
}

// One (tile, intermediate column) item of moe_vec_gate_up_kernel.
__device__ __forceinline__ void moe_vec_gate_up_item(const GemmParams& p, const VecTile& t, int col,
                                                     int lane) {
  const bool shared = t.expert == p.shared_expert;
  const uint16_t* g_row = shared ? p.shared_w + int64_t(col) * p.hidden
                                 : p.w + (int64_t(t.expert) * 2 * p.inter + col) * p.hidden;
  const uint16_t* u_row = g_row + int64_t(p.inter) * p.hidden;
  const uint16_t* x_rows[kVecRows];
#pragma unroll
  for (int r = 0; r < kVecRows; ++r) {
    x_rows[r] = r < t.rows ? p.a + int64_t(p.perm[t.group_row0 + r] / p.top_k) * p.hidden : p.a;
  }
  float g[kVecRows];
  float u[kVecRows];
#pragma unroll
  for (int r = 0; r < kVecRows; ++r) g[r] = u[r] = 0.0f;
  for (int base = 0; base < p.hidden; base += 32 * 8 * kVecChunks) {
    uint4 gw[kVecChunks];
    uint4 uw[kVecChunks];
#pragma unroll
    for (int c = 0; c < kVecChunks; ++c) {
      const int k = base + (c * 32 + lane) * 8;
      gw[c] = uw[c] = make_uint4(0u, 0u, 0u, 0u);
      if (k < p.hidden) {
        gw[c] = __ldg(reinterpret_cast<const uint4*>(g_row + k));
        uw[c] = __ldg(reinterpret_cast<const uint4*>(u_row + k));
      }
    }
#pragma unroll
    for (int r = 0; r < kVecRows; ++r) {
      if (r >= t.rows) break;
#pragma unroll
      for (int c = 0; c < kVecChunks; ++c) {
        const int k = base + (c * 32 + lane) * 8;
        if (k < p.hidden) {
          const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x_rows[r] + k));
          g[r] = dot8(gw[c], xv, g[r]);
          u[r] = dot8(uw[c], xv, u[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kVecRows; ++r) {
    if (r >= t.rows) break;
    float gs = warp_sum(g[r]);
    float us = warp_sum(u[r]);
    if (shared) {  // the dense MLP's gate/up projection writes FP16
      gs = __half2float(__float2half_rn(gs));
      us = __half2float(__float2half_rn(us));
    }
    if (lane == 0) {
      p.act[int64_t(t.group_row0 + r) * p.inter + col] =
          __half_as_ushort(__float2half_rn(silu(gs) * us));
    }
  }
}

// act[group row, c] = FP16(silu(x gate_c^T) * (x up_c^T)): one warp per intermediate column c.
__global__ void __launch_bounds__(kVecWarps * 32)
    moe_vec_gate_up_kernel(const __grid_constant__ GemmParams p) {
  enter_dependent_grid();
  const int lane = int(threadIdx.x) & 31;
  const int n_items = *p.n_tiles * p.inter;
  for (int item = int(blockIdx.x) * kVecWarps + int(threadIdx.x >> 5); item < n_items;
       item += int(gridDim.x) * kVecWarps) {
    moe_vec_gate_up_item(p, vec_tile(p, item / p.inter), item % p.inter, lane);
  }
}

// One (tile, kVecDownCols hidden columns from col0) item of moe_vec_down_kernel.
__device__ __forceinline__ void moe_vec_down_item(const GemmParams& p, const VecTile& t, int col0,
                                                  int lane) {
  const bool shared = t.expert == p.shared_expert;
  const uint16_t* w_base =
      shared ? p.shared_w : p.w + int64_t(t.expert) * int64_t(p.hidden) * p.inter;
  const uint16_t* w_rows[kVecDownCols];
#pragma unroll
  for (int o = 0; o < kVecDownCols; ++o) {
    w_rows[o] = col0 + o < p.hidden ? w_base + int64_t(col0 + o) * p.inter : nullptr;
  }
  float acc[kVecDownCols][kVecRows];
#pragma unroll
  for (int o = 0; o < kVecDownCols; ++o) {
#pragma unroll
    for (int r = 0; r < kVecRows; ++r) acc[o][r] = 0.0f;
  }
  for (int base = 0; base < p.inter; base += 32 * 8 * kVecDownChunks) {
    uint4 wv[kVecDownCols][kVecDownChunks];
#pragma unroll
    for (int o = 0; o < kVecDownCols; ++o) {
#pragma unroll
      for (int c = 0; c < kVecDownChunks; ++c) {
        const int k = base + (c * 32 + lane) * 8;
        wv[o][c] = w_rows[o] != nullptr && k < p.inter
                       ? __ldg(reinterpret_cast<const uint4*>(w_rows[o] + k))
                       : make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int r = 0; r < kVecRows; ++r) {
      if (r >= t.rows) break;
      const uint16_t* a_row = p.a + int64_t(t.group_row0 + r) * p.inter;
#pragma unroll
      for (int c = 0; c < kVecDownChunks; ++c) {
        const int k = base + (c * 32 + lane) * 8;
        if (k < p.inter) {
          const uint4 av = __ldg(reinterpret_cast<const uint4*>(a_row + k));
#pragma unroll
          for (int o = 0; o < kVecDownCols; ++o) acc[o][r] = dot8(wv[o][c], av, acc[o][r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kVecRows; ++r) {
    if (r >= t.rows) break;
    const int pair = p.perm[t.group_row0 + r];
    const float weight = p.pair_weights[pair];
    float* term_row = p.terms + int64_t(pair) * p.hidden;
#pragma unroll
    for (int o = 0; o < kVecDownCols; ++o) {
      const float v = warp_sum(acc[o][r]);
      // The shared expert's output as the dense MLP's down projection writes it (FP16).
      const float term = shared ? __half2float(__float2half_rn(v)) : weight * v;
      if (lane == o && col0 + o < p.hidden) term_row[col0 + o] = term;
    }
  }
}

// terms[pair, h] = weight * (act down_h^T): one warp per kVecDownCols hidden columns.
__global__ void __launch_bounds__(kVecWarps * 32)
    moe_vec_down_kernel(const __grid_constant__ GemmParams p) {
  enter_dependent_grid();
  const int lane = int(threadIdx.x) & 31;
  const int col_items = (p.hidden + kVecDownCols - 1) / kVecDownCols;
  const int n_items = *p.n_tiles * col_items;
  for (int item = int(blockIdx.x) * kVecWarps + int(threadIdx.x >> 5); item < n_items;
       item += int(gridDim.x) * kVecWarps) {
    moe_vec_down_item(p, vec_tile(p, item / col_items), (item % col_items) * kVecDownCols, lane);
  }
}

// ---- combine -----------------------------------------------------------------------------------

struct CombineParams {
  const float* terms;  // [n_rows * top_k, hidden] fp32, by pair index
  const int32_t* ids;  // [n_rows, top_k]
  int64_t n_rows;
  int32_t top_k;
  int32_t n_experts;
  int32_t hidden;
  uint16_t* out;  // [n_rows, hidden] FP16
  // Not null: then out[row] += sigmoid(shared_gate[row]) * shared_y[row] (the shared expert, as
  // sigmoid_gated_add_f16 adds it to the FP16 sum: the same fp32 operations and roundings).
  const uint16_t* shared_y;  // [n_rows, hidden] FP16
  const float* shared_gate;  // [n_rows] fp32 logits
  // The shared expert ran among the experts: its output is the FP16 value in the row's last term
  // (pair column top_k - 1) and is added as shared_y is (shared_y null, shared_gate set).
  bool shared_in_terms;
};

__global__ void moe_combine_kernel(const __grid_constant__ CombineParams p) {
  enter_dependent_grid();
  const int64_t quads = p.hidden / 4;
  const int64_t total = p.n_rows * quads;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / quads;
    const int64_t col = (i % quads) * 4;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const int routed = p.shared_in_terms ? p.top_k - 1 : p.top_k;
    for (int j = 0; j < routed; ++j) {
      const int64_t pair = row * p.top_k + j;
      if (unsigned(p.ids[pair]) >= unsigned(p.n_experts)) continue;
      const float4 t = *reinterpret_cast<const float4*>(p.terms + pair * p.hidden + col);
      sum.x += t.x;
      sum.y += t.y;
      sum.z += t.z;
      sum.w += t.w;
    }
    __half2 lo = __floats2half2_rn(sum.x, sum.y);
    __half2 hi = __floats2half2_rn(sum.z, sum.w);
    if (p.shared_y != nullptr || p.shared_in_terms) {
      const float g = 1.0f / (1.0f + expf(-p.shared_gate[row]));
      float2 y_lo;
      float2 y_hi;
      if (p.shared_in_terms) {
        const float4 t =
            *reinterpret_cast<const float4*>(p.terms + (row * p.top_k + routed) * p.hidden + col);
        y_lo = make_float2(t.x, t.y);
        y_hi = make_float2(t.z, t.w);
      } else {
        const uint2 raw = *reinterpret_cast<const uint2*>(p.shared_y + row * p.hidden + col);
        y_lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
        y_hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
      }
      const float2 o_lo = __half22float2(lo);
      const float2 o_hi = __half22float2(hi);
      lo = __floats2half2_rn(o_lo.x + __fmul_rn(g, y_lo.x), o_lo.y + __fmul_rn(g, y_lo.y));
      hi = __floats2half2_rn(o_hi.x + __fmul_rn(g, y_hi.x), o_hi.y + __fmul_rn(g, y_hi.y));
    }
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo);
    packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(p.out + row * p.hidden + col) = packed;
  }
}

// ---- host --------------------------------------------------------------------------------------

constexpr size_t kWorkspaceAlign = 256;

size_t align_up(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Tiles of tile_rows over any routing of n_pairs pairs to n_experts experts: at most
// min(n_experts, n_pairs) groups are non-empty, and sum ceil(c_e / R) <= (P + groups (R - 1)) / R.
int64_t max_tiles(int64_t n_pairs, int64_t n_experts, int64_t tile_rows) {
  const int64_t groups = std::min(n_pairs, n_experts);
  return (n_pairs + groups * (tile_rows - 1)) / tile_rows;
}

// Byte offsets in the workspace of one pass of `rows` rows.
struct WorkspaceLayout {
  size_t offsets = 0;  // int32 [n_experts + 1]
  size_t n_tiles = 0;  // int32 [1]
  size_t tiles = 0;    // int32 [max tiles, 2] (bounded for the smallest tile, which has most)
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
  l.tiles = take(size_t(max_tiles(n_pairs, n_experts, kVecRows)) * 8);
  l.perm = take(size_t(n_pairs) * 4);
  l.act = take(size_t(n_pairs * inter) * 2);
  l.terms = take(size_t(n_pairs * hidden) * 4);
  l.total = at;
  return l;
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

template <class S>
void launch_gemms(const GemmParams& base, const uint16_t* gate_up_w, const uint16_t* down_w,
                  int64_t n_pairs, int64_t n_experts, cudaStream_t stream) {
  const auto grid_x = unsigned(max_tiles(n_pairs, n_experts, S::kRows));
  GemmParams gate_up = base;
  gate_up.w = gate_up_w;
  const auto gate_up_cols = unsigned((base.inter + S::kW / 2 - 1) / (S::kW / 2));
  launch_kernel(moe_gemm_kernel<S, true>, LaunchDims{dim3(grid_x, gate_up_cols), dim3(S::kThreads)},
                stream, gate_up);
  GemmParams down = base;
  down.a = base.act;
  down.w = down_w;
  const auto down_cols = unsigned((base.hidden + S::kW - 1) / S::kW);
  launch_kernel(moe_gemm_kernel<S, false>, LaunchDims{dim3(grid_x, down_cols), dim3(S::kThreads)},
                stream, down);
}

}  // namespace

namespace {

// The router's checks and parameters (n_rows > 0).
Status route_params(const uint16_t* logits, const float* logits_f32, int64_t n_rows,
                    int64_t n_experts, int64_t top_k, bool norm_topk_prob, int32_t* ids,
                    float* weights, RouteParams* p) {
  if (n_rows < 0 || n_experts < 1 || n_experts > kMoeMaxExperts || top_k < 1 ||
      top_k > std::min(n_experts, kMoeMaxTopK)) {
    return Status::error(cat("cuda moe_route: unsupported shape n_rows=", n_rows, " n_experts=",
                             n_experts, " top_k=", top_k, " (need n_experts <= ", kMoeMaxExperts,
                             ", 1 <= top_k <= min(n_experts, ", kMoeMaxTopK, "))"));
  }
  if (n_rows > 0 &&
      ((logits == nullptr && logits_f32 == nullptr) || ids == nullptr || weights == nullptr)) {
    return Status::error("cuda moe_route: null logits, ids or weights");
  }
  *p = RouteParams{};
  p->logits = logits;
  p->logits_f32 = logits_f32;
  p->n_rows = n_rows;
  p->n_experts = int32_t(n_experts);
  p->top_k = int32_t(top_k);
  p->norm_topk_prob = norm_topk_prob;
  p->ids = ids;
  p->weights = weights;
  p->out_k = int32_t(top_k);
  return ok_status();
}

// The router's own launch: kRouteWarps rows a CTA.
void launch_route(const RouteParams& p, cudaStream_t stream) {
  const auto blocks = unsigned((p.n_rows + kRouteWarps - 1) / kRouteWarps);
  const size_t smem = size_t(kRouteWarps) * size_t(p.n_experts) * sizeof(float);  // <= 16 KB
  launch_kernel(moe_route_kernel, LaunchDims{dim3(blocks), dim3(kRouteWarps * 32), smem}, stream,
                p);
}

Status moe_route_any(const uint16_t* logits, const float* logits_f32, int64_t n_rows,
                     int64_t n_experts, int64_t top_k, bool norm_topk_prob, int32_t* ids,
                     float* weights, cudaStream_t stream) {
  RouteParams p;
  E4KV_RETURN_IF_ERROR(
      route_params(logits, logits_f32, n_rows, n_experts, top_k, norm_topk_prob, ids, weights, &p));
  if (n_rows == 0) return ok_status();
  launch_route(p, stream);
  return ok_status();
}

}  // namespace

Status moe_route_f16(const uint16_t* logits, int64_t n_rows, int64_t n_experts, int64_t top_k,
                     bool norm_topk_prob, int32_t* ids, float* weights, cudaStream_t stream) {
  return moe_route_any(logits, nullptr, n_rows, n_experts, top_k, norm_topk_prob, ids, weights,
                       stream);
}

Status moe_route_f32(const float* logits, int64_t n_rows, int64_t n_experts, int64_t top_k,
                     bool norm_topk_prob, int32_t* ids, float* weights, cudaStream_t stream) {
  return moe_route_any(nullptr, logits, n_rows, n_experts, top_k, norm_topk_prob, ids, weights,
                       stream);
}

int64_t moe_max_tiles(int64_t n_pairs, int64_t n_experts, int64_t tile_rows) {
  return max_tiles(n_pairs, n_experts, tile_rows);
}

namespace {

// moe_group_pairs, with `route` (not null): the router's rows first, in the same launch.
void group_pairs(const int32_t* ids, int64_t n_pairs, int64_t n_experts, int64_t tile_rows,
                 int32_t* offsets, int32_t* n_tiles, int32_t* tiles, int32_t* perm,
                 const RouteParams* route, cudaStream_t stream) {
  GroupParams g{};
  g.ids = ids;
  g.n_pairs = int32_t(n_pairs);
  g.n_experts = int32_t(n_experts);
  g.tile_rows = int32_t(tile_rows);
  g.offsets = offsets;
  g.n_tiles = n_tiles;
  g.tiles = tiles;
  g.perm = perm;
  if (route != nullptr) {
    g.route = *route;
    const size_t smem = size_t(route->n_rows) * size_t(route->n_experts) * sizeof(float);
    launch_kernel(moe_group_kernel<true>, LaunchDims{dim3(1), dim3(kGroupThreads), smem}, stream,
                  g);
    return;
  }
  launch_kernel(moe_group_kernel<false>, LaunchDims{dim3(1), dim3(kGroupThreads)}, stream, g);
}

}  // namespace

void moe_group_pairs(const int32_t* ids, int64_t n_pairs, int64_t n_experts, int64_t tile_rows,
                     int32_t* offsets, int32_t* n_tiles, int32_t* tiles, int32_t* perm,
                     cudaStream_t stream) {
  group_pairs(ids, n_pairs, n_experts, tile_rows, offsets, n_tiles, tiles, perm, nullptr, stream);
}

namespace {

// moe_combine_terms, with the shared expert's gated add when shared_y is not null.
void combine_terms(const float* terms, const int32_t* ids, int64_t n_rows, int64_t top_k,
                   int64_t n_experts, int64_t hidden, uint16_t* out, const uint16_t* shared_y,
                   const float* shared_gate, cudaStream_t stream, bool shared_in_terms = false) {
  CombineParams c{};
  c.shared_y = shared_y;
  c.shared_gate = shared_gate;
  c.shared_in_terms = shared_in_terms;
  c.terms = terms;
  c.ids = ids;
  c.n_rows = n_rows;
  c.top_k = int32_t(top_k);
  c.n_experts = int32_t(n_experts);
  c.hidden = int32_t(hidden);
  c.out = out;
  constexpr int kCombineThreads = 256;
  const int64_t quads = n_rows * (hidden / 4);
  const auto blocks =
      unsigned(std::clamp<int64_t>((quads + kCombineThreads - 1) / kCombineThreads, 1, 65536));
  launch_kernel(moe_combine_kernel, LaunchDims{dim3(blocks), dim3(kCombineThreads)}, stream, c);
}

}  // namespace

void moe_combine_terms(const float* terms, const int32_t* ids, int64_t n_rows, int64_t top_k,
                       int64_t n_experts, int64_t hidden, uint16_t* out, cudaStream_t stream) {
  combine_terms(terms, ids, n_rows, top_k, n_experts, hidden, out, nullptr, nullptr, stream);
}

size_t moe_experts_workspace_bytes(int64_t max_rows, int64_t top_k, int64_t n_experts,
                                   int64_t hidden, int64_t inter) {
  return workspace_layout(std::max<int64_t>(max_rows, 1), std::max<int64_t>(top_k, 1),
                          std::max<int64_t>(n_experts, 1), std::max<int64_t>(hidden, 0),
                          std::max<int64_t>(inter, 0))
      .total;
}

namespace {

// moe_experts_f16; with `route` (not null), the router writes ids and weights first: in the group
// kernel's launch when one pass takes every row and there are at most kRouteGroupMaxRows, else as
// moe_route_f32's own launch.
Status experts_f16(const uint16_t* x, const uint16_t* gate_up, const uint16_t* down,
                   int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                   const float* weights, int64_t n_rows, int64_t top_k, uint16_t* out,
                   void* workspace, size_t workspace_bytes, const RouteParams* route,
                   const uint16_t* shared_y, const float* shared_gate, cudaStream_t stream,
                   const uint16_t* shared_gate_up = nullptr,
                   const uint16_t* shared_down = nullptr) {
  constexpr int64_t kMaxPairs = int64_t(1) << 30;
  // The shared expert among the experts (moe_route_experts_shared_f16): one more pair a row, as
  // expert n_experts; ids and weights have top_k + 1 columns and the routed top_k come first.
  const bool shared_pair = shared_gate_up != nullptr;
  if (shared_pair) {
    if (shared_down == nullptr || shared_y != nullptr || shared_gate == nullptr ||
        route == nullptr || !aligned16(shared_gate_up) || !aligned16(shared_down) ||
        n_experts + 1 > kMoeMaxExperts || n_rows > kRouteGroupMaxRows || top_k + 1 > kMoeMaxTopK) {
      return Status::error(
          "cuda moe_experts: the shared expert among the experts needs both of its weights "
          "(16-byte aligned), its gate, the router, at most 8 rows, n_experts < 1024 and "
          "top_k < 32");
    }
    ++top_k;
    ++n_experts;
  }
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (n_experts < 1 || n_experts > kMoeMaxExperts || hidden < 8 || hidden % 8 != 0 ||
      hidden > kMaxDim || inter < 8 || inter % 8 != 0 || inter > kMaxDim || top_k < 1 ||
      n_rows < 0 || n_rows > kMaxPairs / top_k) {
    return Status::error(
        cat("cuda moe_experts: unsupported shape n_experts=", n_experts, " hidden=", hidden,
            " inter=", inter, " top_k=", top_k, " n_rows=", n_rows, " (need n_experts <= ",
            kMoeMaxExperts, ", hidden and inter positive multiples of 8, n_rows * top_k <= 2^30)"));
  }
  if (n_rows == 0) return ok_status();
  if (x == nullptr || gate_up == nullptr || down == nullptr || ids == nullptr ||
      weights == nullptr || out == nullptr || workspace == nullptr) {
    return Status::error("cuda moe_experts: null input, output or workspace");
  }
  if (!aligned16(x) || !aligned16(gate_up) || !aligned16(down) || !aligned16(out) ||
      !aligned16(workspace)) {
    return Status::error(
        "cuda moe_experts: x, gate_up, down, out and workspace must be 16-byte "
        "aligned");
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
                             moe_experts_workspace_bytes(1, top_k, n_experts, hidden, inter),
                             " bytes of one row (moe_experts_workspace_bytes)"));
  }
  const bool route_in_group =
      route != nullptr && n_rows <= kRouteGroupMaxRows && pass_rows >= n_rows;
  if (route != nullptr && !route_in_group) launch_route(*route, stream);

  auto* base = static_cast<unsigned char*>(workspace);
  for (int64_t r0 = 0; r0 < n_rows; r0 += pass_rows) {
    const int64_t rows = std::min(pass_rows, n_rows - r0);
    const int64_t n_pairs = rows * top_k;
    const WorkspaceLayout l = workspace_layout(rows, top_k, n_experts, hidden, inter);
    auto* offsets = reinterpret_cast<int32_t*>(base + l.offsets);
    auto* n_tiles = reinterpret_cast<int32_t*>(base + l.n_tiles);
    auto* tiles = reinterpret_cast<int32_t*>(base + l.tiles);
    auto* perm = reinterpret_cast<int32_t*>(base + l.perm);
    auto* act = reinterpret_cast<uint16_t*>(base + l.act);
    auto* terms = reinterpret_cast<float*>(base + l.terms);
    const int32_t* pass_ids = ids + r0 * top_k;

    // A few pairs per expert on average (decode): warp-per-weight-row kernels over tiles of up to
    // 8 pairs; up to 32: 16-pair MMA tiles, so the weights are split over many CTAs; otherwise
    // 64-pair tiles reuse each weight tile 64 times.
    const int64_t groups = std::min(n_pairs, n_experts);
    const bool vec = n_pairs <= kVecMaxPairsPerExpert * groups || shared_pair;
    const bool small = n_pairs < 32 * groups;
    const int tile_rows = vec ? kVecRows : small ? SmallTile::kRows : LargeTile::kRows;

    group_pairs(pass_ids, n_pairs, n_experts, tile_rows, offsets, n_tiles, tiles, perm,
                route_in_group ? route : nullptr, stream);

    GemmParams gp{};
    gp.a = x + r0 * hidden;
    gp.w = nullptr;
    gp.offsets = offsets;
    gp.n_tiles = n_tiles;
    gp.tiles = tiles;
    gp.perm = perm;
    gp.pair_weights = weights + r0 * top_k;
    gp.act = act;
    gp.terms = terms;
    gp.hidden = int32_t(hidden);
    gp.inter = int32_t(inter);
    gp.top_k = int32_t(top_k);
    gp.shared_expert = -1;
    if (vec) {
      // At most the resident CTAs, at most one item per warp of the worst-case routing.
      const int64_t tiles_max = max_tiles(n_pairs, n_experts, kVecRows);
      const auto grid = [&](auto kernel, int64_t items) {
        const int64_t ctas = (tiles_max * items + kVecWarps - 1) / kVecWarps;
        return unsigned(std::min<int64_t>(ctas, resident_ctas(kernel, kVecWarps * 32)));
      };
      if (shared_pair) gp.shared_expert = int32_t(n_experts - 1);
      GemmParams g = gp;
      g.w = gate_up;
      g.shared_w = shared_gate_up;
      launch_kernel(moe_vec_gate_up_kernel,
                    LaunchDims{dim3(grid(moe_vec_gate_up_kernel, inter)), dim3(kVecWarps * 32)},
                    stream, g);
      GemmParams d = gp;
      d.a = act;
      d.w = down;
      d.shared_w = shared_down;
      const int64_t down_items = (hidden + kVecDownCols - 1) / kVecDownCols;
      launch_kernel(moe_vec_down_kernel,
                    LaunchDims{dim3(grid(moe_vec_down_kernel, down_items)), dim3(kVecWarps * 32)},
                    stream, d);
    } else if (small) {
      launch_gemms<SmallTile>(gp, gate_up, down, n_pairs, n_experts, stream);
    } else {
      launch_gemms<LargeTile>(gp, gate_up, down, n_pairs, n_experts, stream);
    }

    combine_terms(terms, pass_ids, rows, top_k, shared_pair ? n_experts - 1 : n_experts, hidden,
                  out + r0 * hidden, shared_y != nullptr ? shared_y + r0 * hidden : nullptr,
                  shared_gate != nullptr ? shared_gate + r0 : nullptr, stream, shared_pair);
  }
  return ok_status();
}

}  // namespace

Status moe_experts_f16(const uint16_t* x, const uint16_t* gate_up, const uint16_t* down,
                       int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                       const float* weights, int64_t n_rows, int64_t top_k, uint16_t* out,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return experts_f16(x, gate_up, down, n_experts, hidden, inter, ids, weights, n_rows, top_k, out,
                     workspace, workspace_bytes, nullptr, nullptr, nullptr, stream);
}

Status moe_route_experts_f16(const float* logits, bool norm_topk_prob, const uint16_t* x,
                             const uint16_t* gate_up, const uint16_t* down, int64_t n_experts,
                             int64_t hidden, int64_t inter, int32_t* ids, float* weights,
                             int64_t n_rows, int64_t top_k, uint16_t* out, const uint16_t* shared_y,
                             const float* shared_gate, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  if ((shared_y == nullptr) != (shared_gate == nullptr)) {
    return Status::error("cuda moe_route_experts: shared_y and shared_gate go together");
  }
  if (shared_y != nullptr && reinterpret_cast<uintptr_t>(shared_y) % 8 != 0) {
    return Status::error("cuda moe_route_experts: shared_y must be 8-byte aligned");
  }
  RouteParams route;
  E4KV_RETURN_IF_ERROR(route_params(nullptr, logits, n_rows, n_experts, top_k, norm_topk_prob, ids,
                                    weights, &route));
  return experts_f16(x, gate_up, down, n_experts, hidden, inter, ids, weights, n_rows, top_k, out,
                     workspace, workspace_bytes, &route, shared_y, shared_gate, stream);
}

Status moe_route_experts_shared_f16(const float* logits, bool norm_topk_prob, const uint16_t* x,
                                    const uint16_t* gate_up, const uint16_t* down,
                                    int64_t n_experts, int64_t hidden, int64_t inter, int32_t* ids,
                                    float* weights, int64_t n_rows, int64_t top_k, uint16_t* out,
                                    const uint16_t* shared_gate_up, const uint16_t* shared_down,
                                    const float* shared_gate, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream) {
  static_assert(kMoeSharedInExpertsMaxRows == kRouteGroupMaxRows);
  if (shared_gate_up == nullptr || shared_down == nullptr || shared_gate == nullptr) {
    return Status::error("cuda moe_route_experts_shared: the shared expert's weights and gate");
  }
  RouteParams route;
  E4KV_RETURN_IF_ERROR(route_params(nullptr, logits, n_rows, n_experts, top_k, norm_topk_prob, ids,
                                    weights, &route));
  route.out_k = int32_t(top_k + 1);
  return experts_f16(x, gate_up, down, n_experts, hidden, inter, ids, weights, n_rows, top_k, out,
                     workspace, workspace_bytes, &route, nullptr, shared_gate, stream,
                     shared_gate_up, shared_down);
}

}  // namespace e4kv::cuda
