#include "calib/summarize.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <utility>

#include <nlohmann/json.hpp>

#include "e4kv/e4m3.h"
#include "kv/scale_gate.h"

namespace e4kv {
namespace {

// The largest fp32 below 2^-24: what the underflow counter stands for.
const float kBelowRangeMax = std::nextafter(std::ldexp(1.0f, kKvHistMinLog2), 0.0f);

float divide(float x, float scale) {
  return e4m3_detail::divide_rn(x, scale);  // the cache write's division
}

// Calls f(count, largest value) for underflow, every bin and overflow that hold values.
template <class F>
void for_each_nonzero_group(const KvTensorStats& stats, F&& f) {
  const float absmax = stats.absmax();
  if (stats.underflow() > 0) f(stats.underflow(), std::min(absmax, kBelowRangeMax));
  const std::vector<int64_t> hist = stats.histogram();
  for (int b = 0; b < kKvHistBins; ++b) {
    if (hist[size_t(b)] > 0) f(hist[size_t(b)], std::min(absmax, kv_hist_bin_max(b)));
  }
  if (stats.overflow() > 0) f(stats.overflow(), absmax);
}

int64_t tail_denominator(ScalePolicy policy) {
  switch (policy) {
    case ScalePolicy::kP999:
      return 1000;
    case ScalePolicy::kP9999:
      return 10000;
    case ScalePolicy::kAbsmax:
      break;
  }
  return 0;
}

std::string shard_label(const std::optional<int64_t>& shard) {
  return shard ? std::to_string(*shard) : std::string("merged");
}

double fraction(int64_t part, int64_t whole) {
  return whole > 0 ? double(part) / double(whole) : 0.0;
}

}  // namespace

Result<ScalePolicy> parse_scale_policy(std::string_view name) {
  if (name == "absmax") return ScalePolicy::kAbsmax;
  if (name == "p99.9") return ScalePolicy::kP999;
  if (name == "p99.99") return ScalePolicy::kP9999;
  return Status::option_error(
      "policy", cat("unknown scale policy \"", name, "\"; expected absmax, p99.9 or p99.99"));
}

std::string_view scale_policy_name(ScalePolicy policy) {
  switch (policy) {
    case ScalePolicy::kAbsmax:
      return "absmax";
    case ScalePolicy::kP999:
      return "p99.9";
    case ScalePolicy::kP9999:
      return "p99.99";
  }
  return "?";
}

float min_scale_for(float value) {
  E4KV_ASSERT(std::isfinite(value) && value > 0.0f, "min_scale_for needs a finite value > 0");
  auto fits = [value](float s) { return divide(value, s) <= kE4m3Max; };
  float s = divide(value, kE4m3Max);
  if (s == 0.0f) s = std::numeric_limits<float>::denorm_min();
  // fl(value / s) does not increase with s, so the scales that fit form an upward-closed set: step
  // up to the first that fits, then down while the next smaller one still fits.
  while (!fits(s)) s = std::nextafter(s, std::numeric_limits<float>::infinity());
  for (;;) {
    const float smaller = std::nextafter(s, 0.0f);
    if (smaller <= 0.0f || !fits(smaller)) break;
    s = smaller;
  }
  return s;
}

float histogram_percentile(const KvTensorStats& stats, int64_t tail_denominator) {
  E4KV_ASSERT(tail_denominator > 0, "tail denominator");
  const int64_t n = stats.count();
  if (n == 0) return 0.0f;
  const int64_t rank = n - n / tail_denominator;  // ceil(n * (1 - 1/tail)), 1-based
  int64_t cumulative = stats.zeros();
  if (cumulative >= rank) return 0.0f;
  float value = stats.absmax();
  bool found = false;
  for_each_nonzero_group(stats, [&](int64_t count, float largest) {
    if (found) return;
    cumulative += count;
    if (cumulative >= rank) {
      value = largest;
      found = true;
    }
  });
  return value;
}

int64_t saturated_count(const KvTensorStats& stats, float scale) {
  int64_t saturated = 0;
  for_each_nonzero_group(stats, [&](int64_t count, float largest) {
    if (divide(largest, scale) > kE4m3Max) saturated += count;
  });
  return saturated;
}

int64_t count_below(const KvTensorStats& stats, float scale, float threshold) {
  int64_t below = 0;
  for_each_nonzero_group(stats, [&](int64_t count, float largest) {
    if (divide(largest, scale) < threshold) below += count;
  });
  return below;
}

namespace {

constexpr float kMinSubnormal = 0.001953125f;  // 2^-9
constexpr float kMinNormal = 0.015625f;        // 2^-6

struct LowCounts {
  int64_t below_min_subnormal = 0;
  int64_t subnormal = 0;
};

LowCounts low_counts(const KvTensorStats& stats, float scale) {
  const int64_t below_9 = count_below(stats, scale, kMinSubnormal);
  const int64_t below_6 = count_below(stats, scale, kMinNormal);
  return {below_9, below_6 - below_9};
}

LowRange low_range_of(const LowCounts& counts, int64_t nonzero) {
  return {fraction(counts.below_min_subnormal, nonzero), fraction(counts.subnormal, nonzero)};
}

}  // namespace

double e4m3_rounding_rel_l2(const KvTensorStats& stats, float scale) {
  constexpr int kPoints = 32;
  const float absmax = stats.absmax();
  double sum_err2 = 0.0;
  double sum_x2 = 0.0;
  auto add_range = [&](int64_t count, double lo, double hi) {
    double err2 = 0.0;
    double x2 = 0.0;
    for (int i = 0; i < kPoints; ++i) {
      const float x = float(lo + (hi - lo) * (i + 0.5) / kPoints);
      const double err = double(e4m3_decode(e4m3_encode(x, scale))) * double(scale) - double(x);
      err2 += err * err;
      x2 += double(x) * double(x);
    }
    sum_err2 += double(count) * err2 / kPoints;
    sum_x2 += double(count) * x2 / kPoints;
  };
  if (stats.underflow() > 0) {
    const double x = std::min(double(absmax), double(kBelowRangeMax));
    sum_err2 += double(stats.underflow()) * x * x;  // flushed to 0
    sum_x2 += double(stats.underflow()) * x * x;
  }
  const std::vector<int64_t> hist = stats.histogram();
  for (int b = 0; b < kKvHistBins; ++b) {
    if (hist[size_t(b)] == 0) continue;
    const double lo = double(kv_hist_bin_min(b));
    add_range(hist[size_t(b)], lo,
              std::max(lo, std::min(double(absmax), double(kv_hist_bin_max(b)))));
  }
  if (stats.overflow() > 0) add_range(stats.overflow(), double(absmax), double(absmax));
  return sum_x2 > 0.0 ? std::sqrt(sum_err2 / sum_x2) : 0.0;
}

LowRange low_range(const KvTensorStats& stats, float scale) {
  return low_range_of(low_counts(stats, scale), stats.nonzero());
}

Result<Summary> summarize(std::vector<SummaryInput> inputs, const SummarizeOptions& options) {
  if (inputs.empty()) return Status::error("no statistics files given");
  Summary summary;
  summary.policy = options.policy;

  // Merge everything, and each shard separately for the spread.
  KvStats merged = inputs.front().stats;
  std::map<std::string, KvStats> by_shard;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SummaryInput& input = inputs[i];
    const KvStatsHeader& h = input.stats.header();
    for (size_t j = 0; j < i && !input.sha256.empty(); ++j) {
      if (inputs[j].sha256 == input.sha256) {
        return Status::error(cat(input.path, ": the same contents as ", inputs[j].path, " (sha256 ",
                                 input.sha256, "); each statistics file may be given once"));
      }
    }
    if (i > 0) {
      Status status = merged.merge(input.stats);
      if (!status.ok()) {
        return Status::error(cat(input.path, ": ", status.message(), " (the first file is ",
                                 inputs.front().path, ")"));
      }
    }
    const std::string shard = shard_label(h.shard);
    auto [it, inserted] = by_shard.try_emplace(shard, input.stats);
    if (!inserted) E4KV_RETURN_IF_ERROR(it->second.merge(input.stats));
    summary.inputs.push_back({input.path, input.sha256, shard, h.tokens, h.source});
  }
  const KvStatsHeader& header = merged.header();
  summary.model = header.model;
  summary.prefix = header.prefix;
  summary.n_layers = header.n_layers;
  summary.kv_layers = header.kv_layers;
  summary.source = header.source;
  summary.tokens = header.tokens;
  for (const auto& [shard, stats] : by_shard) summary.shards.push_back(shard);
  // Numeric shard labels in numeric order, "merged" last.
  std::sort(summary.shards.begin(), summary.shards.end(),
            [](const std::string& a, const std::string& b) {
              const bool a_num = a != "merged";
              const bool b_num = b != "merged";
              if (a_num != b_num) return a_num;
              if (a_num) return std::stoll(a) < std::stoll(b);
              return a < b;
            });

