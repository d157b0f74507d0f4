// The W4A16 linear on the tensor cores (quant_w4_mma.cuh), sm_80+.
//
// The weight is the mma's A operand (16 weight rows x 16 k), x^T its B operand (16 k x 8 x rows),
// so one m16n8k16 gives 16 outputs of 8 x rows and a warp's weight fragments serve every x tile.
// A dot product does not depend on the order of its k terms, only on A and B agreeing on it; the
// kernel picks the order that lets each lane load its weights as one 16-byte vector:
// - a warp steps through k in chunks of 128; in a chunk, the lane of quad position t = lane % 4
//   (fragment row g = lane / 4) loads 16 bytes of weight row g and 16 of row g + 8: codes
//   t*32 .. t*32+31 of the chunk, one group of 32 (or part of a larger one): one scale and one
//   zero per row and chunk;
// - word i of those 16 bytes holds codes e0..e7 (k = t*32 + 8i + j, low nibble first); masking
//   word >> 4j with 0x000F000F gives the pair (e_j, e_j+4), which ORed into 0x6400 is FP16
//   1024 + code: minus {1024 + zero} (exact) times {scale, scale} is the dequantized weight pair,
//   rounded once to FP16 (quant/dequantize.h's value as the dequantized FP16 checkpoint holds it);
// - mma 2i + h of the chunk takes (e_2h, e_2h+4) as this lane's k slots {2t, 2t+1} and
//   (e_2h+1, e_2h+5) as {2t+8, 2t+9}; the B operand then needs x at those k: the 16 x values
//   k = t*32 + 8i .. +7 of row g of each x tile, read as one 16-byte shared load and paired by
//   two byte permutes per register.
// x is staged in shared memory by cp.async, kStages deep, each 16-byte unit stored where its lane
// reads it (unit (t, i) of a chunk at position 4i + t: the 8 lanes of a load phase read 64
// contiguous bytes of two rows whose stride is 64 bytes modulo 128, no bank conflict). The
// weights go straight to registers, kPrefetch chunks ahead. Rows of x beyond n are zeros in
// shared memory (their outputs are not stored); weight rows beyond out load the last row (their
// outputs are not stored either).
//
// A CTA is 4 warps: kWarpsM along the weight rows (16 each) and 4 / kWarpsM splitting the chunks
// of k (chunk c goes to warp c % kWarpsK), whose sums meet in shared memory at the end.
// Bytes per 1 x-row output: 0.5 per weight plus 1/16 for scales and zeros at group 32; per weight
// the lane spends about 2 integer and 1 FP16x2 ops per pair (shift, mask-or, subtract, multiply)
// and 1/8 of an mma per x tile.
#include "backend/cuda/quant_w4_mma.cuh"

#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/quant_gemv.cuh"

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 128;  // k per warp step
constexpr int kStages = 3;   // x stages in shared memory

struct W4Params {
  quant::QuantWeight w;  // [out, in]
  const uint16_t* x;     // [n, in] FP16
  const uint16_t* bias;  // [out] FP16 or nullptr
  void* y;               // [n, out] FP16 or fp32
  int64_t n;
  int32_t out;
  int32_t chunks;  // in / kChunk
  bool y_f32;
};

template <int kNTiles, int kWarpsM>
struct Shape {
  static constexpr int kWarpsK = kWarps / kWarpsM;
  static constexpr int kRowsX = 8 * kNTiles;        // x rows per CTA
  static constexpr int kRowsW = 16 * kWarpsM;       // weight rows per CTA
  static constexpr int kBlockK = kChunk * kWarpsK;  // k per stage
  static constexpr int kLd = kBlockK + 32;          // halfs: a row's stride is 64 bytes mod 128
  static constexpr int kStageHalfs = kRowsX * kLd;
  static constexpr int kUnitsPerRow = kBlockK / 8;  // 16-byte units of x per row and stage
  static constexpr size_t kSmemBytes = size_t(kStages) * kStageHalfs * 2;
  static constexpr int kPrefetch = kNTiles <= 2 ? 4 : 2;  // weight chunks in registers
  static_assert(size_t(kWarpsK - 1) * kWarpsM * kNTiles * 4 * 32 * 4 <= kSmemBytes,
                "the cross-warp sums reuse the x stages");
};

