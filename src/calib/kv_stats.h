// Calibration statistics of DESIGN.md section 6: per (layer, K|V, shard) counts, absmax and a log2
// histogram of |x| over the exact values the cache write receives.
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
//
// File format (JSON lines, one file per shard):
//   {"format":"e4kv-kv-stats/1","model":"ckpt","prefix":"model","n_layers":8,"kv_layers":[3,7],
//    "shard":0,"tokens":2048,"source":"synthetic",
//    "histogram":{"min_log2":-24,"max_log2":16,"bins_per_octave":8}}
//   {"layer":3,"tensor":"k","key":"model.layers.3.self_attn.k_scale","count":..,"nonzero":..,
//    "non_finite":..,"underflow":..,"overflow":..,"absmax":7.5,"hist":[320 counts]}
//   ... one line per (KV-cache layer, K|V), 2 * len(kv_layers) lines in all.
// "shard" is null for statistics merged from several shards; "source" is "observed" (the cache
// write of real forwards), "synthetic" (e4kv synth-stats) or "mixed".
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "kv/scale_keys.h"

namespace e4kv {

inline constexpr const char* kKvStatsFormat = "e4kv-kv-stats/1";

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

struct KvStatsHeader {
  std::string model;                // informational: the model directory's name
  std::string prefix;               // scale-key prefix ("model", "model.language_model", ...)
  int64_t n_layers = 0;             // layers of the model
  std::vector<int64_t> kv_layers;   // layers with a main KV cache, strictly increasing
  std::optional<int64_t> shard;     // nullopt: merged from several shards
  int64_t tokens = 0;               // tokens whose K/V rows were observed
  std::string source = "observed";  // "observed", "synthetic" or "mixed"
};

// The statistics of every KV-cache layer's K and V on one shard (or merged).
class KvStats {
 public:
  // Asserts a valid layout (n_layers > 0, kv_layers non-empty, increasing, inside n_layers).
  explicit KvStats(KvStatsHeader header);

  const KvStatsHeader& header() const { return header_; }
  void add_tokens(int64_t n) { header_.tokens += n; }

  // Tensors in file order: layer kv_layers[i] K at 2i, V at 2i + 1.
  size_t size() const { return tensors_.size(); }
  int64_t layer_at(size_t i) const { return header_.kv_layers[i / 2]; }
  KvTensor kind_at(size_t i) const { return i % 2 == 0 ? KvTensor::kK : KvTensor::kV; }
  std::string key_at(size_t i) const;
  const KvTensorStats& at(size_t i) const { return tensors_[i]; }
  KvTensorStats& at(size_t i) { return tensors_[i]; }

  // nullptr when `layer` has no KV cache.
  KvTensorStats* find(int64_t layer, KvTensor tensor);
  const KvTensorStats* find(int64_t layer, KvTensor tensor) const;

  // Adds `other`: an error (naming both layouts) unless prefix, n_layers and kv_layers agree.
  // Tokens add; the shard stays when both agree, else becomes nullopt; sources that differ become
  // "mixed"; the model name stays when both agree, else becomes "mixed".
  Status merge(const KvStats& other);

 private:
  KvStatsHeader header_;
  std::vector<KvTensorStats> tensors_;
};

// JSON lines (format above), ending in a newline.
std::string kv_stats_to_jsonl(const KvStats& stats);
// Parses JSON lines text. Every error names `source` and the 1-based line: invalid JSON, a wrong
// format string or histogram geometry, a bad header field, a record for a layer that is not in
// kv_layers or given twice, a missing record, negative or non-integer counts, a histogram of the
// wrong length and counts that contradict each other. Blank lines are skipped.
Result<KvStats> parse_kv_stats(std::string_view text, const std::string& source);
Result<KvStats> read_kv_stats(const std::filesystem::path& path);
// Writes atomically (temporary file in the same directory, then rename).
Status write_kv_stats(const std::filesystem::path& path, const KvStats& stats);

}  // namespace e4kv
