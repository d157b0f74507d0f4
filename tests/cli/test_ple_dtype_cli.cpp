// --ple-dtype through the built e4kv program (E4KV_CLI_PATH): a bad value is refused naming the
// flag; a Qwen4Exp model with PLE says where its n-gram table lives and what it takes; a model
// without PLE accepts fp8_e4m3 and says it has no table; `e4kv compare --ple-dtype fp8_e4m3`
// reports the table's relative L2 error, equal to a recomputation here from the checkpoint's BF16
// values (the nearest E4M3 code by brute force, ties to even).
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/half.h"
#include "io/checkpoint.h"
#include "testing/cli.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::read_text;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

fs::path write_model(const fs::path& dir, SynthFamily family, int64_t ple_layer) {
  SynthCheckpointOptions synth;
  synth.family = family;
  synth.n_layers = 4;
  synth.ple_layer = ple_layer;
  synth.with_kv_scales = true;
  EXPECT_TRUE(write_synth_checkpoint(dir, synth).ok());
  return dir;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CliPleDtype, BadValueIsRefusedNamingTheFlag) {
  TempDir tmp;
  const fs::path model = write_model(tmp.path() / "m", SynthFamily::kQwen4Exp, 1);
  for (const char* command : {"logits", "generate"}) {
    std::vector<std::string> args = {command, model.string(), "--ple-dtype", "fp8"};
    if (std::string(command) == "logits") {
      args.insert(args.end(), {"--ids", "1,2,3"});
    } else {
      args.insert(args.end(), {"--prompt-ids", "1,2,3", "--max-tokens", "1"});
    }
    const RunResult r = run_cli(tmp.path(), args);
    ASSERT_TRUE(r.exited);
    EXPECT_EQ(r.exit_code, 1) << command << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "e4kv: error: --ple-dtype: unknown value \"fp8\"")) << r.err;
    EXPECT_TRUE(contains(r.err, "expected auto")) << r.err;
  }
}

TEST(CliPleDtype, LoadLineSaysWhereTheTableLives) {
  TempDir tmp;
  const fs::path model = write_model(tmp.path() / "m", SynthFamily::kQwen4Exp, 1);
  Result<Checkpoint> ckpt = Checkpoint::open(model);
  ASSERT_TRUE(ckpt.ok());
  const SafetensorsTensor* table =
      ckpt->find("model.layers.1.ple.ple_embedding.ngram_embedding.weight");
  ASSERT_NE(table, nullptr);
  const int64_t rows = table->shape[0];
  const int64_t dim = table->shape[1];

  const RunResult e4m3 = run_cli(
      tmp.path(), {"logits", model.string(), "--ids", "1,2,3", "--ple-dtype", "fp8_e4m3"});
  ASSERT_EQ(e4m3.exit_code, 0) << e4m3.err;
  EXPECT_TRUE(contains(e4m3.err, cat("PLE n-gram tables: 1 layer, ", rows, " rows x ", dim,
                                     " values in host memory as fp8_e4m3 with an FP32 scale "
                                     "per row")))
      << e4m3.err;
  EXPECT_TRUE(contains(e4m3.err, cat("(", rows * dim + rows * 4, " bytes; the checkpoint's BF16")))
      << e4m3.err;
  const RunResult automatic = run_cli(tmp.path(), {"logits", model.string(), "--ids", "1,2,3"});
  ASSERT_EQ(automatic.exit_code, 0) << automatic.err;
  EXPECT_TRUE(contains(automatic.err, "read in place from the memory-mapped checkpoint (BF16"))
      << automatic.err;
  EXPECT_NE(e4m3.out, automatic.out);  // the table changed what the model computes

  // A dense model has no PLE: fp8_e4m3 is accepted and the run says so.
  const fs::path dense = write_model(tmp.path() / "dense", SynthFamily::kLlama, -1);
  const RunResult d = run_cli(
      tmp.path(), {"logits", dense.string(), "--ids", "1,2,3", "--ple-dtype", "fp8_e4m3"});
  ASSERT_EQ(d.exit_code, 0) << d.err;
  EXPECT_TRUE(contains(d.err, "--ple-dtype fp8_e4m3: this model has no PLE n-gram table")) << d.err;
}