// One lane's weight data of one chunk: 16 bytes of rows g and g + 8, and per row {scale, scale}
// and {1024 + zero, 1024 + zero} as FP16x2.
struct Chunk {
  uint4 w[2];
  uint32_t scale[2];
  uint32_t zero[2];
};

__device__ __forceinline__ void load_chunk(const quant::QuantWeight& q, const int64_t (&rows)[2],
                                           int c, int t, Chunk& out) {
  const int k = c * kChunk + t * 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    out.w[r] = __ldg(reinterpret_cast<const uint4*>(q.data + rows[r] * q.row_bytes + k / 2));
    const int64_t gi = rows[r] * q.scale_row + k / q.group;
    out.scale[r] = uint32_t(__ldg(static_cast<const unsigned short*>(q.scales) + gi)) * 0x00010001u;
    const uint32_t z = q.zeros != nullptr ? uint32_t(__ldg(q.zeros + gi)) : 8u;
    out.zero[r] = (0x6400u | z) * 0x00010001u;
  }
}

// The FP16x2 pair (e_j, e_j+4) of `word`, dequantized.
__device__ __forceinline__ uint32_t dequant_pair(uint32_t word, int j, uint32_t zero,
                                                 uint32_t scale) {
  const uint32_t biased = ((word >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
  const __half2 v =
      __hmul2(__hsub2(quant::as_half2(biased), quant::as_half2(zero)), quant::as_half2(scale));
  uint32_t bits;
  memcpy(&bits, &v, 4);
  return bits;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int kNTiles, int kWarpsM>
__global__ void __launch_bounds__(kThreads) w4_mma_kernel(const __grid_constant__ W4Params p) {
  using S = Shape<kNTiles, kWarpsM>;
  enter_dependent_grid();
  extern __shared__ __align__(16) uint16_t smem[];
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp % kWarpsM;
  const int wk = warp / kWarpsM;
  const int g = lane >> 2;
  const int t = lane & 3;
  const quant::QuantWeight& q = p.w;
  const int in = q.in;
  const int64_t x0 = int64_t(blockIdx.y) * S::kRowsX;
  const int rows_x = p.n - x0 < S::kRowsX ? int(p.n - x0) : S::kRowsX;  // valid x rows here
  const int64_t o_warp = int64_t(blockIdx.x) * S::kRowsW + wm * 16;
  const int64_t last = int64_t(p.out) - 1;
  const int64_t w_rows[2] = {o_warp + g < last ? o_warp + g : last,
                             o_warp + g + 8 < last ? o_warp + g + 8 : last};
  const int blocks = (p.chunks + S::kWarpsK - 1) / S::kWarpsK;

  // Rows of x past n: zeros in every stage, never copied over.
  for (int i = tid; i < kStages * (S::kRowsX - rows_x) * S::kUnitsPerRow; i += kThreads) {
    const int s = i / ((S::kRowsX - rows_x) * S::kUnitsPerRow);
    const int rest = i % ((S::kRowsX - rows_x) * S::kUnitsPerRow);
    const int r = rows_x + rest / S::kUnitsPerRow;
    const int u = rest % S::kUnitsPerRow;
    *reinterpret_cast<uint4*>(smem + s * S::kStageHalfs + r * S::kLd + u * 8) =
        make_uint4(0u, 0u, 0u, 0u);
  }
  // Stage b's x: unit (r, chunk cw, physical unit pu = 4 t + i) at position 4 i + t.
  const auto issue_stage = [&](int b) {
    if (b < blocks) {
      uint16_t* stage = smem + (b % kStages) * S::kStageHalfs;
      const int k0 = b * S::kBlockK;
      for (int i = tid; i < rows_x * S::kUnitsPerRow; i += kThreads) {
        const int r = i / S::kUnitsPerRow;
        const int u = i % S::kUnitsPerRow;
        if (k0 + u * 8 >= in) continue;  // a chunk past in: its warp skips it
        const int cw = u / 16;
        const int pu = u % 16;
        cp_async_16(stage + r * S::kLd + cw * kChunk + ((pu % 4) * 4 + pu / 4) * 8,
                    p.x + (x0 + r) * in + k0 + u * 8);
      }
    }
    cp_async_commit();
  };

  float acc[kNTiles][4];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[nt][c] = 0.0f;
  }
  const auto compute = [&](int b, const Chunk& ch) {
    const uint16_t* xs = smem + (b % kStages) * S::kStageHalfs + wk * kChunk + (t * 8);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t a[2][4];  // [row g, g + 8][pair j]
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t word = word_of(ch.w[r], i);
#pragma unroll
        for (int j = 0; j < 4; ++j) a[r][j] = dequant_pair(word, j, ch.zero[r], ch.scale[r]);
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xs + (nt * 8 + g) * S::kLd + (i * 4) * 8);
        mma_m16n8k16(acc[nt], a[0][0], a[1][0], a[0][1], a[1][1], __byte_perm(xv.x, xv.z, 0x5410),
                     __byte_perm(xv.x, xv.z, 0x7632));
        mma_m16n8k16(acc[nt], a[0][2], a[1][2], a[0][3], a[1][3], __byte_perm(xv.y, xv.w, 0x5410),
                     __byte_perm(xv.y, xv.w, 0x7632));
      }
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue_stage(s);
  Chunk ring[S::kPrefetch];
#pragma unroll
  for (int d = 0; d < S::kPrefetch; ++d) {
    const int c = d * S::kWarpsK + wk;
    if (c < p.chunks) load_chunk(q, w_rows, c, t, ring[d]);
  }
  for (int b0 = 0; b0 < blocks; b0 += S::kPrefetch) {
#pragma unroll
    for (int d = 0; d < S::kPrefetch; ++d) {
      const int b = b0 + d;
      if (b < blocks) {  // uniform over the CTA
        cp_async_wait<kStages - 2>();
        __syncthreads();
        issue_stage(b + kStages - 1);
        const int c = b * S::kWarpsK + wk;
        if (c < p.chunks) compute(b, ring[d]);
        const int c_next = c + S::kPrefetch * S::kWarpsK;
        if (c_next < p.chunks) load_chunk(q, w_rows, c_next, t, ring[d]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // The reduction's warps meet: warps wk > 0 leave their sums, warp wk = 0 adds and writes.
  if constexpr (S::kWarpsK > 1) {
    float* red = reinterpret_cast<float*>(smem);
    if (wk > 0) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          red[(((wk - 1) * kWarpsM + wm) * kNTiles * 4 + nt * 4 + c) * 32 + lane] = acc[nt][c];
        }
      }
    }
    __syncthreads();
    if (wk > 0) return;
#pragma unroll
    for (int o = 0; o < S::kWarpsK - 1; ++o) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[nt][c] += red[((o * kWarpsM + wm) * kNTiles * 4 + nt * 4 + c) * 32 + lane];
        }
      }
    }
  }
  // acc[nt][c]: weight row o_warp + g + 8 (c / 2), x row x0 + nt * 8 + 2 t + c % 2.
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int64_t o = o_warp + g + 8 * (c / 2);
    if (o >= p.out) continue;
    const float bias = p.bias != nullptr ? __half2float(__ushort_as_half(p.bias[o])) : 0.0f;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int r = nt * 8 + 2 * t + c % 2;
      if (r >= rows_x) continue;
      const float v = acc[nt][c] + bias;
      const int64_t at = (x0 + r) * p.out + o;
      if (p.y_f32) {
        static_cast<float*>(p.y)[at] = v;
      } else {
        static_cast<__half*>(p.y)[at] = __float2half_rn(v);
      }
    }
  }
}

