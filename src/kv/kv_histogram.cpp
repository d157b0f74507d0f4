#include "kv/kv_histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <utility>

#include "core/check.h"
#include "core/half.h"

namespace e4kv {
namespace {

// ---- exact sub-octave thresholds
// -----------------------------------------------------------------
//
// Bin j of an octave starts at 2^(j/8), irrational for j = 1..7. kSubBinThreshold[j] is the
// smallest 23-bit mantissa m with 1 + m / 2^23 >= 2^(j/8), i.e. (2^23 + m)^8 >= 2^(184 + j),
// decided in exact integer arithmetic at compile time (the 8th power needs 192 bits: six 32-bit
// limbs).

using Limbs = std::array<uint32_t, 6>;

constexpr Limbs multiply(const Limbs& a, const Limbs& b) {
  Limbs c{};
  for (size_t i = 0; i < a.size(); ++i) {
    uint64_t carry = 0;
    for (size_t j = 0; i + j < c.size(); ++j) {
      const uint64_t t = uint64_t(a[i]) * b[j] + c[i + j] + carry;
      c[i + j] = uint32_t(t);
      carry = t >> 32;
    }
  }
  return c;
}

constexpr int bit_length(const Limbs& a) {
  for (int i = int(a.size()) - 1; i >= 0; --i) {
    if (a[size_t(i)] != 0) return 32 * i + int(std::bit_width(a[size_t(i)]));
  }
  return 0;
}

// (2^23 + mantissa)^8 >= 2^(184 + j)
constexpr bool reaches_edge(uint32_t mantissa, int j) {
  Limbs n{};
  n[0] = (1u << 23) + mantissa;
  const Limbs n2 = multiply(n, n);
  const Limbs n4 = multiply(n2, n2);
  const Limbs n8 = multiply(n4, n4);
  return bit_length(n8) > 184 + j;
}

constexpr std::array<uint32_t, 9> make_sub_bin_thresholds() {
  std::array<uint32_t, 9> t{};
  t[0] = 0;
  t[8] = 1u << 23;  // the next octave
  for (int j = 1; j < 8; ++j) {
    uint32_t lo = 0;
    uint32_t hi = 1u << 23;  // reaches_edge(hi) holds: 2^(j/8) < 2
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (reaches_edge(mid, j)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    t[size_t(j)] = lo;
  }
  return t;
}

constexpr std::array<uint32_t, 9> kSubBinThreshold = make_sub_bin_thresholds();
// ceil((sqrt(2) - 1) * 2^23) = 3474676: a spot check of the integer arithmetic.
static_assert(kSubBinThreshold[4] == 3474676u);

constexpr int kFirstBinExponent = 127 + kKvHistMinLog2;  // biased fp32 exponent of 2^-24
constexpr int kEndBinExponent = 127 + kKvHistMaxLog2;    // biased fp32 exponent of 2^16

// Bin of a normal fp32 magnitude inside [2^-24, 2^16).
inline int bin_of_normal(uint32_t magnitude_bits) {
  const int exponent = int(magnitude_bits >> 23);
  return (exponent - kFirstBinExponent) * kKvHistBinsPerOctave +
         kv_hist_sub_bin(magnitude_bits & 0x7FFFFFu);
}

float float_with(int unbiased_exponent, uint32_t mantissa23) {
  return f32_from_bits(uint32_t(unbiased_exponent + 127) << 23 | mantissa23);
}

}  // namespace

// ---- bins
// ----------------------------------------------------------------------------------------

int kv_hist_sub_bin(uint32_t mantissa23) {
  int sub = 0;
  for (int j = 1; j < 8; ++j) sub += mantissa23 >= kSubBinThreshold[size_t(j)] ? 1 : 0;
  return sub;
}

int kv_hist_bin(float x) {
  const uint32_t mag = f32_bits(x) & 0x7FFFFFFFu;
  E4KV_ASSERT(mag != 0 && mag < 0x7F800000u, "kv_hist_bin needs a finite non-zero value");
  const int exponent = int(mag >> 23);
  if (exponent < kFirstBinExponent) return kKvHistUnderflow;
  if (exponent >= kEndBinExponent) return kKvHistOverflow;
  return bin_of_normal(mag);
}

int kv_hist_bin_f16(uint16_t bits) {
  const uint16_t mag = bits & 0x7FFFu;
  E4KV_ASSERT(mag != 0 && mag < 0x7C00u, "kv_hist_bin_f16 needs a finite non-zero value");
  // Every finite non-zero FP16 value is a normal fp32 in [2^-24, 65504].
  return bin_of_normal(f32_bits(f16_to_f32(mag)));
}

float kv_hist_bin_min(int b) {
  E4KV_ASSERT(b >= 0 && b < kKvHistBins, "bin out of range");
  const int octave = kKvHistMinLog2 + b / kKvHistBinsPerOctave;
  return float_with(octave, kSubBinThreshold[size_t(b % kKvHistBinsPerOctave)]);
}

float kv_hist_bin_max(int b) {
  E4KV_ASSERT(b >= 0 && b < kKvHistBins, "bin out of range");
  const int octave = kKvHistMinLog2 + b / kKvHistBinsPerOctave;
  return float_with(octave, kSubBinThreshold[size_t(b % kKvHistBinsPerOctave) + 1] - 1u);
}

// ---- KvTensorStats
// -------------------------------------------------------------------------------

const std::array<uint16_t, 32768>& KvTensorStats::f16_slots() {
  static const std::array<uint16_t, 32768> table = [] {
    std::array<uint16_t, 32768> t{};
    for (uint32_t mag = 0; mag < t.size(); ++mag) {
      int s = 0;
      if (mag == 0) {
        s = kZeroSlot;
      } else if (mag >= 0x7C00u) {
        s = kNonFiniteSlot;
      } else {
        s = kFirstBinSlot + kv_hist_bin_f16(uint16_t(mag));
      }
      t[mag] = uint16_t(s);
    }
    return t;
  }();
  return table;
}

int KvTensorStats::float_slot(uint32_t mag) {
  if (mag == 0) return kZeroSlot;
  if (mag >= 0x7F800000u) return kNonFiniteSlot;
  const int exponent = int(mag >> 23);
  if (exponent < kFirstBinExponent) return kUnderflowSlot;
  if (exponent >= kEndBinExponent) return kOverflowSlot;
  return kFirstBinSlot + bin_of_normal(mag);
}

void KvTensorStats::observe(const uint16_t* fp16_values, int64_t n) {
  const uint16_t* slots = f16_slots().data();
  uint64_t* c0 = lanes_[0].data();
  uint64_t* c1 = lanes_[1].data();
  uint64_t* c2 = lanes_[2].data();
  uint64_t* c3 = lanes_[3].data();
  // FP16 magnitudes order like their bit patterns; inf/NaN (>= 0x7C00) do not count for absmax.
  auto finite = [](uint32_t mag) { return mag < 0x7C00u ? mag : 0u; };
  uint32_t max_mag = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint32_t m0 = fp16_values[i] & 0x7FFFu;
    const uint32_t m1 = fp16_values[i + 1] & 0x7FFFu;
    const uint32_t m2 = fp16_values[i + 2] & 0x7FFFu;
    const uint32_t m3 = fp16_values[i + 3] & 0x7FFFu;
    ++c0[slots[m0]];
    ++c1[slots[m1]];
    ++c2[slots[m2]];
    ++c3[slots[m3]];
    max_mag = std::max(
        max_mag, std::max(std::max(finite(m0), finite(m1)), std::max(finite(m2), finite(m3))));
  }
  for (; i < n; ++i) {
    const uint32_t m = fp16_values[i] & 0x7FFFu;
    ++c0[slots[m]];
    max_mag = std::max(max_mag, finite(m));
  }
  absmax_ = std::max(absmax_, f16_to_f32(uint16_t(max_mag)));
}

void KvTensorStats::observe(const float* values, int64_t n) {
  uint32_t max_mag = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t mag = f32_bits(values[i]) & 0x7FFFFFFFu;
    ++lanes_[size_t(i & (kLanes - 1))][size_t(float_slot(mag))];
    if (mag < 0x7F800000u) max_mag = std::max(max_mag, mag);
  }
  absmax_ = std::max(absmax_, f32_from_bits(max_mag));
}

