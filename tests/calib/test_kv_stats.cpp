// The calibration statistics collector (calib/kv_stats.h): bins against log2 computed
// independently, counts, merge algebra, the JSON lines format and its errors.
#include "calib/kv_stats.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/half.h"
#include "testing/files.h"

namespace e4kv {
namespace {

using json = nlohmann::json;

// floor(8 * log2|x|) - 8 * (-24), computed with the C library's log2 in long double. Exact powers
// of two are handled apart (log2 is exact there, but a one-ulp error would still flip the floor).
int reference_bin(double x) {
  x = std::fabs(x);
  int exponent = 0;
  const double mantissa = std::frexp(x, &exponent);  // x = mantissa * 2^exponent, [0.5, 1)
  if (mantissa == 0.5) return 8 * (exponent - 1) + 192;
  const long double eight_log2 = 8.0L * std::log2(static_cast<long double>(x));
  // Away from an edge by far more than the error of log2l: the floor is trustworthy.
  EXPECT_GT(std::fabs(eight_log2 - std::nearbyint(eight_log2)), 1e-12L) << x;
  return static_cast<int>(std::floor(eight_log2)) + 192;
}

TEST(KvStatsBins, EveryFp16PatternMatchesFloorOf8Log2) {
  KvTensorStats all;
  std::vector<int64_t> expected_hist(kKvHistBins, 0);
  int64_t finite_nonzero = 0;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint16_t h = uint16_t(bits);
    const float x = f16_to_f32(h);
    const uint16_t single[1] = {h};
    all.observe(single, 1);
    if (!std::isfinite(x) || x == 0.0f) continue;
    ++finite_nonzero;
    const int expected = reference_bin(x);
    ASSERT_GE(expected, 0);
    ASSERT_LT(expected, kKvHistBins);
    ASSERT_EQ(kv_hist_bin_f16(h), expected) << "bits 0x" << std::hex << bits << " x " << x;
    ASSERT_EQ(kv_hist_bin(x), expected) << x;
    ++expected_hist[size_t(expected)];
  }
  EXPECT_EQ(all.histogram(), expected_hist);
  EXPECT_EQ(all.nonzero(), finite_nonzero);
  EXPECT_EQ(all.count(), finite_nonzero + 2);  // +0 and -0
  EXPECT_EQ(all.zeros(), 2);
  EXPECT_EQ(all.non_finite(), 2 * 1024);  // exponent 31: inf and NaN, both signs
  EXPECT_EQ(all.underflow(), 0);
  EXPECT_EQ(all.overflow(), 0);
  EXPECT_EQ(all.absmax(), 65504.0f);
  // Smallest subnormal 2^-24 opens bin 0; 65504 (just below 2^16) is in the last bin.
  EXPECT_EQ(kv_hist_bin_f16(0x0001), 0);
  EXPECT_EQ(kv_hist_bin_f16(0x7BFF), kKvHistBins - 1);
  // Exact powers of two open their octave: 1.0 -> floor(8 * 0) = 0 -> bin 192.
  EXPECT_EQ(kv_hist_bin_f16(0x3C00), 192);
  EXPECT_EQ(kv_hist_bin_f16(0xBC00), 192);  // sign ignored
}

TEST(KvStatsBins, Fp32EdgesAndOutOfRange) {
  for (int b = 0; b < kKvHistBins; ++b) {
    const float lo = kv_hist_bin_min(b);
    const float hi = kv_hist_bin_max(b);
    ASSERT_LE(lo, hi);
    ASSERT_EQ(kv_hist_bin(lo), b);
    ASSERT_EQ(kv_hist_bin(hi), b);
    ASSERT_EQ(kv_hist_bin(-hi), b);
    ASSERT_EQ(reference_bin(lo), b);
    ASSERT_EQ(reference_bin(hi), b);
    const float below = std::nextafter(lo, 0.0f);
    const float above = std::nextafter(hi, 1e30f);
    ASSERT_EQ(kv_hist_bin(below), b == 0 ? kKvHistUnderflow : b - 1);
    ASSERT_EQ(kv_hist_bin(above), b == kKvHistBins - 1 ? kKvHistOverflow : b + 1);
    // The lower edge is 2^(-24 + b/8): lo is the first fp32 at or above it.
    const long double edge = std::exp2(static_cast<long double>(kv_hist_bin_lower_log2(b)));
    ASSERT_GE(static_cast<long double>(lo), edge);
    ASSERT_LT(static_cast<long double>(below), edge);
  }
  EXPECT_EQ(kv_hist_bin(std::ldexp(1.0f, -24)), 0);
  EXPECT_EQ(kv_hist_bin(std::nextafter(std::ldexp(1.0f, -24), 0.0f)), kKvHistUnderflow);
  EXPECT_EQ(kv_hist_bin(std::numeric_limits<float>::denorm_min()), kKvHistUnderflow);
  EXPECT_EQ(kv_hist_bin(65536.0f), kKvHistOverflow);
  EXPECT_EQ(kv_hist_bin(std::numeric_limits<float>::max()), kKvHistOverflow);
  EXPECT_EQ(kv_hist_bin(std::nextafter(65536.0f, 0.0f)), kKvHistBins - 1);
  // The sub-octave thresholds are the first mantissas at or above 2^(j/8).
  for (int j = 0; j < 8; ++j) {
    const long double edge_mantissa = (std::exp2(j / 8.0L) - 1.0L) * 8388608.0L;
    const uint32_t first = uint32_t(std::ceil(edge_mantissa));
    EXPECT_EQ(kv_hist_sub_bin(first), j);
    if (first > 0) {
      EXPECT_EQ(kv_hist_sub_bin(first - 1), j - 1);
    }
  }
}

TEST(KvStatsBins, RandomFp32AgreeWithLog2) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> log2_dist(-24.0, 16.0);
  for (int i = 0; i < 200000; ++i) {
    const float x = float(std::exp2(log2_dist(rng)));
    if (x < std::ldexp(1.0f, -24) || x >= 65536.0f) continue;
    ASSERT_EQ(kv_hist_bin(x), reference_bin(x)) << x;
  }
}

