// Scale policies and report figures (calib/summarize.h, calib/report.h) against figures computed
// directly from the raw values the statistics were built from.
#include "calib/summarize.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "calib/report.h"
#include "core/half.h"
#include "e4kv/e4m3.h"
#include "kv/scale_gate.h"

namespace e4kv {
namespace {

using json = nlohmann::json;

const double kBinRatio = std::exp2(1.0 / 8.0);

// K/V-like FP16 values: Gaussian, every 16th channel of 64 an outlier (30x), a few exact zeros.
std::vector<uint16_t> kv_values(uint32_t seed, size_t n, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    const float channel_sigma = (i % 64) % 16 == 0 ? 30.0f * sigma : sigma;
    out[i] = f32_to_f16(i % 211 == 0 ? 0.0f : dist(rng) * channel_sigma);
  }
  return out;
}

std::vector<float> magnitudes(const std::vector<uint16_t>& values) {
  std::vector<float> out;
  for (uint16_t v : values) {
    const float x = std::fabs(f16_to_f32(v));
    if (std::isfinite(x)) out.push_back(x);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Nearest-rank percentile of the raw magnitudes: the k-th smallest, k = n - floor(n / tail).
float raw_percentile(const std::vector<float>& sorted, int64_t tail) {
  const int64_t n = int64_t(sorted.size());
  return sorted[size_t(n - n / tail - 1)];
}

int64_t raw_below(const std::vector<float>& sorted, float scale, float threshold) {
  int64_t below = 0;
  for (float x : sorted) below += (x != 0.0f && x / scale < threshold) ? 1 : 0;
  return below;
}

int64_t raw_saturated(const std::vector<float>& sorted, float scale) {
  int64_t saturated = 0;
  for (float x : sorted) saturated += x / scale > 448.0f ? 1 : 0;
  return saturated;
}

KvStatsHeader header(std::optional<int64_t> shard = 0, std::string source = "observed") {
  KvStatsHeader h;
  h.model = "tiny";
  h.prefix = "model";
  h.n_layers = 4;
  h.kv_layers = {1, 3};
  h.shard = shard;
  h.tokens = 100;
  h.source = std::move(source);
  return h;
}

// Every tensor of a KvStats filled with kv_values(seed + i, n, sigma * (i + 1)).
KvStats stats_with(uint32_t seed, float sigma, std::optional<int64_t> shard = 0, size_t n = 20000) {
  KvStats stats(header(shard));
  for (size_t i = 0; i < stats.size(); ++i) {
    const auto values = kv_values(seed + uint32_t(i), n, sigma * float(i + 1));
    stats.at(i).observe(values.data(), int64_t(values.size()));
  }
  return stats;
}

TEST(Summarize, PolicyNames) {
  EXPECT_EQ(*parse_scale_policy("absmax"), ScalePolicy::kAbsmax);
  EXPECT_EQ(*parse_scale_policy("p99.9"), ScalePolicy::kP999);
  EXPECT_EQ(*parse_scale_policy("p99.99"), ScalePolicy::kP9999);
  Result<ScalePolicy> bad = parse_scale_policy("p99");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("expected absmax, p99.9 or p99.99"), std::string::npos);
  EXPECT_EQ(scale_policy_name(ScalePolicy::kP9999), "p99.99");
}

void expect_smallest_scale(float value) {
  const float s = min_scale_for(value);
  ASSERT_GT(s, 0.0f) << value;
  EXPECT_LE(value / s, 448.0f) << value << " / " << s;
  const float smaller = std::nextafter(s, 0.0f);
  if (smaller > 0.0f) {
    EXPECT_GT(value / smaller, 448.0f) << value << " / " << smaller;
  }
}

TEST(Summarize, AbsmaxScaleIsTheSmallestFp32ThatFits) {
  for (float v : {448.0f, 1.0f, 65504.0f, 7.6718750f, 0.0171247218f, std::ldexp(1.0f, -24), 1e-30f,
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
                  std::nextafter(448.0f, 0.0f), std::nextafter(448.0f, 1e9f)}) {
    expect_smallest_scale(v);
  }
  EXPECT_EQ(min_scale_for(448.0f), 1.0f);
  EXPECT_EQ(min_scale_for(896.0f), 2.0f);
  for (uint32_t bits = 1; bits < 0x7C00; bits += 7)
    expect_smallest_scale(f16_to_f32(uint16_t(bits)));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> log2_dist(-60.0f, 60.0f);
  for (int i = 0; i < 20000; ++i) expect_smallest_scale(std::exp2(log2_dist(rng)));
}

TEST(Summarize, AbsmaxPolicyNeverSaturates) {
  for (float sigma : {0.001f, 0.3f, 40.0f}) {
    const auto values = kv_values(17, 30000, sigma);
    KvStats stats(header());
    for (size_t i = 0; i < stats.size(); ++i) stats.at(i).observe(values.data(), 30000);
    Result<Summary> summary = summarize({{"a.jsonl", "", stats}}, {});
    ASSERT_TRUE(summary.ok()) << summary.message();
    const std::vector<float> raw = magnitudes(values);
    for (const TensorSummary& t : summary->tensors) {
      EXPECT_EQ(t.absmax, raw.back());
      EXPECT_EQ(t.scale, min_scale_for(raw.back()));
      EXPECT_EQ(t.saturated, 0);
      EXPECT_EQ(t.saturation_ratio, 0.0);
      EXPECT_EQ(raw_saturated(raw, t.scale), 0);
    }
    EXPECT_EQ(summary->totals.saturated, 0);
  }
}

// Statistics whose only nonzero magnitude is 2^-24: min_scale_for gives 2^-24 / 448 (to within
// an ulp), at which every nonzero FP16 value is stored as +-448 and the gate refuses the scale.
// Summarize gives the smallest scale the gate accepts instead, which still saturates nothing.
TEST(Summarize, AScaleBelowTheUsableRangeIsRaisedToIt) {
  KvStats stats(header());
  const uint16_t values[4] = {0x0001, 0x8001, 0, 0x0001};  // +-2^-24 and a zero
  for (size_t i = 0; i < stats.size(); ++i) stats.at(i).observe(values, 4);
  Result<Summary> summary = summarize({{"a.jsonl", "", stats}}, {});
  ASSERT_TRUE(summary.ok()) << summary.message();
  const float tiny = std::ldexp(1.0f, -24);
  ASSERT_TRUE(kv_scale_value_problem(min_scale_for(tiny)));
  const float smallest_valid =
      std::nextafter(kv_scale_limits().largest_saturating, std::numeric_limits<float>::infinity());
  for (const TensorSummary& t : summary->tensors) {
    EXPECT_EQ(t.scale, smallest_valid) << t.key;
    EXPECT_FALSE(kv_scale_value_problem(t.scale)) << t.key;
    EXPECT_LE(tiny / t.scale, 448.0f);
    EXPECT_EQ(t.saturated, 0);
  }
  const std::filesystem::path out =
      std::filesystem::path(::testing::TempDir()) / cat("raised-", ::getpid(), ".scales.json");
  EXPECT_TRUE(write_scales_file(out, summary_scales_file(*summary)).ok());
  std::filesystem::remove(out);
}

TEST(Summarize, PercentilesAndFractionsAgreeWithRawValuesWithinOneBin) {
  for (float sigma : {0.002f, 0.05f, 1.0f, 25.0f}) {
    SCOPED_TRACE(sigma);
    const auto values = kv_values(23, 50000, sigma);
    const std::vector<float> raw = magnitudes(values);
    KvTensorStats stats;
    stats.observe(values.data(), int64_t(values.size()));
    for (int64_t tail : {1000, 10000}) {
      const float exact = raw_percentile(raw, tail);
      const float p = histogram_percentile(stats, tail);
      EXPECT_GE(p, exact) << tail;
      EXPECT_LT(double(p), double(exact) * kBinRatio) << tail;
      // The percentile scale: its predicted saturation brackets the raw one within a bin, and is
      // at most the tail.
      const float s = min_scale_for(p);
      const int64_t predicted = saturated_count(stats, s);
      EXPECT_GE(predicted, raw_saturated(raw, s)) << tail;
      EXPECT_LE(predicted, raw_saturated(raw, float(s / kBinRatio * (1 - 1e-6)))) << tail;
      EXPECT_LE(double(predicted), double(stats.count()) / double(tail)) << tail;
    }
    // Low-range fractions: exact at scale 1.0 (2^-9 and 2^-6 are bin edges), within a bin at s.
    const float s = min_scale_for(stats.absmax());
    for (float threshold : {std::ldexp(1.0f, -9), std::ldexp(1.0f, -6)}) {
      EXPECT_EQ(count_below(stats, 1.0f, threshold), raw_below(raw, 1.0f, threshold));
      const int64_t below = count_below(stats, s, threshold);
      EXPECT_LE(below, raw_below(raw, s, threshold));
      EXPECT_GE(below, raw_below(raw, s, float(threshold / kBinRatio * (1 - 1e-6))));
    }
    const LowRange unit = low_range(stats, 1.0f);
    const double nonzero = double(stats.nonzero());
    EXPECT_DOUBLE_EQ(unit.below_min_subnormal,
                     double(raw_below(raw, 1.0f, std::ldexp(1.0f, -9))) / nonzero);
    EXPECT_DOUBLE_EQ(unit.subnormal, double(raw_below(raw, 1.0f, std::ldexp(1.0f, -6)) -
                                            raw_below(raw, 1.0f, std::ldexp(1.0f, -9))) /
                                         nonzero);
  }
}

// The histogram estimate of E4M3's rounding error against the error over the raw values, in the
// normal range (absmax scale), with many subnormals (small values at scale 1) and with saturation
// (large values at scale 1), on the K/V-like values above (outlier channels included).
TEST(Summarize, RoundingErrorEstimateMatchesTheRawValues) {
  for (float sigma : {1.0f, 0.01f, 200.0f}) {
    const std::vector<uint16_t> bits = kv_values(17, 1 << 17, sigma);
    KvTensorStats stats;
    stats.observe(bits.data(), int64_t(bits.size()));
    for (float scale : {1.0f, min_scale_for(stats.absmax())}) {
      double err2 = 0.0;
      double x2 = 0.0;
      for (uint16_t b : bits) {
        const float x = f16_to_f32(b);
        const double err = double(e4m3_decode(e4m3_encode(x, scale))) * scale - double(x);
        err2 += err * err;
        x2 += double(x) * double(x);
      }
      const double exact = std::sqrt(err2 / x2);
      const double estimate = e4m3_rounding_rel_l2(stats, scale);
      EXPECT_NEAR(estimate, exact, 0.05 * exact) << "sigma " << sigma << ", scale " << scale;
      if (scale != 1.0f) {
        // Inside the normal range the error is E4M3's rounding alone: near 0.027 for these values.
        EXPECT_GT(exact, 0.02) << sigma;
        EXPECT_LT(exact, 0.035) << sigma;
      }
    }
  }
}

TEST(Summarize, PercentilePolicyScalesThePercentile) {
  const KvStats stats = stats_with(3, 0.2f);
  for (ScalePolicy policy : {ScalePolicy::kP999, ScalePolicy::kP9999}) {
    SummarizeOptions options;
    options.policy = policy;
    Result<Summary> summary = summarize({{"a.jsonl", "", stats}}, options);
    ASSERT_TRUE(summary.ok()) << summary.message();
    for (const TensorSummary& t : summary->tensors) {
      const float p = policy == ScalePolicy::kP999 ? t.p99_9 : t.p99_99;
      EXPECT_EQ(t.policy_value, p);
      EXPECT_EQ(t.scale, min_scale_for(p));
      EXPECT_LE(t.scale, min_scale_for(t.absmax));
      EXPECT_EQ(t.saturated, saturated_count(t.stats, t.scale));
      EXPECT_LE(t.saturation_ratio, policy == ScalePolicy::kP999 ? 1e-3 : 1e-4);
    }
  }
}

TEST(Summarize, MergesShardsAndReportsTheirSpread) {
  const KvStats shard0 = stats_with(1, 0.1f, 0);
  const KvStats shard1 = stats_with(2, 0.3f, 1);
  const KvStats shard1_again = stats_with(3, 0.1f, 1);
  Result<Summary> summary = summarize(
      {{"s0.jsonl", "", shard0}, {"s1.jsonl", "", shard1}, {"s1b.jsonl", "", shard1_again}}, {});
  ASSERT_TRUE(summary.ok()) << summary.message();
  EXPECT_EQ(summary->shards, (std::vector<std::string>{"0", "1"}));
  EXPECT_EQ(summary->tokens, 300);
  ASSERT_EQ(summary->tensors.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const TensorSummary& t = summary->tensors[i];
    KvTensorStats all = shard0.at(i);
    all.merge(shard1.at(i));
    all.merge(shard1_again.at(i));
    EXPECT_EQ(t.stats, all);
    const float a0 = shard0.at(i).absmax();
    const float a1 = std::max(shard1.at(i).absmax(), shard1_again.at(i).absmax());
    ASSERT_EQ(t.shard_absmax.size(), 2u);
    EXPECT_EQ(t.shard_absmax[0].shard, "0");
    EXPECT_EQ(t.shard_absmax[0].absmax, a0);
    EXPECT_EQ(t.shard_absmax[1].absmax, a1);
    ASSERT_TRUE(t.shard_spread.has_value());
    EXPECT_DOUBLE_EQ(*t.shard_spread, double(std::max(a0, a1)) / double(std::min(a0, a1)));
    EXPECT_EQ(t.absmax, std::max(a0, a1));
  }
  EXPECT_EQ(summary->tensors[0].key, "model.layers.1.self_attn.k_scale");
  EXPECT_EQ(summary->tensors[3].key, "model.layers.3.self_attn.v_scale");

  // One shard: spread 1.
  Result<Summary> one = summarize({{"s0.jsonl", "", shard0}}, {});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one->tensors[0].shard_spread, 1.0);
}

TEST(Summarize, EnvelopeTakesTheLargerScale) {
  const KvStats stats = stats_with(4, 0.5f);
  Result<Summary> base = summarize({{"a.jsonl", "", stats}}, {});
  ASSERT_TRUE(base.ok());
  SummarizeOptions options;
  options.envelope = ScalesFile{};
  options.envelope_path = "old.json";
  for (size_t i = 0; i < base->tensors.size(); ++i) {
    const TensorSummary& t = base->tensors[i];
    options.envelope->scales[t.key] = i % 2 == 0 ? t.scale * 2.0f : t.scale * 0.5f;
  }
  Result<Summary> merged = summarize({{"a.jsonl", "", stats}}, options);
  ASSERT_TRUE(merged.ok()) << merged.message();
  for (size_t i = 0; i < merged->tensors.size(); ++i) {
    const TensorSummary& t = merged->tensors[i];
    const float fresh = base->tensors[i].scale;
    EXPECT_EQ(t.scale_from_stats, fresh);
    EXPECT_EQ(t.scale, i % 2 == 0 ? fresh * 2.0f : fresh);
    EXPECT_EQ(*t.envelope_scale, options.envelope->scales.at(t.key));
    EXPECT_EQ(t.saturated, 0);
  }
  EXPECT_EQ(*merged->envelope_path, "old.json");

  // Keys must match both ways.
  options.envelope->scales.erase("model.layers.3.self_attn.v_scale");
  options.envelope->scales["model.layers.2.self_attn.k_scale"] = 1.0f;
  Result<Summary> bad = summarize({{"a.jsonl", "", stats}}, options);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("old.json: the envelope's keys differ"), std::string::npos);
  EXPECT_NE(bad.message().find("missing: model.layers.3.self_attn.v_scale"), std::string::npos)
      << bad.message();
  EXPECT_NE(bad.message().find("not in the statistics: model.layers.2.self_attn.k_scale"),
            std::string::npos)
      << bad.message();
}