  if (options.envelope) {
    std::vector<std::string> missing;
    std::vector<std::string> extra;
    for (size_t i = 0; i < merged.size(); ++i) {
      if (!options.envelope->scales.contains(merged.key_at(i))) missing.push_back(merged.key_at(i));
    }
    for (const auto& [key, value] : options.envelope->scales) {
      bool known = false;
      for (size_t i = 0; i < merged.size() && !known; ++i) known = merged.key_at(i) == key;
      if (!known) extra.push_back(key);
    }
    if (!missing.empty() || !extra.empty()) {
      std::string message = cat(options.envelope_path,
                                ": the envelope's keys differ from the statistics' keys (a scales "
                                "file of another model?)");
      if (!missing.empty()) {
        message += " missing:";
        for (const std::string& key : missing) message += " " + key;
      }
      if (!extra.empty()) {
        message += (missing.empty() ? "" : ";");
        message += " not in the statistics:";
        for (const std::string& key : extra) message += " " + key;
      }
      return Status::error(message);
    }
  }

  SummaryTotals& totals = summary.totals;
  LowCounts unit_total;
  LowCounts scaled_total;
  for (size_t i = 0; i < merged.size(); ++i) {
    TensorSummary t;
    t.key = merged.key_at(i);
    t.layer = merged.layer_at(i);
    t.tensor = merged.kind_at(i);
    t.stats = merged.at(i);
    if (t.stats.nonzero() == 0) {
      return Status::error(cat(t.key, ": the statistics hold no non-zero value (", t.stats.count(),
                               " zeros, ", t.stats.non_finite(),
                               " non-finite): nothing to calibrate this tensor from"));
    }
    t.absmax = t.stats.absmax();
    t.p99_9 = histogram_percentile(t.stats, 1000);
    t.p99_99 = histogram_percentile(t.stats, 10000);
    switch (options.policy) {
      case ScalePolicy::kAbsmax:
        t.policy_value = t.absmax;
        break;
      case ScalePolicy::kP999:
        t.policy_value = t.p99_9;
        break;
      case ScalePolicy::kP9999:
        t.policy_value = t.p99_99;
        break;
    }
    if (t.policy_value <= 0.0f) {
      return Status::option_error(
          "policy",
          cat(t.key, ": the ", scale_policy_name(options.policy), " value is 0 (more than 1/",
              tail_denominator(options.policy), " of the values are zero); use the absmax policy"));
    }
    // The gate refuses a scale at which every nonzero FP16 value saturates (kv_scale_limits);
    // min_scale_for gives one only for a policy value of 2^-24 (or less, which no FP16 value is).
    // The smallest scale the gate accepts is larger, so it still keeps fl(p / s) <= 448.
    t.scale_from_stats = std::max(min_scale_for(t.policy_value),
                                  std::nextafter(kv_scale_limits().largest_saturating,
                                                 std::numeric_limits<float>::infinity()));
    if (std::optional<std::string> problem = kv_scale_value_problem(t.scale_from_stats)) {
      return Status::error(cat(t.key, ": the ", scale_policy_name(options.policy), " value ",
                               format_scale_value(t.policy_value), " gives the scale ",
                               format_scale_value(t.scale_from_stats), ", which is ", *problem,
                               " (the statistics do not describe FP16 values)"));
    }
    t.scale = t.scale_from_stats;
    if (options.envelope) {
      t.envelope_scale = options.envelope->scales.at(t.key);
      t.scale = std::max(t.scale, *t.envelope_scale);
    }
    t.saturated = saturated_count(t.stats, t.scale);
    t.saturation_ratio = fraction(t.saturated, t.stats.count());
    const LowCounts unit = low_counts(t.stats, 1.0f);
    const LowCounts scaled = low_counts(t.stats, t.scale);
    t.at_unit = low_range_of(unit, t.stats.nonzero());
    t.at_scale = low_range_of(scaled, t.stats.nonzero());
    t.rounding_rel_l2_unit = e4m3_rounding_rel_l2(t.stats, 1.0f);
    t.rounding_rel_l2 = e4m3_rounding_rel_l2(t.stats, t.scale);

    float shard_min = std::numeric_limits<float>::infinity();
    float shard_max = 0.0f;
    for (const std::string& shard : summary.shards) {
      const float absmax = by_shard.at(shard).at(i).absmax();
      t.shard_absmax.push_back({shard, absmax});
      shard_min = std::min(shard_min, absmax);
      shard_max = std::max(shard_max, absmax);
    }
    if (shard_min > 0.0f) t.shard_spread = double(shard_max) / double(shard_min);

    totals.count += t.stats.count();
    totals.nonzero += t.stats.nonzero();
    totals.non_finite += t.stats.non_finite();
    totals.saturated += t.saturated;
    unit_total.below_min_subnormal += unit.below_min_subnormal;
    unit_total.subnormal += unit.subnormal;
    scaled_total.below_min_subnormal += scaled.below_min_subnormal;
    scaled_total.subnormal += scaled.subnormal;
    totals.min_scale = i == 0 ? t.scale : std::min(totals.min_scale, t.scale);
    totals.max_scale = std::max(totals.max_scale, t.scale);
    summary.tensors.push_back(std::move(t));
  }
  totals.at_unit = low_range_of(unit_total, totals.nonzero);
  totals.at_scale = low_range_of(scaled_total, totals.nonzero);
  if (options.envelope) {
    summary.envelope_path = options.envelope_path;
    summary.envelope_sha256 = options.envelope_sha256;
  }
  return summary;
}

