// The PLE n-gram table held as E4M3 (PleTable::to_e4m3, --ple-dtype fp8_e4m3): per row
// scale = amax / 448 (1 for a zero row), code = round to nearest even of fp32(value / scale) with
// saturation, decoded value = code's value * scale. Checked against a brute-force search over every
// E4M3 code with values computed here from the format's definition (not e4m3_decode), on a
// hand-made table of ties, subnormals and zeros, and on a synthetic checkpoint's whole table in
// F32, F16 and BF16; the error sums against a recomputation from the checkpoint's values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/half.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "model/model.h"
#include "testing/compare.h"
#include "io/safetensors.h"
#include "model/ple_ngram.h"
#include "testing/files.h"
#include "testing/model_runs.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::TempDir;
using testing_support::write_text;

constexpr const char* kMinimalConfig =
    R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 16})";
constexpr const char* kPrefix = "model.layers.0.ple.ple_embedding.";

// The value of an E4M3 code from the format's definition: 1 sign, 4 exponent bits (bias 7), 3
// mantissa bits, subnormals m * 2^-9. Finite codes only.
double code_value(int code) {
  const int e = (code >> 3) & 15;
  const int m = code & 7;
  const double magnitude = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

// The nearest finite E4M3 code to q (beyond 448 that is +-448), a tie going to the even code (its
// last mantissa bit 0); the sign of q picks the half of the codes (-0 for a tiny negative q).
int nearest_code(float q) {
  const int sign = std::signbit(q) ? 0x80 : 0;
  int best = -1;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double distance = std::fabs(double(q) - code_value(sign | c));
    if (distance < best_distance || (distance == best_distance && (c & 1) == 0)) {
      best = c;
      best_distance = distance;
    }
  }
  return sign | best;
}

// Opens a checkpoint of one F32 table [rows, dim] holding `values`.
struct HandTable {
  TempDir tmp;
  std::optional<Checkpoint> ckpt;
  std::optional<PleTable> table;

  void open(const std::vector<float>& values, int64_t rows, int64_t dim) {
    std::vector<std::byte> bytes(values.size() * 4);
    std::memcpy(bytes.data(), values.data(), bytes.size());
    write_text(tmp.path() / "config.json", kMinimalConfig);
    const std::vector<SafetensorsWriteTensor> tensors = {
        {std::string(kPrefix) + "ngram_embedding.weight", DType::kF32, {rows, dim}, bytes}};
    ASSERT_TRUE(write_safetensors(tmp.path() / "model.safetensors", tensors).ok());
    Result<Checkpoint> opened = Checkpoint::open(tmp.path());
    ASSERT_TRUE(opened.ok()) << opened.message();
    ckpt.emplace(std::move(opened).value());
    Result<PleTable> t = PleTable::open(*ckpt, kPrefix, rows, dim);
    ASSERT_TRUE(t.ok()) << t.message();
    table.emplace(std::move(t).value());
  }
};

// Every row of `table` (already E4M3) against `values` (the checkpoint's, as fp32): the scale, each
// code, each gathered value, and the error sums.
void expect_e4m3_table(const PleTable& table, const std::vector<float>& values) {
  const int64_t rows = table.n_rows();
  const int64_t dim = table.dim();
  ASSERT_TRUE(table.is_e4m3());
  ASSERT_EQ(table.e4m3_codes().size(), size_t(rows * dim));
  ASSERT_EQ(table.e4m3_scales().size(), size_t(rows));
  EXPECT_EQ(table.owned_bytes(), rows * dim + rows * 4);
  std::vector<int64_t> ids(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) ids[size_t(r)] = rows - 1 - r;  // any order
  std::vector<float> gathered(size_t(rows * dim));
  table.gather(ids.data(), rows, gathered.data());
  double sum_sq_error = 0.0, sum_sq_value = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0.0f;
    for (int64_t c = 0; c < dim; ++c) amax = std::max(amax, std::fabs(values[size_t(r * dim + c)]));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    ASSERT_EQ(table.e4m3_scales()[size_t(r)], scale) << "row " << r;
    for (int64_t c = 0; c < dim; ++c) {
      const float value = values[size_t(r * dim + c)];
      const int code = table.e4m3_codes()[size_t(r * dim + c)];
      ASSERT_EQ(code, nearest_code(value / scale))
          << "row " << r << " column " << c << " value " << value << " scale " << scale;
      // The fp32 product (what gather returns): the code's value times the scale, rounded once.
      const double decoded = float(code_value(code)) * scale;
      // Gathered row rows-1-r sits at position r of the output.
      ASSERT_EQ(double(gathered[size_t((rows - 1 - r) * dim + c)]), decoded)
          << "row " << r << " column " << c;
      sum_sq_error += (decoded - value) * (decoded - value);
      sum_sq_value += double(value) * value;
    }
  }
  const PleTableError error = table.e4m3_error();
  EXPECT_EQ(error.n_rows, rows);
  EXPECT_EQ(error.n_values, rows * dim);
  EXPECT_NEAR(error.sum_sq_error, sum_sq_error, 1e-12 * sum_sq_error + 1e-300);
  EXPECT_NEAR(error.sum_sq_value, sum_sq_value, 1e-12 * sum_sq_value);
  EXPECT_NEAR(error.rel_l2(), std::sqrt(sum_sq_error / sum_sq_value),
              1e-9 * std::sqrt(sum_sq_error / sum_sq_value));
}

