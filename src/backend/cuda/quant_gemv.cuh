// Device pieces shared by the quantized-weight kernels (quant_linear.cu, quant_moe.cu): a few
// token rows times the weight's rows, with the weight dequantized in registers as
// quant/dequantize.h defines it (the host contract) and fp32 products and sums.
//
// Shape of the work: a CTA of kGemvWarps warps, each warp owns kOutPerWarp weight rows (output
// columns of y) for kRows token rows (x rows). The reduction dimension goes in chunks of 32 lanes
// x one 16-byte load each (1024 elements of a 4-bit row, 512 of an FP8 row, 256 of an FP16 row):
//   1. each lane issues its 16-byte load of every owned weight row (and the group's scale / zero,
//      one load per 16-byte chunk: a chunk never straddles a group, except NVFP4's two 16-element
//      groups, whose two scale bytes come in one 2-byte load) for the next chunk, before
//   2. the CTA stages this chunk of its x rows as fp32 in shared memory (FP16 -> fp32 once per
//      CTA, not once per weight row), so two chunks of loads are in flight during the staging;
//   3. each lane forms its 16 or 32 products per x row: the codes are unpacked into FP16x2 pairs
//      with a logic op or two (see the decoders), widened to fp32 and multiplied with fp32 x;
//      the group's scale multiplies the lane's partial sum once (the products of codes and FP16 x
//      are exact in fp32, so this only moves roundings: the error bound of the tests covers it).
//   4. at the end a butterfly over the lanes gives every lane every (weight row, x row) sum.
// Every weight byte is read once per CTA; token tiles of kRows > 8 rows are separate CTAs of the
// same weight rows, adjacent in launch order so the second read comes from L2.
//
// Decoders (FP16 patterns built with integer ops, exact for every code):
//   kW4     t = ((word >> 4j) & 0x000F000F) | 0x64006400 is FP16x2 {1024 + q_j, 1024 + q_j+4};
//           minus {1024 + zero, 1024 + zero} (an exact FP16 subtraction) gives (q - zero).
//   kNvfp4  ((u << 9) & 0x0E000E00) | ((u << 12) & 0x80008000), u = word >> 4j, puts the E2M1
//           exponent / mantissa bits at FP16 bits 11..9 and the sign at bit 15: the FP16 value is
//           e2m1 * 2^-14 for every code (normal and subnormal alike), folded into the scale.
//   kFp8    the software E4M3 decoder of e4m3_vec.cuh: value * 2^-8, folded into the scale.
//   kDense  FP16 pairs as they are (MoE experts where only one projection is quantized).
// x layout in shared memory: per x row, lane segments of kLaneK floats padded by 4, so the
// 16-byte shared loads of 8 neighbouring lanes fall into distinct banks.
//
// Volta (sm_70): only FP16x2 integer/half ops, prmt and FP32 FMA are used, so the same code runs
// there. A tensor-core version (mma.sync m16n8k16, or m8n8k4 pairs on sm_70) with the codes
// dequantized into the A fragments would take over for larger row counts; see quant_linear.cu.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "backend/cuda/e4m3_vec.cuh"
#include "e4kv/e4m3.h"
#include "quant/linear_view.h"

