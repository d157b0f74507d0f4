// Main KV cache write: FP16 K/V rows into the paged cache as FP16 or E4M3, with inf/NaN counts
// and optional fused calibration statistics (DESIGN.md sections 2, 3 and 6). The CPU reference
// backend/cpu/cache_write.cpp is the oracle; the cache bytes and counts are identical.
//
// Work: one warp per (token, K|V) row; gridDim.y = 2 (K, V), 8 warps per CTA, a grid-stride loop
// over tokens. A chunk is 16 contiguous elements: two 16-byte loads, then one 16-byte store (E4M3)
// or two (FP16). Lane l takes chunks l, l + 32, l + 64, ... of a row, kUnroll per step, and issues
// the loads of a step's chunks before any of its stores: the compiler would not move a load above a
// store on its own (dst may alias the source as far as it knows), so a row of 1024 elements took
// two round trips to memory instead of one. kUnroll is a lane's chunks per row rounded up to 1, 2
// or 4 (at most 2 with statistics), picked per launch (lane_unroll). A slot of -1 skips the token
// (the whole warp).
//
// Short E4M3 rows, several tokens per step: with 1 or 2 chunks per lane (rows of up to 512 or 1024
// elements) a warp's step covers kTokens = 4 / kUnroll consecutive tokens (2 tokens of 1 chunk with
// statistics; tokens_per_step), so a lane has 4 chunks in flight as with longer rows, when there
// are enough tokens to fill the GPU with those larger steps (launch_tokens_per_step). Otherwise the
// loads of the next token waited for the encode and stores of this one: one chunk per lane in
// flight, and the E4M3 encode of a chunk is 16 elements of about 13 instructions each. A step first
// reads the slot of each of its tokens (a slot of -1 or outside the cache, or a token past the end,
// skips that token's row, uniformly over the warp), then issues the loads of every row that it
// writes, then encodes and stores them token by token. The host sizes the grid by kWarps * kTokens
// tokens per CTA step. A chunk in flight holds 8 registers, and the register budget follows the
// chunks in flight (min_ctas_per_sm): the E4M3 4-chunk kernels run 3 CTAs per SM instead of 5, for
// more bytes in flight per SM (2 x 256 E4M3: 68% -> 76% of copy bandwidth, see notes).
//
// E4M3 encode, exact for finite x without the general codec's branches:
//   q = |x| / scale             in one of the three forms below, each exact for the scales it gets
//   a = min(q, 448)             scale > 0, so |x| / scale = |x / scale|; an overflow to inf clamps
//                               to 448, which is the codec's saturation
//   a >= 2^-6: code = (bits(a) + 0x7FFFF + lsb - 0x3C000000) >> 20   the codec's own RNE
//   a <  2^-6: code = bits(a + 2^14) - bits(2^14): the fp32 add rounds a to a multiple of 2^-9
//              (the ulp of [2^14, 2^15)) half to even, which is the codec's subnormal rounding
//   sign: the FP16 sign bit (x / scale keeps the sign of x, zeros and underflow included).
// min() would turn NaN into 448, so a chunk holding any inf/NaN (found with one x * 0 + acc HFMA2
// per two elements: NaN for inf/NaN, +-0 otherwise) takes the reference e4m3_encode instead and
// counts its non-finite elements; the engine treats any as an error, so that path is cold.
//
// The division: e4m3_encode's IEEE division (__fdiv_rn: a reciprocal, FMAs, a range check and a
// slow-path branch) was most of the encode's instructions. A code only depends on q up to E4M3's
// rounding, and there are only 31744 finite FP16 magnitudes, so per scale the host tries the
// cheaper forms on every one of them against e4m3_encode and takes the first that gives the
// reference's code for all (cache_write_division_mode, memoised per scale value; r = 1 / scale is
// rounded to fp32 on the host and passed in the parameters):
//   kReciprocal: q = |x| * r                                       one FMUL
//   kCorrected:  q0 = |x| * r; q = fma(fma(-q0, scale, |x|), r, q0)  FMUL and two FFMAs
//   kExact:      q = __fdiv_rn(|x|, scale)
// The host check runs this file's own magnitude_code (host and device), whose products are never
// contracted into FMAs on either side, so it checks the bits that the GPU computes. Of 20000
// random calibration-like scales (FP16 absmax / 448) 88% got kReciprocal and 12% kCorrected; kExact
// came up only for scales <= 2^-128 (subnormal, where 1 / scale overflows). K and V rows are in
// different blockIdx.y, so the branch on the form is uniform per CTA.
//
// Hardware encode (sm_89+): per two elements one cvt.rn.satfinite.e4m3x2.f32 of q = |x| / scale
// (the same divide() value) with the FP16 sign attached, in place of the rounding above
// (encode4_hardware). The conversion rounds to nearest even and saturates, inf too, to 448: that is
// min(q, 448) rounded as above, checked on all 2^32 fp32 inputs. The sign goes onto q, not onto x
// before the division: the corrected form turns -0 into +0 (q0 = -0 * r = -0, then
// -q0 * scale + -0 = +0), and -0 must stay 0x80 as in the reference. Chunks with inf/NaN take
// encode4_exact on both paths. The kernels are instances per encoder (CacheStore) that the host
// picks per launch: with cache_write_hardware_encode_usable (so E4KV_FORCE_SOFTWARE_E4M3=1 turns
// it off) unless the caller asks for software (CacheWriteEncode). Not a branch on a kernel
// parameter: with both encoders in one kernel ptxas spilled 152 bytes in the 2 x 256 kernel (1
// chunk, 4 tokens per step) at its 80 registers, and none with one (CUDA 13, sm_90). Code for
// older GPUs, or built with E4KV_FORCE_SOFTWARE_E4M3, holds only the software encoder.
//
// Statistics (optional): per element one read of the FP16 -> slot table (64 KB, L1-resident;
// built from kv_hist_bin_f16) and a shared-memory atomic in the warp's own histogram; CTAs loop
// over tokens (2 CTAs per SM and tensor) and add their histograms to the global counters once.
//
// Limits: n_kv_heads * head_dim a multiple of 16; 16-byte aligned K, V and cache.
// Why fast: every byte is read once and written once with 16-byte accesses, a lane's loads of up
// to 4 chunks (of one or several tokens) in flight together; without the division the E4M3 encode
// is mostly integer work, and on sm_89+ one conversion per two elements; the block of a slot is a
// shift for power-of-two block sizes.
// Experiments: bench/notes/cache_write.md (the encoders and the multi-token step, with figures).
#include "backend/cuda/cache_write.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <unordered_map>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/launch.cuh"
#include "core/check.h"
#include "core/half.h"
#include "e4kv/e4m3.h"