ScalesFile summary_scales_file(const Summary& summary) {
  using ordered_json = nlohmann::ordered_json;
  ScalesFile file;
  for (const TensorSummary& t : summary.tensors) file.scales[t.key] = t.scale;
  file.policy = std::string(scale_policy_name(summary.policy));
  ordered_json source;
  source["tool"] = cat("e4kv ", E4KV_VERSION, " summarize");
  source["synthetic"] = summary.source != "observed";
  source["kind"] = summary.source;
  source["model"] = summary.model;
  source["prefix"] = summary.prefix;
  source["tokens"] = summary.tokens;
  source["shards"] = summary.shards;
  ordered_json stats = ordered_json::array();
  for (const Summary::Input& input : summary.inputs) {
    ordered_json entry;
    entry["path"] = input.path;
    if (!input.sha256.empty()) entry["sha256"] = input.sha256;
    entry["shard"] = input.shard;
    entry["tokens"] = input.tokens;
    entry["source"] = input.source;
    stats.push_back(std::move(entry));
  }
  source["stats"] = std::move(stats);
  if (summary.envelope_path) {
    ordered_json envelope;
    envelope["path"] = *summary.envelope_path;
    if (!summary.envelope_sha256.empty()) envelope["sha256"] = summary.envelope_sha256;
    envelope["rule"] = "scale = max(new, old) per key";
    source["envelope"] = std::move(envelope);
  } else {
    source["envelope"] = nullptr;
  }
  file.source_json = source.dump();
  return file;
}

}  // namespace e4kv
