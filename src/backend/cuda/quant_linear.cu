// Quantized linear (see quant_linear.cuh): y = x dequant(W)^T + bias with the weight dequantized
// in registers (quant_gemv.cuh gives the loads, the decoders and the lane work).
//
// Two kernels, chosen by the rows n:
// - n <= 16: the GEMV of quant_gemv.cuh, one kernel per (format, x-tile height kRows in {1, 2, 4,
//   8}): a CTA of 8 warps takes kRows x rows (1, 2 or 4 where that holds n, else tiles of 8;
//   two for 9..16) and 8 * kOutPerWarp weight rows (kOutPerWarp 1 for kRows <= 2, so that 1024-row
//   projections still give 128 CTAs; 2 above, so that a staged x chunk serves more weight rows).
//   The grid's x dimension is the x tiles, so CTAs that read the same weight rows launch next to
//   each other and a second read hits L2. The decode case n = 1 reads 0.5 bytes per weight (W4,
//   NVFP4) and spends about 2.5 ALU ops per weight on unpacking and widening plus one FMA per x
//   row: about 7 ops per byte, the budget of an H200 (KERNELS.md's table), so it should sit near
//   the bandwidth there and on H100; n = 4..16 is ALU-bound (2.5 + n ops per weight). Not measured
//   yet.
// - n > 16: tensor-core tiles of 64 x rows x 32 weight rows (below), where a 64-wide k-tile lies in
//   one group (W4 and FP8 groups that are multiples of 64, every NVFP4 weight) and x is 16-byte
//   aligned; other shapes stay on the GEMV in x tiles of 8 rows (CUDA cores, several times slower
//   than cuBLAS FP16 on long prefill chunks).
// Volta: the GEMV uses no tensor-core instruction; the tiles' mma goes through
// attention_common.cuh's m16n8k8 (two m8n8k4 on sm_70) and ldmatrix_x4 (shared loads there).
#include "backend/cuda/quant_linear.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/e4m3_vec.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/quant_gemv.cuh"
#include "backend/cuda/quant_w4_mma.cuh"

namespace e4kv::cuda {
namespace {

using quant::kGemvThreads;
using quant::kGemvWarps;

bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

struct LinearParams {
  quant::QuantWeight w;  // [out, in]
  const uint16_t* x;     // [n, in] FP16
  const uint16_t* bias;  // [out] FP16 or nullptr
  void* y;               // [n, out] FP16 or fp32
  int64_t n;
  int32_t out;
  bool y_f32;
};

// F: the lane work (quant_gemv.cuh), Format<format> or the Exact<format> fallback.
template <class F, int kRows, int kOutPerWarp>
__global__ void __launch_bounds__(kGemvThreads)
    quant_linear_kernel(const __grid_constant__ LinearParams p) {
  enter_dependent_grid();
  __shared__ __align__(16) float xs[kRows * quant::x_stage_stride<F>()];
  __shared__ const uint16_t* x_rows[kRows];
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  if (int(threadIdx.x) < kRows) {
    const int64_t row = row0 + int64_t(threadIdx.x);
    x_rows[threadIdx.x] = row < p.n ? p.x + row * p.w.in : nullptr;
  }  // read after gemv_rows' first barrier
  const int warp = int(threadIdx.x) >> 5;
  const int lane = int(threadIdx.x) & 31;
  const int64_t o0 = (int64_t(blockIdx.y) * kGemvWarps + warp) * kOutPerWarp;
  int64_t w_rows[kOutPerWarp];
#pragma unroll
  for (int o = 0; o < kOutPerWarp; ++o) w_rows[o] = o0 + o < p.out ? o0 + o : -1;
  float acc[kOutPerWarp][kRows];
  quant::gemv_rows<F, kRows, kOutPerWarp>(p.w, w_rows, x_rows, xs, acc);

  // Lane o * kRows + r writes y[row0 + r, w_rows[o]].
#pragma unroll
  for (int o = 0; o < kOutPerWarp; ++o) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (lane != o * kRows + r || w_rows[o] < 0 || row0 + r >= p.n) continue;
      float v = acc[o][r];
      if (p.bias != nullptr) v += __half2float(__ushort_as_half(p.bias[w_rows[o]]));
      const int64_t at = (row0 + r) * p.out + w_rows[o];
      if (p.y_f32) {
        static_cast<float*>(p.y)[at] = v;
      } else {
        static_cast<__half*>(p.y)[at] = __float2half_rn(v);
      }
    }
  }
}