namespace e4kv::cuda::quant {

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = kGemvWarps * 32;
constexpr int kGemvMaxRows = 8;  // x rows per CTA
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// A weight as the kernels read it (quant/linear_weight.h gives the planes).
struct QuantWeight {
  const uint8_t* data = nullptr;   // [out, row_bytes]
  const void* scales = nullptr;    // [out, scale_row]: FP16 (kW4), E4M3 (kNvfp4), fp32 (kFp8Block)
  const uint8_t* zeros = nullptr;  // [out, scale_row] (kW4; nullptr: every zero is 8)
  const float* global = nullptr;   // [out] (kNvfp4)
  int64_t row_bytes = 0;
  int64_t scale_row = 0;
  int32_t in = 0;
  int32_t group = 0;
};

// The kernels' view of `w` (device memory).
inline QuantWeight quant_weight(const LinearView& w) {
  QuantWeight q;
  q.data = static_cast<const uint8_t*>(w.data);
  q.scales = w.scales;
  q.zeros = static_cast<const uint8_t*>(w.zeros);
  q.global = w.global;
  q.row_bytes = w.data_row_bytes();
  q.scale_row = w.format == WeightFormat::kFp8Block ? (w.in + w.group - 1) / w.group
                : w.format == WeightFormat::kDense  ? 0
                                                    : w.in / w.group;
  q.in = int32_t(w.in);
  q.group = int32_t(w.group);
  return q;
}

// One lane's 16 bytes of a weight row and the raw scale data of its group(s).
struct Fetch {
  uint4 w;
  uint32_t m0;  // kW4: scale FP16 bits; kNvfp4: the two E4M3 scale bytes; kFp8Block: fp32 bits
  uint32_t m1;  // kW4: zero; kNvfp4: the row's global divisor (fp32 bits)
};

__device__ __forceinline__ __half2 as_half2(uint32_t bits) {
  __half2 h;
  memcpy(&h, &bits, sizeof(h));
  return h;
}

__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t bits) {
  return __half22float2(as_half2(bits));
}

template <WeightFormat kFormat>
struct Format;

template <>
struct Format<WeightFormat::kW4> {
  static constexpr int kLaneK = 32;  // elements per 16-byte load

  __device__ __forceinline__ static Fetch fetch(const QuantWeight& q, int64_t row, int k) {
    Fetch f;
    f.w = __ldg(reinterpret_cast<const uint4*>(q.data + row * q.row_bytes + k / 2));
    const int64_t g = row * q.scale_row + k / q.group;
    f.m0 = __ldg(static_cast<const unsigned short*>(q.scales) + g);
    f.m1 = q.zeros != nullptr ? uint32_t(__ldg(q.zeros + g)) : 8u;
    return f;
  }

