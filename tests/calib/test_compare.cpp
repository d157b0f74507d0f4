// compare's measures (calib/compare.h) on tiny hand-computed inputs, and its report files.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "calib/compare.h"
#include "core/file_io.h"
#include "testing/files.h"

namespace e4kv {
namespace {

TEST(CompareMeasures, OutputsPoolPerLayerAndOverAllLayers) {
  ModeCompare m;
  // Layer 3: ref (3, 4) vs test (3, 4) in one forward, then ref (0, 5) vs test (0, 4) in another:
  // pooled diff^2 = 1, ref^2 = 25 + 25 -> rel L2 = 1 / sqrt(50).
  m.add_output(3, true, std::vector<float>{3, 4}, std::vector<float>{3, 4});
  m.add_output(3, true, std::vector<float>{0, 4}, std::vector<float>{0, 5});
  // Layer 1: ref (1, 0) vs test (0, 1): diff^2 = 2, ref^2 = 1, cosine 0.
  m.add_output(1, false, std::vector<float>{0, 1}, std::vector<float>{1, 0});
  ASSERT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(m.layers[0].layer, 1);  // kept in layer order
  EXPECT_FALSE(m.layers[0].qsa);
  EXPECT_NEAR(m.layers[0].output.result().cosine, 0.0, 1e-12);
  EXPECT_NEAR(m.layers[1].output.result().rel_l2, 1.0 / std::sqrt(50.0), 1e-12);
  EXPECT_NEAR(m.layers[1].output.result().rmse, std::sqrt(1.0 / 4.0), 1e-12);
  // Everything pooled: diff^2 = 3, ref^2 = 51.
  EXPECT_NEAR(m.aggregate_output().rel_l2, std::sqrt(3.0 / 51.0), 1e-12);
}

TEST(CompareMeasures, SelectionOverlapUsesOnlyTheCountedTokensOfEachRow) {
  ModeCompare m;
  // width 3; row 0: ref {1, 2}, test {2, 1} (exact as sets; the third slot is ignored garbage);
  // row 1: ref {4, 5, 6}, test {4, 7}: |A∩B| 1, |A∪B| 4, recall 1/3.
  const std::vector<int32_t> ref = {1, 2, 99, 4, 5, 6};
  const std::vector<int32_t> test = {2, 1, 42, 4, 7, 0};
  m.add_selection(5, test, std::vector<int32_t>{2, 2}, ref, std::vector<int32_t>{2, 3}, 3);
  const LayerCompare& l = m.layers.at(0);
  EXPECT_TRUE(l.qsa);
  EXPECT_EQ(l.rows, 2);
  EXPECT_EQ(l.exact_rows, 1);
  EXPECT_DOUBLE_EQ(l.sum_recall, 1.0 + 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(l.min_recall, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(l.sum_jaccard, 1.0 + 0.25);
  EXPECT_EQ(l.sum_intersection, 3);
  EXPECT_EQ(l.sum_union, 6);
}

TEST(CompareMeasures, GreedyDivergenceAndPerplexity) {
  ModeCompare m;
  m.add_greedy(std::vector<int32_t>{1, 2, 3}, std::vector<int32_t>{1, 2, 3});
  m.add_greedy(std::vector<int32_t>{1, 5, 3}, std::vector<int32_t>{1, 2, 3});
  m.add_greedy(std::vector<int32_t>{1, 2}, std::vector<int32_t>{1, 2, 3});  // stopped earlier
  EXPECT_EQ(m.greedy_prompts, 3);
  EXPECT_EQ(m.greedy_identical, 1);
  EXPECT_EQ(m.first_divergence, (std::vector<int64_t>{-1, 1, 2}));
  m.sum_nll = 2.0 * std::log(4.0);
  m.nll_tokens = 2;
  EXPECT_NEAR(m.perplexity(), 4.0, 1e-12);
  m.add_passkey(1024, 50, true);
  m.add_passkey(1024, 50, false);
  m.add_passkey(1024, 100, true);
  ASSERT_EQ(m.passkey.size(), 2u);
  EXPECT_EQ(m.passkey[0].correct, 1);
  EXPECT_EQ(m.passkey[0].total, 2);
}

TEST(CompareMeasures, ReportFilesCarryTheMeasures) {
  CompareReport report;
  report.model = "tiny";
  report.device = "cpu";
  report.prompts = 1;
  report.reference.name = "fp16";
  report.reference.sum_nll = std::log(2.0);
  report.reference.nll_tokens = 1;
  ModeCompare m;
  m.name = "e4m3";
  m.scales = "calibrated";
  m.add_output(3, true, std::vector<float>{3, 4}, std::vector<float>{3, 5});
  m.prompts = 1;
  m.first_token_equal = 1;
  m.sum_kl = 0.004;
  m.kl_positions = 2;
  report.modes.push_back(m);
  const nlohmann::json j = nlohmann::json::parse(compare_json(report));
  EXPECT_EQ(j["format"], "e4kv-compare/1");
  EXPECT_NEAR(j["reference"]["perplexity"].get<double>(), 2.0, 1e-12);
  EXPECT_NEAR(j["modes"][0]["mean_kl"].get<double>(), 0.002, 1e-15);
  EXPECT_NEAR(j["modes"][0]["layers"][0]["rel_l2"].get<double>(), 1.0 / std::sqrt(34.0), 1e-12);
  const std::string md = compare_markdown(report);
  EXPECT_NE(md.find("| e4m3 | calibrated | "), std::string::npos) << md;
  const std::string svg = compare_svg(report);
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("layer 3 e4m3"), std::string::npos);
  testing_support::TempDir tmp;
  ASSERT_TRUE(write_compare_report(tmp.path() / "out", report).ok());
  for (const char* name : {"compare.json", "compare.md", "compare.svg"}) {
    EXPECT_TRUE(read_file(tmp.path() / "out" / name).ok()) << name;
  }
}

// A report over no prompts (a passkey-only run) has no perplexity, KL or attention error: the
// JSON says null and the table "-", never 0 or 1 as if something had been measured.
TEST(CompareMeasures, MeasuresOverNothingAreNotNumbers) {
  CompareReport report;
  report.model = "tiny";
  report.device = "cpu";
  report.reference.name = "fp16";
  ModeCompare m;
  m.name = "e4m3";
  m.scales = "calibrated";
  m.add_passkey(1024, 50, true);
  report.modes.push_back(m);
  EXPECT_TRUE(std::isnan(m.perplexity()));
  EXPECT_TRUE(std::isnan(m.mean_kl()));
  const nlohmann::json j = nlohmann::json::parse(compare_json(report));
  EXPECT_TRUE(j["reference"]["perplexity"].is_null()) << j.dump();
  EXPECT_TRUE(j["modes"][0]["perplexity"].is_null());
  EXPECT_TRUE(j["modes"][0]["mean_kl"].is_null());
  EXPECT_TRUE(j["modes"][0]["attention_output"]["rel_l2"].is_null());
  EXPECT_TRUE(j["modes"][0]["attention_output"]["cosine"].is_null());
  const std::string md = compare_markdown(report);
  EXPECT_NE(md.find("| fp16 | - | - | - | - | - | - | - |"), std::string::npos) << md;
  EXPECT_NE(md.find("| e4m3 | calibrated | - | - | 0/0 | 0/0 | - | - |"), std::string::npos) << md;
  EXPECT_EQ(md.find("nan"), std::string::npos) << md;
}

TEST(CompareMeasures, IsolatedOutputsAreReportedBesideTheWholeRun) {
  CompareReport report;
  report.model = "tiny";
  report.device = "cpu";
  report.isolated = true;
  report.reference.name = "fp16";
  ModeCompare m;
  m.name = "e4m3";
  m.scales = "calibrated";
  // Layer 3: whole run (3, 4) vs ref (3, 5): diff^2 1, ref^2 34; isolated (3, 5) vs (3, 5): 0.
  // Layer 7: whole run (0, 2) vs (1, 1); isolated (1, 2) vs (1, 1): diff^2 1, ref^2 2.
  m.add_output(3, true, std::vector<float>{3, 4}, std::vector<float>{3, 5});
  m.add_isolated_output(3, true, std::vector<float>{3, 5}, std::vector<float>{3, 5});
  m.add_output(7, true, std::vector<float>{0, 2}, std::vector<float>{1, 1});
  m.add_isolated_output(7, true, std::vector<float>{1, 2}, std::vector<float>{1, 1});
  report.modes.push_back(m);
  const nlohmann::json j = nlohmann::json::parse(compare_json(report));
  EXPECT_EQ(j["isolated"], true);
  const nlohmann::json& mode = j["modes"][0];
  EXPECT_NEAR(mode["layers"][0]["rel_l2"].get<double>(), 1.0 / std::sqrt(34.0), 1e-12);
  EXPECT_NEAR(mode["layers"][0]["isolated"]["rel_l2"].get<double>(), 0.0, 1e-12);
  EXPECT_NEAR(mode["layers"][1]["isolated"]["rel_l2"].get<double>(), std::sqrt(0.5), 1e-12);
  // Pooled over both layers: diff^2 1, ref^2 34 + 2.
  EXPECT_NEAR(mode["attention_output_isolated"]["rel_l2"].get<double>(), 1.0 / 6.0, 1e-12);
  const std::string md = compare_markdown(report);
  EXPECT_NE(md.find("(--isolated)"), std::string::npos) << md;
  EXPECT_NE(md.find("| e4m3 | 7 | qsa | 0.7071 |"), std::string::npos) << md;
  // Without an isolated pass the report says nothing of one.
  report.isolated = false;
  const nlohmann::json plain = nlohmann::json::parse(compare_json(report));
  EXPECT_EQ(plain["isolated"], false);
  EXPECT_FALSE(plain["modes"][0].contains("attention_output_isolated"));
  EXPECT_FALSE(plain["modes"][0]["layers"][0].contains("isolated"));
  EXPECT_EQ(compare_markdown(report).find("--isolated"), std::string::npos);
}

}  // namespace
}  // namespace e4kv