namespace e4kv::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 16;  // elements per chunk
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int64_t kMaxCtas = int64_t(1) << 20;  // per tensor; more tokens loop
constexpr int kStatsCtasPerSm = 2;  // per tensor: few CTAs, each merges its histogram once
// FP16 magnitudes (bits & 0x7FFF) below this are finite.
constexpr uint32_t kF16Infinity = 0x7C00u;
// Scales whose division form is remembered; a caller cycling through more starts over.
constexpr size_t kMaxMemoisedScales = 4096;

// What a kernel instance stores: FP16, or E4M3 through the software or the hardware encoder.
enum class CacheStore { kF16, kE4m3Software, kE4m3Hardware };

struct CacheWriteKernelParams {
  const uint16_t* k;         // [n_tokens, n_kv_heads, head_dim] FP16
  const uint16_t* v;         // [n_tokens, n_kv_heads, head_dim] FP16
  const void* slot_mapping;  // [n_tokens] int64 or int32, -1 = skip
  uint8_t* cache;            // [n_blocks, 2, block_size, n_kv_heads, head_dim] FP16 or E4M3
  int64_t n_tokens;
  int64_t n_slots;  // n_blocks * block_size
  int64_t block_size;
  int32_t block_shift;  // log2(block_size) when a power of two, else -1
  int32_t row_chunks;   // row_elems / kChunk
  int64_t row_elems;    // n_kv_heads * head_dim
  float k_scale;
  float v_scale;
  float k_reciprocal;  // division_reciprocal(k_scale)
  float v_reciprocal;  // division_reciprocal(v_scale)
  CacheWriteDivision k_division;
  CacheWriteDivision v_division;
  unsigned long long* non_finite;     // [2] (K, V) or nullptr
  CacheWriteStatsCounters* counters;  // nullptr without statistics
  const uint16_t* slot_table;         // [kCacheWriteStatTableSize]
  // 0: the multiplier of the inf/NaN test, a parameter so that no compiler folds x * 0.
  uint32_t zero_f16x2;
};

// fp32 operations rounded to nearest that compute the same bits in the kernel and in the host's
// division check. The device intrinsics are never contracted into an FMA; on the host the product
// goes through a volatile so that no contraction can fuse it either (std::fma is the fused one).
__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  const volatile float product = a * b;
  return product;
#endif
}

__host__ __device__ __forceinline__ float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

__host__ __device__ __forceinline__ float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// The r of the cheaper division forms, the same value for the host check and the kernel.
float division_reciprocal(float scale) {
  return 1.0f / scale;
}

// a / scale for a >= 0 in the form kDivision; r = division_reciprocal(scale).
template <CacheWriteDivision kDivision>
__host__ __device__ __forceinline__ float divide(float a, float scale, float r) {
  if constexpr (kDivision == CacheWriteDivision::kReciprocal) {
    return mul_rn(a, r);
  } else if constexpr (kDivision == CacheWriteDivision::kCorrected) {
    const float q0 = mul_rn(a, r);
    return fma_rn(fma_rn(-q0, scale, a), r, q0);
  } else {
    return e4m3_detail::divide_rn(a, scale);
  }
}

// E4M3 code of a / scale without the sign, for finite a >= 0 (see the top of the file).
template <CacheWriteDivision kDivision>
__host__ __device__ __forceinline__ uint32_t magnitude_code(float a, float scale, float r) {
  const float q = fminf(divide<kDivision>(a, scale, r), kE4m3Max);
  const uint32_t m = e4m3_detail::float_bits(q);
  const uint32_t normal = (m + 0x7FFFFu + ((m >> 20) & 1u) - 0x3C000000u) >> 20;
  const uint32_t subnormal = e4m3_detail::float_bits(add_rn(q, 16384.0f)) - 0x46800000u;
  return m < 0x3C800000u ? subnormal : normal;
}

// True when kDivision gives e4m3_encode's code at `scale` for every finite FP16 magnitude.
template <CacheWriteDivision kDivision>
bool division_is_exact(float scale) {
  const float r = division_reciprocal(scale);
  for (uint32_t h = 0; h < kF16Infinity; ++h) {
    const float a = f16_to_f32(uint16_t(h));
    // a >= 0, so the reference code has no sign bit.
    if (magnitude_code<kDivision>(a, scale, r) != e4m3_encode(a, scale)) return false;
  }
  return true;
}