  template <int kRows>
  __device__ __forceinline__ static void dot(const Fetch& f, const float* xs, int x_stride,
                                             float (&acc)[kRows]) {
    const __half2 zero = as_half2((0x6400u | f.m1) * 0x00010001u);  // {1024 + z, 1024 + z}
    const float scale = __half2float(__ushort_as_half(uint16_t(f.m0)));
    const uint32_t words[4] = {f.w.x, f.w.y, f.w.z, f.w.w};
    float part[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) part[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 v[4];  // v[j] = {q[8i + j] - z, q[8i + j + 4] - z}
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t t = ((words[i] >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
        v[j] = __half22float2(__hsub2(as_half2(t), zero));
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4 a = *reinterpret_cast<const float4*>(xs + r * x_stride + 8 * i);
        const float4 b = *reinterpret_cast<const float4*>(xs + r * x_stride + 8 * i + 4);
        part[r] = fmaf(v[0].x, a.x, part[r]);
        part[r] = fmaf(v[1].x, a.y, part[r]);
        part[r] = fmaf(v[2].x, a.z, part[r]);
        part[r] = fmaf(v[3].x, a.w, part[r]);
        part[r] = fmaf(v[0].y, b.x, part[r]);
        part[r] = fmaf(v[1].y, b.y, part[r]);
        part[r] = fmaf(v[2].y, b.z, part[r]);
        part[r] = fmaf(v[3].y, b.w, part[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = fmaf(part[r], scale, acc[r]);
  }
};

template <>
struct Format<WeightFormat::kNvfp4> {
  static constexpr int kLaneK = 32;  // two 16-element groups

  __device__ __forceinline__ static Fetch fetch(const QuantWeight& q, int64_t row, int k) {
    Fetch f;
    f.w = __ldg(reinterpret_cast<const uint4*>(q.data + row * q.row_bytes + k / 2));
    // k is a multiple of 32: the two scale bytes of groups k / 16 and k / 16 + 1, 2-aligned.
    f.m0 = __ldg(reinterpret_cast<const unsigned short*>(static_cast<const uint8_t*>(q.scales) +
                                                         row * q.scale_row + k / 16));
    f.m1 = __float_as_uint(__ldg(q.global + row));
    return f;
  }

  template <int kRows>
  __device__ __forceinline__ static void dot(const Fetch& f, const float* xs, int x_stride,
                                             float (&acc)[kRows]) {
    // quant/dequantize.h: scale = e4m3(s) / global (one fp32 division), w = e2m1 * scale; the
    // decoded codes carry 2^-14, returned here exactly.
    const float global = __uint_as_float(f.m1);
    const float scale_lo = e4m3_decode(uint8_t(f.m0 & 0xFFu)) / global * 16384.0f;
    const float scale_hi = e4m3_decode(uint8_t(f.m0 >> 8)) / global * 16384.0f;
    const uint32_t words[4] = {f.w.x, f.w.y, f.w.z, f.w.w};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float part[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) part[r] = 0.0f;
#pragma unroll
      for (int i = 2 * half; i < 2 * half + 2; ++i) {
        float2 v[4];  // v[j] = {e2m1(q[8i + j]), e2m1(q[8i + j + 4])} * 2^-14
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t u = words[i] >> (4 * j);
          v[j] = half2_bits_to_float2(((u << 9) & 0x0E000E00u) | ((u << 12) & 0x80008000u));
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float4 a = *reinterpret_cast<const float4*>(xs + r * x_stride + 8 * i);
          const float4 b = *reinterpret_cast<const float4*>(xs + r * x_stride + 8 * i + 4);
          part[r] = fmaf(v[0].x, a.x, part[r]);
          part[r] = fmaf(v[1].x, a.y, part[r]);
          part[r] = fmaf(v[2].x, a.z, part[r]);
          part[r] = fmaf(v[3].x, a.w, part[r]);
          part[r] = fmaf(v[0].y, b.x, part[r]);
          part[r] = fmaf(v[1].y, b.y, part[r]);
          part[r] = fmaf(v[2].y, b.z, part[r]);
          part[r] = fmaf(v[3].y, b.w, part[r]);
        }
      }
      const float scale = half == 0 ? scale_lo : scale_hi;
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] = fmaf(part[r], scale, acc[r]);
    }
  }
};

template <>
struct Format<WeightFormat::kFp8Block> {
  static constexpr int kLaneK = 16;

  __device__ __forceinline__ static Fetch fetch(const QuantWeight& q, int64_t row, int k) {
    Fetch f;
    f.w = __ldg(reinterpret_cast<const uint4*>(q.data + row * q.row_bytes + k));
    f.m0 = __float_as_uint(
        __ldg(static_cast<const float*>(q.scales) + row * q.scale_row + k / q.group));
    f.m1 = 0;
    return f;
  }

  template <int kRows>
  __device__ __forceinline__ static void dot(const Fetch& f, const float* xs, int x_stride,
                                             float (&acc)[kRows]) {
    using Decoder = E4m3Decoder<E4m3Decode::kSoftware>;
    const float scale = __uint_as_float(f.m0) * Decoder::kValueFactor;
    const uint32_t words[4] = {f.w.x, f.w.y, f.w.z, f.w.w};
    float part[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) part[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t lo;
      uint32_t hi;
      Decoder::decode4(words[i], lo, hi);  // {q[4i], q[4i + 1]}, {q[4i + 2], q[4i + 3]}
      const float2 v0 = half2_bits_to_float2(lo);
      const float2 v1 = half2_bits_to_float2(hi);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4 a = *reinterpret_cast<const float4*>(xs + r * x_stride + 4 * i);
        part[r] = fmaf(v0.x, a.x, part[r]);
        part[r] = fmaf(v0.y, a.y, part[r]);
        part[r] = fmaf(v1.x, a.z, part[r]);
        part[r] = fmaf(v1.y, a.w, part[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = fmaf(part[r], scale, acc[r]);
  }
};

template <>
struct Format<WeightFormat::kDense> {  // FP16 elements
  static constexpr int kLaneK = 8;

  __device__ __forceinline__ static Fetch fetch(const QuantWeight& q, int64_t row, int k) {
    Fetch f;
    f.w = __ldg(reinterpret_cast<const uint4*>(q.data + row * q.row_bytes + 2 * k));
    f.m0 = 0;
    f.m1 = 0;
    return f;
  }

  template <int kRows>
  __device__ __forceinline__ static void dot(const Fetch& f, const float* xs, int x_stride,
                                             float (&acc)[kRows]) {
    const uint32_t words[4] = {f.w.x, f.w.y, f.w.z, f.w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = half2_bits_to_float2(words[i]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float2 a = *reinterpret_cast<const float2*>(xs + r * x_stride + 2 * i);
        acc[r] = fmaf(v.x, a.x, acc[r]);
        acc[r] = fmaf(v.y, a.y, acc[r]);
      }
    }
  }
};

// The fallback for shapes the 16-byte paths do not take (in a multiple of 4 is enough; any
// group, any plane alignment): four elements per lane, each dequantized by the formula of
// quant/dequantize.h from scalar loads (the same fp32 value as the host's), then multiplied.
template <WeightFormat kFormat>
struct Exact {
  static constexpr int kLaneK = 4;

  __device__ __forceinline__ static float element(const QuantWeight& q, int64_t row, int k) {
    const uint8_t* data = q.data + row * q.row_bytes;
    if constexpr (kFormat == WeightFormat::kDense) {
      const uint16_t bits = __ldg(reinterpret_cast<const unsigned short*>(data) + k);
      return __half2float(__ushort_as_half(bits));
    } else if constexpr (kFormat == WeightFormat::kFp8Block) {
      return e4m3_decode(__ldg(data + k)) *
             __ldg(static_cast<const float*>(q.scales) + row * q.scale_row + k / q.group);
    } else {
      const uint8_t byte = __ldg(data + k / 2);
      const uint32_t code = (k % 2 == 0) ? (byte & 0xFu) : uint32_t(byte >> 4);
      const int64_t g = row * q.scale_row + k / q.group;
      if constexpr (kFormat == WeightFormat::kW4) {
        const float zero = q.zeros != nullptr ? float(__ldg(q.zeros + g)) : 8.0f;
        const float scale =
            __half2float(__ushort_as_half(__ldg(static_cast<const unsigned short*>(q.scales) + g)));
        return (float(code) - zero) * scale;
      } else {
        const float scale =
            e4m3_decode(__ldg(static_cast<const uint8_t*>(q.scales) + g)) / __ldg(q.global + row);
        const uint32_t bits = ((code & 7u) << 9) | ((code & 8u) << 12);  // e2m1 * 2^-14
        return __half2float(__ushort_as_half(uint16_t(bits))) * 16384.0f * scale;
      }
    }
  }

  __device__ __forceinline__ static Fetch fetch(const QuantWeight& q, int64_t row, int k) {
    Fetch f;
    f.w = make_uint4(__float_as_uint(element(q, row, k)), __float_as_uint(element(q, row, k + 1)),
                     __float_as_uint(element(q, row, k + 2)),
                     __float_as_uint(element(q, row, k + 3)));
    f.m0 = 0;
    f.m1 = 0;
    return f;
  }

  template <int kRows>
  __device__ __forceinline__ static void dot(const Fetch& f, const float* xs, int x_stride,
                                             float (&acc)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float4 a = *reinterpret_cast<const float4*>(xs + r * x_stride);
      acc[r] = fmaf(__uint_as_float(f.w.x), a.x, acc[r]);
      acc[r] = fmaf(__uint_as_float(f.w.y), a.y, acc[r]);
      acc[r] = fmaf(__uint_as_float(f.w.z), a.z, acc[r]);
      acc[r] = fmaf(__uint_as_float(f.w.w), a.w, acc[r]);
    }
  }
};

// Floats of one x row's chunk in shared memory, for the lane work F (Format<> or Exact<>).
template <class F>
constexpr int x_stage_stride() {
  return 32 * (F::kLaneK + 4);
}

// Stages elements [c0, c0 + 32 kLaneK) of each x row (x_rows[r]; nullptr: zeros) as fp32 into xs
// [kRows][x_stage_stride]; elements at or past `in` are zeros. x rows: FP16, 8-byte aligned; `in`
// a multiple of 4.
template <class F, int kRows>
__device__ __forceinline__ void stage_x(float* xs, const uint16_t* const* x_rows, int c0, int in) {
  constexpr int kLaneK = F::kLaneK;
  constexpr int kQuads = 32 * kLaneK / 4;
  for (int idx = int(threadIdx.x); idx < kRows * kQuads; idx += int(blockDim.x)) {
    const int r = idx / kQuads;
    const int kk = 4 * (idx % kQuads);
    const uint16_t* row = x_rows[r];
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row != nullptr && c0 + kk < in) {
      const uint2 raw = *reinterpret_cast<const uint2*>(row + c0 + kk);
      const float2 lo = half2_bits_to_float2(raw.x);
      const float2 hi = half2_bits_to_float2(raw.y);
      v = make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    *reinterpret_cast<float4*>(xs + r * x_stage_stride<F>() + (kk / kLaneK) * (kLaneK + 4) +
                               kk % kLaneK) = v;
  }
}

// acc[o][r] = sum over k of w[w_rows[o], k] * x_rows[r][k] (every lane gets every sum), for the
// weight rows w_rows[o] (-1: none; the same for the whole warp) and the CTA's x rows. Called by
// every thread of the CTA (it synchronises the CTA); xs: shared [kRows][x_stage_stride].
// F: the lane work, Format<format> or Exact<format>.
template <class F, int kRows, int kOutPerWarp>
__device__ __forceinline__ void gemv_rows(const QuantWeight& q,
                                          const int64_t (&w_rows)[kOutPerWarp],
                                          const uint16_t* const* x_rows, float* xs,
                                          float (&acc)[kOutPerWarp][kRows]) {
  const int lane = int(threadIdx.x) & 31;
#pragma unroll
  for (int o = 0; o < kOutPerWarp; ++o) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[o][r] = 0.0f;
  }
  constexpr int kChunk = 32 * F::kLaneK;
  // The loads of chunk c + 1 are issued before chunk c is staged and used: two chunks of every
  // warp's rows in flight (the memory-level parallelism decode needs), 6 registers per row more.
  const auto fetch = [&](Fetch(&f)[kOutPerWarp], int c0) {
    const int k = c0 + lane * F::kLaneK;
#pragma unroll
    for (int o = 0; o < kOutPerWarp; ++o) {
      f[o] = Fetch{make_uint4(0u, 0u, 0u, 0u), 0u, 0u};
      if (w_rows[o] >= 0 && k < q.in) f[o] = F::fetch(q, w_rows[o], k);
    }
  };
  Fetch cur[kOutPerWarp];
  Fetch next[kOutPerWarp];
  fetch(cur, 0);
  for (int c0 = 0; c0 < q.in; c0 += kChunk) {
    fetch(next, c0 + kChunk);  // nothing past the row: k >= in
    __syncthreads();           // every warp is done reading the previous chunk
    stage_x<F, kRows>(xs, x_rows, c0, q.in);
    __syncthreads();
    if (c0 + lane * F::kLaneK < q.in) {
#pragma unroll
      for (int o = 0; o < kOutPerWarp; ++o) {
        if (w_rows[o] >= 0) {
          F::template dot<kRows>(cur[o], xs + lane * (F::kLaneK + 4), x_stage_stride<F>(), acc[o]);
        }
      }
    }
#pragma unroll
    for (int o = 0; o < kOutPerWarp; ++o) cur[o] = next[o];
  }
#pragma unroll
  for (int o = 0; o < kOutPerWarp; ++o) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        acc[o][r] += __shfl_xor_sync(kFullMask, acc[o][r], off);
      }
    }
  }
}

}  // namespace e4kv::cuda::quant
