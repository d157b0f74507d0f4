// CUDA cache write against the CPU reference (backend/cpu/cache_write.h) and the CPU statistics
// collector (calib/kv_stats.h) on fresh random data: head_dim {64,128,256} x n_kv_heads {1,2,8} x
// block_size {16,64} x FP16/E4M3, int64 and int32 slot mappings with -1 entries over shuffled
// slots (or -1 in a fixed pattern between written ones), inputs with inf/NaN, E4M3 rounding ties,
// saturating values, -0 and subnormals. The caches are poisoned with random bytes first; every byte
// must equal the CPU result (untouched slots keep the poison), the non-finite counts and the fused
// statistics must be identical. Rows of up to 10 chunks of 16 elements per lane, and E4M3 scales
// that select each division form (cache_write_division_mode), K and V in different forms. Rows of 1
// and 2 chunks per lane, whose warps write several tokens per step, with token counts that are not
// multiples of that. Every E4M3 write runs on both encoders where the GPU has the hardware one
// (cache_write_hardware_encode_usable: sm_89+, not E4KV_FORCE_SOFTWARE_E4M3=1): CacheWriteEncode
// kAuto, then kSoftware; run the binary again with E4KV_FORCE_SOFTWARE_E4M3=1 for software only.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/cache_write.h"
#include "backend/cuda/cache_write.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "calib/kv_stats.h"
#include "core/half.h"
#include "core/status.h"
#include "device_buffer.cuh"
#include "e4kv/e4m3.h"

namespace e4kv::cuda {
namespace {

struct Case {
  int head_dim;
  int n_kv_heads;
  int block_size;
  KvCacheDtype dtype;
  bool slots32;
  int64_t n_tokens;
  // E4M3 scales; 0: the defaults of run_case.
  float k_scale = 0.0f;
  float v_scale = 0.0f;
  // -1 slots in a fixed pattern (tokens 1 and 2 of every 4, and tokens 8 to 15) instead of about
  // 10% at random.
  bool patterned_skips = false;
};

std::string describe(const Case& c) {
  return cat("d", c.head_dim, " kv", c.n_kv_heads, " bs", c.block_size,
             c.dtype == KvCacheDtype::kF16 ? " f16" : " e4m3", c.slots32 ? " slots32" : " slots64",
             " tokens", c.n_tokens, " k_scale ", c.k_scale, " v_scale ", c.v_scale,
             c.patterned_skips ? " patterned skips" : "");
}

// FP16 values of x * scale for x at the midpoint between two neighbouring E4M3 values (exact
// ties when scale is a power of two, near ties otherwise), and just beside them.
std::vector<uint16_t> tie_values(float scale) {
  std::vector<uint16_t> out;
  for (int code = 0; code < 0x7E; ++code) {
    const float mid = 0.5f * (e4m3_decode(uint8_t(code)) + e4m3_decode(uint8_t(code + 1)));
    const uint16_t h = f32_to_f16(mid * scale);
    out.push_back(h);
    out.push_back(uint16_t(h + 1));
    if (h > 0) out.push_back(uint16_t(h - 1));
  }
  return out;
}

// Random FP16 rows: Gaussian with outlier channels, then injected special values.
std::vector<uint16_t> make_values(std::mt19937& rng, int64_t n, int64_t head_dim, float sigma,
                                  float scale) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::uniform_int_distribution<int> pick(0, 99);
  const std::vector<uint16_t> ties = tie_values(scale);
  const std::vector<uint16_t> specials = {
      0x0000, 0x8000,          // +0, -0
      0x7C00, 0xFC00,          // +-inf
      0x7E00, 0xFE00, 0x7C01,  // NaNs
      0xFFFF, 0x7BFF, 0xFBFF,  // NaN, +-65504
      0x0001, 0x8001, 0x03FF,  // subnormals
      0x0400, 0x8400,          // smallest normals
  };
  std::vector<uint16_t> out(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int r = pick(rng);
    if (r < 1) {
      out[size_t(i)] = specials[rng() % specials.size()];
    } else if (r < 6) {
      out[size_t(i)] = uint16_t(ties[rng() % ties.size()] | (rng() % 2 ? 0x8000u : 0u));
    } else if (r < 8) {
      out[size_t(i)] = uint16_t((rng() % 0x400u) | (rng() % 2 ? 0x8000u : 0u));  // subnormal
    } else if (r < 9) {
      out[size_t(i)] = f32_to_f16((rng() % 2 ? 1.0f : -1.0f) * 448.0f * scale *
                                  (1.0f + float(rng() % 64) / 16.0f));  // saturates
    } else {
      const float outlier = (i % head_dim) % 37 == 5 ? 30.0f : 1.0f;
      out[size_t(i)] = f32_to_f16(normal(rng) * outlier);
    }
  }
  return out;
}

// The E4M3 encoders to run: kAuto, and kSoftware where kAuto is the hardware one.
std::vector<CacheWriteEncode> encodes_to_test() {
  if (cache_write_hardware_encode_usable(0)) {
    return {CacheWriteEncode::kAuto, CacheWriteEncode::kSoftware};
  }
  return {CacheWriteEncode::kAuto};
}

std::string describe(CacheWriteEncode encode) {
  return encode == CacheWriteEncode::kAuto && cache_write_hardware_encode_usable(0)
             ? "hardware encode"
             : "software encode";
}

std::string describe_stats(const KvTensorStats& s) {
  return cat("count ", s.count(), " nonzero ", s.nonzero(), " non_finite ", s.non_finite(),
             " absmax ", s.absmax());
}

void expect_same_stats(const KvTensorStats& gpu, const KvTensorStats& cpu,
                       const std::string& what) {
  if (gpu == cpu) return;
  std::string first_bin = "none";
  for (int b = 0; b < kKvHistBins; ++b) {
    if (gpu.bin(b) != cpu.bin(b)) {
      first_bin = cat(b, " (gpu ", gpu.bin(b), ", cpu ", cpu.bin(b), ")");
      break;
    }
  }
  ADD_FAILURE() << what << ": statistics differ: gpu " << describe_stats(gpu) << "; cpu "
                << describe_stats(cpu) << "; first differing bin " << first_bin;
}

void run_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937 rng(seed);
  const bool e4m3 = c.dtype == KvCacheDtype::kE4m3;
  const int64_t row = int64_t(c.n_kv_heads) * c.head_dim;
  // Room for half again as many tokens, so some slots stay untouched.
  const int64_t n_blocks = (c.n_tokens * 3 / 2) / c.block_size + 2;
  const KvCacheGeometry geo{n_blocks, c.block_size, c.n_kv_heads, c.head_dim, c.dtype};
  // Default k_scale: not a power of two (near ties only); v_scale: a power of two (exact ties).
  const float k_scale = !e4m3              ? 1.0f
                        : c.k_scale > 0.0f ? c.k_scale
                                           : 0.0234375f * (1.0f + float(seed % 7) / 13.0f);
  const float v_scale = !e4m3 ? 1.0f : c.v_scale > 0.0f ? c.v_scale : 0.0078125f;

