// Main KV cache write on the GPU (DESIGN.md sections 2, 3 and 6): the same operation as the CPU
// reference backend/cpu/cache_write.h, byte for byte, with optional fused calibration statistics.
// Host-only header (no CUDA include beyond the runtime API types).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "core/status.h"
#include "kv/kv_cache_view.h"
#include "kv/kv_histogram.h"

namespace e4kv::cuda {

// Slots of the device statistics, per tensor: 0 = zeros, 1 + b = histogram bin b (kv_hist_bin_f16),
// then non-finite. FP16 input never underflows or overflows the histogram.
inline constexpr int kCacheWriteStatZeroSlot = 0;
inline constexpr int kCacheWriteStatFirstBinSlot = 1;
inline constexpr int kCacheWriteStatNonFiniteSlot = kCacheWriteStatFirstBinSlot + kKvHistBins;
inline constexpr int kCacheWriteStatSlots = kCacheWriteStatNonFiniteSlot + 1;
// Entries of the FP16 -> slot table: one per FP16 magnitude (bits & 0x7FFF).
inline constexpr int kCacheWriteStatTableSize = 32768;

// Device counters of the fused statistics, accumulated over any number of cache writes until
// reset. count = zeros + sum(bins), nonzero = sum(bins).
struct CacheWriteStatsCounters {
  unsigned long long slots[2][kCacheWriteStatSlots];  // [K, V][slot]
  unsigned int absmax_f16[2];  // [K, V] largest finite |x| as FP16 magnitude bits (ordered)
};

// What the kernel needs for fused statistics (device pointers).
struct CacheWriteStatsView {
  CacheWriteStatsCounters* counters = nullptr;
  const uint16_t* slot_table = nullptr;  // [kCacheWriteStatTableSize], cache_write_stats_slot_table
};

// The FP16 magnitude -> slot table, built from kv_hist_bin_f16 so the bins are exactly the CPU
// collector's.
std::vector<uint16_t> cache_write_stats_slot_table();

// Owns the device counters and the uploaded slot table (allocated zeroed). Not copyable.
class CacheWriteStatsBuffer {
 public:
  CacheWriteStatsBuffer();
  ~CacheWriteStatsBuffer();
  CacheWriteStatsBuffer(const CacheWriteStatsBuffer&) = delete;
  CacheWriteStatsBuffer& operator=(const CacheWriteStatsBuffer&) = delete;

  CacheWriteStatsView view() const { return CacheWriteStatsView{counters_, slot_table_}; }
  // Zeroes the counters (asynchronous on `stream`).
  void reset(cudaStream_t stream);
  // Copies the counters back (waits for `stream`): {K statistics, V statistics}, comparable with
  // KvTensorStats::observe over the same FP16 values.
  std::pair<KvTensorStats, KvTensorStats> read(cudaStream_t stream) const;

 private:
  CacheWriteStatsCounters* counters_ = nullptr;
  uint16_t* slot_table_ = nullptr;
};

// How the E4M3 cache write divides |x| by a scale: the cheapest form that gives e4m3_encode's code
// for every finite FP16 input at that scale (see the top of cache_write.cu). r = 1 / scale,
// rounded to fp32 on the host.
enum class CacheWriteDivision : int32_t {
  kReciprocal = 0,  // q = |x| * r
  kCorrected = 1,   // q0 = |x| * r; q = fma(fma(-q0, scale, |x|), r, q0)
  kExact = 2,       // q = |x| / scale, the IEEE division of e4m3_encode
};

// The division form for `scale` (finite, > 0): every finite FP16 magnitude is tried on the host
// with the kernel's arithmetic against e4m3_encode, once per scale value (memoised, thread-safe).
CacheWriteDivision cache_write_division_mode(float scale);

// The kernel's E4M3 code, without the sign bit, of the FP16 magnitude `f16_magnitude` (< 0x7C00)
// at `scale` with `division`, computed on the host with the kernel's own arithmetic (for tests).
uint8_t cache_write_magnitude_code(uint16_t f16_magnitude, float scale,
                                   CacheWriteDivision division);

// Which E4M3 encoder a cache write runs; both give the same bytes (see the top of cache_write.cu).
enum class CacheWriteEncode : int32_t {
  kAuto = 0,      // hardware where cache_write_hardware_encode_usable(), else software
  kSoftware = 1,  // software on every GPU (tests and benchmarks of that path)
};

// True when an E4M3 cache write with CacheWriteEncode::kAuto on `device` runs the hardware
// conversion (cvt.rn.satfinite.e4m3x2.f32): sm_89+, not forced to software (e4m3_native_available,
// which honours E4KV_FORCE_SOFTWARE_E4M3), and this binary holds kernels compiled for sm_89+ (not
// only older PTX, which the driver would compile without the hardware path).
bool cache_write_hardware_encode_usable(int device);

// Writes n_tokens K/V rows into one layer's cache (device pointers throughout), as
// e4kv::cache_write does on the CPU:
//   k, v:         [n_tokens, n_kv_heads, head_dim] FP16 bits
//   slot_mapping: [n_tokens] int64 or int32; -1 = skip (other slots outside the cache are skipped
//                 too: a caller bug that the kernel never turns into an out-of-bounds write)
//   non_finite:   [2] (K, V) device counters of inf/NaN inputs, accumulated (zero them first);
//                 nullptr to skip counting
//   stats:        nullptr, or fused statistics of the written rows' FP16 values (skipped tokens are
//                 not observed)
//   encode:       the E4M3 encoder (FP16 caches ignore it); kSoftware to test or time that path
// Limits: n_kv_heads * head_dim a multiple of 16; k, v and cache.data 16-byte aligned. Returns an
// error for inputs outside the limits or invalid E4M3 scales; launch failures are fatal.
Status cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                   const int64_t* slot_mapping, int64_t n_tokens, unsigned long long* non_finite,
                   const CacheWriteStatsView* stats, cudaStream_t stream,
                   CacheWriteEncode encode = CacheWriteEncode::kAuto);
Status cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                   const int32_t* slot_mapping, int64_t n_tokens, unsigned long long* non_finite,
                   const CacheWriteStatsView* stats, cudaStream_t stream,
                   CacheWriteEncode encode = CacheWriteEncode::kAuto);

}  // namespace e4kv::cuda
