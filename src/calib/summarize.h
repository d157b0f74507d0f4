// Summarise calibration statistics into K/V scales (DESIGN.md section 6): one fp32 scale per
// (KV-cache layer, K|V) and the figures of the report.
//
// Conventions (all read from the log2 histogram of kv_stats.h, so exact to within one bin,
// 2^(1/8)):
// - A bin stands for its largest possible value: the largest fp32 in the bin, capped at the
//   tensor's absmax (the "conservative upper-bin" reading). Underflow stands for the largest fp32
//   below 2^-24, overflow for absmax.
// - Percentile pq (p99.9: q = 0.999, p99.99: q = 0.9999) is nearest-rank over all finite values,
//   zeros included: rank k = ceil(q * count) = count - floor(count * (1 - q)) in exact integer
//   arithmetic, and the value is that of the bin where the cumulative count first reaches k. It
//   bounds the true k-th smallest |x| from above and lies within one bin of it.
// - Scale for a value p > 0: the smallest fp32 s with fl(p / s) <= 448 (IEEE fp32 division, as the
//   cache write divides). Policy absmax: p = absmax, so no observed value saturates. Percentile
//   policies: p = the percentile above. Never below the smallest scale the start-up gate accepts
//   (kv_scale_limits: a smaller one stores every nonzero FP16 value as +-448).
// - Envelope (--envelope OLD): scale = max(new, old) per key; OLD must hold exactly the same keys.
//   The report's figures are then computed at the final scale.
// - Saturation at scale s: values with fl(|x| / s) > 448, counted per bin when the bin's largest
//   value saturates (an upper bound; exactly 0 whenever fl(absmax / s) <= 448), as a fraction of
//   all finite values.
// - "Below 2^-9" and "in [2^-9, 2^-6)" at scale s: non-zero values with fl(|x| / s) < 2^-9, and
//   with 2^-9 <= fl(|x| / s) < 2^-6, as fractions of the non-zero finite values (zeros are exact at
//   any scale); a bin counts as below a threshold when its largest value is (a lower bound; exact
//   at scale 1.0, where 2^-9 and 2^-6 are bin edges).
// - Per-shard absmax spread: max / min of the shards' absmax (statistics files grouped by their
//   "shard"; 1 with one shard; absent when a shard's absmax is 0).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "calib/kv_stats.h"
#include "calib/scales_file.h"
#include "core/status.h"

namespace e4kv {

enum class ScalePolicy { kAbsmax, kP999, kP9999 };

// "absmax" | "p99.9" | "p99.99"; the error lists the three.
Result<ScalePolicy> parse_scale_policy(std::string_view name);
std::string_view scale_policy_name(ScalePolicy policy);

// The smallest positive fp32 s with fl(value / s) <= 448. `value` must be finite and > 0.
float min_scale_for(float value);

// The percentile with tail 1/`tail_denominator` (1000 for p99.9, 10000 for p99.99), read from
// the histogram as described above; 0 when there are no values or the rank falls on a zero.
float histogram_percentile(const KvTensorStats& stats, int64_t tail_denominator);
// Values with fl(|x| / scale) > 448 (upper bound, see above).
int64_t saturated_count(const KvTensorStats& stats, float scale);
// Non-zero values with fl(|x| / scale) < threshold (lower bound, see above).
int64_t count_below(const KvTensorStats& stats, float scale, float threshold);

// Fractions of the non-zero values at one scale.
struct LowRange {
  double below_min_subnormal = 0.0;  // fl(|x| / s) < 2^-9: stored as 0 (or 2^-9 by rounding)
  double subnormal = 0.0;            // 2^-9 <= fl(|x| / s) < 2^-6: E4M3 subnormals
};
LowRange low_range(const KvTensorStats& stats, float scale);

// Relative L2 error of storing the values as E4M3 at `scale` (the cache write's encode, then the
// exact decode times `scale`) over all finite values: sqrt(sum of squared errors / sum of
// squares). Estimated from the histogram: each bin's values taken as spread evenly over the bin
// (its upper edge capped at absmax) and integrated at 32 points with the exact codec; underflow
// counts as flushed to 0 (error = value), overflow as absmax. For smooth data it is within a few
// percent of the figure over the raw values (tested on Gaussian values at several scales). What
// rounding alone costs, whatever the scale: about 0.027 for Gaussian values in E4M3's normal range.
double e4m3_rounding_rel_l2(const KvTensorStats& stats, float scale);

struct ShardAbsmax {
  std::string shard;  // the shard number, or "merged" for files whose "shard" is null
  float absmax = 0.0f;
};

struct TensorSummary {
  std::string key;  // canonical scale key
  int64_t layer = 0;
  KvTensor tensor = KvTensor::kK;
  KvTensorStats stats;  // merged over every input