// ---- tensor-core tiles (n > kMaxGemvRows) ------------------------------------------------------
// A CTA of 4 warps computes 64 x rows x 32 weight rows, the reduction in k-tiles of 64 through two
// shared-memory stages (the next tile's global loads held in registers during the math, as
// moe.cu's GEMMs do). The weight codes are decoded between the global load and the shared store
// into FP16 values that are exact: W4 (q - zero) (an integer in [-15, 15]); NVFP4 e2m1 * e4m3
// (at most 5 significant bits, in [2^-10, 2688]); FP8 e4m3 * 2^-8 (the software decoder). FP16 x
// and these meet in mma.sync (m16n8k16 on sm_80+, two m16n8k8 on sm_75, m8n8k4 pairs on sm_70;
// exact products, fp32 sums); per k-tile the W4 / FP8 partial sums are multiplied by their
// group's fp32 scale into the accumulators (a k-tile lies in one group: group % 64 == 0), NVFP4's
// per-row 1 / global divides the result. Warp w owns x rows 16w..16w+15 (one m16 tile) and all 32
// weight rows (four n8 tiles). Each weight byte is read once per 64 x rows.
// note: correct first, nothing timed; no cp.async or swizzle, and the 64-row x tile wastes MMA
// work below 64 rows (tensor throughput is not the limit there; decoding is).
namespace tile {

constexpr int kThreads = 128;
constexpr int kTokens = 64;                             // x rows per CTA
constexpr int kW = 32;                                  // weight rows per CTA
constexpr int kK = 64;                                  // reduction per k-tile
constexpr int kLd = kK + 8;                             // shared row stride in halfs (+16 bytes)
constexpr int kStageHalfs = (kTokens + kW) * kLd;       // x rows, then weight rows
constexpr int kNTiles = kW / 8;                         // n8 tiles per warp
constexpr int kXLoads = kTokens * (kK / 8) / kThreads;  // 16-byte x chunks per thread

}  // namespace tile

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

// The weight chunks of one k-tile: W4 / NVFP4 16 bytes = 32 codes (2 per row and k-tile, 64 in
// all: threads 0..63); FP8 16 bytes = 16 codes (4 per row, 128: every thread). Decoded into 32
// or 16 FP16 values in k order.
template <WeightFormat kFormat>
struct TileCodes {
  static constexpr int kCodes = kFormat == WeightFormat::kFp8Block ? 16 : 32;
  static constexpr int kChunksPerRow = tile::kK / kCodes;
  static constexpr int kChunks = tile::kW * kChunksPerRow;
  static constexpr int kOut = kCodes / 8;  // 16-byte FP16 stores

  // Natural-order FP16 pairs from two FP16x2 words holding {k_j, k_j+4}, {k_j+1, k_j+5}.
  __device__ __forceinline__ static void interleave(uint32_t t0, uint32_t t1, uint32_t t2,
                                                    uint32_t t3, uint4& out) {
    out.x = __byte_perm(t0, t1, 0x5410);  // k0, k1
    out.y = __byte_perm(t2, t3, 0x5410);  // k2, k3
    out.z = __byte_perm(t0, t1, 0x7632);  // k4, k5
    out.w = __byte_perm(t2, t3, 0x7632);  // k6, k7
  }

  // meta: kW4 the zero; kNvfp4 the two E4M3 scale bytes of the chunk's two groups.
  __device__ __forceinline__ static void decode(const uint4& w, uint32_t meta, uint4 (&out)[kOut]) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    if constexpr (kFormat == WeightFormat::kW4) {
      const __half2 zero = quant::as_half2((0x6400u | meta) * 0x00010001u);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t t[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t biased = ((words[i] >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
          const __half2 v = __hsub2(quant::as_half2(biased), zero);
          memcpy(&t[j], &v, 4);
        }
        interleave(t[0], t[1], t[2], t[3], out[i]);
      }
    } else if constexpr (kFormat == WeightFormat::kNvfp4) {
      const __half2 unit = __float2half2_rn(16384.0f);  // e2m1 * 2^-14 -> e2m1
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __half2 scale = __float2half2_rn(e4m3_decode(uint8_t(meta >> (8 * (i / 2)))));
        uint32_t t[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t u = words[i] >> (4 * j);
          const uint32_t bits = ((u << 9) & 0x0E000E00u) | ((u << 12) & 0x80008000u);
          const __half2 v = __hmul2(__hmul2(quant::as_half2(bits), unit), scale);  // exact
          memcpy(&t[j], &v, 4);
        }
        interleave(t[0], t[1], t[2], t[3], out[i]);
      }
    } else {
      (void)meta;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        E4m3Decoder<E4m3Decode::kSoftware>::decode4(words[2 * i], out[i].x, out[i].y);
        E4m3Decoder<E4m3Decode::kSoftware>::decode4(words[2 * i + 1], out[i].z, out[i].w);
      }
    }
  }
};