  std::vector<uint16_t> k = make_values(rng, c.n_tokens * row, c.head_dim, 2.0f, k_scale);
  std::vector<uint16_t> v = make_values(rng, c.n_tokens * row, c.head_dim, 0.5f, v_scale);
  // The last token is always written: give it an inf and a NaN so every case counts some.
  k[size_t((c.n_tokens - 1) * row + 3)] = 0x7C00;
  v[size_t((c.n_tokens - 1) * row + row - 1)] = 0xFE00;

  // Shuffled distinct slots, about 10% of the tokens (or the pattern's) skipped with -1.
  std::vector<int64_t> all_slots(size_t(n_blocks * c.block_size));
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int64_t> slots(size_t(c.n_tokens));
  for (int64_t t = 0; t < c.n_tokens; ++t) {
    const bool skip =
        c.patterned_skips ? t % 4 == 1 || t % 4 == 2 || (t >= 8 && t < 16) : rng() % 10 == 0;
    slots[size_t(t)] = skip ? -1 : all_slots[size_t(t)];
  }
  if (c.n_tokens > 2) slots[0] = -1;  // a skipped first and a written last token
  slots.back() = all_slots[size_t(c.n_tokens - 1)];
  std::vector<int32_t> slots32(slots.begin(), slots.end());

  std::vector<uint8_t> poison(geo.total_bytes());
  for (auto& b : poison) b = uint8_t(rng());