TEST(PleE4m3, HandMadeTableTiesSubnormalsZerosAndSaturation) {
  const int64_t dim = 8;
  const float t10 = std::ldexp(1.0f, -10);
  const std::vector<float> values = {
      // amax 448: scale 1, so the quotients are the values. Ties between neighbouring codes go to
      // the even one: 1.0625 -> 1 (0x38), 1.1875 -> 1.25 (0x3A), 2^-10 (half the smallest
      // subnormal) -> 0, 3 * 2^-10 -> 2^-8 (code 2), -1.0625 -> -1; 440 -> 448 (nearer than 416).
      448.0f, 1.0625f, 1.1875f, t10, 3.0f * t10, -1.0625f, 440.0f, -448.0f,
      // A zero row: scale 1, every code 0.
      0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f,
      // amax 7.25 (negative values, a zero, a value far below the row's amax).
      0.3f, -0.017f, 1e-4f, 0.0f, -7.25f, 5.5f, -0.0f, 2.0f,
      // Tiny values: scale = 1e-30 / 448, exact relative precision all the same.
      1e-30f, -3e-31f, 7e-32f, 1e-33f, 0.0f, 5e-31f, -1e-30f, 2.5e-31f};
  HandTable hand;
  ASSERT_NO_FATAL_FAILURE(hand.open(values, int64_t(values.size()) / dim, dim));
  PleTable& table = *hand.table;
  ASSERT_FALSE(table.is_e4m3());
  EXPECT_EQ(table.owned_bytes(), 0);
  ASSERT_TRUE(table.to_e4m3(*hand.ckpt, kPrefix, nullptr).ok());
  ASSERT_NO_FATAL_FAILURE(expect_e4m3_table(table, values));
  // The ties, spelled out (the brute force above agrees with them).
  const std::span<const uint8_t> codes = table.e4m3_codes();
  EXPECT_EQ(codes[0], 0x7E);
  EXPECT_EQ(codes[1], 0x38);
  EXPECT_EQ(codes[2], 0x3A);
  EXPECT_EQ(codes[3], 0x00);
  EXPECT_EQ(codes[4], 0x02);
  EXPECT_EQ(codes[5], 0xB8);
  EXPECT_EQ(codes[6], 0x7E);
  EXPECT_EQ(codes[7], 0xFE);
  for (int64_t c = 0; c < dim; ++c) EXPECT_EQ(codes[size_t(dim + c)], 0);
  EXPECT_EQ(table.e4m3_scales()[1], 1.0f);
}