template <WeightFormat kFormat>
__global__ void __launch_bounds__(tile::kThreads)
    quant_linear_mma_kernel(const __grid_constant__ LinearParams p) {
  using Codes = TileCodes<kFormat>;
  enter_dependent_grid();
  __shared__ __align__(16) uint16_t smem[2 * tile::kStageHalfs];
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t x0 = int64_t(blockIdx.x) * tile::kTokens;  // first x row
  const int64_t w0 = int64_t(blockIdx.y) * tile::kW;       // first weight row
  const quant::QuantWeight& q = p.w;
  const int in = q.in;

  // This thread's x chunks: row x0 + r, k offset 8 * (idx % 8) within the k-tile.
  const uint16_t* x_src[tile::kXLoads];
  int x_dst[tile::kXLoads];
  int x_k[tile::kXLoads];
#pragma unroll
  for (int i = 0; i < tile::kXLoads; ++i) {
    const int idx = tid + i * tile::kThreads;
    const int r = idx / (tile::kK / 8);
    x_k[i] = 8 * (idx % (tile::kK / 8));
    x_dst[i] = r * tile::kLd + x_k[i];
    x_src[i] = x0 + r < p.n ? p.x + (x0 + r) * in : nullptr;
  }
  // This thread's weight chunk (if any): row w0 + wr, code offset wk within the k-tile.
  const bool has_chunk = tid < Codes::kChunks;
  const int wr = tid / Codes::kChunksPerRow;
  const int wk = Codes::kCodes * (tid % Codes::kChunksPerRow);
  const int64_t w_row = w0 + wr;
  const bool w_valid = has_chunk && w_row < p.out;

  uint4 x_reg[tile::kXLoads];
  uint4 w_reg = make_uint4(0u, 0u, 0u, 0u);
  uint32_t w_meta = 0;
  bool w_in = false;
  const auto load_stage = [&](int k0) {
#pragma unroll
    for (int i = 0; i < tile::kXLoads; ++i) {
      const int k = k0 + x_k[i];
      x_reg[i] = x_src[i] != nullptr && k < in ? *reinterpret_cast<const uint4*>(x_src[i] + k)
                                               : make_uint4(0u, 0u, 0u, 0u);
    }
    const int k = k0 + wk;
    w_in = w_valid && k < in;
    if (w_in) {
      if constexpr (kFormat == WeightFormat::kFp8Block) {
        w_reg = __ldg(reinterpret_cast<const uint4*>(q.data + w_row * q.row_bytes + k));
      } else {
        w_reg = __ldg(reinterpret_cast<const uint4*>(q.data + w_row * q.row_bytes + k / 2));
      }
      if constexpr (kFormat == WeightFormat::kW4) {
        w_meta =
            q.zeros != nullptr ? uint32_t(__ldg(q.zeros + w_row * q.scale_row + k / q.group)) : 8u;
      } else if constexpr (kFormat == WeightFormat::kNvfp4) {
        w_meta = __ldg(reinterpret_cast<const unsigned short*>(
            static_cast<const uint8_t*>(q.scales) + w_row * q.scale_row + k / 16));
      }
    }
  };
  const auto store_stage = [&](uint16_t* stage) {
#pragma unroll
    for (int i = 0; i < tile::kXLoads; ++i) {
      *reinterpret_cast<uint4*>(stage + x_dst[i]) = x_reg[i];
    }
    if (has_chunk) {
      uint4 decoded[Codes::kOut];
      if (w_in) {
        Codes::decode(w_reg, w_meta, decoded);
      } else {
#pragma unroll
        for (int i = 0; i < Codes::kOut; ++i) decoded[i] = make_uint4(0u, 0u, 0u, 0u);
      }
      uint16_t* dst = stage + (tile::kTokens + wr) * tile::kLd + wk;
#pragma unroll
      for (int i = 0; i < Codes::kOut; ++i) reinterpret_cast<uint4*>(dst)[i] = decoded[i];
    }
  };

  // The scale of accumulator column 2 (lane % 4) + h of n8 tile ni for the k-tile at k0 (W4, FP8).
  const int col_in_n8 = 2 * (lane & 3);
  const auto tile_scale = [&](int ni, int h, int k0) -> float {
    const int64_t row = w0 + ni * 8 + col_in_n8 + h;
    if (row >= p.out) return 0.0f;
    const int64_t g = row * q.scale_row + k0 / q.group;
    if constexpr (kFormat == WeightFormat::kW4) {
      return __half2float(
          __ushort_as_half(__ldg(static_cast<const unsigned short*>(q.scales) + g)));
    } else {
      return __ldg(static_cast<const float*>(q.scales) + g) *
             E4m3Decoder<E4m3Decode::kSoftware>::kValueFactor;
    }
  };

  float acc[tile::kNTiles][4];
#pragma unroll
  for (int ni = 0; ni < tile::kNTiles; ++ni) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[ni][c] = 0.0f;
  }

  const int n_stages = (in + tile::kK - 1) / tile::kK;
  load_stage(0);
  store_stage(smem);
  __syncthreads();
  for (int kt = 0; kt < n_stages; ++kt) {
    const int k0 = kt * tile::kK;
    const bool more = kt + 1 < n_stages;
    if (more) load_stage(k0 + tile::kK);  // in flight during the math below
    float scale[tile::kNTiles][2];
    if constexpr (kFormat != WeightFormat::kNvfp4) {
#pragma unroll
      for (int ni = 0; ni < tile::kNTiles; ++ni) {
        scale[ni][0] = tile_scale(ni, 0, k0);
        scale[ni][1] = tile_scale(ni, 1, k0);
      }
    }
    float part[tile::kNTiles][4];
#pragma unroll
    for (int ni = 0; ni < tile::kNTiles; ++ni) {
#pragma unroll
      for (int c = 0; c < 4; ++c) part[ni][c] = 0.0f;
    }
    const uint16_t* stage = smem + (kt & 1) * tile::kStageHalfs;
    const uint16_t* stage_w = stage + tile::kTokens * tile::kLd;
#pragma unroll
    for (int kk = 0; kk < tile::kK; kk += 16) {
      uint32_t a_frag[4];
      ldmatrix_x4(a_frag, stage + (warp * 16 + (lane & 15)) * tile::kLd + kk + (lane >> 4) * 8);
#pragma unroll
      for (int ni = 0; ni < tile::kNTiles; ni += 2) {
        // Matrices: (ni, k 0-7), (ni, k 8-15), (ni + 1, k 0-7), (ni + 1, k 8-15).
        const int m = lane >> 3;
        const int r = (ni + (m >> 1)) * 8 + (lane & 7);
        uint32_t b_frag[4];
        ldmatrix_x4(b_frag, stage_w + r * tile::kLd + kk + (m & 1) * 8);
        mma_16x8x16(part[ni], a_frag, b_frag[0], b_frag[1]);
        mma_16x8x16(part[ni + 1], a_frag, b_frag[2], b_frag[3]);
      }
    }
    // part[ni][c]: x row 16 warp + lane / 4 + 8 (c / 2), weight column col_in_n8 + c % 2.
#pragma unroll
    for (int ni = 0; ni < tile::kNTiles; ++ni) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if constexpr (kFormat == WeightFormat::kNvfp4) {
          acc[ni][c] += part[ni][c];
        } else {
          acc[ni][c] = fmaf(part[ni][c], scale[ni][c % 2], acc[ni][c]);
        }
      }
    }
    if (more) store_stage(smem + ((kt + 1) & 1) * tile::kStageHalfs);
    __syncthreads();
  }