TEST(KvStatsCollector, Fp32CountsEveryKind) {
  const float inf = std::numeric_limits<float>::infinity();
  const float values[] = {0.0f,     -0.0f,  1.0f, -2.5f, 1e-30f,
                          70000.0f, -1e30f, inf,  -inf,  std::numeric_limits<float>::quiet_NaN(),
                          0.75f,    3.0f};
  KvTensorStats s;
  s.observe(values, int64_t(std::size(values)));
  EXPECT_EQ(s.count(), 9);  // all finite values
  EXPECT_EQ(s.zeros(), 2);
  EXPECT_EQ(s.nonzero(), 7);
  EXPECT_EQ(s.non_finite(), 3);
  EXPECT_EQ(s.underflow(), 1);
  EXPECT_EQ(s.overflow(), 2);
  EXPECT_EQ(s.absmax(), 1e30f);
  EXPECT_EQ(s.bin(192), 1);                  // 1.0
  EXPECT_EQ(s.bin(reference_bin(2.5)), 1);   // -2.5
  EXPECT_EQ(s.bin(reference_bin(0.75)), 1);  // 0.75
  EXPECT_EQ(s.bin(reference_bin(3.0)), 1);   // 3.0
  int64_t in_bins = 0;
  for (int64_t c : s.histogram()) in_bins += c;
  EXPECT_EQ(in_bins, 4);

  // FP16 and fp32 observations of the same values agree.
  std::vector<uint16_t> h;
  std::vector<float> f;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (int i = 0; i < 1001; ++i) {  // odd: exercises the unrolled loop's tail
    h.push_back(f32_to_f16(dist(rng)));
    f.push_back(f16_to_f32(h.back()));
  }
  KvTensorStats from_f16;
  KvTensorStats from_f32;
  from_f16.observe(h.data(), int64_t(h.size()));
  from_f32.observe(f.data(), int64_t(f.size()));
  EXPECT_EQ(from_f16, from_f32);
}

std::vector<uint16_t> random_fp16(uint32_t seed, size_t n, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_f16(i % 97 == 0 ? 0.0f : dist(rng));
  return out;
}

TEST(KvStatsCollector, MergeIsAssociativeCommutativeAndEqualsOneCollection) {
  const auto a = random_fp16(1, 5000, 0.1f);
  const auto b = random_fp16(2, 3001, 4.0f);
  const auto c = random_fp16(3, 777, 300.0f);
  KvTensorStats sa, sb, sc, whole;
  sa.observe(a.data(), int64_t(a.size()));
  sb.observe(b.data(), int64_t(b.size()));
  sc.observe(c.data(), int64_t(c.size()));
  whole.observe(a.data(), int64_t(a.size()));
  whole.observe(b.data(), int64_t(b.size()));
  whole.observe(c.data(), int64_t(c.size()));

  KvTensorStats ab_c = sa;
  ab_c.merge(sb);
  ab_c.merge(sc);
  KvTensorStats bc = sb;
  bc.merge(sc);
  KvTensorStats a_bc = sa;
  a_bc.merge(bc);
  KvTensorStats ba = sb;
  ba.merge(sa);
  KvTensorStats ab = sa;
  ab.merge(sb);
  EXPECT_EQ(ab_c, a_bc);
  EXPECT_EQ(ab_c, whole);
  EXPECT_EQ(ab, ba);
  EXPECT_EQ(whole.count(), int64_t(a.size() + b.size() + c.size()));
  EXPECT_NE(sa, whole);
  KvTensorStats empty;
  KvTensorStats with_empty = whole;
  with_empty.merge(empty);
  EXPECT_EQ(with_empty, whole);
}