  // CPU reference and the CPU statistics collector over the written rows.
  std::vector<uint8_t> ref = poison;
  const CacheWriteStats ref_counts = e4kv::cache_write(
      KvCacheView{ref.data(), geo, k_scale, v_scale}, k.data(), v.data(), slots.data(), c.n_tokens);
  KvTensorStats k_ref;
  KvTensorStats v_ref;
  for (int64_t t = 0; t < c.n_tokens; ++t) {
    if (slots[size_t(t)] == -1) continue;
    k_ref.observe(k.data() + t * row, row);
    v_ref.observe(v.data() + t * row, row);
  }
  EXPECT_GT(ref_counts.k_non_finite, 0) << "no inf/NaN injected";
  EXPECT_GT(ref_counts.v_non_finite, 0) << "no inf/NaN injected";

  DeviceBuffer<uint16_t> d_k(k);
  DeviceBuffer<uint16_t> d_v(v);
  DeviceBuffer<int64_t> d_slots(slots);
  DeviceBuffer<int32_t> d_slots32(slots32);
  DeviceBuffer<unsigned long long> d_non_finite(2);
  CacheWriteStatsBuffer stats_buffer;

  // Per encoder, once without and once with fused statistics, each into a freshly poisoned cache.
  const std::vector<CacheWriteEncode> encodes =
      e4m3 ? encodes_to_test() : std::vector<CacheWriteEncode>{CacheWriteEncode::kAuto};
  for (const CacheWriteEncode encode : encodes) {
    SCOPED_TRACE(e4m3 ? describe(encode) : "fp16");
    for (const bool with_stats : {false, true}) {
      SCOPED_TRACE(with_stats ? "with statistics" : "without statistics");
      DeviceBuffer<uint8_t> d_cache(poison);
      E4KV_CUDA_CHECK(cudaMemset(d_non_finite.ptr, 0, 2 * sizeof(unsigned long long)));
      stats_buffer.reset(nullptr);
      const CacheWriteStatsView view = stats_buffer.view();
      const KvCacheView cache{d_cache.ptr, geo, k_scale, v_scale};
      const Status st =
          c.slots32 ? cache_write(cache, d_k.ptr, d_v.ptr, d_slots32.ptr, c.n_tokens,
                                  d_non_finite.ptr, with_stats ? &view : nullptr, nullptr, encode)
                    : cache_write(cache, d_k.ptr, d_v.ptr, d_slots.ptr, c.n_tokens,
                                  d_non_finite.ptr, with_stats ? &view : nullptr, nullptr, encode);
      ASSERT_TRUE(st.ok()) << st.message();
      E4KV_CUDA_CHECK(cudaDeviceSynchronize());

      const std::vector<uint8_t> got = d_cache.to_host();
      int64_t n_bad = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] == ref[i]) continue;
        if (n_bad++ == 0) {
          const size_t elem = i / geo.elem_bytes();
          const int64_t row_index = int64_t(elem) / row;  // (block * 2 + kv) * block_size + slot
          ADD_FAILURE() << "first bad byte " << i << " (block " << row_index / (2 * c.block_size)
                        << ", " << ((row_index / c.block_size) % 2 ? "V" : "K") << ", row "
                        << row_index % c.block_size << ", element " << int64_t(elem) % row
                        << "): gpu 0x" << std::hex << int(got[i]) << " cpu 0x" << int(ref[i])
                        << " poison 0x" << int(poison[i]) << std::dec;
        }
      }
      EXPECT_EQ(n_bad, 0) << "bytes differing from the CPU reference";

      const std::vector<unsigned long long> counts = d_non_finite.to_host();
      EXPECT_EQ(int64_t(counts[0]), ref_counts.k_non_finite);
      EXPECT_EQ(int64_t(counts[1]), ref_counts.v_non_finite);

      const auto [k_gpu, v_gpu] = stats_buffer.read(nullptr);
      if (with_stats) {
        expect_same_stats(k_gpu, k_ref, "K");
        expect_same_stats(v_gpu, v_ref, "V");
      } else {
        EXPECT_EQ(k_gpu.count() + v_gpu.count() + k_gpu.non_finite() + v_gpu.non_finite(), 0)
            << "statistics written without a statistics view";
      }
    }
  }
}