#pragma unroll
  for (int ni = 0; ni < tile::kNTiles; ++ni) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t row = x0 + warp * 16 + (lane >> 2) + 8 * (c / 2);
      const int64_t col = w0 + ni * 8 + col_in_n8 + c % 2;
      if (row >= p.n || col >= p.out) continue;
      float v = acc[ni][c];
      if constexpr (kFormat == WeightFormat::kNvfp4) v = v / __ldg(q.global + col);
      if (p.bias != nullptr) v += __half2float(__ushort_as_half(p.bias[col]));
      const int64_t at = row * p.out + col;
      if (p.y_f32) {
        static_cast<float*>(p.y)[at] = v;
      } else {
        static_cast<__half*>(p.y)[at] = __float2half_rn(v);
      }
    }
  }
}

template <WeightFormat kFormat>
void launch_mma(const LinearParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned((p.n + tile::kTokens - 1) / tile::kTokens),
                  unsigned((p.out + tile::kW - 1) / tile::kW));
  launch_kernel(quant_linear_mma_kernel<kFormat>, LaunchDims{grid, dim3(tile::kThreads)}, stream,
                p);
}

template <class F, int kRows>
void launch_rows(const LinearParams& p, cudaStream_t stream) {
  constexpr int kOutPerWarp = kRows <= 2 ? 1 : 2;
  constexpr int64_t kOutPerCta = int64_t(kGemvWarps) * kOutPerWarp;
  const dim3 grid(unsigned((p.n + kRows - 1) / kRows),
                  unsigned((p.out + kOutPerCta - 1) / kOutPerCta));
  launch_kernel(quant_linear_kernel<F, kRows, kOutPerWarp>, LaunchDims{grid, dim3(kGemvThreads)},
                stream, p);
}

