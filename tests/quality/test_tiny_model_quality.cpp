// The quality suite's short version on the embedded model (models/tiny-qwen4exp;
// docs/quality.md), through the built e4kv program: calibrate on the first documents of
// data/tiny/calibration.jsonl -> summarize (absmax) -> overlay -> compare FP16 KV, calibrated
// E4M3 KV and unit-scale E4M3 KV (the negative control) on the first evaluation documents of
// data/tiny/eval.jsonl and on passkey prompts, greedy. Fails when calibrated E4M3 misses a target:
// perplexity within 0.5% of FP16, mean next-token KL <= 0.002, passkey accuracy equal to FP16 in
// every cell, QSA attention-output cosine >= 0.999, selected-block FP16 recall >= 0.995 in every
// QSA layer, the first token identical on every prompt. The relative L2 target of 0.03 is missed
// (0.036-0.038 on this model; the seed's checkpoint: 0.0324): storing K and V as E4M3 alone costs
// 0.033 here, measured with transformers with no error carried between layers (docs/quality.md),
// so the test holds the measured level, 0.04, as a regression bound and docs/quality.md reports
// the miss. compare --isolated (every QSA layer of the E4M3 runs on the FP16 run's inputs) is
// checked against transformers' own Qwen4Exp classes doing the same on the same documents
// (kIsolatedReference), and against itself: the first QSA layer reads the same input either way.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/cli.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

constexpr int kCalibrationDocuments = 16;
constexpr int kEvalDocuments = 6;

// scripts/hf_kv_rounding_floor.py models/tiny-qwen4exp data/tiny OUT --calibration-docs 16
// --eval-docs 6 (transformers 5.17, torch 2.11, H200, 2026-12-03; its output is
// bench/notes/kv_rounding_floor_tiny_ci_subset_2026-12-03.json): the gated attention output's
// relative L2 with K and V in E4M3, each layer on FP16 inputs and the FP16 selection.
struct IsolatedReference {
  const char* mode;
  int layer;  // -1: both QSA layers pooled
  double rel_l2;
};
constexpr IsolatedReference kIsolatedReference[] = {
    {"e4m3", 3, 0.035058083390112474}, {"e4m3", 7, 0.03399591113953068},
    {"e4m3", -1, 0.03436078881649238}, {"unit", 3, 0.03368168132385451},
    {"unit", 7, 0.03433524895322154},  {"unit", -1, 0.03411440733801405}};

const fs::path kModel = fs::path(E4KV_SOURCE_DIR) / "models" / "tiny-qwen4exp";
const fs::path kData = fs::path(E4KV_SOURCE_DIR) / "data" / "tiny";