template <int kNTiles, int kWarpsM>
void launch_tile(const W4Params& p, cudaStream_t stream) {
  using S = Shape<kNTiles, kWarpsM>;
  const auto kernel = w4_mma_kernel<kNTiles, kWarpsM>;
  if (S::kSmemBytes > 48 * 1024) {
    set_attribute_once(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::kSmemBytes));
  }
  const dim3 grid(unsigned((p.out + S::kRowsW - 1) / S::kRowsW),
                  unsigned((p.n + S::kRowsX - 1) / S::kRowsX));
  launch_kernel(kernel, LaunchDims{grid, dim3(kThreads), S::kSmemBytes}, stream, p);
}

bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// Why the kernel does not take w with x, or "" when it does.
const char* refusal(const LinearView& w, const void* x) {
  if (w.format != WeightFormat::kW4) return "the weight is not AWQ W4";
  if (w.in < kChunk || w.in % kChunk != 0 || w.in > (int64_t(1) << 30)) {
    return "in must be a positive multiple of 128 (below 2^30)";
  }
  if (w.group < 32 || w.group % 32 != 0 || w.in % w.group != 0) {
    return "group must be a multiple of 32 dividing in";
  }
  if (w.out < 1 || w.out > (int64_t(1) << 30)) return "out must be in [1, 2^30]";
  if (w.data == nullptr || w.scales == nullptr || !aligned(w.data, 16) || !aligned(w.scales, 2)) {
    return "the codes must be 16-byte aligned and the scales present";
  }
  if (x == nullptr || !aligned(x, 16)) return "x must be 16-byte aligned";
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || compute_capability(device) < 80) {
    return "it needs an sm_80+ device";
  }
  return "";
}

}  // namespace