void KvTensorStats::merge(const KvTensorStats& other) {
  for (int s = 0; s < kSlots; ++s) lanes_[0][size_t(s)] += uint64_t(other.slot(s));
  absmax_ = std::max(absmax_, other.absmax_);
}

int64_t KvTensorStats::slot(int s) const {
  uint64_t total = 0;
  for (const auto& lane : lanes_) total += lane[size_t(s)];
  return int64_t(total);
}

int64_t KvTensorStats::count() const {
  int64_t total = 0;
  for (int s = 0; s < kNonFiniteSlot; ++s) total += slot(s);
  return total;
}

int64_t KvTensorStats::nonzero() const {
  return count() - slot(kZeroSlot);
}

int64_t KvTensorStats::non_finite() const {
  return slot(kNonFiniteSlot);
}

int64_t KvTensorStats::underflow() const {
  return slot(kUnderflowSlot);
}

int64_t KvTensorStats::overflow() const {
  return slot(kOverflowSlot);
}

int64_t KvTensorStats::bin(int b) const {
  E4KV_ASSERT(b >= 0 && b < kKvHistBins, "bin out of range");
  return slot(kFirstBinSlot + b);
}

std::vector<int64_t> KvTensorStats::histogram() const {
  std::vector<int64_t> h(kKvHistBins);
  for (int b = 0; b < kKvHistBins; ++b) h[size_t(b)] = slot(kFirstBinSlot + b);
  return h;
}

KvTensorStats KvTensorStats::from_counts(int64_t count, int64_t non_finite, int64_t underflow,
                                         int64_t overflow, float absmax,
                                         const std::vector<int64_t>& histogram) {
  E4KV_ASSERT(histogram.size() == size_t(kKvHistBins), "histogram length");
  KvTensorStats stats;
  auto& lane = stats.lanes_[0];
  int64_t nonzero = underflow + overflow;
  for (int b = 0; b < kKvHistBins; ++b) {
    lane[size_t(kFirstBinSlot + b)] = uint64_t(histogram[size_t(b)]);
    nonzero += histogram[size_t(b)];
  }
  E4KV_ASSERT(count >= nonzero && non_finite >= 0 && underflow >= 0 && overflow >= 0,
              "inconsistent counts");
  lane[kZeroSlot] = uint64_t(count - nonzero);
  lane[kUnderflowSlot] = uint64_t(underflow);
  lane[kOverflowSlot] = uint64_t(overflow);
  lane[kNonFiniteSlot] = uint64_t(non_finite);
  stats.absmax_ = absmax;
  return stats;
}

bool operator==(const KvTensorStats& a, const KvTensorStats& b) {
  for (int s = 0; s < KvTensorStats::kSlots; ++s) {
    if (a.slot(s) != b.slot(s)) return false;
  }
  return a.absmax_ == b.absmax_;
}

}  // namespace e4kv