CacheWriteDivision choose_division(float scale) {
  if (division_is_exact<CacheWriteDivision::kReciprocal>(scale)) {
    return CacheWriteDivision::kReciprocal;
  }
  if (division_is_exact<CacheWriteDivision::kCorrected>(scale)) {
    return CacheWriteDivision::kCorrected;
  }
  return CacheWriteDivision::kExact;
}

__device__ __forceinline__ float half_bits_to_float(uint32_t bits16) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
}

// x * 0 + acc on both FP16 halves: +-0 stays +-0 for finite x; inf and NaN make (and keep) NaN.
// `zero` is 0 (both halves).
__device__ __forceinline__ uint32_t accumulate_non_finite(uint32_t w, uint32_t zero, uint32_t acc) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(w), "r"(zero), "r"(acc));
  return d;
}

// Number of inf/NaN halves of w: the exponent field plus 0x400 reaches bit 15 only when all ones.
__device__ __forceinline__ int count_non_finite(uint32_t w) {
  return __popc(((w & 0x7C007C00u) + 0x04000400u) & 0x80008000u);
}

// Four finite FP16 values (w0 = elements 0, 1; w1 = 2, 3; first in the low half) -> four codes,
// code i in byte i.
template <CacheWriteDivision kDivision>
__device__ __forceinline__ uint32_t encode4_finite(uint32_t w0, uint32_t w1, float scale, float r) {
  const auto code = [&](uint32_t bits16) {
    return magnitude_code<kDivision>(fabsf(half_bits_to_float(bits16)), scale, r);
  };
  const uint32_t c0 = code(w0 & 0xFFFFu);
  const uint32_t c1 = code(w0 >> 16);
  const uint32_t c2 = code(w1 & 0xFFFFu);
  const uint32_t c3 = code(w1 >> 16);
  const uint32_t codes =
      __byte_perm(__byte_perm(c0, c1, 0x0040u), __byte_perm(c2, c3, 0x0040u), 0x5410u);
  const uint32_t signs = __byte_perm(w0, w1, 0x7531u);  // the high byte of each FP16
  return codes | (signs & 0x80808080u);
}

// encode4_finite's codes through the sm_89+ conversion (see the top of the file).
template <CacheWriteDivision kDivision>
__device__ __forceinline__ uint32_t encode4_hardware(uint32_t w0, uint32_t w1, float scale,
                                                     float r) {
#if E4KV_DEVICE_ARCH >= 890 && !defined(E4KV_FORCE_SOFTWARE_E4M3)
  const auto signed_quotient = [&](uint32_t bits16) {
    const float x = half_bits_to_float(bits16);
    return copysignf(divide<kDivision>(fabsf(x), scale, r), x);
  };
  const float q0 = signed_quotient(w0 & 0xFFFFu);
  const float q1 = signed_quotient(w0 >> 16);
  const float q2 = signed_quotient(w1 & 0xFFFFu);
  const float q3 = signed_quotient(w1 >> 16);
  // The conversion puts its first source in the upper byte: (q1, q0) -> code 1 << 8 | code 0.
  uint32_t codes;
  asm("{\n\t"
      ".reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t"
      "}"
      : "=r"(codes)
      : "f"(q0), "f"(q1), "f"(q2), "f"(q3));
  return codes;
#else
  // Never launched: the host picks kE4m3Hardware only where cache_write_hardware_encode_usable.
  (void)w0;
  (void)w1;
  (void)scale;
  (void)r;
  __trap();
  return 0;
#endif
}

// The same through the reference codec, for any input (NaN -> 0x7F).
__device__ __noinline__ uint32_t encode4_exact(uint32_t w0, uint32_t w1, float scale) {
  const uint32_t c0 = e4m3_encode(half_bits_to_float(w0 & 0xFFFFu), scale);
  const uint32_t c1 = e4m3_encode(half_bits_to_float(w0 >> 16), scale);
  const uint32_t c2 = e4m3_encode(half_bits_to_float(w1 & 0xFFFFu), scale);
  const uint32_t c3 = e4m3_encode(half_bits_to_float(w1 >> 16), scale);
  return c0 | c1 << 8 | c2 << 16 | c3 << 24;
}

// What a chunk (w: 16 FP16 values, two per word, first in the low half) becomes in the cache row
// dst: FP16 as it is, or E4M3 codes.
struct ChunkToF16 {
  static constexpr int64_t kElemBytes = 2;