KvStatsHeader test_header(std::optional<int64_t> shard = 0) {
  KvStatsHeader h;
  h.model = "tiny";
  h.prefix = "model.language_model";
  h.n_layers = 8;
  h.kv_layers = {3, 7};
  h.shard = shard;
  h.tokens = 128;
  h.source = "synthetic";
  return h;
}

KvStats filled_stats(uint32_t seed, std::optional<int64_t> shard = 0) {
  KvStats stats(test_header(shard));
  for (size_t i = 0; i < stats.size(); ++i) {
    const auto values = random_fp16(seed + uint32_t(i), 2000, 0.05f * float(i + 1));
    stats.at(i).observe(values.data(), int64_t(values.size()));
  }
  // Out-of-range and non-finite fp32 values in one tensor.
  const float odd[] = {1e-35f, 1e20f, std::numeric_limits<float>::quiet_NaN()};
  stats.find(7, KvTensor::kV)->observe(odd, 3);
  return stats;
}

TEST(KvStatsSet, LayoutAndKeys) {
  KvStats stats(test_header());
  ASSERT_EQ(stats.size(), 4u);
  EXPECT_EQ(stats.key_at(0), "model.language_model.layers.3.self_attn.k_scale");
  EXPECT_EQ(stats.key_at(3), "model.language_model.layers.7.self_attn.v_scale");
  EXPECT_EQ(stats.layer_at(2), 7);
  EXPECT_EQ(stats.kind_at(2), KvTensor::kK);
  EXPECT_EQ(stats.find(7, KvTensor::kV), &stats.at(3));
  EXPECT_EQ(stats.find(4, KvTensor::kK), nullptr);
}

TEST(KvStatsSet, MergeAddsTokensAndForgetsDifferingShard) {
  KvStats a = filled_stats(10, 0);
  KvStats b = filled_stats(20, 1);
  KvStats same_shard = filled_stats(30, 0);
  KvStats merged = a;
  ASSERT_TRUE(merged.merge(b).ok());
  EXPECT_EQ(merged.header().tokens, 256);
  EXPECT_FALSE(merged.header().shard.has_value());
  KvTensorStats expected = a.at(1);
  expected.merge(b.at(1));
  EXPECT_EQ(merged.at(1), expected);
  KvStats merged_same = a;
  ASSERT_TRUE(merged_same.merge(same_shard).ok());
  EXPECT_EQ(merged_same.header().shard, std::optional<int64_t>(0));

  KvStatsHeader other = test_header();
  other.kv_layers = {3};
  Status status = merged.merge(KvStats(other));
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("KV-cache layers [3, 7]"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("KV-cache layers [3]"), std::string::npos) << status.message();
}

TEST(KvStatsFile, JsonLinesRoundTrip) {
  for (std::optional<int64_t> shard : {std::optional<int64_t>(2), std::optional<int64_t>()}) {
    const KvStats stats = filled_stats(5, shard);
    const std::string text = kv_stats_to_jsonl(stats);
    Result<KvStats> back = parse_kv_stats(text, "mem.jsonl");
    ASSERT_TRUE(back.ok()) << back.message();
    EXPECT_EQ(back->header().model, "tiny");
    EXPECT_EQ(back->header().prefix, "model.language_model");
    EXPECT_EQ(back->header().n_layers, 8);
    EXPECT_EQ(back->header().kv_layers, (std::vector<int64_t>{3, 7}));
    EXPECT_EQ(back->header().shard, shard);
    EXPECT_EQ(back->header().tokens, 128);
    EXPECT_EQ(back->header().source, "synthetic");
    ASSERT_EQ(back->size(), stats.size());
    for (size_t i = 0; i < stats.size(); ++i) EXPECT_EQ(back->at(i), stats.at(i)) << i;
    EXPECT_EQ(kv_stats_to_jsonl(*back), text);
  }
  // Header line first, then one line per tensor.
  const std::string text = kv_stats_to_jsonl(filled_stats(5));
  const json header = json::parse(text.substr(0, text.find('\n')));
  EXPECT_EQ(header["format"], "e4kv-kv-stats/1");
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 5);

  // Through a file.
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / cat("e4kv_kv_stats_", ::getpid(), ".jsonl");
  const KvStats stats = filled_stats(9);
  ASSERT_TRUE(write_kv_stats(path, stats).ok());
  Result<KvStats> read = read_kv_stats(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(read.ok()) << read.message();
  EXPECT_EQ(read->at(3), stats.at(3));
  Result<KvStats> missing = read_kv_stats(path);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find(path.string()), std::string::npos);
}