template <WeightFormat kFormat>
void launch_format(const LinearParams& p, bool fast, cudaStream_t stream) {
  using Fast = quant::Format<kFormat>;
  // More than 16 rows: tensor-core tiles where a k-tile of 64 lies in one group (NVFP4's scales
  // go into the decoded values instead) and x takes 16-byte loads.
  const bool mma = fast && p.n > 2 * quant::kGemvMaxRows &&
                   (kFormat == WeightFormat::kNvfp4 || p.w.group % tile::kK == 0) &&
                   aligned(p.x, 16);
  if (mma) {
    launch_mma<kFormat>(p, stream);
  } else if (!fast) {
    // Odd shapes only (small test models): one x tile height for every n.
    if (p.n <= 1) {
      launch_rows<quant::Exact<kFormat>, 1>(p, stream);
    } else {
      launch_rows<quant::Exact<kFormat>, quant::kGemvMaxRows>(p, stream);
    }
  } else if (p.n <= 1) {
    launch_rows<Fast, 1>(p, stream);
  } else if (p.n <= 2) {
    launch_rows<Fast, 2>(p, stream);
  } else if (p.n <= 4) {
    launch_rows<Fast, 4>(p, stream);
  } else {
    launch_rows<Fast, quant::kGemvMaxRows>(p, stream);
  }
}

}  // namespace

bool quant_weight_fast_path(const LinearView& w) {
  if (w.data == nullptr || !aligned(w.data, 16)) return false;
  switch (w.format) {
    case WeightFormat::kW4:
      return w.in % 32 == 0 && w.group % 32 == 0 && aligned(w.scales, 2);
    case WeightFormat::kNvfp4:
      return w.in % 32 == 0 && w.group == 16 && aligned(w.scales, 2);
    case WeightFormat::kFp8Block:
      return w.in % 16 == 0 && w.group % 16 == 0 && aligned(w.scales, 4);
    case WeightFormat::kDense:
      return w.in % 8 == 0;
  }
  return false;
}

namespace {

// Four elements per thread: the fp32 value of quant/dequantize.h's formula (Exact<>, the same
// expression the GEMV fallback evaluates), rounded once to FP16, stored as 8 bytes.
template <WeightFormat kFormat>
__global__ void quant_dequantize_kernel(const __grid_constant__ quant::QuantWeight q, int64_t row0,
                                        int64_t rows, uint16_t* out) {
  enter_dependent_grid();
  const int64_t quads = q.in / 4;
  const int64_t total = rows * quads;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / quads;
    const int k = int(i % quads) * 4;
    uint16_t h[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      h[e] = __half_as_ushort(__float2half_rn(quant::Exact<kFormat>::element(q, row0 + r, k + e)));
    }
    *reinterpret_cast<uint2*>(out + r * q.in + k) = make_uint2(
        uint32_t(h[0]) | (uint32_t(h[1]) << 16), uint32_t(h[2]) | (uint32_t(h[3]) << 16));
  }
}

}  // namespace