  __device__ __forceinline__ void store(uint4* dst, int c, const uint32_t (&w)[kChunk / 2],
                                        bool) const {
    dst[2 * c] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[2 * c + 1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
};

// kHardware: finite chunks through encode4_hardware (sm_89+ code only), else encode4_finite.
template <CacheWriteDivision kDivision, bool kHardware>
struct ChunkToE4m3 {
  static constexpr int64_t kElemBytes = 1;
  float scale;
  float r;  // division_reciprocal(scale)

  __device__ __forceinline__ void store(uint4* dst, int c, const uint32_t (&w)[kChunk / 2],
                                        bool all_finite) const {
    uint4 out;
    if (all_finite) {
      if constexpr (kHardware) {
        out.x = encode4_hardware<kDivision>(w[0], w[1], scale, r);
        out.y = encode4_hardware<kDivision>(w[2], w[3], scale, r);
        out.z = encode4_hardware<kDivision>(w[4], w[5], scale, r);
        out.w = encode4_hardware<kDivision>(w[6], w[7], scale, r);
      } else {
        out.x = encode4_finite<kDivision>(w[0], w[1], scale, r);
        out.y = encode4_finite<kDivision>(w[2], w[3], scale, r);
        out.z = encode4_finite<kDivision>(w[4], w[5], scale, r);
        out.w = encode4_finite<kDivision>(w[6], w[7], scale, r);
      }
    } else {
      out.x = encode4_exact(w[0], w[1], scale);
      out.y = encode4_exact(w[2], w[3], scale);
      out.z = encode4_exact(w[4], w[5], scale);
      out.w = encode4_exact(w[6], w[7], scale);
    }
    dst[c] = out;
  }
};

// Threads an SM holds, which bounds the CTAs that __launch_bounds__ may ask for: 2048 on sm_70,
// sm_80, sm_90 and sm_100, 1024 on sm_75, 1536 assumed elsewhere (sm_86, sm_89, sm_120; asking for
// fewer CTAs than fit only loosens the register budget). A resource of the real target, so
// __CUDA_ARCH__ and not E4KV_DEVICE_ARCH (a Volta-path build for sm_75 still has sm_75's SMs).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
constexpr int kMaxThreadsPerSm = 1024;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 700 && __CUDA_ARCH__ != 800 && \
    __CUDA_ARCH__ != 900 && __CUDA_ARCH__ != 1000
constexpr int kMaxThreadsPerSm = 1536;
#else
constexpr int kMaxThreadsPerSm = 2048;
#endif

// A lane's chunks per row and step (kUnroll): its chunks of a row rounded up to 1, 2 or 4 (longer
// rows take several steps); at most 2 with statistics, whose register budget 4 would not fit
// without spilling (min_ctas_per_sm).
constexpr int lane_unroll(bool stats, int32_t row_chunks) {
  const int32_t lane_chunks = (row_chunks + 31) / 32;
  if (lane_chunks <= 1) return 1;
  if (stats || lane_chunks <= 2) return 2;
  return 4;
}

// Tokens per warp and step of the grid-stride loop (kTokens): E4M3 rows of 1 or 2 chunks per lane
// take 4 / kUnroll tokens, so that a lane has 4 chunks in flight as with longer rows; 2 with
// statistics (their budget). kUnroll = 2 with statistics may be a step of a longer row: one token.
// FP16 rows take one token: 4 tokens per step made the FP16 copy slower (fewer CTAs per SM for no
// encode latency to hide) while it made E4M3 faster (see notes).
// The multi-token step needs enough tokens to fill the GPU with its fewer, larger CTAs: slower than
// one token per step at 4096 tokens, faster at 65536 (see notes). It is taken when its grid has at
// least 8 CTAs per SM (K and V together); sizes between those two were not measured.
constexpr int tokens_per_step(bool e4m3, bool stats, int unroll) {
  if (!e4m3) return 1;
  if (stats) return unroll == 1 ? 2 : 1;
  return 4 / unroll;
}

int launch_tokens_per_step(bool e4m3, bool stats, int unroll, int64_t n_tokens, int n_sms) {
  const int tokens = tokens_per_step(e4m3, stats, unroll);
  const int64_t ctas = 2 * ((n_tokens + int64_t(kWarps) * tokens - 1) / (int64_t(kWarps) * tokens));
  return ctas >= 8 * int64_t(n_sms) ? tokens : 1;
}

// CTAs per SM that the kernel's register budget must allow, for `in_flight` chunks per lane and
// step (kUnroll x kTokens): with 64K registers and 256 threads, 8 / 5 / 4 / 3 CTAs leave
// 32 / 48 / 64 / 80 registers. A chunk in flight costs 8 registers, and the E4M3 encode needs more:
// there the budgets are the smallest at which ptxas (CUDA 13, sm_90) does not spill. With
// statistics the grid has kStatsCtasPerSm CTAs per SM for each of K and V, which must all be
// resident.
constexpr int min_ctas_per_sm(bool e4m3, bool stats, int in_flight) {
  const int fit = kMaxThreadsPerSm / kThreads;
  if (stats) return std::min(2 * kStatsCtasPerSm, fit);
  if (in_flight == 1) return std::min(e4m3 ? 5 : 8, fit);
  if (in_flight == 2) return std::min(e4m3 ? 4 : 5, fit);
  return std::min(e4m3 ? 3 : 4, fit);
}

// Per-CTA statistics of one tensor: a histogram per warp (same-address atomics of one warp do not
// contend with other warps) and the largest finite FP16 magnitude.
struct StatsShared {
  unsigned int hist[kWarps][kCacheWriteStatSlots];
  unsigned int absmax;
};

template <bool kStats>
struct StatsCollector;

template <>
struct StatsCollector<false> {
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ void observe(const uint32_t (&)[kChunk / 2]) {}
  __device__ __forceinline__ void end(const CacheWriteKernelParams&) {}
};

template <>
struct StatsCollector<true> {
  StatsShared* shared;
  const uint16_t* table;
  int warp;
  unsigned int absmax = 0;

  __device__ __forceinline__ void begin() {
    unsigned int* words = &shared->hist[0][0];
    for (int i = threadIdx.x; i < kWarps * kCacheWriteStatSlots; i += kThreads) words[i] = 0;
    if (threadIdx.x == 0) shared->absmax = 0;
    __syncthreads();
  }

  __device__ __forceinline__ void observe(const uint32_t (&w)[kChunk / 2]) {
    unsigned int* hist = shared->hist[warp];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const uint32_t mag = (w[i / 2] >> (16 * (i % 2))) & 0x7FFFu;
      atomicAdd(&hist[__ldg(table + mag)], 1u);
      if (mag < kF16Infinity) absmax = max(absmax, mag);  // FP16 magnitudes order like their bits
    }
  }

  __device__ __forceinline__ void end(const CacheWriteKernelParams& p) {
    for (int offset = 16; offset > 0; offset /= 2) {
      absmax = max(absmax, __shfl_xor_sync(kFullMask, absmax, offset));
    }
    if (threadIdx.x % 32 == 0) atomicMax(&shared->absmax, absmax);
    __syncthreads();
    const int kv = int(blockIdx.y);
    for (int s = threadIdx.x; s < kCacheWriteStatSlots; s += kThreads) {
      unsigned long long sum = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += shared->hist[w][s];
      if (sum != 0) atomicAdd(&p.counters->slots[kv][s], sum);
    }
    if (threadIdx.x == 0 && shared->absmax != 0) {
      atomicMax(&p.counters->absmax_f16[kv], shared->absmax);
    }
  }
};

// Chunk c of the row at src (16 FP16 values, two per word, first in the low half) into w.
__device__ __forceinline__ void load_chunk(const uint4* __restrict__ src, int c,
                                           uint32_t (&w)[kChunk / 2]) {
  const uint4 lo = __ldg(src + 2 * c);
  const uint4 hi = __ldg(src + 2 * c + 1);
  w[0] = lo.x;
  w[1] = lo.y;
  w[2] = lo.z;
  w[3] = lo.w;
  w[4] = hi.x;
  w[5] = hi.y;
  w[6] = hi.z;
  w[7] = hi.w;
}

// Counts the inf/NaN of a loaded chunk, observes it and stores it as chunk c of the row at dst.
template <bool kStats, class Chunk>
__device__ __forceinline__ void store_chunk(const CacheWriteKernelParams& p, const Chunk& chunk,
                                            uint4* dst, int c, const uint32_t (&w)[kChunk / 2],
                                            StatsCollector<kStats>& stats,
                                            unsigned long long& non_finite) {
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < kChunk / 2; ++i) acc = accumulate_non_finite(w[i], p.zero_f16x2, acc);
  const bool all_finite = (acc & 0x7FFF7FFFu) == 0;
  if (!all_finite) {
#pragma unroll
    for (int i = 0; i < kChunk / 2; ++i) non_finite += count_non_finite(w[i]);
  }
  stats.observe(w);
  chunk.store(dst, c, w, all_finite);
}