TEST(CacheWriteCuda, MatchesCpuReferenceOverTheSweep) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1;
  int n_cases = 0;
  for (int head_dim : {64, 128, 256}) {
    for (int n_kv_heads : {1, 2, 8}) {
      for (int block_size : {16, 64}) {
        for (KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
          const bool slots32 = seed % 2 == 0;
          const int64_t n_tokens = 1 + int64_t(seed * 37 % 300);
          run_case(Case{head_dim, n_kv_heads, block_size, dtype, slots32, n_tokens}, seed);
          ++seed;
          ++n_cases;
        }
      }
    }
  }
  std::printf("[ info ] %d cases; E4M3 on %s\n", n_cases,
              encodes_to_test().size() == 2 ? "the hardware and the software encoder"
                                            : "the software encoder only");
}

// More tokens than the statistics grid covers in one pass (2 CTAs per SM x 8 warps x 1 token per
// step for 8 x 128, 2 for 2 x 256: 2112 or 4224 tokens on an H200), and a single token.
TEST(CacheWriteCuda, LargeAndTinyBatches) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  run_case(Case{128, 8, 64, KvCacheDtype::kE4m3, false, 9000}, 1001);
  run_case(Case{256, 2, 64, KvCacheDtype::kF16, true, 9000}, 1002);
  run_case(Case{256, 2, 16, KvCacheDtype::kE4m3, true, 1}, 1003);
}

// Rows whose lanes hold several chunks of 16 elements: 48 chunks (lanes 0-15 two, the others one)
// and 320 (steps of 4, 4 and 2 chunks per lane; of 2 with statistics).
TEST(CacheWriteCuda, RowsOfSeveralChunksPerLane) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  run_case(Case{128, 6, 16, KvCacheDtype::kE4m3, false, 200}, 1101);
  run_case(Case{128, 40, 16, KvCacheDtype::kE4m3, true, 100}, 1102);
  run_case(Case{128, 40, 16, KvCacheDtype::kF16, false, 100}, 1103);
}

// Rows of 1 or 2 chunks per lane, whose warps take several tokens per step (4 or 2; with
// statistics 2 or 1): token counts that are not multiples of the tokens per step or of the tokens
// of a CTA step, and -1 slots between written ones within a step, whole skipped steps and a skipped
// first token. 1 chunk: 2 x 256 (all lanes), 1 x 64 (lanes 0-3), 3 x 128 (lanes 0-23); 2 chunks:
// 8 x 128 and 4 x 256 (all lanes), 6 x 128 (lanes 0-15 two, the others one). 9001 tokens are more
// than one pass of the statistics grid.
TEST(CacheWriteCuda, SeveralTokensPerWarpStep) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::array<std::pair<int, int>, 6> shapes = {
      std::pair{256, 2}, std::pair{64, 1},  std::pair{128, 3},
      std::pair{128, 8}, std::pair{256, 4}, std::pair{128, 6},
  };
  // Per shape and dtype: a few tokens and some tens to hundreds (patterned skips), 9001 (random
  // skips), and 20003 (patterned skips): enough tokens for the multi-token step, which is launched
  // only when its grid has 8+ CTAs per SM (true for GPUs of up to 156 SMs at 4 tokens per step).
  const std::array<int64_t, 5> few_tokens = {1, 2, 3, 5, 7};
  const std::array<int64_t, 3> some_tokens = {33, 70, 259};
  uint32_t seed = 3001;
  int n_cases = 0;
  for (const auto& [head_dim, n_kv_heads] : shapes) {
    for (KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
      for (int i = 0; i < 4; ++i) {
        const int64_t n_tokens = i == 0   ? few_tokens[seed % few_tokens.size()]
                                 : i == 1 ? some_tokens[seed % some_tokens.size()]
                                 : i == 2 ? 9001
                                          : 20003;
        Case c{head_dim, n_kv_heads, i == 1 ? 64 : 16, dtype, seed % 2 == 0, n_tokens};
        c.patterned_skips = i != 2;
        run_case(c, seed);
        ++seed;
        ++n_cases;
      }
    }
  }
  std::printf("[ info ] %d cases\n", n_cases);
}