::testing::AssertionResult ran(const RunResult& r, const std::string& what) {
  if (r.exited && r.exit_code == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << " failed (exit " << r.exit_code << "): " << r.err
                                       << r.out;
}

// The first n lines of a JSON-lines file.
std::string first_lines(const fs::path& path, int n) {
  std::ifstream in(path);
  std::string line, out;
  for (int i = 0; i < n && std::getline(in, line); ++i) out += line + "\n";
  return out;
}

TEST(TinyModelQuality, CalibratedE4m3MeetsTheTargets) {
  ASSERT_TRUE(fs::is_directory(kModel)) << kModel << ": the embedded model is missing";
  TempDir tmp;
  const fs::path stats = tmp.path() / "stats";
  ASSERT_TRUE(ran(run_cli(tmp.path(), {"calibrate", kModel.string(), "--corpus",
                                 (kData / "calibration.jsonl").string(), "--out", stats.string(),
                                 "--max-documents", std::to_string(kCalibrationDocuments),
                                 "--no-progress"}),
                  "calibrate"));
  const fs::path scales = tmp.path() / "scales.json";
  ASSERT_TRUE(ran(run_cli(tmp.path(), {"summarize", stats.string(), "--policy", "absmax", "--out",
                                       scales.string(), "--report",
                                       (tmp.path() / "report").string()}),
                  "summarize"));
  const fs::path derived = tmp.path() / "derived";
  ASSERT_TRUE(ran(run_cli(tmp.path(), {"overlay", kModel.string(), "--scales", scales.string(),
                                       "--out", derived.string()}),
                  "overlay"));
  const fs::path prompts = tmp.path() / "eval.jsonl";
  write_text(prompts, first_lines(kData / "eval.jsonl", kEvalDocuments));
  const fs::path out = tmp.path() / "compare";
  const RunResult cmp = run_cli(
      tmp.path(), {"compare", derived.string(), "--prompts", prompts.string(), "--max-tokens", "8",
                   "--with-unit-control", "--task", "passkey", "--context", "1k", "--depths",
                   "0,50,100", "--isolated", "--out", out.string()});
  ASSERT_TRUE(ran(cmp, "compare"));
  std::printf("%s\n", cmp.out.c_str());
  const json report = json::parse(read_text(out / "compare.json"));
  const json& fp16 = report["reference"];
  const json* e4m3 = nullptr;
  for (const json& m : report["modes"]) {
    if (m["name"] == "e4m3") e4m3 = &m;
  }
  ASSERT_NE(e4m3, nullptr);
  const json& m = *e4m3;
  ASSERT_EQ(m["scales"], "calibrated");
  const double ppl_ratio = m["perplexity"].get<double>() / fp16["perplexity"].get<double>();
  EXPECT_LE(std::abs(ppl_ratio - 1.0), 0.005) << "perplexity " << m["perplexity"] << " vs FP16 "
                                              << fp16["perplexity"];
  EXPECT_LE(m["mean_kl"].get<double>(), 0.002);
  EXPECT_EQ(m["first_token_equal"], m["prompts"]);
  EXPECT_GE(m["attention_output"]["cosine"].get<double>(), 0.999);
  EXPECT_LE(m["attention_output"]["rel_l2"].get<double>(), 0.04);  // target 0.03: missed
  int qsa_layers = 0;
  for (const json& layer : m["layers"]) {
    if (layer["kind"] != "qsa") continue;
    ++qsa_layers;
    EXPECT_GE(layer["selection"]["mean_fp16_recall"].get<double>(), 0.995)
        << "layer " << layer["layer"];
  }
  EXPECT_EQ(qsa_layers, 2);
  // Retrieval: calibrated E4M3 equal to FP16 in every cell, and FP16 itself far above chance (the
  // model was trained for it; a 5-digit key is 1 in 90,000 by chance).
  ASSERT_EQ(m["passkey"].size(), fp16["passkey"].size());
  int fp16_correct = 0, cells = 0;
  for (size_t c = 0; c < fp16["passkey"].size(); ++c) {
    EXPECT_EQ(m["passkey"][c]["correct"], fp16["passkey"][c]["correct"])
        << "context " << fp16["passkey"][c]["context"] << " depth " << fp16["passkey"][c]["depth"];
    fp16_correct += fp16["passkey"][c]["correct"].get<int>();
    cells += fp16["passkey"][c]["total"].get<int>();
  }
  EXPECT_EQ(cells, 3);
  EXPECT_GE(fp16_correct, 2);

  // The isolated pass against transformers (within 1%: the two differ in summation order and
  // e4kv rounds Q and the gate to FP16; measured agreement 2e-4) and against the whole run.
  ASSERT_EQ(report["isolated"], true);
  int checked = 0;
  for (const json& mode : report["modes"]) {
    for (const IsolatedReference& want : kIsolatedReference) {
      if (mode["name"] != want.mode) continue;
      double got = -1.0;
      if (want.layer < 0) {
        got = mode["attention_output_isolated"]["rel_l2"].get<double>();
      } else {
        for (const json& layer : mode["layers"]) {
          if (layer["layer"] == want.layer) got = layer["isolated"]["rel_l2"].get<double>();
        }
      }
      EXPECT_NEAR(got, want.rel_l2, 0.01 * want.rel_l2) << want.mode << " layer " << want.layer;
      ++checked;
    }
    const json& first = mode["layers"][0];
    EXPECT_DOUBLE_EQ(first["isolated"]["rel_l2"].get<double>(), first["rel_l2"].get<double>())
        << mode["name"] << ": the first QSA layer reads the same input in both passes";
  }
  EXPECT_EQ(checked, 6);
}

}  // namespace
}  // namespace e4kv