Status quant_dequantize_rows(const LinearView& w, int64_t row0, int64_t rows, uint16_t* out,
                             cudaStream_t stream) {
  E4KV_RETURN_IF_ERROR(quant_weight_supported(w, "cuda dequantize"));
  if (w.format == WeightFormat::kDense) {
    return Status::error("cuda dequantize: the weight is already FP16");
  }
  if (row0 < 0 || rows < 0 || row0 + rows > w.out) {
    return Status::error(
        cat("cuda dequantize: rows [", row0, ", ", row0 + rows, ") outside the weight's ", w.out));
  }
  if (rows == 0) return ok_status();
  if (out == nullptr || !aligned(out, 8)) {
    return Status::error("cuda dequantize: out must be present and 8-byte aligned");
  }
  const quant::QuantWeight q = quant::quant_weight(w);
  constexpr int kThreads = 256;
  const int64_t total = rows * (w.in / 4);
  const auto blocks = unsigned(std::min<int64_t>((total + kThreads - 1) / kThreads, 132 * 32));
  const LaunchDims dims{dim3(blocks), dim3(kThreads)};
  switch (w.format) {
    case WeightFormat::kW4:
      launch_kernel(quant_dequantize_kernel<WeightFormat::kW4>, dims, stream, q, row0, rows, out);
      break;
    case WeightFormat::kNvfp4:
      launch_kernel(quant_dequantize_kernel<WeightFormat::kNvfp4>, dims, stream, q, row0, rows,
                    out);
      break;
    case WeightFormat::kFp8Block:
      launch_kernel(quant_dequantize_kernel<WeightFormat::kFp8Block>, dims, stream, q, row0, rows,
                    out);
      break;
    case WeightFormat::kDense:
      break;
  }
  return ok_status();
}

Status quant_weight_supported(const LinearView& w, std::string_view op) {
  const auto refuse = [&](std::string_view need) {
    return Status::error(cat(op, ": ", weight_format_name(w.format), " weight [out=", w.out,
                             ", in=", w.in, ", group=", w.group,
                             "] does not run on the CUDA kernels: ", need));
  };
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (w.out < 0 || w.out > kMaxDim || w.in < 4 || w.in > kMaxDim || w.in % 4 != 0) {
    return refuse("in must be a multiple of 4, out and in below 2^31");
  }
  if (w.data == nullptr) return refuse("no data");
  switch (w.format) {
    case WeightFormat::kW4:
    case WeightFormat::kNvfp4:
    case WeightFormat::kFp8Block:
      if (w.group < 1 || w.scales == nullptr) return refuse("group >= 1 and scales present");
      if (w.format == WeightFormat::kNvfp4 && w.global == nullptr) {
        return refuse("the global scales must be present");
      }
      if (w.format != WeightFormat::kFp8Block && w.in % w.group != 0) {
        return refuse("group must divide in");
      }
      return ok_status();
    case WeightFormat::kDense:
      if (w.act_size != 2) return refuse("FP16 elements");
      return ok_status();
  }
  return refuse("an unknown format");
}

Status quant_linear(const uint16_t* x, const LinearView& w, const uint16_t* bias, int64_t n,
                    void* y, bool y_f32, cudaStream_t stream, QuantLinearPath path) {
  if (w.format == WeightFormat::kDense) {
    return Status::error("cuda linear_quantized: a dense weight goes through linear (cuBLAS)");
  }
  if (path == QuantLinearPath::kW4Mma ||
      (path == QuantLinearPath::kAuto && w4_mma_auto() && w4_mma_supported(w, x))) {
    return quant_linear_w4_mma(x, w, bias, n, y, y_f32, stream);
  }
  E4KV_RETURN_IF_ERROR(quant_weight_supported(w, "cuda linear"));
  if (n < 0) return Status::error(cat("cuda linear: n=", n, " rows"));
  if (n == 0 || w.out == 0) return ok_status();
  if (x == nullptr || y == nullptr || !aligned(x, 8)) {
    return Status::error(
        cat("cuda linear: x (FP16 [", n, ", ", w.in, "]) must be 8-byte aligned, and y present"));
  }
  constexpr int64_t kMaxCtaRows = 65535;  // grid y: 8 or 16 weight rows each
  if ((w.out + 7) / 8 > kMaxCtaRows) {
    return Status::error(cat("cuda linear: out=", w.out, " exceeds ", kMaxCtaRows * 8, " rows"));
  }
  LinearParams p{};
  p.w = quant::quant_weight(w);
  p.x = x;
  p.bias = bias;
  p.y = y;
  p.n = n;
  p.out = int32_t(w.out);
  p.y_f32 = y_f32;
  const bool fast = quant_weight_fast_path(w);
  switch (w.format) {
    case WeightFormat::kW4:
      launch_format<WeightFormat::kW4>(p, fast, stream);
      break;
    case WeightFormat::kNvfp4:
      launch_format<WeightFormat::kNvfp4>(p, fast, stream);
      break;
    case WeightFormat::kFp8Block:
      launch_format<WeightFormat::kFp8Block>(p, fast, stream);
      break;
    case WeightFormat::kDense:
      break;
  }
  return ok_status();
}

}  // namespace e4kv::cuda