// Every FP16 bit pattern through the E4M3 path (K and V at their own scales), against e4m3_encode.
// A chunk holds 16 consecutive patterns, so every finite one goes through the finite encoder.
void expect_every_pattern_matches(float k_scale, float v_scale, CacheWriteEncode encode) {
  SCOPED_TRACE(cat("k_scale ", k_scale, " v_scale ", v_scale, ", ", describe(encode)));
  const int64_t row = 8 * 128;
  const int64_t n_tokens = 65536 / row;
  const KvCacheGeometry geo{n_tokens / 64, 64, 8, 128, KvCacheDtype::kE4m3};
  std::vector<uint16_t> k(65536);
  std::iota(k.begin(), k.end(), uint16_t(0));
  std::vector<uint16_t> v(k.rbegin(), k.rend());
  std::vector<int64_t> slots(static_cast<size_t>(n_tokens));
  std::iota(slots.begin(), slots.end(), 0);
  DeviceBuffer<uint16_t> d_k(k);
  DeviceBuffer<uint16_t> d_v(v);
  DeviceBuffer<int64_t> d_slots(slots);
  DeviceBuffer<uint8_t> d_cache(geo.total_bytes());
  DeviceBuffer<unsigned long long> d_non_finite(2);
  E4KV_CUDA_CHECK(cudaMemset(d_cache.ptr, 0x5A, geo.total_bytes()));
  E4KV_CUDA_CHECK(cudaMemset(d_non_finite.ptr, 0, 2 * sizeof(unsigned long long)));
  const Status st = cache_write(KvCacheView{d_cache.ptr, geo, k_scale, v_scale}, d_k.ptr, d_v.ptr,
                                d_slots.ptr, n_tokens, d_non_finite.ptr, nullptr, nullptr, encode);
  ASSERT_TRUE(st.ok()) << st.message();
  const std::vector<uint8_t> got = d_cache.to_host();
  int64_t n_bad = 0;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int64_t i = 0; i < row; ++i) {
        const uint16_t h = (kv == 0 ? k : v)[size_t(t * row + i)];
        const uint8_t want = e4m3_encode(f16_to_f32(h), kv == 0 ? k_scale : v_scale);
        const uint8_t have = got[size_t(geo.elem_offset(t / 64, kv, t % 64, 0) + i)];
        if (have != want && n_bad++ < 5) {
          ADD_FAILURE() << "fp16 0x" << std::hex << h << (kv ? " V" : " K") << ": gpu 0x"
                        << int(have) << " codec 0x" << int(want) << std::dec;
        }
      }
    }
  }
  EXPECT_EQ(n_bad, 0);
  const std::vector<unsigned long long> counts = d_non_finite.to_host();
  EXPECT_EQ(counts[0], 2048u);  // 2 * 1024 patterns with an all-ones exponent
  EXPECT_EQ(counts[1], 2048u);
}

TEST(CacheWriteCuda, EveryFp16PatternMatchesTheCodec) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  // 2^-7 and 1 make exact ties; 1e20 sends every FP16 below E4M3's smallest subnormal (signed
  // zeros) and 2^-130 overflows q to inf for most of them (saturation from inf).
  for (const CacheWriteEncode encode : encodes_to_test()) {
    for (float scale : {1.0f, 0.0078125f, 0.0234375f, 1.0f / 448.0f, 3.0e-5f, 7.1f, 1.0e-20f,
                        1.0e20f, std::ldexp(1.0f, -130)}) {
      expect_every_pattern_matches(scale, scale * 1.5f, encode);
    }
  }
}

// One scale per division form ([form] = scale), from random scales of a fixed seed: calibration-
// like ones (FP16 absmax / 448) give the reciprocal and the corrected form, log-uniform ones over
// all that the scale gate accepts give the exact form below about 2^-128 (1 / scale overflows).
std::array<float, 3> scales_per_division() {
  std::array<float, 3> found = {0.0f, 0.0f, 0.0f};
  std::mt19937 rng(4242);
  std::uniform_int_distribution<int> absmax(1, 0x7BFF);
  std::uniform_real_distribution<float> exponent(-149.0f, 127.5f);
  for (int i = 0; i < 4000 && std::count(found.begin(), found.end(), 0.0f) > 0; ++i) {
    const float scale =
        i % 2 == 0 ? f16_to_f32(uint16_t(absmax(rng))) / 448.0f : std::exp2(exponent(rng));
    if (!(scale > 0.0f)) continue;  // exp2 underflowed
    float& slot = found[size_t(cache_write_division_mode(scale))];
    if (slot == 0.0f) slot = scale;
  }
  return found;
}