// The cache row of `slot` in rows of row_elems, or -1 for a slot outside the cache (-1: padding).
__device__ __forceinline__ int64_t cache_row(const CacheWriteKernelParams& p, int64_t slot,
                                             int kv) {
  if (slot < 0 || slot >= p.n_slots) return -1;
  const int64_t block = p.block_shift >= 0 ? slot >> p.block_shift : slot / p.block_size;
  // Row (block * 2 + kv) * block_size + slot % block_size of the cache.
  return slot + (block + kv) * p.block_size;
}

// The CTA's share of the rows of one tensor (K or V: blockIdx.y), each chunk stored by `chunk`;
// per warp and step of the grid-stride loop kTokens consecutive tokens, kUnroll chunks of each
// per lane.
template <int kUnroll, int kTokens, bool kStats, class Slot, class Chunk>
__device__ __forceinline__ void write_rows(const CacheWriteKernelParams& p, const Chunk& chunk,
                                           StatsCollector<kStats>& stats,
                                           unsigned long long& non_finite) {
  const int kv = int(blockIdx.y);
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const uint16_t* __restrict__ src_tensor = kv == 0 ? p.k : p.v;
  const Slot* __restrict__ slot_mapping = static_cast<const Slot*>(p.slot_mapping);

  for (int64_t t0 = (int64_t(blockIdx.x) * kWarps + warp) * kTokens; t0 < p.n_tokens;
       t0 += int64_t(gridDim.x) * kWarps * kTokens) {
    if constexpr (kTokens == 1) {
      const int64_t dst_row = cache_row(p, int64_t(__ldg(slot_mapping + t0)), kv);
      if (dst_row < 0) continue;  // the whole warp skips
      const uint4* src = reinterpret_cast<const uint4*>(src_tensor + t0 * p.row_elems);
      uint4* dst = reinterpret_cast<uint4*>(p.cache + dst_row * p.row_elems * Chunk::kElemBytes);
      for (int first = lane; first < p.row_chunks; first += 32 * kUnroll) {
        // Chunk u of the step is first + 32 * u; all loads first (see the top of the file).
        uint32_t w[kUnroll][kChunk / 2];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (first + 32 * u < p.row_chunks) load_chunk(src, first + 32 * u, w[u]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (first + 32 * u >= p.row_chunks) break;
          store_chunk(p, chunk, dst, first + 32 * u, w[u], stats, non_finite);
        }
      }
    } else {
      // Each token's slot first: -1 (padding), outside the cache or past the last token skips its
      // row (uniform over the warp). The host takes kTokens > 1 only for rows of at most
      // 32 * kUnroll chunks, one pass of the loop over `first`.
      int64_t dst_row[kTokens];
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        const int64_t t = t0 + j;
        dst_row[j] = t < p.n_tokens ? cache_row(p, int64_t(__ldg(slot_mapping + t)), kv) : -1;
      }
      const uint4* src = reinterpret_cast<const uint4*>(src_tensor + t0 * p.row_elems);
      for (int first = lane; first < p.row_chunks; first += 32 * kUnroll) {
        // Chunk u of token j's step is first + 32 * u; the loads of every token first.
        uint32_t w[kTokens][kUnroll][kChunk / 2];
#pragma unroll
        for (int j = 0; j < kTokens; ++j) {
          if (dst_row[j] < 0) continue;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (first + 32 * u < p.row_chunks) {
              load_chunk(src + j * (2 * int64_t(p.row_chunks)), first + 32 * u, w[j][u]);
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kTokens; ++j) {
          if (dst_row[j] < 0) continue;
          uint4* dst =
              reinterpret_cast<uint4*>(p.cache + dst_row[j] * p.row_elems * Chunk::kElemBytes);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (first + 32 * u >= p.row_chunks) break;
            store_chunk(p, chunk, dst, first + 32 * u, w[j][u], stats, non_finite);
          }
        }
      }
    }
  }
}

