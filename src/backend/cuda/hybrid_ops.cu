// The small FP16 ops of the hybrid layers (see hybrid_ops.cuh). All are memory-bound and tiny at
// decode (about 4 us each on an H200 at batch 1, launch-bound), so each is one launch that reads
// every input once:
//   - row reductions (grouped / gated RMSNorm, PLE gate): 8, 16 or 32 lanes per row for rows of up
//     to 1024 values (the fewest that give each lane one vector: DeltaNet's 128-wide heads take
//     16), one 256-thread CTA per row above that; warp shuffles, then (CTA) 8 partials in shared
//     memory that every thread sums in the same order;
//   - elementwise ops (silu_scaled, hc_mix, hc_inject, hc_expand, sigmoid_gated_add, gates): grid
//     stride over vectors of 8 FP16 (one 16-byte load) when the row width and every pointer allow
//     it, else 2, else 1;
//   - conv1d_silu: a CTA stages the x rows of a chunk of the batch in shared memory, then one
//     thread per channel walks the rows in order (see the kernel's comment for why state reads and
//     writes cannot race).
// At 4096 rows (H200): the elementwise ops and the grouped norm run at 2.4-3.8 TB/s, the gated norm
// (128-wide rows) at 1.7 TB/s, conv1d_silu (8192 channels) at about 0.8 TB/s (170 us; the fp32
// expf and division of the SiLU and the serial walk of each column bound it). Unrolling the row
// walk by 4 took it to 142 us but cost about 0.8 us at batch-1 decode (a spill), so it is not.
// fp32 math; products that the CPU reference adds are formed with __fmul_rn so no FMA contraction
// changes them, so the fp32 values differ from the reference only by reduction order and expf /
// log1pf (<= 2 ulp); FP16 results are rounded once (round to nearest even).
#include "backend/cuda/hybrid_ops.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "backend/cpu/ple.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"
#include "core/check.h"
#include "core/status.h"

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Rows up to this many values get 8-32 lanes of a warp, longer rows one CTA.
constexpr int64_t kWarpRowMaxDim = 1024;

__device__ __forceinline__ float h2f(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t f2h(float x) {
  return __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}
__device__ __forceinline__ float silu(float x) {
  return x / (1.0f + expf(-x));
}

// kV FP16 values loaded or stored with one instruction (16, 4 or 2 bytes).
template <int kV>
struct alignas(2 * kV) HalfVec {
  uint16_t h[kV];
};

template <int kV>
__device__ __forceinline__ void load_vec(const uint16_t* p, float (&v)[kV]) {
  const HalfVec<kV> raw = *reinterpret_cast<const HalfVec<kV>*>(p);
#pragma unroll
  for (int i = 0; i < kV; ++i) v[i] = h2f(raw.h[i]);
}

template <int kV>
__device__ __forceinline__ void store_vec(uint16_t* p, const float (&v)[kV]) {
  HalfVec<kV> raw;
#pragma unroll
  for (int i = 0; i < kV; ++i) raw.h[i] = f2h(v[i]);
  *reinterpret_cast<HalfVec<kV>*>(p) = raw;
}

// The widest vector (8, 2 or 1 values) that divides `width` and whose alignment every pointer has
// (null pointers count as aligned). Rows of `width` values then start aligned too.
int vec_width(int64_t width, std::initializer_list<const void*> pointers) {
  for (const int v : {8, 2}) {
    bool ok = width % v == 0;
    for (const void* p : pointers) ok = ok && reinterpret_cast<uintptr_t>(p) % (2 * v) == 0;
    if (ok) return v;
  }
  return 1;
}

// A grid-stride launch over n work items.
LaunchDims flat(int64_t n) {
  const auto blocks = std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65536);
  return LaunchDims{dim3(static_cast<unsigned>(blocks)), dim3(kThreads)};
}

#define E4KV_GRID_STRIDE(i, n)                                              \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

