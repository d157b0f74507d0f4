#include "backend/cuda/hc_mix_fused.cuh"

#include <cuda_fp16.h>

#include "backend/cuda/launch.cuh"
#include "core/check.h"
#include "core/status.h"

namespace e4kv::cuda {
namespace {

// Both launches: 8 warps a CTA. Launch 1 gives each (output, stream) pair a warp, so a CTA holds
// 8 / streams outputs with all their streams and sums the streams' partial dots in shared memory.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStreams = 8;
constexpr int kMaxRankChunks = 4;  // rank <= 4 * 32 lanes * 8 values
constexpr int kSliceChunks = 8;  // launch 1: a warp's pass over its stream covers 32 * 8 * 8 values
constexpr size_t kMaxActBytes = 48 * 1024;

struct HcMixParams {
  uint16_t* x;  // read; with a pending injection, launch 2 writes it back injected
  const uint16_t* norm_weight;
  const uint16_t* down;
  const uint16_t* up;
  const uint16_t* inject;
  uint16_t* mix;
  uint16_t* inj;
  float* act;                   // [n_rows, rank] silu(down / S), each value FP16-rounded
  float* inv;                   // [n_rows, streams] the streams' 1 / rms
  const uint16_t* pending_y;    // [n_rows, hidden] or null: an injection not yet applied to x
  const uint16_t* pending_inj;  // [n_rows, streams] its logits
  int n_rows;
  int streams;
  int hidden;
  int rank;
  float eps;
};

__device__ __forceinline__ float h2f(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t f2h(float x) {
  return __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ float round_h(float x) {
  return h2f(f2h(x));
}

struct alignas(16) Half8 {
  uint16_t h[8];
};

// hc_inject's gain for (row, stream) (hybrid_ops.cu: 2 sigmoid(inj / streams), the same fp32
// operations).
__device__ __forceinline__ float inject_gain(const HcMixParams& p, int r, int s) {
  const float logit = h2f(p.pending_inj[r * p.streams + s]) / float(p.streams);
  return 2.0f * (1.0f / (1.0f + expf(-logit)));
}

// x[r, s, j..j+8) as hc_inject(x, pending_y, pending_inj) leaves it: FP16(x + fl(gain * y)), or x
// itself without a pending injection.
__device__ __forceinline__ void load_x8(const HcMixParams& p, int r, int s, int j, float gain,
                                        float (&v)[8]);

__device__ __forceinline__ void load8(const uint16_t* p, float (&v)[8]) {
  const Half8 raw = *reinterpret_cast<const Half8*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = h2f(raw.h[i]);
}

__device__ __forceinline__ void load_x8(const HcMixParams& p, int r, int s, int j, float gain,
                                        float (&v)[8]) {
  load8(p.x + int64_t(r) * p.streams * p.hidden + int64_t(s) * p.hidden + j, v);
  if (p.pending_y != nullptr) {
    float y[8];
    load8(p.pending_y + int64_t(r) * p.hidden + j, y);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = round_h(__fadd_rn(v[i], __fmul_rn(gain, y[i])));
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  return v;
}

__device__ __forceinline__ void load8_raw(const uint16_t* p, Half8& v) {
  v = *reinterpret_cast<const Half8*>(p);
}

// Launch 1's epilogue (both kernel pairs): CTA 0 stores the rows' 1 / rms for launch 2, then
// each output's first warp sums its streams' partial dots (stream order) per row and writes the
// injection logit or silu(. / S) of the down projection.
__device__ __forceinline__ void finish_down(const HcMixParams& p,
                                            float (&partial)[kWarps][kHcFusedMaxRows],
                                            const float (&inv)[kHcFusedMaxRows], int warp, int lane,
                                            int s, int slot, int out, bool active, bool is_inject) {
  if (blockIdx.x == 0 && slot == 0 && lane < p.n_rows) {
#pragma unroll
    for (int r = 0; r < kHcFusedMaxRows; ++r) {
      if (r == lane) p.inv[r * p.streams + s] = inv[r];
    }
  }
  __syncthreads();
  if (active && s == 0 && lane < p.n_rows) {
    const int r = lane;
    float total = 0.0f;
    for (int t = 0; t < p.streams; ++t) total += partial[warp + t][r];
    if (is_inject) {
      p.inj[r * p.streams + out] = f2h(total);
    } else {
      const float scaled = round_h(total) * (1.0f / float(p.streams));
      p.act[r * p.rank + out] = round_h(scaled / (1.0f + expf(-scaled)));
    }
  }
}

__global__ void __launch_bounds__(kThreads) hc_down_kernel(const __grid_constant__ HcMixParams p) {
  enter_dependent_grid();
  __shared__ float partial[kWarps][kHcFusedMaxRows];
  const int width = p.streams * p.hidden;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int s = warp % p.streams;
  const int slot = warp / p.streams;  // which of the CTA's outputs
  const int outs_per_cta = kWarps / p.streams;
  const int down_blocks = (p.rank + outs_per_cta - 1) / outs_per_cta;
  const bool is_inject = int(blockIdx.x) >= down_blocks;
  const int out =
      (is_inject ? int(blockIdx.x) - down_blocks : int(blockIdx.x)) * outs_per_cta + slot;
  const bool active = out < (is_inject ? p.streams : p.rank);
  const uint16_t* w_row =
      (is_inject ? p.inject : p.down) + int64_t(active ? out : 0) * width + int64_t(s) * p.hidden;
  const uint16_t* gain_row = p.norm_weight + int64_t(s) * p.hidden;

  // Stream s's 1 / rms for every row (its 2 * hidden bytes come from L2 after the first warp).
  float inv[kHcFusedMaxRows];
  float gain[kHcFusedMaxRows];
#pragma unroll
  for (int r = 0; r < kHcFusedMaxRows; ++r) {
    inv[r] = 0.0f;
    gain[r] = 0.0f;
    if (r < p.n_rows) {
      if (p.pending_y != nullptr) gain[r] = inject_gain(p, r, s);
      float ss = 0.0f;
      for (int j = lane * 8; j < p.hidden; j += 32 * 8) {
        float v[8];
        load_x8(p, r, s, j, gain[r], v);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += v[i] * v[i];
      }
      inv[r] = 1.0f / sqrtf(warp_sum(ss) / float(p.hidden) + p.eps);
    }
  }

  float dot[kHcFusedMaxRows];
#pragma unroll
  for (int r = 0; r < kHcFusedMaxRows; ++r) dot[r] = 0.0f;
  for (int base = 0; base < p.hidden; base += 32 * 8 * kSliceChunks) {
    // The weight slice first, so its loads are in flight while the rows are normalised.
    Half8 wv[kSliceChunks];
    Half8 gv[kSliceChunks];
#pragma unroll
    for (int c = 0; c < kSliceChunks; ++c) {
      const int j = base + (c * 32 + lane) * 8;
      if (j < p.hidden) {
        load8_raw(w_row + j, wv[c]);
        load8_raw(gain_row + j, gv[c]);
      }
    }
#pragma unroll
    for (int r = 0; r < kHcFusedMaxRows; ++r) {
      if (r >= p.n_rows) break;
#pragma unroll
      for (int c = 0; c < kSliceChunks; ++c) {
        const int j = base + (c * 32 + lane) * 8;
        if (j < p.hidden) {
          float v[8];
          load_x8(p, r, s, j, gain[r], v);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float xn = round_h((v[i] * inv[r]) * (1.0f + h2f(gv[c].h[i])));
            dot[r] += xn * h2f(wv[c].h[i]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kHcFusedMaxRows; ++r) {
    if (r >= p.n_rows) break;
    const float d = warp_sum(dot[r]);
    if (lane == 0) partial[warp][r] = d;
  }
  finish_down(p, partial, inv, warp, lane, s, slot, out, active, is_inject);
}

__global__ void __launch_bounds__(kThreads)
    hc_up_mix_kernel(const __grid_constant__ HcMixParams p) {
  enter_dependent_grid();
  extern __shared__ __align__(16) float act_s[];  // [n_rows, rank]
  for (int i = threadIdx.x; i < p.n_rows * p.rank; i += kThreads) act_s[i] = p.act[i];
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int width = p.streams * p.hidden;
  {
    const int j = int(blockIdx.x) * kWarps + warp;
    if (j >= p.hidden) return;
    float mix[kHcFusedMaxRows];
#pragma unroll
    for (int r = 0; r < kHcFusedMaxRows; ++r) mix[r] = 0.0f;
    for (int s = 0; s < p.streams; ++s) {
      const int col = s * p.hidden + j;
      const uint16_t* u_row = p.up + int64_t(col) * p.rank;
      float w[kMaxRankChunks][8];
#pragma unroll
      for (int k = 0; k < kMaxRankChunks; ++k) {
        const int at = (k * 32 + lane) * 8;
        if (at < p.rank) {
          load8(u_row + at, w[k]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) w[k][i] = 0.0f;
        }
      }
      const float gain = 1.0f + h2f(p.norm_weight[col]);
#pragma unroll
      for (int r = 0; r < kHcFusedMaxRows; ++r) {
        if (r >= p.n_rows) break;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < kMaxRankChunks; ++k) {
          const int at = (k * 32 + lane) * 8;
          if (at < p.rank) {
#pragma unroll
            for (int i = 0; i < 8; ++i) dot += act_s[r * p.rank + at + i] * w[k][i];
          }
        }
        dot = warp_sum(dot);
        const float u = round_h(dot);
        uint16_t* x_at = p.x + int64_t(r) * width + col;
        float xv = h2f(*x_at);
        if (p.pending_y != nullptr) {
          // hc_inject's value, written back once every lane has read x (this warp alone owns
          // column col of every row and stream in this launch).
          xv = round_h(__fadd_rn(
              xv, __fmul_rn(inject_gain(p, r, s), h2f(p.pending_y[int64_t(r) * p.hidden + j]))));
          __syncwarp();
          if (lane == 0) *x_at = f2h(xv);
        }
        const float xn = round_h((xv * p.inv[r * p.streams + s]) * gain);
        const float weighted = (1.0f / (1.0f + expf(-u))) * xn;
        mix[r] = s == 0 ? weighted : mix[r] + weighted;
      }
    }
    if (lane == 0) {
      for (int r = 0; r < p.n_rows; ++r) {
        p.mix[int64_t(r) * p.hidden + j] = f2h(mix[r] / float(p.streams));
      }
    }
  }
}

// ---- the load-first kernels (HcMixKernels::kLoadFirst) -----------------------------------------
// The same work with every load issued before its first use: launch 1 takes one pass over x per
// row that sums x^2 and x (1 + g) w together and scales the finished dot by 1 / rms (the
// normalised stream stays fp32 inside the dot: a rounding-order difference from the unfused
// ops), so a warp waits for memory once per pass instead of once per 256 values; launch 2
// loads the up rows of all streams and, one (row, stream) per lane, x, 1 / rms and the gains
// before any reduction, and broadcasts the normalised inputs by shuffles.

// Two CTAs an SM (128 registers): the benchmark model's 162 CTAs in one wave.
__global__ void __launch_bounds__(kThreads, 2)
    hc_down_load_first_kernel(const __grid_constant__ HcMixParams p) {
  enter_dependent_grid();
  __shared__ float partial[kWarps][kHcFusedMaxRows];
  const int width = p.streams * p.hidden;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int s = warp % p.streams;
  const int slot = warp / p.streams;
  const int outs_per_cta = kWarps / p.streams;
  const int down_blocks = (p.rank + outs_per_cta - 1) / outs_per_cta;
  const bool is_inject = int(blockIdx.x) >= down_blocks;
  const int out =
      (is_inject ? int(blockIdx.x) - down_blocks : int(blockIdx.x)) * outs_per_cta + slot;
  const bool active = out < (is_inject ? p.streams : p.rank);
  const uint16_t* w_row =
      (is_inject ? p.inject : p.down) + int64_t(active ? out : 0) * width + int64_t(s) * p.hidden;
  const uint16_t* gain_row = p.norm_weight + int64_t(s) * p.hidden;

  float gain[kHcFusedMaxRows];
  float ss[kHcFusedMaxRows];
  float dot[kHcFusedMaxRows];
#pragma unroll
  for (int r = 0; r < kHcFusedMaxRows; ++r) {
    ss[r] = dot[r] = 0.0f;
    gain[r] = p.pending_y != nullptr && r < p.n_rows ? inject_gain(p, r, s) : 0.0f;
  }
  // Passes of kPass chunks a lane: the weight and gain chunks, then each row's x (and pending y)
  // chunks, are all loaded before the first of them is used.
  constexpr int kPass = 2;
  for (int base = 0; base < p.hidden; base += 32 * 8 * kPass) {
    Half8 wv[kPass];
    Half8 gv[kPass];
#pragma unroll
    for (int c = 0; c < kPass; ++c) {
      const int j = base + (c * 32 + lane) * 8;
      wv[c] = gv[c] = Half8{};
      if (j < p.hidden) {
        load8_raw(w_row + j, wv[c]);
        load8_raw(gain_row + j, gv[c]);
      }
    }
#pragma unroll
    for (int r = 0; r < kHcFusedMaxRows; ++r) {
      if (r >= p.n_rows) break;
      const uint16_t* xs = p.x + int64_t(r) * width + int64_t(s) * p.hidden;
      const uint16_t* ys = p.pending_y != nullptr ? p.pending_y + int64_t(r) * p.hidden : nullptr;
      Half8 xr[kPass];
      Half8 yr[kPass];
#pragma unroll
      for (int c = 0; c < kPass; ++c) {
        const int j = base + (c * 32 + lane) * 8;
        xr[c] = yr[c] = Half8{};
        if (j < p.hidden) {
          load8_raw(xs + j, xr[c]);
          if (ys != nullptr) load8_raw(ys + j, yr[c]);
        }
      }
#pragma unroll
      for (int c = 0; c < kPass; ++c) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float v = h2f(xr[c].h[i]);
          // hc_inject's value (load_x8); chunks past hidden are zeros and add nothing.
          if (ys != nullptr) v = round_h(__fadd_rn(v, __fmul_rn(gain[r], h2f(yr[c].h[i]))));
          ss[r] += v * v;
          dot[r] += (v * (1.0f + h2f(gv[c].h[i]))) * h2f(wv[c].h[i]);
        }
      }
    }
  }
  float inv[kHcFusedMaxRows];
#pragma unroll
  for (int r = 0; r < kHcFusedMaxRows; ++r) {
    inv[r] = 0.0f;
    if (r >= p.n_rows) break;
    inv[r] = 1.0f / sqrtf(warp_sum(ss[r]) / float(p.hidden) + p.eps);
    const float d = warp_sum(dot[r]) * inv[r];
    if (lane == 0) partial[warp][r] = d;
  }
  finish_down(p, partial, inv, warp, lane, s, slot, out, active, is_inject);
}

// kChunks: 16-byte chunks of an up row per lane (rank <= kChunks * 256).
template <int kChunks>
__global__ void __launch_bounds__(kThreads)
    hc_up_mix_load_first_kernel(const __grid_constant__ HcMixParams p) {
  enter_dependent_grid();
  extern __shared__ __align__(16) float act_s[];  // [n_rows, rank]
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int width = p.streams * p.hidden;
  const int j = int(blockIdx.x) * kWarps + warp;
  const bool column = j < p.hidden;
  // The up rows of column j for every stream, before anything waits.
  Half8 w[kMaxStreams][kChunks];
#pragma unroll
  for (int s = 0; s < kMaxStreams; ++s) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int at = (k * 32 + lane) * 8;
      if (column && s < p.streams && at < p.rank) {
        load8_raw(p.up + int64_t(s * p.hidden + j) * p.rank + at, w[s][k]);
      } else {
        w[s][k] = Half8{};
      }
    }
  }
  // One (row, stream) pair per lane (two where rows x streams > 32): x as injected, its
  // normalised value xn.
  constexpr int kPairsPerLane = kHcFusedMaxRows * kMaxStreams / 32;
  float xv[kPairsPerLane];
  float xn[kPairsPerLane];
  const int n_pairs = p.n_rows * p.streams;
#pragma unroll
  for (int q = 0; q < kPairsPerLane; ++q) {
    const int idx = q * 32 + lane;
    xv[q] = xn[q] = 0.0f;
    if (column && idx < n_pairs) {
      const int r = idx / p.streams;
      const int s = idx % p.streams;
      xv[q] = h2f(p.x[int64_t(r) * width + s * p.hidden + j]);
      if (p.pending_y != nullptr) {
        xv[q] = round_h(__fadd_rn(
            xv[q], __fmul_rn(inject_gain(p, r, s), h2f(p.pending_y[int64_t(r) * p.hidden + j]))));
      }
      xn[q] = round_h((xv[q] * p.inv[r * p.streams + s]) *
                      (1.0f + h2f(p.norm_weight[s * p.hidden + j])));
    }
  }
  for (int i = threadIdx.x; i < p.n_rows * p.rank; i += kThreads) act_s[i] = p.act[i];
  __syncthreads();
  if (!column) return;
  float mix[kHcFusedMaxRows];
#pragma unroll
  for (int r = 0; r < kHcFusedMaxRows; ++r) mix[r] = 0.0f;
#pragma unroll
  for (int s = 0; s < kMaxStreams; ++s) {
    if (s >= p.streams) break;
#pragma unroll
    for (int r = 0; r < kHcFusedMaxRows; ++r) {
      if (r >= p.n_rows) break;
      float dot = 0.0f;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int at = (k * 32 + lane) * 8;
        if (at < p.rank) {
#pragma unroll
          for (int i = 0; i < 8; ++i) dot += act_s[r * p.rank + at + i] * h2f(w[s][k].h[i]);
        }
      }
      const float u = round_h(warp_sum(dot));
      const int idx = r * p.streams + s;
      float x_norm = 0.0f;
#pragma unroll
      for (int q = 0; q < kPairsPerLane; ++q) {
        const float v = __shfl_sync(0xFFFFFFFFu, xn[q], idx % 32);
        if (idx / 32 == q) x_norm = v;
      }
      const float weighted = (1.0f / (1.0f + expf(-u))) * x_norm;
      mix[r] = s == 0 ? weighted : mix[r] + weighted;
    }
  }
  if (p.pending_y != nullptr) {
#pragma unroll
    for (int q = 0; q < kPairsPerLane; ++q) {
      const int idx = q * 32 + lane;
      if (idx < n_pairs) {
        p.x[int64_t(idx / p.streams) * width + (idx % p.streams) * p.hidden + j] = f2h(xv[q]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kHcFusedMaxRows; ++r) {
    if (r < p.n_rows && lane == r)
      p.mix[int64_t(r) * p.hidden + j] = f2h(mix[r] / float(p.streams));
  }
}

}  // namespace

bool hc_mix_fused_supported(int64_t n_rows, int64_t streams, int64_t hidden, int64_t rank) {
  return n_rows >= 1 && n_rows <= kHcFusedMaxRows && streams >= 1 && streams <= kMaxStreams &&
         kWarps % streams == 0 && hidden > 0 && hidden % 8 == 0 && rank > 0 && rank % 8 == 0 &&
         rank <= kMaxRankChunks * 32 * 8 && size_t(n_rows * rank) * 4 <= kMaxActBytes;
}

size_t hc_mix_fused_scratch_bytes(int64_t n_rows, int64_t streams, int64_t rank) {
  return size_t(n_rows * (rank + streams)) * sizeof(float);
}

void hc_mix_fused_f16(uint16_t* x, const uint16_t* norm_weight, const uint16_t* down,
                      const uint16_t* up, const uint16_t* inject, int64_t n_rows, int64_t streams,
                      int64_t hidden, int64_t rank, float eps, uint16_t* mix, uint16_t* inj,
                      void* scratch, const uint16_t* pending_y, const uint16_t* pending_inj,
                      cudaStream_t stream, HcMixKernels kernels) {
  E4KV_ASSERT(hc_mix_fused_supported(n_rows, streams, hidden, rank),
              cat("hc_mix_fused_f16: unsupported shape: ", n_rows, " rows, ", streams,
                  " streams, hidden ", hidden, ", rank ", rank));
  E4KV_ASSERT((inject == nullptr) == (inj == nullptr),
              "hc_mix_fused_f16: inject and inj go together");
  E4KV_ASSERT((pending_y == nullptr) == (pending_inj == nullptr) &&
                  (pending_inj == nullptr || pending_inj != inj),
              "hc_mix_fused_f16: pending_y and pending_inj go together, and not in inj");
  HcMixParams p{};
  p.x = x;
  p.norm_weight = norm_weight;
  p.down = down;
  p.up = up;
  p.inject = inject;
  p.mix = mix;
  p.inj = inj;
  p.act = static_cast<float*>(scratch);
  p.inv = p.act + n_rows * rank;
  p.n_rows = int(n_rows);
  p.streams = int(streams);
  p.hidden = int(hidden);
  p.rank = int(rank);
  p.eps = eps;
  p.pending_y = pending_y;
  p.pending_inj = pending_inj;
  const int64_t outs_per_cta = kWarps / streams;
  const int64_t down_blocks = (rank + outs_per_cta - 1) / outs_per_cta;
  const int64_t inject_blocks = inject != nullptr ? (streams + outs_per_cta - 1) / outs_per_cta : 0;
  const LaunchDims down_dims{dim3(unsigned(down_blocks + inject_blocks)), dim3(kThreads), 0};
  const LaunchDims up_dims{dim3(unsigned((hidden + kWarps - 1) / kWarps)), dim3(kThreads),
                           size_t(n_rows * rank) * sizeof(float)};
  if (kernels == HcMixKernels::kLoadFirst) {
    launch_kernel(hc_down_load_first_kernel, down_dims, stream, p);
    if (rank <= 256) {
      launch_kernel(hc_up_mix_load_first_kernel<1>, up_dims, stream, p);
    } else if (rank <= 512) {
      launch_kernel(hc_up_mix_load_first_kernel<2>, up_dims, stream, p);
    } else {
      launch_kernel(hc_up_mix_load_first_kernel<4>, up_dims, stream, p);
    }
    return;
  }
  launch_kernel(hc_down_kernel, down_dims, stream, p);
  launch_kernel(hc_up_mix_kernel, up_dims, stream, p);
}

}  // namespace e4kv::cuda