// Valid text split into lines, for editing.
std::vector<json> valid_lines() {
  const std::string text = kv_stats_to_jsonl(filled_stats(11));
  std::vector<json> lines;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = text.find('\n', pos);
    lines.push_back(json::parse(text.substr(pos, end - pos)));
    pos = end + 1;
  }
  return lines;
}

std::string join(const std::vector<json>& lines) {
  std::string out;
  for (const json& line : lines) out += line.dump() + "\n";
  return out;
}

void expect_error(const std::string& text, const std::string& needle) {
  Result<KvStats> r = parse_kv_stats(text, "shard0.jsonl");
  ASSERT_FALSE(r.ok()) << "accepted; wanted an error with: " << needle;
  EXPECT_NE(r.message().find(needle), std::string::npos) << r.message();
  EXPECT_EQ(r.message().rfind("shard0.jsonl", 0), 0u) << r.message();
}

TEST(KvStatsFile, MalformedFilesNameFileAndLine) {
  using Edit = std::function<void(std::vector<json>&)>;
  auto edited = [](const Edit& edit) {
    std::vector<json> lines = valid_lines();
    edit(lines);
    return join(lines);
  };
  // Bad JSON on line 3.
  {
    std::string text = join(valid_lines());
    const size_t second_newline = text.find('\n', text.find('\n') + 1);
    text.insert(second_newline + 1, "{\"layer\": 3,, }\n");
    expect_error(text, "shard0.jsonl:3: invalid JSON");
  }
  expect_error("", "empty statistics file");
  expect_error(edited([](std::vector<json>& l) { l[0]["format"] = "e4kv-kv-stats/2"; }),
               "shard0.jsonl:1: unsupported format \"e4kv-kv-stats/2\"");
  expect_error(edited([](std::vector<json>& l) { l[0].erase("format"); }),
               "shard0.jsonl:1: missing \"format\"");
  expect_error(edited([](std::vector<json>& l) { l[0]["histogram"]["bins_per_octave"] = 4; }),
               "shard0.jsonl:1: \"histogram\" must be");
  expect_error(edited([](std::vector<json>& l) {
                 l[0]["kv_layers"] = json::array({3, 3});
               }),
               "kv_layers must increase");
  expect_error(edited([](std::vector<json>& l) {
                 l[0]["kv_layers"] = json::array({3, 9});
               }),
               "kv_layers[1] = 9 is not below n_layers = 8");
  expect_error(edited([](std::vector<json>& l) { l[0]["tokens"] = -5; }),
               "shard0.jsonl:1: \"tokens\" must not be negative");
  expect_error(edited([](std::vector<json>& l) { l[0]["source"] = "made up"; }),
               "\"source\" must be");
  // Mismatched layer counts: records missing, a layer the header does not list, one record too
  // many.
  expect_error(edited([](std::vector<json>& l) { l.pop_back(); }),
               "the file ends after 3 records; the header's 2 KV-cache layers need 4 (missing: "
               "layer 7 v)");
  expect_error(edited([](std::vector<json>& l) {
                 l[0]["kv_layers"] = json::array({3, 5, 7});
               }),
               "need 6 (missing: layer 5 k, layer 5 v)");
  expect_error(edited([](std::vector<json>& l) { l[2]["layer"] = 5; }),
               "shard0.jsonl:3: layer 5 is not one of the header's KV-cache layers [3, 7]");
  expect_error(edited([](std::vector<json>& l) { l.push_back(l[1]); }),
               "shard0.jsonl:6: more records");
  expect_error(edited([](std::vector<json>& l) { l[2] = l[1]; }),
               "shard0.jsonl:3: a second record for layer 3 k");
  // Counts.
  expect_error(edited([](std::vector<json>& l) { l[1]["count"] = -1; }),
               "shard0.jsonl:2: \"count\" must not be negative, got -1");
  expect_error(edited([](std::vector<json>& l) { l[2]["hist"][100] = -3; }),
               "shard0.jsonl:3: hist[100] must not be negative, got -3");
  expect_error(edited([](std::vector<json>& l) { l[1]["nonzero"] = 1.5; }),
               "\"nonzero\" must be a non-negative integer, got 1.5");
  expect_error(edited([](std::vector<json>& l) { l[1].erase("non_finite"); }),
               "shard0.jsonl:2: missing field \"non_finite\"");
  expect_error(edited([](std::vector<json>& l) { l[3]["hist"].erase(l[3]["hist"].size() - 1); }),
               "shard0.jsonl:4: \"hist\" has 319 bins; expected 320");
  expect_error(edited([](std::vector<json>& l) { l[3]["hist"] = "none"; }),
               "\"hist\" must be an array");
  expect_error(
      edited([](std::vector<json>& l) { l[1]["nonzero"] = l[1]["nonzero"].get<int64_t>() + 1; }),
      "but underflow + overflow + sum(hist)");
  expect_error(edited([](std::vector<json>& l) { l[1]["count"] = 0; }), "exceeds \"count\" = 0");
  expect_error(edited([](std::vector<json>& l) { l[1]["absmax"] = double(1e-3f); }),
               "does not lie in the highest non-empty histogram bin");
  expect_error(edited([](std::vector<json>& l) { l[1]["absmax"] = -1.0; }),
               "\"absmax\" must be a finite");
  expect_error(edited([](std::vector<json>& l) { l[1]["absmax"] = 0.1; }), "fp32 value");
  expect_error(edited([](std::vector<json>& l) { l[1]["tensor"] = "q"; }),
               "\"tensor\" must be \"k\" or \"v\"");
  expect_error(
      edited([](std::vector<json>& l) { l[1]["key"] = "model.layers.3.self_attn.k_scale"; }),
      "does not match layer 3 k under prefix \"model.language_model\"");
  // Blank lines are fine.
  Result<KvStats> with_blank = parse_kv_stats(join(valid_lines()) + "\n\n", "x");
  EXPECT_TRUE(with_blank.ok()) << with_blank.message();
}

