// The magnitude statistics of the K/V values a cache write receives (DESIGN.md section 6): counts,
// absmax and a log2 histogram of |x| per tensor. Both backends' cache writes collect them
// (backend/cpu, the fused statistics of backend/cuda/cache_write); calibration (calib/kv_stats.h)
// stores, merges and turns them into scales.
//
// Histogram: 8 bins per octave over [2^-24, 2^16). Bin b (0 <= b < 320) holds the finite x with
//   floor(8 * log2|x|) == b - 192,   i.e.   2^(-24 + b/8) <= |x| < 2^(-24 + (b+1)/8).
// The bins are geometric (edges at 2^(k/8)), not the linear sub-octave steps 1 + j/8 that the top 3
// mantissa bits give; the bin is still found from the bit pattern, without log2: the exponent gives
// the octave and the mantissa is compared against the 7 exact mantissa thresholds of 2^(j/8)
// (kv_hist_sub_bin). Every non-zero finite FP16 value lies in [2^-24, 65504], so FP16 input always
// lands in a bin; fp32 input may also fall below 2^-24 (counted as `underflow`) or at or above 2^16
// (`overflow`), two separate counters outside the 320 bins. Zeros are counted separately; inf and
// NaN are counted as `non_finite` and are not part of count, absmax or the histogram.
//
// Invariants: nonzero == underflow + sum(histogram) + overflow, nonzero <= count, and absmax lies
// in the highest non-empty bin (0 when nonzero == 0).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace e4kv {

inline constexpr int kKvHistBinsPerOctave = 8;
inline constexpr int kKvHistMinLog2 = -24;
inline constexpr int kKvHistMaxLog2 = 16;
inline constexpr int kKvHistBins = (kKvHistMaxLog2 - kKvHistMinLog2) * kKvHistBinsPerOctave;

// Where a finite non-zero value goes: a bin in [0, kKvHistBins), or one of these.
inline constexpr int kKvHistUnderflow = -1;          // 0 < |x| < 2^-24
inline constexpr int kKvHistOverflow = kKvHistBins;  // |x| >= 2^16

// floor(8 * log2(1 + mantissa / 2^23)) for a 23-bit fp32 mantissa field, exact (0..7).
int kv_hist_sub_bin(uint32_t mantissa23);
// The bin of a finite non-zero fp32 value (kKvHistUnderflow / kKvHistOverflow outside the range).
int kv_hist_bin(float x);
// The bin of a finite non-zero FP16 value (always in [0, kKvHistBins)).
int kv_hist_bin_f16(uint16_t bits);
// The smallest and the largest fp32 magnitude that fall in bin b.
float kv_hist_bin_min(int b);
float kv_hist_bin_max(int b);
// log2 of the lower edge of bin b: -24 + b / 8.
inline double kv_hist_bin_lower_log2(int b) {
  return kKvHistMinLog2 + double(b) / kKvHistBinsPerOctave;
}

// Statistics of one tensor (one layer's K or V) on one shard. Cheap enough for the cache-write
// path: one table lookup and one increment per FP16 value (bench/cpu/bench_kv_stats.cpp). Not
// thread-safe: give each writer its own collector and merge them afterwards.
class KvTensorStats {
 public:
  // FP16 bit patterns, as the cache write receives them.
  void observe(const uint16_t* fp16_values, int64_t n);
  void observe(const float* values, int64_t n);
  // Adds `other` (commutative and associative: counts add, absmax is the max).
  void merge(const KvTensorStats& other);

  int64_t count() const;  // finite values, zeros included
  int64_t nonzero() const;
  int64_t zeros() const { return count() - nonzero(); }
  int64_t non_finite() const;
  int64_t underflow() const;
  int64_t overflow() const;
  int64_t bin(int b) const;  // b in [0, kKvHistBins)
  std::vector<int64_t> histogram() const;
  float absmax() const { return absmax_; }

  // Rebuilds statistics from serialised counts. The caller has validated them (kv_stats.cpp's
  // parser checks the invariants above); a broken invariant here is a bug.
  static KvTensorStats from_counts(int64_t count, int64_t non_finite, int64_t underflow,
                                   int64_t overflow, float absmax,
                                   const std::vector<int64_t>& histogram);

  friend bool operator==(const KvTensorStats& a, const KvTensorStats& b);

 private:
  // Slots: 0 zero, 1 underflow, 2 .. 2 + kKvHistBins - 1 the bins, then overflow, then non-finite.
  static constexpr int kZeroSlot = 0;
  static constexpr int kUnderflowSlot = 1;
  static constexpr int kFirstBinSlot = 2;
  static constexpr int kOverflowSlot = kFirstBinSlot + kKvHistBins;
  static constexpr int kNonFiniteSlot = kOverflowSlot + 1;
  static constexpr int kSlots = kNonFiniteSlot + 1;
  // Four independent copies of the counters, summed when read: consecutive values often fall in
  // the same bin, and one counter array would serialise on that store-to-load dependency.
  static constexpr int kLanes = 4;

  int64_t slot(int s) const;
  // The slot of every FP16 magnitude (bits & 0x7FFF), built once.
  static const std::array<uint16_t, 32768>& f16_slots();
  static int float_slot(uint32_t magnitude_bits);

  std::array<std::array<uint64_t, kSlots>, kLanes> lanes_{};
  float absmax_ = 0.0f;
};

}  // namespace e4kv