TEST(CacheWriteCuda, EveryDivisionFormMatchesTheCpuReference) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::array<float, 3> scales = scales_per_division();
  for (size_t d = 0; d < scales.size(); ++d) {
    ASSERT_GT(scales[d], 0.0f) << "no scale found for division form " << d;
    EXPECT_EQ(int(cache_write_division_mode(scales[d])), int(d));
  }
  std::printf("[ info ] scales per division form: reciprocal %a, corrected %a, exact %a\n",
              double(scales[0]), double(scales[1]), double(scales[2]));
  // Every FP16 pattern; each form once for K and once for V, next to another one.
  for (const CacheWriteEncode encode : encodes_to_test()) {
    for (size_t d = 0; d < scales.size(); ++d) {
      expect_every_pattern_matches(scales[d], scales[(d + 1) % scales.size()], encode);
    }
  }
  // Random rows with statistics and non-finite values, 1, 2 and 4 chunks per lane.
  uint32_t seed = 2001;
  for (size_t d = 0; d < scales.size(); ++d) {
    const float k_scale = scales[d];
    const float v_scale = scales[(d + 2) % scales.size()];
    for (const auto& [head_dim, n_kv_heads] :
         {std::pair{256, 2}, std::pair{128, 8}, std::pair{128, 16}}) {
      run_case(
          Case{head_dim, n_kv_heads, 64, KvCacheDtype::kE4m3, seed % 2 == 0, 300, k_scale, v_scale},
          seed);
      ++seed;
    }
  }
}

// The values where the two encoders could part, side by side in rows of 64 (4 chunks), against the
// CPU reference byte for byte: signed zeros, values that round to a signed zero, E4M3's subnormals
// and their ties, exact ties between normals (scale a power of two), the largest code and what
// saturates to it (464 is the tie between 448 and the NaN pattern's 480), FP16 subnormals and
// extremes; then the same next to an inf or a NaN in the chunk, which sends the whole chunk through
// the reference codec, and non-finite counts.
TEST(CacheWriteCuda, EncodersMatchTheCpuReferenceOnEdgeValues) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<float> multiples = {
      0.0f,    0x1p-12f,  0x1p-11f, 0x1p-10f, 0x3p-10f,  0x1p-9f, 0x5p-10f, 0x1p-7f,
      0x1p-6f, 0x11p-10f, 1.0f,     1.0625f,  1.1875f,   1.5f,    240.0f,   416.0f,
      432.0f,  440.0f,    448.0f,   456.0f,   463.9f,    464.0f,  464.1f,   480.0f,
      1000.0f, 1.0e4f,    0.3f,     0.7f,     0x1.1p-8f, 3.0f,    5.0f,     7.5f,
  };
  for (const float scale : {0.0078125f, 1.0f, 0.0234375f * 1.3f, std::ldexp(1.0f, -130)}) {
    std::vector<uint16_t> values;
    for (const float m : multiples) {
      const uint16_t h = f32_to_f16(m * scale);
      values.push_back(h);
      values.push_back(uint16_t(h ^ 0x8000u));  // the negative (or -0)
    }
    // FP16 subnormals, the smallest normal, +-65504 and 1.
    const std::array<uint16_t, 8> bits = {0x0001, 0x8001, 0x03FF, 0x83FF,
                                          0x0400, 0x7BFF, 0xFBFF, 0x3C00};
    values.insert(values.end(), bits.begin(), bits.end());
    const size_t finite = values.size();
    values.resize((finite + 63) / 64 * 64, 0x8000);  // -0 up to a whole row
    // Again, with an inf or a NaN at the start of every chunk.
    const std::array<uint16_t, 4> non_finite = {0x7C00, 0xFC00, 0x7E00, 0xFFFF};
    const std::vector<uint16_t> finite_rows = values;
    values.insert(values.end(), finite_rows.begin(), finite_rows.end());
    for (size_t i = finite_rows.size(); i < values.size(); i += 16) {
      values[i] = non_finite[(i / 16) % 4];
    }

    const int64_t row = 64;
    const int64_t n_tokens = int64_t(values.size()) / row;
    const KvCacheGeometry geo{(n_tokens + 15) / 16, 16, 1, 64, KvCacheDtype::kE4m3};
    const std::vector<uint16_t> v(values.rbegin(), values.rend());
    std::vector<int64_t> slots(static_cast<size_t>(n_tokens));
    std::iota(slots.begin(), slots.end(), 0);
    std::vector<uint8_t> ref(geo.total_bytes(), 0x5A);
    const float k_scale = scale;
    const float v_scale = scale * 2.0f;
    const CacheWriteStats ref_counts =
        e4kv::cache_write(KvCacheView{ref.data(), geo, k_scale, v_scale}, values.data(), v.data(),
                          slots.data(), n_tokens);
    EXPECT_GT(ref_counts.k_non_finite, 0);

    DeviceBuffer<uint16_t> d_k(values);
    DeviceBuffer<uint16_t> d_v(v);
    DeviceBuffer<int64_t> d_slots(slots);
    DeviceBuffer<unsigned long long> d_non_finite(2);
    for (const CacheWriteEncode encode : encodes_to_test()) {
      SCOPED_TRACE(cat("scale ", scale, ", ", describe(encode)));
      DeviceBuffer<uint8_t> d_cache(std::vector<uint8_t>(geo.total_bytes(), 0x5A));
      E4KV_CUDA_CHECK(cudaMemset(d_non_finite.ptr, 0, 2 * sizeof(unsigned long long)));
      const Status st =
          cache_write(KvCacheView{d_cache.ptr, geo, k_scale, v_scale}, d_k.ptr, d_v.ptr,
                      d_slots.ptr, n_tokens, d_non_finite.ptr, nullptr, nullptr, encode);
      ASSERT_TRUE(st.ok()) << st.message();
      // Every byte, the unwritten rest of the cache too; the input of each bad one (slot t holds
      // token t).
      const std::vector<uint8_t> got = d_cache.to_host();
      int64_t n_bad = 0;
      for (size_t at = 0; at < got.size(); ++at) {
        if (got[at] == ref[at] || n_bad++ >= 5) continue;
        const int64_t row_index = int64_t(at) / row;  // (block * 2 + kv) * 16 + slot % 16
        const int kv = int(row_index / 16 % 2);
        const int64_t t = row_index / 32 * 16 + row_index % 16;
        const uint16_t h = t < n_tokens ? (kv == 0 ? values : v)[size_t(t * row) + at % row] : 0;
        ADD_FAILURE() << "token " << t << (kv ? " V" : " K") << " element " << at % row
                      << " fp16 0x" << std::hex << h << ": gpu 0x" << int(got[at]) << " cpu 0x"
                      << int(ref[at]) << std::dec;
      }
      EXPECT_EQ(n_bad, 0) << "bytes differing from the CPU reference";
      const std::vector<unsigned long long> counts = d_non_finite.to_host();
      EXPECT_EQ(int64_t(counts[0]), ref_counts.k_non_finite);
      EXPECT_EQ(int64_t(counts[1]), ref_counts.v_non_finite);
    }
  }
}