// Sum over the kRowThreads threads of a row (8, 16 or 32 lanes of a warp, or the whole CTA); every
// thread gets the same value. Every lane of the warp must call it. `partials`: [kWarps] shared,
// used once per kernel.
template <int kRowThreads>
__device__ __forceinline__ float row_sum(float v, float* partials) {
  constexpr int kLanes = kRowThreads < 32 ? kRowThreads : 32;
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  if constexpr (kRowThreads <= 32) {
    return v;
  } else {
    static_assert(kRowThreads == kThreads);
    if (threadIdx.x % 32 == 0) partials[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += partials[w];
    return total;
  }
}

// ---- row norms ----------------------------------------------------------------------------------

enum class NormKind { kWeight, kOnePlusWeight, kGatedSilu, kGatedSigmoid };

struct RowNormParams {
  const uint16_t* x;       // [n_rows, dim] FP16 (grouped: rows * groups rows)
  const uint16_t* z;       // [n_rows, dim] FP16, gated kinds only
  const uint16_t* weight;  // [n_groups, dim] FP16; row r uses weight row r % n_groups
  uint16_t* out;           // [n_rows, dim] FP16, may alias x or z
  int64_t n_rows;
  int64_t n_groups;
  int64_t dim;
  float eps;
};

// kRowThreads threads per row: 8, 16 or 32 lanes (kThreads / kRowThreads rows per CTA; short rows
// such as DeltaNet's 128-wide heads take 16 lanes of 8 values, so no lane idles) or the whole CTA.
// Pass 1 sums the squares of the row, pass 2 reads each element again and writes it: every element
// is read and written by the same thread, after the row's reduction, so out may alias x (or z).
template <int kV, int kRowThreads, NormKind kKind>
__global__ void __launch_bounds__(kThreads)
    row_norm_kernel(const __grid_constant__ RowNormParams p) {
  enter_dependent_grid();
  __shared__ float partials[kWarps];
  constexpr int kRowsPerBlock = kThreads / kRowThreads;
  const int64_t row = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.x / kRowThreads;
  const int tid = threadIdx.x % kRowThreads;
  // A row past the end (last CTA, lane groups only) runs no loop but joins the warp's shuffles.
  const int64_t dim = row < p.n_rows ? p.dim : 0;
  const uint16_t* xr = p.x + row * p.dim;
  float ss = 0.0f;
  for (int64_t j = int64_t(tid) * kV; j < dim; j += int64_t(kRowThreads) * kV) {
    float v[kV];
    load_vec<kV>(xr + j, v);
#pragma unroll
    for (int i = 0; i < kV; ++i) ss += v[i] * v[i];
  }
  ss = row_sum<kRowThreads>(ss, partials);
  const float inv_rms = 1.0f / sqrtf(ss / float(p.dim) + p.eps);
  const uint16_t* wr = p.weight + (row % p.n_groups) * p.dim;
  uint16_t* yr = p.out + row * p.dim;
  for (int64_t j = int64_t(tid) * kV; j < dim; j += int64_t(kRowThreads) * kV) {
    float v[kV];
    float w[kV];
    load_vec<kV>(xr + j, v);
    load_vec<kV>(wr + j, w);
    if constexpr (kKind == NormKind::kGatedSilu || kKind == NormKind::kGatedSigmoid) {
      float z[kV];
      load_vec<kV>(p.z + row * p.dim + j, z);
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const float weighted = w[i] * (v[i] * inv_rms);
        const float gate = kKind == NormKind::kGatedSilu ? silu(z[i]) : sigmoid(z[i]);
        v[i] = weighted * gate;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const float gain = kKind == NormKind::kOnePlusWeight ? 1.0f + w[i] : w[i];
        v[i] = (v[i] * inv_rms) * gain;
      }
    }
    store_vec<kV>(yr + j, v);
  }
}