TEST(Summarize, Errors) {
  EXPECT_FALSE(summarize({}, {}).ok());
  // A tensor with only zeros has nothing to calibrate from.
  KvStats zeros = stats_with(5, 0.1f);
  zeros.at(2) = KvTensorStats();
  const uint16_t z[4] = {0, 0, 0x8000, 0};
  zeros.at(2).observe(z, 4);
  Result<Summary> r = summarize({{"z.jsonl", "", zeros}}, {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("model.layers.3.self_attn.k_scale: the statistics hold no non-zero"),
            std::string::npos)
      << r.message();
  // Statistics of different models.
  KvStatsHeader other = header();
  other.kv_layers = {0, 1, 3};
  Result<Summary> mixed = summarize(
      {{"first.jsonl", "", stats_with(1, 0.1f)}, {"second.jsonl", "", KvStats(other)}}, {});
  ASSERT_FALSE(mixed.ok());
  EXPECT_EQ(mixed.message().rfind("second.jsonl: statistics of different models", 0), 0u)
      << mixed.message();
  EXPECT_NE(mixed.message().find("first.jsonl"), std::string::npos);
  // A percentile that falls on zeros.
  KvStats mostly_zero(header());
  for (size_t i = 0; i < mostly_zero.size(); ++i) {
    std::vector<uint16_t> v(1000, 0);
    v[0] = f32_to_f16(1.0f);
    mostly_zero.at(i).observe(v.data(), 1000);
  }
  SummarizeOptions p999;
  p999.policy = ScalePolicy::kP999;
  Result<Summary> zero_p = summarize({{"m.jsonl", "", mostly_zero}}, p999);
  ASSERT_FALSE(zero_p.ok());
  EXPECT_NE(zero_p.message().find("the p99.9 value is 0"), std::string::npos) << zero_p.message();
  EXPECT_TRUE(summarize({{"m.jsonl", "", mostly_zero}}, {}).ok());
}

Summary synthetic_summary() {
  KvStats a = stats_with(8, 0.05f, 0);
  KvStats b = stats_with(9, 0.05f, 1);
  KvStatsHeader h = a.header();
  h.source = "synthetic";
  KvStats a_synth(h);
  for (size_t i = 0; i < a.size(); ++i) a_synth.at(i) = a.at(i);
  Result<Summary> s =
      summarize({{"dir/s0.jsonl", std::string(64, 'a'), a_synth}, {"dir/s1.jsonl", "", b}}, {});
  EXPECT_TRUE(s.ok()) << s.message();
  return *s;
}

TEST(Summarize, ScalesFileCarriesProvenance) {
  const Summary summary = synthetic_summary();
  EXPECT_EQ(summary.source, "mixed");
  const ScalesFile file = summary_scales_file(summary);
  EXPECT_EQ(file.policy, "absmax");
  ASSERT_EQ(file.scales.size(), 4u);
  for (const TensorSummary& t : summary.tensors) EXPECT_EQ(file.scales.at(t.key), t.scale);
  const json source = json::parse(file.source_json);
  EXPECT_EQ(source["synthetic"], true);
  EXPECT_EQ(source["tokens"], 200);
  EXPECT_EQ(source["shards"], json({"0", "1"}));
  ASSERT_EQ(source["stats"].size(), 2u);
  EXPECT_EQ(source["stats"][0]["path"], "dir/s0.jsonl");
  EXPECT_EQ(source["stats"][0]["sha256"], std::string(64, 'a'));
  EXPECT_FALSE(source["stats"][1].contains("sha256"));
  EXPECT_TRUE(source["envelope"].is_null());
}

TEST(Report, JsonMarkdownAndSvg) {
  const Summary summary = synthetic_summary();
  const json report = json::parse(report_json(summary));
  EXPECT_EQ(report["format"], "e4kv-kv-report/1");
  EXPECT_EQ(report["policy"], "absmax");
  EXPECT_EQ(report["synthetic"], true);
  ASSERT_EQ(report["tensors"].size(), 4u);
  const json& t0 = report["tensors"][0];
  const TensorSummary& s0 = summary.tensors[0];
  EXPECT_EQ(t0["key"], s0.key);
  EXPECT_EQ(t0["scale"].get<float>(), s0.scale);
  EXPECT_EQ(t0["absmax"].get<float>(), s0.absmax);
  EXPECT_EQ(t0["p99.9"].get<float>(), s0.p99_9);
  EXPECT_EQ(t0["saturation_ratio"], 0.0);
  EXPECT_DOUBLE_EQ(t0["at_scale_1"]["below_2^-9"].get<double>(), s0.at_unit.below_min_subnormal);
  EXPECT_DOUBLE_EQ(t0["at_calibrated_scale"]["in_2^-9_2^-6"].get<double>(), s0.at_scale.subnormal);
  EXPECT_EQ(t0["shard_absmax"].size(), 2u);
  // The trimmed histogram adds up to the non-zero count.
  int64_t sum =
      t0["histogram"]["underflow"].get<int64_t>() + t0["histogram"]["overflow"].get<int64_t>();
  for (const json& c : t0["histogram"]["counts"]) sum += c.get<int64_t>();
  EXPECT_EQ(sum, s0.stats.nonzero());
  EXPECT_EQ(report["totals"]["tensors"], 4);

  const std::string md = report_markdown(summary);
  EXPECT_NE(md.find("**Synthetic statistics**"), std::string::npos);
  EXPECT_NE(md.find("| `model.layers.3.self_attn.v_scale` |"), std::string::npos) << md;
  EXPECT_NE(md.find("![log2 histograms"), std::string::npos);

  const std::string svg = report_svg(summary);
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>\n"), std::string::npos);
  size_t panels = 0;
  for (size_t pos = svg.find("<g>"); pos != std::string::npos; pos = svg.find("<g>", pos + 1)) {
    ++panels;
  }
  EXPECT_EQ(panels, 4u);
  EXPECT_NE(svg.find("layer 3 V"), std::string::npos);
  EXPECT_NE(svg.find("SYNTHETIC"), std::string::npos);

  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / cat("e4kv_report_", ::getpid()) / "nested";
  ASSERT_TRUE(write_report(dir, summary).ok());
  for (const char* name : {"report.json", "report.md", "report.svg"}) {
    EXPECT_TRUE(std::filesystem::is_regular_file(dir / name)) << name;
  }
  std::filesystem::remove_all(dir.parent_path());
}

}  // namespace
}  // namespace e4kv