const char* w4_mma_tile_name(W4MmaTile tile) {
  switch (tile) {
    case W4MmaTile::kAuto:
      return "auto";
    case W4MmaTile::k8x16:
      return "8x16";
    case W4MmaTile::k8x64:
      return "8x64";
    case W4MmaTile::k16x32:
      return "16x32";
    case W4MmaTile::k16x64:
      return "16x64";
    case W4MmaTile::k32x64:
      return "32x64";
    case W4MmaTile::k64x64:
      return "64x64";
  }
  return "?";
}

namespace {
// -1: not yet decided (the environment is read on first use), 0 off, 1 on.
std::atomic<int> g_w4_mma_auto{-1};
}  // namespace

bool w4_mma_auto() {
  int v = g_w4_mma_auto.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("E4KV_W4_MMA");
    v = env != nullptr && std::string_view(env) == "on" ? 1 : 0;
    g_w4_mma_auto.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

void set_w4_mma_auto(bool enabled) {
  g_w4_mma_auto.store(enabled ? 1 : 0, std::memory_order_relaxed);
}

bool w4_mma_supported(const LinearView& w, const void* x) {
  return *refusal(w, x) == '\0';
}

Status quant_linear_w4_mma(const uint16_t* x, const LinearView& w, const uint16_t* bias, int64_t n,
                           void* y, bool y_f32, cudaStream_t stream, W4MmaTile tile) {
  if (const char* why = refusal(w, x); *why != '\0') {
    return Status::error(cat("cuda W4 mma linear: weight [out=", w.out, ", in=", w.in,
                             ", group=", w.group, "]: ", why));
  }
  if (n < 0 || n > (int64_t(1) << 30)) return Status::error(cat("cuda W4 mma linear: n=", n));
  if (n == 0) return ok_status();
  if (y == nullptr) return Status::error("cuda W4 mma linear: y must be present");
  W4Params p{};
  p.w = quant::quant_weight(w);
  p.x = x;
  p.bias = bias;
  p.y = y;
  p.n = n;
  p.out = int32_t(w.out);
  p.chunks = int32_t(w.in / kChunk);
  p.y_f32 = y_f32;
  if (tile == W4MmaTile::kAuto) {
    tile = n <= 8    ? W4MmaTile::k8x16
           : n <= 16 ? W4MmaTile::k16x32
           : n <= 32 ? W4MmaTile::k32x64
                     : W4MmaTile::k64x64;
  }
  switch (tile) {
    case W4MmaTile::kAuto:
    case W4MmaTile::k8x16:
      launch_tile<1, 1>(p, stream);
      break;
    case W4MmaTile::k8x64:
      launch_tile<1, 4>(p, stream);
      break;
    case W4MmaTile::k16x32:
      launch_tile<2, 2>(p, stream);
      break;
    case W4MmaTile::k16x64:
      launch_tile<2, 4>(p, stream);
      break;
    case W4MmaTile::k32x64:
      launch_tile<4, 4>(p, stream);
      break;
    case W4MmaTile::k64x64:
      launch_tile<8, 4>(p, stream);
      break;
  }
  return ok_status();
}

}  // namespace e4kv::cuda