// write_rows of an E4M3 cache with the tensor's division form and the encode kHardware.
template <bool kHardware, int kUnroll, int kTokens, bool kStats, class Slot>
__device__ __forceinline__ void write_e4m3_rows(const CacheWriteKernelParams& p,
                                                StatsCollector<kStats>& stats,
                                                unsigned long long& non_finite) {
  const int kv = int(blockIdx.y);
  const float scale = kv == 0 ? p.k_scale : p.v_scale;
  const float r = kv == 0 ? p.k_reciprocal : p.v_reciprocal;
  // Uniform per CTA (K and V are different blockIdx.y).
  switch (kv == 0 ? p.k_division : p.v_division) {
    case CacheWriteDivision::kReciprocal:
      write_rows<kUnroll, kTokens, kStats, Slot>(
          p, ChunkToE4m3<CacheWriteDivision::kReciprocal, kHardware>{scale, r}, stats, non_finite);
      break;
    case CacheWriteDivision::kCorrected:
      write_rows<kUnroll, kTokens, kStats, Slot>(
          p, ChunkToE4m3<CacheWriteDivision::kCorrected, kHardware>{scale, r}, stats, non_finite);
      break;
    case CacheWriteDivision::kExact:
      write_rows<kUnroll, kTokens, kStats, Slot>(
          p, ChunkToE4m3<CacheWriteDivision::kExact, kHardware>{scale, r}, stats, non_finite);
      break;
  }
}

template <CacheStore kStore, bool kStats, int kUnroll, int kTokens, class Slot>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm(kStore != CacheStore::kF16, kStats,
                                                            kUnroll* kTokens))
    cache_write_kernel(const __grid_constant__ CacheWriteKernelParams p) {
  enter_dependent_grid();
  const int kv = int(blockIdx.y);
  const int lane = int(threadIdx.x) % 32;

  StatsCollector<kStats> stats;
  if constexpr (kStats) {
    __shared__ StatsShared shared;
    stats.shared = &shared;
    stats.table = p.slot_table;
    stats.warp = int(threadIdx.x) / 32;
  }
  stats.begin();

  unsigned long long non_finite = 0;
  if constexpr (kStore == CacheStore::kF16) {
    write_rows<kUnroll, kTokens, kStats, Slot>(p, ChunkToF16{}, stats, non_finite);
  } else {
    write_e4m3_rows<kStore == CacheStore::kE4m3Hardware, kUnroll, kTokens, kStats, Slot>(
        p, stats, non_finite);
  }

  // Warp-aggregated: one atomic per warp that saw any inf/NaN.
  if (p.non_finite != nullptr && __any_sync(kFullMask, non_finite != 0)) {
    for (int offset = 16; offset > 0; offset /= 2) {
      non_finite += __shfl_xor_sync(kFullMask, non_finite, offset);
    }
    if (lane == 0) atomicAdd(&p.non_finite[kv], non_finite);
  }
  stats.end(p);
}

template <CacheStore kStore, bool kStats, int kUnroll, int kTokens>
void launch_write(const CacheWriteKernelParams& kp, bool slots64, dim3 grid, cudaStream_t stream) {
  if (slots64) {
    launch_kernel(cache_write_kernel<kStore, kStats, kUnroll, kTokens, int64_t>,
                  LaunchDims{grid, dim3(kThreads)}, stream, kp);
  } else {
    launch_kernel(cache_write_kernel<kStore, kStats, kUnroll, kTokens, int32_t>,
                  LaunchDims{grid, dim3(kThreads)}, stream, kp);
  }
}

// tokens: 1 or tokens_per_step(e4m3, kStats, kUnroll).
template <CacheStore kStore, bool kStats, int kUnroll>
void launch_unrolled(const CacheWriteKernelParams& kp, bool slots64, int tokens, dim3 grid,
                     cudaStream_t stream) {
  constexpr int kMulti = tokens_per_step(kStore != CacheStore::kF16, kStats, kUnroll);
  if (tokens == 1) {
    launch_write<kStore, kStats, kUnroll, 1>(kp, slots64, grid, stream);
  } else if constexpr (kMulti > 1) {
    E4KV_ASSERT(tokens == kMulti, cat("cache write: ", tokens, " tokens per step"));
    launch_write<kStore, kStats, kUnroll, kMulti>(kp, slots64, grid, stream);
  } else {
    E4KV_ASSERT(false, cat("cache write: ", tokens, " tokens per step"));
  }
}

// unroll = lane_unroll(kStats, kp.row_chunks).
template <CacheStore kStore, bool kStats>
void launch_write(const CacheWriteKernelParams& kp, bool slots64, int unroll, int tokens, dim3 grid,
                  cudaStream_t stream) {
  if (unroll == 1) {
    launch_unrolled<kStore, kStats, 1>(kp, slots64, tokens, grid, stream);
  } else if (unroll == 2) {
    launch_unrolled<kStore, kStats, 2>(kp, slots64, tokens, grid, stream);
  } else if constexpr (!kStats) {
    launch_unrolled<kStore, kStats, 4>(kp, slots64, tokens, grid, stream);
  } else {
    E4KV_ASSERT(false, cat("cache write: ", unroll, " chunks per lane and step with statistics"));
  }
}