TEST(CacheWriteCuda, RejectsUnsupportedInputs) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer<uint8_t> d_cache(1 << 16);
  DeviceBuffer<uint16_t> d_kv(1 << 12);
  DeviceBuffer<int64_t> d_slots(4);
  const KvCacheGeometry ok_geo{4, 16, 2, 64, KvCacheDtype::kE4m3};
  // n_kv_heads * head_dim not a multiple of 16.
  KvCacheGeometry odd = ok_geo;
  odd.head_dim = 40;
  odd.n_kv_heads = 1;
  EXPECT_FALSE(cache_write(KvCacheView{d_cache.ptr, odd, 1.0f, 1.0f}, d_kv.ptr, d_kv.ptr,
                           d_slots.ptr, 4, nullptr, nullptr, nullptr)
                   .ok());
  // Misaligned K.
  EXPECT_FALSE(cache_write(KvCacheView{d_cache.ptr, ok_geo, 1.0f, 1.0f}, d_kv.ptr + 1, d_kv.ptr,
                           d_slots.ptr, 4, nullptr, nullptr, nullptr)
                   .ok());
  // Invalid E4M3 scales.
  EXPECT_FALSE(cache_write(KvCacheView{d_cache.ptr, ok_geo, 0.0f, 1.0f}, d_kv.ptr, d_kv.ptr,
                           d_slots.ptr, 4, nullptr, nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(cache_write(KvCacheView{d_cache.ptr, ok_geo, 1.0f, NAN}, d_kv.ptr, d_kv.ptr,
                           d_slots.ptr, 4, nullptr, nullptr, nullptr)
                   .ok());
  // Nothing to do.
  EXPECT_TRUE(cache_write(KvCacheView{d_cache.ptr, ok_geo, 1.0f, 1.0f}, d_kv.ptr, d_kv.ptr,
                          d_slots.ptr, 0, nullptr, nullptr, nullptr)
                  .ok());
}

}  // namespace
}  // namespace e4kv::cuda