  float absmax = 0.0f;
  float p99_9 = 0.0f;
  float p99_99 = 0.0f;
  float policy_value = 0.0f;      // the value the policy scales to 448
  float scale_from_stats = 0.0f;  // min_scale_for(policy_value), at least the smallest valid scale
  std::optional<float> envelope_scale;
  float scale = 0.0f;  // the final scale: max(scale_from_stats, envelope_scale)

  int64_t saturated = 0;
  double saturation_ratio = 0.0;      // of count
  LowRange at_unit;                   // at scale 1.0
  LowRange at_scale;                  // at `scale`
  double rounding_rel_l2_unit = 0.0;  // e4m3_rounding_rel_l2 at scale 1.0
  double rounding_rel_l2 = 0.0;       // at `scale`

  std::vector<ShardAbsmax> shard_absmax;
  std::optional<double> shard_spread;  // max / min over shards
};

struct SummaryInput {
  std::string path;
  std::string sha256;  // of the file's bytes; empty when not computed
  KvStats stats;
};

struct SummaryTotals {
  int64_t count = 0;
  int64_t nonzero = 0;
  int64_t non_finite = 0;
  int64_t saturated = 0;
  LowRange at_unit;   // over the non-zero values of every tensor
  LowRange at_scale;  // each tensor at its own scale
  float min_scale = 0.0f;
  float max_scale = 0.0f;
};

struct Summary {
  ScalePolicy policy = ScalePolicy::kAbsmax;
  std::string model;   // the inputs' model name ("mixed" when they differ)
  std::string prefix;  // scale-key prefix
  int64_t n_layers = 0;
  std::vector<int64_t> kv_layers;
  std::string source;  // "observed", "synthetic" or "mixed"
  int64_t tokens = 0;  // summed over the input files
  std::vector<std::string> shards;
  struct Input {
    std::string path;
    std::string sha256;
    std::string shard;
    int64_t tokens = 0;
    std::string source;
  };
  std::vector<Input> inputs;
  std::optional<std::string> envelope_path;
  std::string envelope_sha256;
  std::vector<TensorSummary> tensors;  // layer by layer, K before V
  SummaryTotals totals;
};

struct SummarizeOptions {
  ScalePolicy policy = ScalePolicy::kAbsmax;
  // --envelope: the earlier scales and where they came from.
  std::optional<ScalesFile> envelope;
  std::string envelope_path;
  std::string envelope_sha256;
};

// Merges the inputs (their layouts must agree: the error names the file that differs) and
// computes every scale and figure. Errors: no inputs, two inputs with the same sha256 (a file
// given twice would count twice), a tensor with no non-zero value (nothing to calibrate from), a
// percentile of 0, an envelope whose keys differ from the statistics' keys.
Result<Summary> summarize(std::vector<SummaryInput> inputs, const SummarizeOptions& options);

// The scales.json contents: canonical key -> scale, the policy, and "source" with the inputs
// (path, sha256, shard, tokens, source), total tokens, shards, the envelope and "synthetic".
ScalesFile summary_scales_file(const Summary& summary);

}  // namespace e4kv