template <CacheStore kStore>
void launch_write(const CacheWriteKernelParams& kp, bool slots64, bool stats, int unroll,
                  int tokens, dim3 grid, cudaStream_t stream) {
  if (stats) {
    launch_write<kStore, true>(kp, slots64, unroll, tokens, grid, stream);
  } else {
    launch_write<kStore, false>(kp, slots64, unroll, tokens, grid, stream);
  }
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

Status launch(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
              const void* slot_mapping, bool slots64, int64_t n_tokens,
              unsigned long long* non_finite, const CacheWriteStatsView* stats, cudaStream_t stream,
              CacheWriteEncode encode) {
  const KvCacheGeometry& g = cache.geometry;
  if (g.n_blocks < 0 || g.block_size <= 0 || g.n_kv_heads <= 0 || g.head_dim <= 0) {
    return Status::error(cat("cache write: malformed cache geometry (n_blocks ", g.n_blocks,
                             ", block_size ", g.block_size, ", n_kv_heads ", g.n_kv_heads,
                             ", head_dim ", g.head_dim, ")"));
  }
  if (g.row_elems() % kChunk != 0) {
    return Status::error(cat("cache write: n_kv_heads * head_dim = ", g.row_elems(),
                             " is not a multiple of ", kChunk));
  }
  if (n_tokens < 0) return Status::error(cat("cache write: negative n_tokens ", n_tokens));
  if (n_tokens == 0) return ok_status();
  if (cache.data == nullptr || k == nullptr || v == nullptr || slot_mapping == nullptr) {
    return Status::error("cache write: null cache, K, V or slot mapping");
  }
  if (!aligned16(cache.data) || !aligned16(k) || !aligned16(v)) {
    return Status::error("cache write: cache, K and V must be 16-byte aligned");
  }
  const bool e4m3 = g.dtype == KvCacheDtype::kE4m3;
  if (e4m3 && !(std::isfinite(cache.k_scale) && cache.k_scale > 0.0f &&
                std::isfinite(cache.v_scale) && cache.v_scale > 0.0f)) {
    return Status::error(
        cat("cache write: invalid scales k_scale=", cache.k_scale, " v_scale=", cache.v_scale));
  }
  if (stats != nullptr && (stats->counters == nullptr || stats->slot_table == nullptr)) {
    return Status::error("cache write: statistics view without counters or slot table");
  }

  CacheWriteKernelParams kp{};
  kp.k = k;
  kp.v = v;
  kp.slot_mapping = slot_mapping;
  kp.cache = static_cast<uint8_t*>(cache.data);
  kp.n_tokens = n_tokens;
  kp.n_slots = g.n_blocks * g.block_size;
  kp.block_size = g.block_size;
  kp.block_shift = -1;
  for (int shift = 0; shift < 62; ++shift) {
    if ((int64_t(1) << shift) == g.block_size) kp.block_shift = shift;
  }
  kp.row_chunks = int32_t(g.row_elems() / kChunk);
  kp.row_elems = g.row_elems();
  kp.k_scale = cache.k_scale;
  kp.v_scale = cache.v_scale;
  kp.k_division = CacheWriteDivision::kExact;
  kp.v_division = CacheWriteDivision::kExact;
  if (e4m3) {
    kp.k_reciprocal = division_reciprocal(cache.k_scale);
    kp.v_reciprocal = division_reciprocal(cache.v_scale);
    kp.k_division = cache_write_division_mode(cache.k_scale);
    kp.v_division = cache_write_division_mode(cache.v_scale);
  }
  kp.non_finite = non_finite;
  kp.counters = stats != nullptr ? stats->counters : nullptr;
  kp.slot_table = stats != nullptr ? stats->slot_table : nullptr;
  kp.zero_f16x2 = 0;

  int device = 0;
  int n_sms = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  n_sms = std::max(n_sms, 1);
  const int64_t max_ctas = stats != nullptr ? int64_t(kStatsCtasPerSm) * n_sms : kMaxCtas;
  // A CTA step covers kWarps * tokens tokens; the grid-stride loop takes any that one pass of the
  // grid does not.
  const int unroll = lane_unroll(stats != nullptr, kp.row_chunks);
  const int tokens = launch_tokens_per_step(e4m3, stats != nullptr, unroll, n_tokens, n_sms);
  const int64_t tokens_per_cta = int64_t(kWarps) * tokens;
  const int64_t ctas = std::min((n_tokens + tokens_per_cta - 1) / tokens_per_cta, max_ctas);
  const dim3 grid(unsigned(ctas), 2);
  const bool with_stats = stats != nullptr;
  if (!e4m3) {
    launch_write<CacheStore::kF16>(kp, slots64, with_stats, unroll, tokens, grid, stream);
  } else if (encode == CacheWriteEncode::kAuto && cache_write_hardware_encode_usable(device)) {
    launch_write<CacheStore::kE4m3Hardware>(kp, slots64, with_stats, unroll, tokens, grid, stream);
  } else {
    launch_write<CacheStore::kE4m3Software>(kp, slots64, with_stats, unroll, tokens, grid, stream);
  }
  return ok_status();
}

}  // namespace

bool cache_write_hardware_encode_usable(int device) {
  if (!e4m3_native_available(device)) return false;
  // The PTX architecture that the device's kernels come from (fixed for the process): code JIT-
  // compiled from older PTX holds only the trap of encode4_hardware.
  static std::mutex mutex;
  static std::unordered_map<int, bool> built;  // by device
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = built.find(device);
  if (it != built.end()) return it->second;
  int saved = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&saved));
  E4KV_CUDA_CHECK(cudaSetDevice(device));
  cudaFuncAttributes attr{};
  E4KV_CUDA_CHECK(cudaFuncGetAttributes(
      &attr, cache_write_kernel<CacheStore::kE4m3Hardware, false, 1, 1, int64_t>));
  E4KV_CUDA_CHECK(cudaSetDevice(saved));
  return built.emplace(device, attr.ptxVersion >= 89).first->second;
}