template <int kV, int kRowThreads, NormKind kKind>
void launch_row_norm_kernel(const RowNormParams& p, cudaStream_t stream) {
  constexpr int64_t kRowsPerBlock = kThreads / kRowThreads;
  const int64_t blocks = (p.n_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  launch_kernel(row_norm_kernel<kV, kRowThreads, kKind>,
                LaunchDims{dim3(static_cast<unsigned>(blocks)), dim3(kThreads)}, stream, p);
}

// The fewest lanes (8, 16, 32) that cover a row in one vector each, a CTA above kWarpRowMaxDim.
template <int kV, NormKind kKind>
void launch_row_norm(const RowNormParams& p, cudaStream_t stream) {
  if (p.dim > kWarpRowMaxDim) {
    launch_row_norm_kernel<kV, kThreads, kKind>(p, stream);
  } else if (p.dim > 16 * kV) {
    launch_row_norm_kernel<kV, 32, kKind>(p, stream);
  } else if (p.dim > 8 * kV) {
    launch_row_norm_kernel<kV, 16, kKind>(p, stream);
  } else {
    launch_row_norm_kernel<kV, 8, kKind>(p, stream);
  }
}

template <NormKind kKind>
void launch_row_norm(const RowNormParams& p, cudaStream_t stream) {
  E4KV_ASSERT(
      p.n_rows >= 0 && p.n_rows < (int64_t(1) << 31) && p.n_groups > 0 && p.dim > 0,
      cat("row norm: bad shape n_rows=", p.n_rows, " n_groups=", p.n_groups, " dim=", p.dim));
  if (p.n_rows == 0) return;
  switch (vec_width(p.dim, {p.x, p.z, p.weight, p.out})) {
    case 8:
      launch_row_norm<8, kKind>(p, stream);
      break;
    case 2:
      launch_row_norm<2, kKind>(p, stream);
      break;
    default:
      launch_row_norm<1, kKind>(p, stream);
      break;
  }
}

// ---- elementwise --------------------------------------------------------------------------------

template <int kV>
__global__ void silu_scaled_kernel(const uint16_t* x, int64_t n_vecs, float scale, uint16_t* out) {
  enter_dependent_grid();
  E4KV_GRID_STRIDE(i, n_vecs) {
    float v[kV];
    load_vec<kV>(x + i * kV, v);
#pragma unroll
    for (int j = 0; j < kV; ++j) v[j] = silu(v[j] * scale);
    store_vec<kV>(out + i * kV, v);
  }
}

// One thread per kV consecutive features of a row, summing the streams in order.
template <int kV>
__global__ void hc_mix_kernel(const uint16_t* __restrict__ up, const uint16_t* __restrict__ xn,
                              int64_t n_rows, int64_t n_streams, int64_t hidden,
                              uint16_t* __restrict__ mix) {
  enter_dependent_grid();
  const int64_t row_vecs = hidden / kV;
  const float streams = float(n_streams);
  E4KV_GRID_STRIDE(idx, n_rows * row_vecs) {
    const int64_t r = idx / row_vecs;
    const int64_t i = (idx - r * row_vecs) * kV;
    float sum[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) sum[j] = 0.0f;
    for (int64_t s = 0; s < n_streams; ++s) {
      const int64_t offset = (r * n_streams + s) * hidden + i;
      float u[kV];
      float v[kV];
      load_vec<kV>(up + offset, u);
      load_vec<kV>(xn + offset, v);
#pragma unroll
      for (int j = 0; j < kV; ++j) sum[j] += __fmul_rn(sigmoid(u[j]), v[j]);
    }
#pragma unroll
    for (int j = 0; j < kV; ++j) sum[j] = sum[j] / streams;
    store_vec<kV>(mix + r * hidden + i, sum);
  }
}

template <int kV>
__global__ void hc_inject_kernel(uint16_t* __restrict__ x, const uint16_t* __restrict__ y,
                                 const uint16_t* __restrict__ inj, int64_t n_rows,
                                 int64_t n_streams, int64_t hidden) {
  enter_dependent_grid();
  const int64_t row_vecs = hidden / kV;
  const float streams = float(n_streams);
  E4KV_GRID_STRIDE(idx, n_rows * n_streams * row_vecs) {
    const int64_t rs = idx / row_vecs;  // r * n_streams + s
    const int64_t i = (idx - rs * row_vecs) * kV;
    const int64_t r = rs / n_streams;
    const float gain = 2.0f * sigmoid(h2f(inj[rs]) / streams);
    float xv[kV];
    float yv[kV];
    load_vec<kV>(x + rs * hidden + i, xv);
    load_vec<kV>(y + r * hidden + i, yv);
#pragma unroll
    for (int j = 0; j < kV; ++j) xv[j] += __fmul_rn(gain, yv[j]);
    store_vec<kV>(x + rs * hidden + i, xv);
  }
}

template <int kV>
__global__ void hc_expand_kernel(const uint16_t* __restrict__ e, int64_t n_rows, int64_t n_streams,
                                 int64_t hidden, uint16_t* __restrict__ x) {
  enter_dependent_grid();
  const int64_t row_vecs = hidden / kV;
  E4KV_GRID_STRIDE(idx, n_rows * n_streams * row_vecs) {
    const int64_t rs = idx / row_vecs;
    const int64_t i = (idx - rs * row_vecs) * kV;
    const int64_t r = rs / n_streams;
    *reinterpret_cast<HalfVec<kV>*>(x + rs * hidden + i) =
        *reinterpret_cast<const HalfVec<kV>*>(e + r * hidden + i);
  }
}

template <int kV>
__global__ void sigmoid_gated_add_kernel(uint16_t* __restrict__ out, const uint16_t* __restrict__ y,
                                         const float* __restrict__ gate, int64_t n_rows,
                                         int64_t dim) {
  enter_dependent_grid();
  const int64_t row_vecs = dim / kV;
  E4KV_GRID_STRIDE(idx, n_rows * row_vecs) {
    const int64_t r = idx / row_vecs;
    const int64_t offset = r * dim + (idx - r * row_vecs) * kV;
    const float g = sigmoid(gate[r]);
    float o[kV];
    float v[kV];
    load_vec<kV>(out + offset, o);
    load_vec<kV>(y + offset, v);
#pragma unroll
    for (int j = 0; j < kV; ++j) o[j] += __fmul_rn(g, v[j]);
    store_vec<kV>(out + offset, o);
  }
}

__global__ void gated_delta_gates_kernel(const uint16_t* __restrict__ a,
                                         const uint16_t* __restrict__ b,
                                         const uint16_t* __restrict__ a_log,
                                         const uint16_t* __restrict__ dt_bias, int64_t n_rows,
                                         int64_t n_heads, float* __restrict__ g,
                                         float* __restrict__ beta) {
  enter_dependent_grid();
  E4KV_GRID_STRIDE(i, n_rows * n_heads) {
    const int64_t h = i % n_heads;
    const float s = h2f(a[i]) + h2f(dt_bias[h]);
    const float softplus = s > 20.0f ? s : log1pf(expf(s));
    const float decay_rate = expf(h2f(a_log[h]));
    g[i] = -decay_rate * softplus;
    beta[i] = sigmoid(h2f(b[i]));
  }
}

// ---- PLE gate -----------------------------------------------------------------------------------

// One CTA per (row, stream): the dot product over hidden, then the gated copy of val. The segment
// of kn / qn a CTA reads is the one it writes, after the reduction: out may alias kn or qn.
template <int kV>
__global__ void __launch_bounds__(kThreads)
    ple_gate_kernel(const uint16_t* kn, const uint16_t* qn, const uint16_t* __restrict__ val,
                    int64_t n_streams, int64_t hidden, float sqrt_hidden, uint16_t* out) {
  enter_dependent_grid();
  __shared__ float partials[kWarps];
  const int64_t rs = blockIdx.x;  // r * n_streams + s
  const int64_t r = rs / n_streams;
  float dot = 0.0f;
  for (int64_t i = int64_t(threadIdx.x) * kV; i < hidden; i += int64_t(kThreads) * kV) {
    float k[kV];
    float q[kV];
    load_vec<kV>(kn + rs * hidden + i, k);
    load_vec<kV>(qn + rs * hidden + i, q);
#pragma unroll
    for (int j = 0; j < kV; ++j) dot += k[j] * q[j];
  }
  dot = row_sum<kThreads>(dot, partials);
  // sign(g) * sqrt(max(|g|, 1e-6)), with sign(0) = 0 and NaN kept (ple.cpp's signed_sqrt).
  const float g = dot / sqrt_hidden;
  const float magnitude = sqrtf(fmaxf(fabsf(g), kPleGateMinMagnitude));
  const float signed_root = g > 0.0f ? magnitude : g < 0.0f ? -magnitude : g * magnitude;
  const float gate = sigmoid(signed_root);
  for (int64_t i = int64_t(threadIdx.x) * kV; i < hidden; i += int64_t(kThreads) * kV) {
    float v[kV];
    load_vec<kV>(val + r * hidden + i, v);
#pragma unroll
    for (int j = 0; j < kV; ++j) v[j] = gate * v[j];
    store_vec<kV>(out + rs * hidden + i, v);
  }
}

// ---- conv1d_silu --------------------------------------------------------------------------------

constexpr int kConvThreads = 128;  // channels per CTA
constexpr int kConvMaxChunkRows = 64;
// The planner sizes row chunks so that about this many CTAs run while rows are few (decode: one
// row per chunk up to 32 sequences at 8192 channels), and chunks of kConvMaxChunkRows beyond.
constexpr int64_t kConvTargetBlocks = 2048;
// row_begin and state_slot are copied to shared memory up to this many sequences (else read from
// global memory).
constexpr int64_t kConvSmemSeqs = 1024;
// New state rows loaded together (all loaded, then all stored).
constexpr int kConvStateBatch = 16;
// Shared memory at the limits (kernel 16, state 64 rows, 1024 sequences).
constexpr size_t kConvMaxSmemBytes =
    size_t(kConv1dMaxKernel) * kConvThreads * sizeof(float) + (2 * kConvSmemSeqs + 4) * 4 +
    size_t(kConvMaxChunkRows + 2 * kConv1dMaxState) * kConvThreads * sizeof(uint16_t);

struct Conv1dParams {
  const uint16_t* x;          // [n_rows, channels] FP16
  const uint16_t* weight;     // [channels, kernel] FP16
  uint16_t* states;           // [n_slots, n_state, channels] FP16, oldest first
  uint16_t* out;              // [n_rows, channels] FP16
  const int32_t* row_begin;   // [n_seqs + 1]
  const int32_t* state_slot;  // [n_seqs]
  int32_t n_seqs;
  int32_t channels;
  int32_t kernel;
  int32_t dilation;
  int32_t n_state;     // (kernel - 1) * dilation
  int32_t first_row;   // row_begin[0]
  int32_t end_row;     // row_begin[n_seqs]
  int32_t chunk_rows;  // rows per chunk, >= 1
  int32_t n_tiles;     // channel tiles of kConvThreads
  int32_t meta_ints;   // shared ints for row_begin and state_slot (0: read them from global)
  bool vec8;           // x rows staged 8 values per load (channels % 8 = 0, x 16-byte aligned)
};

// The sequence holding `row`: the last s with row_begin[s] <= row (empty sequences are skipped,
// their row_begin equals the next one's). Requires row_begin[0] <= row < row_begin[n_seqs].
__device__ __forceinline__ int seq_of_row(const int32_t* row_begin, int n_seqs, int row) {
  int lo = 0;
  int hi = n_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (row_begin[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Grid: n_tiles x n_chunks CTAs; CTA (tile, chunk) covers channels [tile * 128, +128) and the
// batch rows [first_row + chunk * chunk_rows, +chunk_rows). It stages the x rows its taps read in
// shared memory (one coalesced pass, 16-byte loads where aligned), then one thread per channel
// walks the rows in order; the taps read the stage, or the state before a sequence's first row.
//
// Who reads and writes a sequence's state:
//   - only its first n_state rows read the state (each tap reaches back at most n_state rows);
//   - the chunk holding the sequence's first row computes those rows, even past its own end, and
//     then rewrites the state; every other chunk skips them.
// So one thread owns each (sequence, channel) state column for the whole launch: it loads the new
// column (the last n_state inputs of [state | x]) and the old values its taps need, writes the
// outputs, then stores the new column in ascending batches (a batch's sources are old rows above
// it or x rows), as dilated_conv1d_silu does. No other thread touches it, so no barrier or second
// kernel is needed. The new state is a bit copy of inputs (never rounded), so a run split into
// calls anywhere gives the same outputs as one call.
// kKernel: the tap count when it is 4 (both of the model's convs), 0 for any other (p.kernel).
template <int kKernel>
__global__ void __launch_bounds__(kConvThreads)
    conv1d_silu_kernel(const __grid_constant__ Conv1dParams p) {
  enter_dependent_grid();
  extern __shared__ __align__(16) unsigned char conv_smem[];
  const int kernel = kKernel > 0 ? kKernel : p.kernel;
  float* tap_weight = reinterpret_cast<float*>(conv_smem);  // [kernel, 128]: conflict-free
  int32_t* meta = reinterpret_cast<int32_t*>(tap_weight + kernel * kConvThreads);
  uint16_t* stage = reinterpret_cast<uint16_t*>(meta + p.meta_ints);  // [stage rows, 128]
  const int tid = threadIdx.x;
  const int tile = int(blockIdx.x) % p.n_tiles;
  const int chunk = int(blockIdx.x) / p.n_tiles;
  const int c0 = tile * kConvThreads;
  const int tile_channels = min(kConvThreads, p.channels - c0);
  // The tile's weights are contiguous: [tile_channels, kernel] from weight[c0 * kernel].
  for (int j = tid; j < tile_channels * kernel; j += kConvThreads) {
    tap_weight[(j % kernel) * kConvThreads + j / kernel] =
        h2f(__ldg(p.weight + int64_t(c0) * kernel + j));
  }
  if (p.meta_ints > 0) {
    for (int j = tid; j <= p.n_seqs; j += kConvThreads) meta[j] = p.row_begin[j];
    if (p.n_state > 0) {
      for (int j = tid; j < p.n_seqs; j += kConvThreads) {
        meta[p.n_seqs + 1 + j] = p.state_slot[j];
      }
    }
  }
  __syncthreads();
  const int32_t* row_begin = p.meta_ints > 0 ? meta : p.row_begin;
  const int32_t* state_slot = p.meta_ints > 0 ? meta + p.n_seqs + 1 : p.state_slot;
  const int chunk_begin = p.first_row + chunk * p.chunk_rows;
  const int chunk_end = min(p.end_row, chunk_begin + p.chunk_rows);
  const int first_seq = seq_of_row(row_begin, p.n_seqs, chunk_begin);
  const int last_seq = seq_of_row(row_begin, p.n_seqs, chunk_end - 1);

  // Staged rows: from n_state rows before the chunk (not before its first sequence) to its end,
  // or further to the end of the first n_state rows of the last sequence starting in it.
  const int stage_begin = max(chunk_begin - p.n_state, row_begin[first_seq]);
  const int last_begin = row_begin[last_seq];
  const int stage_end = last_begin >= chunk_begin
                            ? max(chunk_end, min(row_begin[last_seq + 1], last_begin + p.n_state))
                            : chunk_end;
  const int n_stage = stage_end - stage_begin;  // <= chunk_rows + 2 * n_state
  if (p.vec8) {
    const int row_vecs = tile_channels / 8;
#pragma unroll 4
    for (int i = tid; i < n_stage * row_vecs; i += kConvThreads) {
      const int r = i / row_vecs;
      const int v = i - r * row_vecs;
      *reinterpret_cast<uint4*>(stage + r * kConvThreads + v * 8) = __ldg(
          reinterpret_cast<const uint4*>(p.x + int64_t(stage_begin + r) * p.channels + c0 + v * 8));
    }
  } else {
#pragma unroll 4
    for (int i = tid; i < n_stage * tile_channels; i += kConvThreads) {
      const int r = i / tile_channels;
      const int ch = i - r * tile_channels;
      stage[r * kConvThreads + ch] = __ldg(p.x + int64_t(stage_begin + r) * p.channels + c0 + ch);
    }
  }
  __syncthreads();
  if (tid >= tile_channels) return;
  const int c = c0 + tid;

  for (int s = first_seq; s <= last_seq; ++s) {
    const int begin = row_begin[s];
    const int end = row_begin[s + 1];
    const int n = end - begin;
    // The sequence starts in this chunk (only the first one may start before it).
    const bool owns_start = begin >= chunk_begin;
    // Rows [row_lo, row_hi) of this sequence are this chunk's (none when the sequence is empty).
    const int row_lo = owns_start ? begin : max(chunk_begin, begin + p.n_state);
    const int row_hi =
        owns_start ? min(end, max(chunk_end, begin + p.n_state)) : min(end, chunk_end);
    if (row_hi <= row_lo) continue;
    uint16_t* state =
        p.n_state > 0 ? p.states + int64_t(state_slot[s]) * p.n_state * p.channels + c : nullptr;
    // Input j of the sequence in this call (j < 0: the state), from global memory.
    auto input = [&](int j) {
      return j < 0 ? state[(p.n_state + j) * p.channels]
                   : __ldg(p.x + int64_t(begin + j) * p.channels + c);
    };
    uint16_t moved[kConvStateBatch];
    auto load_state_batch = [&](int r0) {
#pragma unroll
      for (int i = 0; i < kConvStateBatch; ++i) {
        if (r0 + i < p.n_state) moved[i] = input(r0 + i + n - p.n_state);
      }
    };
    if (owns_start) load_state_batch(0);
    for (int t = row_lo; t < row_hi; ++t) {
      float sum = 0.0f;
#pragma unroll 4
      for (int k = 0; k < kernel; ++k) {
        const int j = t - (kernel - 1 - k) * p.dilation;
        const uint16_t v = j < begin ? state[(p.n_state + j - begin) * p.channels]
                                     : stage[(j - stage_begin) * kConvThreads + tid];
        sum += __fmul_rn(tap_weight[k * kConvThreads + tid], h2f(v));
      }
      p.out[int64_t(t) * p.channels + c] = f2h(silu(sum));
    }
    if (owns_start) {
      for (int r0 = 0; r0 < p.n_state; r0 += kConvStateBatch) {
        if (r0 > 0) load_state_batch(r0);
#pragma unroll
        for (int i = 0; i < kConvStateBatch; ++i) {
          if (r0 + i < p.n_state) state[(r0 + i) * p.channels] = moved[i];
        }
      }
    }
  }
}

}  // namespace

void rms_norm_grouped_f16(const uint16_t* x, const uint16_t* weight, int64_t n_rows,
                          int64_t n_groups, int64_t dim, float eps, RmsNormForm form, uint16_t* out,
                          cudaStream_t stream) {
  const RowNormParams p{x, nullptr, weight, out, n_rows * n_groups, n_groups, dim, eps};
  if (form == RmsNormForm::kOnePlusWeight) {
    launch_row_norm<NormKind::kOnePlusWeight>(p, stream);
  } else {
    launch_row_norm<NormKind::kWeight>(p, stream);
  }
}

void gated_rms_norm_f16(const uint16_t* x, const uint16_t* z, const uint16_t* weight,
                        int64_t n_rows, int64_t dim, float eps, bool sigmoid_gate, uint16_t* out,
                        cudaStream_t stream) {
  const RowNormParams p{x, z, weight, out, n_rows, 1, dim, eps};
  if (sigmoid_gate) {
    launch_row_norm<NormKind::kGatedSigmoid>(p, stream);
  } else {
    launch_row_norm<NormKind::kGatedSilu>(p, stream);
  }
}

void silu_scaled_f16(const uint16_t* x, int64_t n, float scale, uint16_t* out,
                     cudaStream_t stream) {
  E4KV_ASSERT(n >= 0, cat("silu_scaled_f16: bad size ", n));
  if (n == 0) return;
  switch (vec_width(n, {x, out})) {
    case 8:
      launch_kernel(silu_scaled_kernel<8>, flat(n / 8), stream, x, n / 8, scale, out);
      break;
    case 2:
      launch_kernel(silu_scaled_kernel<2>, flat(n / 2), stream, x, n / 2, scale, out);
      break;
    default:
      launch_kernel(silu_scaled_kernel<1>, flat(n), stream, x, n, scale, out);
      break;
  }
}

void hc_mix_f16(const uint16_t* up, const uint16_t* xn, int64_t n_rows, int64_t n_streams,
                int64_t hidden, uint16_t* mix, cudaStream_t stream) {
  E4KV_ASSERT(n_rows >= 0 && n_streams > 0 && hidden > 0,
              cat("hc_mix_f16: bad shape ", n_rows, " x ", n_streams, " x ", hidden));
  if (n_rows == 0) return;
  const int v = vec_width(hidden, {up, xn, mix});
  const LaunchDims dims = flat(n_rows * hidden / v);
  if (v == 8) {
    launch_kernel(hc_mix_kernel<8>, dims, stream, up, xn, n_rows, n_streams, hidden, mix);
  } else if (v == 2) {
    launch_kernel(hc_mix_kernel<2>, dims, stream, up, xn, n_rows, n_streams, hidden, mix);
  } else {
    launch_kernel(hc_mix_kernel<1>, dims, stream, up, xn, n_rows, n_streams, hidden, mix);
  }
}

void hc_inject_f16(uint16_t* x, const uint16_t* y, const uint16_t* inj, int64_t n_rows,
                   int64_t n_streams, int64_t hidden, cudaStream_t stream) {
  E4KV_ASSERT(n_rows >= 0 && n_streams > 0 && hidden > 0,
              cat("hc_inject_f16: bad shape ", n_rows, " x ", n_streams, " x ", hidden));
  if (n_rows == 0) return;
  const int v = vec_width(hidden, {x, y});
  const LaunchDims dims = flat(n_rows * n_streams * hidden / v);
  if (v == 8) {
    launch_kernel(hc_inject_kernel<8>, dims, stream, x, y, inj, n_rows, n_streams, hidden);
  } else if (v == 2) {
    launch_kernel(hc_inject_kernel<2>, dims, stream, x, y, inj, n_rows, n_streams, hidden);
  } else {
    launch_kernel(hc_inject_kernel<1>, dims, stream, x, y, inj, n_rows, n_streams, hidden);
  }
}

void hc_expand_f16(const uint16_t* e, int64_t n_rows, int64_t n_streams, int64_t hidden,
                   uint16_t* x, cudaStream_t stream) {
  E4KV_ASSERT(n_rows >= 0 && n_streams > 0 && hidden > 0,
              cat("hc_expand_f16: bad shape ", n_rows, " x ", n_streams, " x ", hidden));
  if (n_rows == 0) return;
  const int v = vec_width(hidden, {e, x});
  const LaunchDims dims = flat(n_rows * n_streams * hidden / v);
  if (v == 8) {
    launch_kernel(hc_expand_kernel<8>, dims, stream, e, n_rows, n_streams, hidden, x);
  } else if (v == 2) {
    launch_kernel(hc_expand_kernel<2>, dims, stream, e, n_rows, n_streams, hidden, x);
  } else {
    launch_kernel(hc_expand_kernel<1>, dims, stream, e, n_rows, n_streams, hidden, x);
  }
}

bool conv1d_silu_f16_supported(int64_t kernel, int64_t dilation) {
  return kernel > 0 && kernel <= kConv1dMaxKernel && dilation > 0 &&
         (kernel - 1) * dilation <= kConv1dMaxState;
}

void conv1d_silu_f16(const uint16_t* x, int64_t channels, const uint16_t* weight, int64_t kernel,
                     int64_t dilation, uint16_t* states, const SequenceRowsView& seqs,
                     uint16_t* out, cudaStream_t stream) {
  E4KV_ASSERT(
      channels > 0 && channels < (int64_t(1) << 30) && conv1d_silu_f16_supported(kernel, dilation),
      cat("conv1d_silu_f16: unsupported shape channels=", channels, " kernel=", kernel,
          " dilation=", dilation));
  if (seqs.n_seqs <= 0) return;
  E4KV_ASSERT(seqs.row_begin != nullptr, "conv1d_silu_f16: no row_begin");
  const int64_t first_row = seqs.first_row;
  const int64_t end_row = seqs.end_row;
  const int64_t n_rows = end_row - first_row;
  if (n_rows <= 0) return;
  const int64_t n_state = (kernel - 1) * dilation;
  E4KV_ASSERT(n_state == 0 || (states != nullptr && seqs.state_slot != nullptr),
              "conv1d_silu_f16: null states or state_slot");
  const int64_t n_tiles = (channels + kConvThreads - 1) / kConvThreads;
  // Few rows (decode): short chunks, so that about kConvTargetBlocks CTAs share the rows; many
  // rows (prefill): chunks of kConvMaxChunkRows.
  const int64_t chunk_rows = std::clamp<int64_t>(
      (n_rows * n_tiles + kConvTargetBlocks - 1) / kConvTargetBlocks, 1, kConvMaxChunkRows);
  const int64_t n_chunks = (n_rows + chunk_rows - 1) / chunk_rows;
  const int64_t blocks = n_tiles * n_chunks;
  E4KV_ASSERT(blocks < (int64_t(1) << 31) && seqs.n_seqs < (int64_t(1) << 30),
              cat("conv1d_silu_f16: too many rows x channels (", n_rows, " x ", channels, ")"));
  const int64_t meta_ints =
      seqs.n_seqs <= kConvSmemSeqs ? (2 * seqs.n_seqs + 1 + 3) / 4 * 4 : 0;  // 16-byte multiple
  Conv1dParams p{};
  p.x = x;
  p.weight = weight;
  p.states = states;
  p.out = out;
  p.row_begin = seqs.row_begin;
  p.state_slot = seqs.state_slot;
  p.n_seqs = int32_t(seqs.n_seqs);
  p.channels = int32_t(channels);
  p.kernel = int32_t(kernel);
  p.dilation = int32_t(dilation);
  p.n_state = int32_t(n_state);
  p.first_row = int32_t(first_row);
  p.end_row = int32_t(end_row);
  p.chunk_rows = int32_t(chunk_rows);
  p.n_tiles = int32_t(n_tiles);
  p.meta_ints = int32_t(meta_ints);
  p.vec8 = channels % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  LaunchDims dims{dim3(static_cast<unsigned>(blocks)), dim3(kConvThreads)};
  dims.smem_bytes = size_t(kernel) * kConvThreads * sizeof(float) + size_t(meta_ints) * 4 +
                    size_t(chunk_rows + 2 * n_state) * kConvThreads * sizeof(uint16_t);
  const auto kernel_fn = kernel == 4 ? conv1d_silu_kernel<4> : conv1d_silu_kernel<0>;
  if (dims.smem_bytes > 48 * 1024) {
    set_attribute_once(kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       int(kConvMaxSmemBytes));
  }
  launch_kernel(kernel_fn, dims, stream, p);
}

void gated_delta_gates_f16(const uint16_t* a, const uint16_t* b, const uint16_t* a_log,
                           const uint16_t* dt_bias, int64_t n_rows, int64_t n_heads, float* g,
                           float* beta, cudaStream_t stream) {
  E4KV_ASSERT(n_rows >= 0 && n_heads > 0,
              cat("gated_delta_gates_f16: bad shape ", n_rows, " x ", n_heads));
  if (n_rows == 0) return;
  launch_kernel(gated_delta_gates_kernel, flat(n_rows * n_heads), stream, a, b, a_log, dt_bias,
                n_rows, n_heads, g, beta);
}

void sigmoid_gated_add_f16(uint16_t* out, const uint16_t* y, const float* gate, int64_t n_rows,
                           int64_t dim, cudaStream_t stream) {
  E4KV_ASSERT(n_rows >= 0 && dim > 0, cat("sigmoid_gated_add_f16: bad shape ", n_rows, " x ", dim));
  if (n_rows == 0) return;
  const int v = vec_width(dim, {out, y});
  const LaunchDims dims = flat(n_rows * dim / v);
  if (v == 8) {
    launch_kernel(sigmoid_gated_add_kernel<8>, dims, stream, out, y, gate, n_rows, dim);
  } else if (v == 2) {
    launch_kernel(sigmoid_gated_add_kernel<2>, dims, stream, out, y, gate, n_rows, dim);
  } else {
    launch_kernel(sigmoid_gated_add_kernel<1>, dims, stream, out, y, gate, n_rows, dim);
  }
}

void ple_gate_f16(const uint16_t* kn, const uint16_t* qn, const uint16_t* val, int64_t n_rows,
                  int64_t n_streams, int64_t hidden, uint16_t* out, cudaStream_t stream) {
  E4KV_ASSERT(n_rows >= 0 && n_streams > 0 && hidden > 0 && n_rows * n_streams < (int64_t(1) << 31),
              cat("ple_gate_f16: bad shape ", n_rows, " x ", n_streams, " x ", hidden));
  if (n_rows == 0) return;
  const float sqrt_hidden = float(std::sqrt(double(hidden)));  // as ple.cpp: math.sqrt(H) in fp32
  const LaunchDims dims{dim3(static_cast<unsigned>(n_rows * n_streams)), dim3(kThreads)};
  switch (vec_width(hidden, {kn, qn, val, out})) {
    case 8:
      launch_kernel(ple_gate_kernel<8>, dims, stream, kn, qn, val, n_streams, hidden, sqrt_hidden,
                    out);
      break;
    case 2:
      launch_kernel(ple_gate_kernel<2>, dims, stream, kn, qn, val, n_streams, hidden, sqrt_hidden,
                    out);
      break;
    default:
      launch_kernel(ple_gate_kernel<1>, dims, stream, kn, qn, val, n_streams, hidden, sqrt_hidden,
                    out);
      break;
  }
}

}  // namespace e4kv::cuda