// The value of an E4M3 code from the format's definition (finite codes).
double code_value(int code) {
  const int e = (code >> 3) & 15;
  const int m = code & 7;
  const double magnitude = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

// The nearest E4M3 value to q, ties to the even code.
double nearest_value(float q) {
  const int sign = std::signbit(q) ? 0x80 : 0;
  double best = 0.0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double v = code_value(sign | c);
    const double distance = std::fabs(double(q) - v);
    if (distance < best_distance || (distance == best_distance && (c & 1) == 0)) {
      best = v;
      best_distance = distance;
    }
  }
  return best;
}

TEST(CliPleDtype, CompareReportsTheTablesErrorOverEveryRow) {
  TempDir tmp;
  const fs::path model = write_model(tmp.path() / "m", SynthFamily::kQwen4Exp, 1);
  const fs::path prompts = tmp.path() / "prompts.jsonl";
  json ids = json::array();
  for (int i = 5; i < 40; ++i) ids.push_back(i);
  write_text(prompts, json{{"token_ids", ids}}.dump() + "\n");

  // The error recomputed from the checkpoint's values.
  Result<Checkpoint> ckpt = Checkpoint::open(model);
  ASSERT_TRUE(ckpt.ok());
  const SafetensorsTensor* table =
      ckpt->find("model.layers.1.ple.ple_embedding.ngram_embedding.weight");
  ASSERT_NE(table, nullptr);
  ASSERT_EQ(table->dtype, DType::kBF16);
  const int64_t rows = table->shape[0];
  const int64_t dim = table->shape[1];
  double sum_sq_error = 0.0, sum_sq_value = 0.0;
  std::vector<float> row(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0.0f;
    for (int64_t c = 0; c < dim; ++c) {
      uint16_t bits;
      std::memcpy(&bits, table->bytes.data() + size_t(r * dim + c) * 2, 2);
      row[size_t(c)] = bf16_to_f32(bits);
      amax = std::max(amax, std::fabs(row[size_t(c)]));
    }
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (float value : row) {
      const double decoded = float(nearest_value(value / scale)) * scale;  // fp32, as gathered
      sum_sq_error += (decoded - value) * (decoded - value);
      sum_sq_value += double(value) * value;
    }
  }
  const double want = std::sqrt(sum_sq_error / sum_sq_value);

  const fs::path out = tmp.path() / "compare";
  const RunResult r =
      run_cli(tmp.path(), {"compare", model.string(), "--prompts", prompts.string(), "--max-tokens",
                           "2", "--ple-dtype", "fp8_e4m3", "--out", out.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const json report = json::parse(read_text(out / "compare.json"));
  const json& ple = report["ple_tables"];
  ASSERT_TRUE(ple.is_object()) << report.dump(1);
  EXPECT_EQ(ple["dtype"], "fp8_e4m3");
  EXPECT_EQ(ple["rows_measured"], "all");
  EXPECT_EQ(ple["checkpoint_dtype"], "BF16");
  EXPECT_EQ(ple["rows"], rows);
  EXPECT_EQ(ple["values"], rows * dim);
  EXPECT_EQ(ple["host_bytes"], rows * dim + rows * 4);
  EXPECT_EQ(ple["checkpoint_bytes"], rows * dim * 2);
  EXPECT_NEAR(ple["rel_l2"].get<double>(), want, 1e-9 * want);
  ASSERT_EQ(ple["layers"].size(), 1u);
  EXPECT_EQ(ple["layers"][0]["layer"], 1);
  EXPECT_NEAR(ple["layers"][0]["rel_l2"].get<double>(), want, 1e-9 * want);
  EXPECT_TRUE(contains(r.out, "Every mode read the PLE n-gram tables as fp8_e4m3")) << r.out;

  // Without the flag there is nothing to report.
  const fs::path plain = tmp.path() / "plain";
  const RunResult p = run_cli(tmp.path(), {"compare", model.string(), "--prompts",
                                           prompts.string(), "--max-tokens", "0", "--out",
                                           plain.string()});
  ASSERT_EQ(p.exit_code, 0) << p.err;
  EXPECT_TRUE(json::parse(read_text(plain / "compare.json"))["ple_tables"].is_null());
}

}  // namespace
}  // namespace e4kv