// A calibrate shard's statistics count only beside a run file that records their size and SHA-256
// (the known digest of "abc", FIPS 180-2).
TEST(KvStatsFile, CalibrateRunFileMustVouchForTheStatistics) {
  testing_support::TempDir tmp;
  const std::filesystem::path stats = tmp.path() / "kv-stats-shard-1-of-2.jsonl";
  const std::filesystem::path run = tmp.path() / "calibrate-shard-1-of-2.json";
  EXPECT_EQ(calibrate_stats_name(1, 2), stats.filename().string());
  EXPECT_EQ(calibrate_run_name(1, 2), run.filename().string());
  const std::string abc_sha256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
  auto message = [&](std::string_view text) {
    return check_calibrate_run_file(stats, text).message();
  };
  EXPECT_NE(message("abc").find("its run file " + run.string() + " is missing"), std::string::npos)
      << message("abc");
  EXPECT_NE(message("abc").find("re-run that shard (e4kv calibrate --shard 1/2 --force"),
            std::string::npos);
  testing_support::write_text(
      run, json{{"statistics_bytes", 3}, {"statistics_sha256", abc_sha256}}.dump());
  EXPECT_TRUE(check_calibrate_run_file(stats, "abc").ok()) << message("abc");
  EXPECT_NE(message("abd").find("is not the statistics file its run file " + run.string() +
                                " records (3 bytes, SHA-256 ba7816bf8f01...)"),
            std::string::npos)
      << message("abd");
  EXPECT_NE(message("abcd").find("(4 bytes"), std::string::npos) << message("abcd");
  testing_support::write_text(run, json{{"statistics_bytes", 3}}.dump());
  EXPECT_NE(message("abc").find("records no \"statistics_bytes\" and \"statistics_sha256\""),
            std::string::npos)
      << message("abc");
  testing_support::write_text(run, "{oops");
  EXPECT_NE(message("abc").find(run.string() + ": invalid JSON"), std::string::npos);
  // Other names are not calibrate's set: synth-stats outputs, copies.
  EXPECT_TRUE(check_calibrate_run_file(tmp.path() / "stats.jsonl", "abc").ok());
  EXPECT_TRUE(check_calibrate_run_file(tmp.path() / "kv-stats-shard-x-of-2.jsonl", "abc").ok());
}

}  // namespace
}  // namespace e4kv