CacheWriteDivision cache_write_division_mode(float scale) {
  E4KV_ASSERT(std::isfinite(scale) && scale > 0.0f,
              cat("cache_write_division_mode: invalid scale ", scale));
  static std::mutex mutex;
  static std::unordered_map<uint32_t, CacheWriteDivision> memo;  // by the scale's bits
  const uint32_t key = f32_bits(scale);
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = memo.find(key);
    if (it != memo.end()) return it->second;
  }
  // Outside the lock: a few hundred microseconds; two threads may both check a new scale.
  const CacheWriteDivision division = choose_division(scale);
  const std::lock_guard<std::mutex> lock(mutex);
  if (memo.size() >= kMaxMemoisedScales) memo.clear();
  memo.emplace(key, division);
  return division;
}

uint8_t cache_write_magnitude_code(uint16_t f16_magnitude, float scale,
                                   CacheWriteDivision division) {
  E4KV_ASSERT(f16_magnitude < kF16Infinity,
              cat("cache_write_magnitude_code: not a finite FP16 magnitude: ", f16_magnitude));
  const float a = f16_to_f32(f16_magnitude);
  const float r = division_reciprocal(scale);
  if (division == CacheWriteDivision::kReciprocal) {
    return uint8_t(magnitude_code<CacheWriteDivision::kReciprocal>(a, scale, r));
  }
  if (division == CacheWriteDivision::kCorrected) {
    return uint8_t(magnitude_code<CacheWriteDivision::kCorrected>(a, scale, r));
  }
  return uint8_t(magnitude_code<CacheWriteDivision::kExact>(a, scale, r));
}

std::vector<uint16_t> cache_write_stats_slot_table() {
  std::vector<uint16_t> table(kCacheWriteStatTableSize);
  for (uint32_t mag = 0; mag < table.size(); ++mag) {
    int slot = 0;
    if (mag == 0) {
      slot = kCacheWriteStatZeroSlot;
    } else if (mag >= 0x7C00u) {
      slot = kCacheWriteStatNonFiniteSlot;
    } else {
      slot = kCacheWriteStatFirstBinSlot + kv_hist_bin_f16(uint16_t(mag));
    }
    table[mag] = uint16_t(slot);
  }
  return table;
}

CacheWriteStatsBuffer::CacheWriteStatsBuffer() {
  E4KV_CUDA_CHECK(cudaMalloc(&counters_, sizeof(CacheWriteStatsCounters)));
  E4KV_CUDA_CHECK(cudaMemset(counters_, 0, sizeof(CacheWriteStatsCounters)));
  const std::vector<uint16_t> table = cache_write_stats_slot_table();
  E4KV_CUDA_CHECK(cudaMalloc(&slot_table_, table.size() * sizeof(uint16_t)));
  E4KV_CUDA_CHECK(cudaMemcpy(slot_table_, table.data(), table.size() * sizeof(uint16_t),
                             cudaMemcpyHostToDevice));
}

CacheWriteStatsBuffer::~CacheWriteStatsBuffer() {
  cudaFree(counters_);
  cudaFree(slot_table_);
}

void CacheWriteStatsBuffer::reset(cudaStream_t stream) {
  E4KV_CUDA_CHECK(cudaMemsetAsync(counters_, 0, sizeof(CacheWriteStatsCounters), stream));
}

std::pair<KvTensorStats, KvTensorStats> CacheWriteStatsBuffer::read(cudaStream_t stream) const {
  CacheWriteStatsCounters host{};
  E4KV_CUDA_CHECK(cudaMemcpyAsync(&host, counters_, sizeof(host), cudaMemcpyDeviceToHost, stream));
  E4KV_CUDA_CHECK(cudaStreamSynchronize(stream));
  auto tensor = [&](int kv) {
    std::vector<int64_t> hist(kKvHistBins);
    int64_t nonzero = 0;
    for (int b = 0; b < kKvHistBins; ++b) {
      hist[size_t(b)] = int64_t(host.slots[kv][kCacheWriteStatFirstBinSlot + b]);
      nonzero += hist[size_t(b)];
    }
    const int64_t count = int64_t(host.slots[kv][kCacheWriteStatZeroSlot]) + nonzero;
    const int64_t non_finite = int64_t(host.slots[kv][kCacheWriteStatNonFiniteSlot]);
    const float absmax = f16_to_f32(uint16_t(host.absmax_f16[kv]));
    return KvTensorStats::from_counts(count, non_finite, 0, 0, absmax, hist);
  };
  return {tensor(0), tensor(1)};
}

Status cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                   const int64_t* slot_mapping, int64_t n_tokens, unsigned long long* non_finite,
                   const CacheWriteStatsView* stats, cudaStream_t stream, CacheWriteEncode encode) {
  return launch(cache, k, v, slot_mapping, true, n_tokens, non_finite, stats, stream, encode);
}

Status cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                   const int32_t* slot_mapping, int64_t n_tokens, unsigned long long* non_finite,
                   const CacheWriteStatsView* stats, cudaStream_t stream, CacheWriteEncode encode) {
  return launch(cache, k, v, slot_mapping, false, n_tokens, non_finite, stats, stream, encode);
}

}  // namespace e4kv::cuda