TEST(PleE4m3, NonFiniteValueIsRefusedNamingTheRow) {
  const std::vector<float> values = {1.0f, 2.0f, 3.0f, std::numeric_limits<float>::infinity()};
  HandTable hand;
  ASSERT_NO_FATAL_FAILURE(hand.open(values, 2, 2));
  const Status st = hand.table->to_e4m3(*hand.ckpt, kPrefix, nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("non-finite value in row 1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(hand.tmp.path().string()), std::string::npos) << st.message();
  EXPECT_FALSE(hand.table->is_e4m3());  // unchanged: still read in place
}

TEST(PleE4m3, SynthTableEveryRowEveryDtypeAndTheCacheSharesIt) {
  for (const DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(dtype_name(dtype));
    TempDir tmp;
    SynthCheckpointOptions synth;
    synth.family = SynthFamily::kQwen4Exp;
    synth.n_layers = 2;
    synth.ple_layer = 1;
    synth.dtype = dtype;
    synth.with_tokenizer = false;
    ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
    Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    const std::string prefix = "model.layers.1.ple.ple_embedding.";
    const SafetensorsTensor* tensor = ckpt->find(prefix + "ngram_embedding.weight");
    ASSERT_NE(tensor, nullptr);
    const int64_t rows = tensor->shape[0];
    const int64_t dim = tensor->shape[1];
    // The checkpoint's values, read from the tensor's bytes here.
    std::vector<float> values(size_t(rows * dim));
    for (size_t i = 0; i < values.size(); ++i) {
      if (dtype == DType::kF32) {
        std::memcpy(&values[i], tensor->bytes.data() + i * 4, 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, tensor->bytes.data() + i * 2, 2);
        values[i] = dtype == DType::kBF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
      }
    }
    Result<PleTable> table = PleTable::open(*ckpt, prefix, rows, dim);
    ASSERT_TRUE(table.ok()) << table.message();
    EXPECT_EQ(table->checkpoint_bytes(), rows * dim * int64_t(dtype_size(dtype)));
    PleE4m3Cache cache;
    ASSERT_TRUE(table->to_e4m3(*ckpt, prefix, &cache).ok());
    ASSERT_NO_FATAL_FAILURE(expect_e4m3_table(*table, values));
    EXPECT_GT(table->e4m3_error().rel_l2(), 0.0);
    // A second table of the same prefix takes the cached copy (the same bytes, not a new one).
    Result<PleTable> again = PleTable::open(*ckpt, prefix, rows, dim);
    ASSERT_TRUE(again.ok());
    ASSERT_TRUE(again->to_e4m3(*ckpt, prefix, &cache).ok());
    EXPECT_EQ(again->e4m3_codes().data(), table->e4m3_codes().data());
  }
}

Result<std::vector<float>> all_logits(Model& model, const std::vector<int32_t>& ids) {
  return testing_support::prompt_logits(model, ids);
}

// A Qwen4Exp model with PLE runs on the E4M3 table: the logits move (the table is read), by less
// than the table's own relative L2 error. Why that bound holds: the table rows enter the model
// only through the PLE block of one layer, whose key and value projections are linear in them and
// whose output is one additive term of the residual streams; the gathered embedding's error is
// the table's (every row is a row of it), and the rest of the network (normalised layers, the
// PLE term a fraction of the residual) does not amplify a perturbation of one additive term past
// its relative size. Measured on this checkpoint: see the figures printed below.
TEST(PleE4m3, Qwen4ExpLogitsCloseToTheCheckpointsTable) {
  TempDir tmp;
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kQwen4Exp;
  synth.n_layers = 4;
  synth.ple_layer = 1;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  auto backend = make_cpu_backend();
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < 80; ++i) ids.push_back((i * 37 + 11) % 200);
  std::vector<float> logits[2];
  PleTablesSummary tables[2];
  for (const PleDtype dtype : {PleDtype::kAuto, PleDtype::kE4m3}) {
    ModelOptions options;
    options.ple_dtype = dtype;
    options.block_size = 16;
    options.n_blocks = 8;
    options.max_model_len = 96;
    options.max_logit_rows = 96;
    Result<std::unique_ptr<Model>> model = load_model(*ckpt, *backend, options);
    ASSERT_TRUE(model.ok()) << model.message();
    Result<std::vector<float>> out = all_logits(**model, ids);
    ASSERT_TRUE(out.ok()) << out.message();
    const int i = dtype == PleDtype::kE4m3 ? 1 : 0;
    logits[i] = std::move(out).value();
    tables[i] = (*model)->ple_tables();
  }
  ASSERT_EQ(tables[0].layers.size(), 1u);
  ASSERT_EQ(tables[1].layers.size(), 1u);
  EXPECT_EQ(tables[0].layers[0].layer, 1);
  EXPECT_EQ(tables[0].host_bytes, 0);
  EXPECT_EQ(tables[0].error().n_values, 0);
  const int64_t rows = tables[1].layers[0].n_rows;
  EXPECT_EQ(tables[1].host_bytes, rows * tables[1].dim + rows * 4);
  EXPECT_EQ(tables[1].checkpoint_bytes, rows * tables[1].dim * 2);  // BF16
  const double table_error = tables[1].error().rel_l2();
  const double logits_error = test::compare(logits[1], logits[0], 0.0, 0.0).rel_l2;
  std::printf("PLE table rel L2 %.4g, logits rel L2 %.4g\n", table_error, logits_error);
  EXPECT_GT(table_error, 0.0);
  EXPECT_LT(table_error, 0.05);  // 3 mantissa bits: at most 2^-4 relative per normal value
  EXPECT_GT(logits_error, 0.0);
  EXPECT_LT(logits_error, table_error);
}

TEST(PleE4m3, ParseDtype) {
  Result<PleDtype> a = parse_ple_dtype("auto");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, PleDtype::kAuto);
  Result<PleDtype> f = parse_ple_dtype("fp8_e4m3");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, PleDtype::kE4m3);
  Result<PleDtype> bad = parse_ple_dtype("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().option(), "ple_dtype");
  EXPECT_NE(bad.message().find("expected auto"), std::string::npos) << bad.message();
  EXPECT_EQ(ple_dtype_name(PleDtype::kE4m3), "fp8_e4m3");
  EXPECT_EQ(ple_dtype_name(PleDtype::kAuto), "auto");
}

}  // namespace
}  // namespace e4kv
