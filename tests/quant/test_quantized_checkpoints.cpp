// e4kv on the quantized checkpoints of tests/data/quant (written by scripts/quantize_checkpoint.py
// the way AutoAWQ, llm-compressor and the FP8 releases lay them out) against the same models'
// dequantized checkpoints, which that script wrote independently of this runtime:
//   - every quantized weight, loaded and dequantized here (quant/dequantize.h), rounds to exactly
//     the FP16 value the script stored;
//   - the logits agree to relative L2 <= 1e-3 and greedy decoding gives the same tokens (the
//     dequantized checkpoint holds each weight rounded to FP16, this runtime uses the fp32 value:
//     a relative difference of at most 2^-11 per weight, which moves the logits far less).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/half.h"
#include "core/json.h"
#include "engine/generate.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/weights.h"
#include "quant/dequantize.h"
#include "testing/compare.h"
#include "testing/files.h"
#include "testing/model_runs.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

const fs::path& kQuantDir = testing_support::quant_data_dir();
using testing_support::quant_case_names;

// The modules of `ckpt` stored in a quantized format.
std::vector<std::string> quantized_modules(const Checkpoint& ckpt) {
  std::vector<std::string> modules;
  for (const std::string& name : ckpt.tensor_names()) {
    for (const char* suffix : {".qweight", ".weight_packed", ".weight_scale_inv"}) {
      if (name.ends_with(suffix)) modules.push_back(name.substr(0, name.size() - strlen(suffix)));
    }
  }
  return modules;
}

float element(const SafetensorsTensor& t, int64_t i) {
  uint16_t h;
  std::memcpy(&h, t.bytes.data() + i * 2, 2);
  return t.dtype == DType::kF16 ? f16_to_f32(h) : bf16_to_f32(h);
}

TEST(QuantizedCheckpoint, EveryWeightDequantizesToTheScriptsValue) {
  const std::vector<std::string> cases = quant_case_names();
  ASSERT_EQ(cases.size(), 7u) << kQuantDir << ": run scripts/make_quant_test_data.sh";
  auto backend = make_cpu_backend();
  for (const std::string& name : cases) {
    SCOPED_TRACE(name);
    Result<Checkpoint> q = Checkpoint::open(kQuantDir / name / "quantized");
    ASSERT_TRUE(q.ok()) << q.message();
    Result<Checkpoint> d = Checkpoint::open(kQuantDir / name / "dequantized");
    ASSERT_TRUE(d.ok()) << d.message();
    ASSERT_TRUE(q->config().quant.quantized());
    WeightLoader loader(*q, *backend, "test");
    const std::vector<std::string> modules = quantized_modules(*q);
    ASSERT_GT(modules.size(), 4u);
    int64_t checked = 0;
    for (const std::string& module : modules) {
      const SafetensorsTensor* want = d->find(module + ".weight");
      ASSERT_NE(want, nullptr) << module;
      ASSERT_EQ(want->dtype, DType::kF16) << module;
      const int64_t out = want->shape[0];
      const int64_t in = want->shape[1];
      Result<LinearWeight> w = loader.load_linear(module, out, in, "test");
      ASSERT_TRUE(w.ok()) << w.message();
      EXPECT_NE(w->format(), WeightFormat::kDense) << module;
      std::vector<float> got(size_t(out * in));
      dequantize_rows(w->view(), 0, out, got.data());
      int64_t bad = 0;
      for (int64_t i = 0; i < out * in; ++i) {
        if (f32_to_f16(got[size_t(i)]) != f32_to_f16(element(*want, i))) ++bad;
      }
      EXPECT_EQ(bad, 0) << module << ": " << bad << " of " << out * in << " elements differ";
      ++checked;
    }
    EXPECT_EQ(checked, int64_t(modules.size()));
  }
}

// Slices and regrouped rows of a quantized weight equal the same parts of the dequantized one.
TEST(QuantizedCheckpoint, SlicesAndRowBlocksAreThePartsOfTheWhole) {
  auto backend = make_cpu_backend();
  struct Case {
    const char* name;
    const char* module;
    int64_t col_begin, col_count;  // a column slice on whole groups
    int64_t bad_col_begin;         // one that cuts a group
  };
  const Case cases[] = {
      {"llama_awq_g64_sym", "model.layers.0.mlp.down_proj", 64, 64, 32},
      {"llama_awq_g128", "model.layers.0.mlp.down_proj", 0, 128, 64},
      {"llama_nvfp4", "model.layers.0.mlp.down_proj", 80, 48, 72},
      {"llama_fp8_block", "model.layers.0.self_attn.o_proj", 192, 64, 200},  // 256 = 5 x 48 + 16
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Result<Checkpoint> q = Checkpoint::open(kQuantDir / c.name / "quantized");
    ASSERT_TRUE(q.ok()) << q.message();
    Result<Checkpoint> d = Checkpoint::open(kQuantDir / c.name / "dequantized");
    ASSERT_TRUE(d.ok()) << d.message();
    const SafetensorsTensor* want = d->find(std::string(c.module) + ".weight");
    ASSERT_NE(want, nullptr);
    const int64_t out = want->shape[0];
    const int64_t in = want->shape[1];
    ASSERT_EQ(c.col_begin + c.col_count, in) << "the case should end at the last column";
    WeightLoader loader(*q, *backend, "test");
    auto check = [&](const LinearView& v, auto ref_row, auto ref_col) {
      std::vector<float> got(size_t(v.out * v.in));
      dequantize_rows(v, 0, v.out, got.data());
      int64_t bad = 0;
      for (int64_t r = 0; r < v.out; ++r) {
        for (int64_t k = 0; k < v.in; ++k) {
          const float ref = element(*want, ref_row(r) * in + ref_col(k));
          if (f32_to_f16(got[size_t(r * v.in + k)]) != f32_to_f16(ref)) ++bad;
        }
      }
      return bad;
    };
    // Output rows [8, 8 + 16).
    LinearSlice rows{LinearSlice::Dim::kRows, 8, 16};
    Result<LinearWeight> r = loader.load_linear(c.module, out, in, "test", rows);
    ASSERT_TRUE(r.ok()) << r.message();
    EXPECT_EQ(r->out(), 16);
    EXPECT_EQ(check(
                  r->view(), [](int64_t x) { return x + 8; }, [](int64_t k) { return k; }),
              0);
    // The same through a view of the whole weight.
    Result<LinearWeight> whole = loader.load_linear(c.module, out, in, "test");
    ASSERT_TRUE(whole.ok()) << whole.message();
    EXPECT_EQ(check(
                  whole->rows(8, 16), [](int64_t x) { return x + 8; }, [](int64_t k) { return k; }),
              0);
    // Input columns.
    LinearSlice cols{LinearSlice::Dim::kColumns, c.col_begin, c.col_count};
    Result<LinearWeight> cw = loader.load_linear(c.module, out, in, "test", cols);
    ASSERT_TRUE(cw.ok()) << cw.message();
    EXPECT_EQ(cw->in(), c.col_count);
    const int64_t c0 = c.col_begin;
    EXPECT_EQ(check(
                  cw->view(), [](int64_t x) { return x; }, [&](int64_t k) { return k + c0; }),
              0);
    LinearSlice bad{LinearSlice::Dim::kColumns, c.bad_col_begin, in - c.bad_col_begin};
    Result<LinearWeight> refused = loader.load_linear(c.module, out, in, "test", bad);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.message().find("groups of"), std::string::npos) << refused.message();
    // Row blocks of 8 rows in reverse order.
    std::vector<int64_t> order;
    for (int64_t b = out / 8 - 1; b >= 0; --b) order.push_back(b);
    Result<LinearWeight> rb = loader.load_linear_row_blocks(c.module, out, in, "test", 8, order);
    ASSERT_TRUE(rb.ok()) << rb.message();
    EXPECT_EQ(check(
                  rb->view(), [&](int64_t x) { return order[size_t(x / 8)] * 8 + x % 8; },
                  [](int64_t k) { return k; }),
              0);
  }
}

testing_support::PromptRun run_model(const fs::path& dir, const std::vector<int32_t>& ids,
                                     int64_t n_greedy) {
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.message();
  if (!ckpt.ok()) return {};
  auto backend = make_cpu_backend();
  Result<std::unique_ptr<Model>> model =
      load_model(*ckpt, *backend, testing_support::small_model_options());
  EXPECT_TRUE(model.ok()) << model.message();
  if (!model.ok()) return {};
  return testing_support::run_prompt(**model, ids, n_greedy);
}

TEST(QuantizedCheckpoint, LogitsAndGreedyMatchTheDequantizedCheckpoint) {
  const std::vector<int32_t> ids = {1, 17, 42, 7, 99, 3, 250, 64, 5, 128, 33, 2};
  for (const std::string& name : quant_case_names()) {
    SCOPED_TRACE(name);
    const testing_support::PromptRun q = run_model(kQuantDir / name / "quantized", ids, 16);
    const testing_support::PromptRun d = run_model(kQuantDir / name / "dequantized", ids, 16);
    ASSERT_FALSE(q.logits.empty());
    const double rel = test::compare(q.logits, d.logits, 0.0, 0.0).rel_l2;
    EXPECT_LE(rel, 1e-3);
    EXPECT_GT(rel, 0.0) << "the two runs should differ by the FP16 rounding of the weights";
    EXPECT_EQ(q.greedy, d.greedy);
    std::printf("[ %s ] logits relative L2 %.3g\n", name.c_str(), rel);
  }
}

// e4kv on each quantized checkpoint against transformers on its dequantized twin
// (CASE/reference.json, written by scripts/hf_reference_quant.py on the GPU machine's image):
// logits within 1e-3 relative L2 (the dequantized weights' FP16 rounding, ~5e-4 above, plus the
// CPU runtime's own 1e-4 against transformers), greedy tokens identical.
TEST(QuantizedCheckpoint, MatchesTransformersOnTheDequantizedCheckpoint) {
  int64_t checked = 0;
  for (const std::string& name : quant_case_names()) {
    const fs::path ref_path = kQuantDir / name / "reference.json";
    if (!fs::exists(ref_path)) continue;
    SCOPED_TRACE(name);
    Result<nlohmann::json> ref =
        parse_json(testing_support::read_text(ref_path), ref_path.string());
    ASSERT_TRUE(ref.ok()) << ref.message();
    const std::vector<int32_t> ids = (*ref)["input_ids"].get<std::vector<int32_t>>();
    const std::vector<std::vector<double>> rows =
        (*ref)["logits"].get<std::vector<std::vector<double>>>();
    std::vector<double> want;
    for (const auto& row : rows) want.insert(want.end(), row.begin(), row.end());
    const std::vector<int32_t> greedy = (*ref)["greedy"]["output_ids"].get<std::vector<int32_t>>();
    const testing_support::PromptRun got =
        run_model(kQuantDir / name / "quantized", ids, int64_t(greedy.size()));
    const double rel = test::compare(got.logits, want, 0.0, 0.0).rel_l2;
    EXPECT_LE(rel, 1e-3);
    EXPECT_EQ(got.greedy, greedy);
    std::printf("[ %s ] against transformers: logits relative L2 %.3g\n", name.c_str(), rel);
    ++checked;
  }
  if (checked == 0) {
    GTEST_SKIP() << "no tests/data/quant/*/reference.json yet: run scripts/hf_reference_quant.py "
                    "on the GPU machine (transformers 5.17) and commit its output";
  }
}

// Quantized tensors that config.json does not declare, and a declared method whose tensors are
// missing, are load errors naming the tensor.
// The error loading the checkpoint in `dir` on the CPU backend gives ("" if it loads).
std::string load_error(const fs::path& dir) {
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  if (!ckpt.ok()) return "Checkpoint::open: " + ckpt.message();
  auto backend = make_cpu_backend();
  ModelOptions options;
  options.n_blocks = 4;
  options.block_size = 16;
  Result<std::unique_ptr<Model>> model = load_model(*ckpt, *backend, options);
  return model.ok() ? std::string() : model.message();
}

TEST(QuantizedCheckpoint, TensorsAndConfigMustAgree) {
  testing_support::TempDir tmp;
  const fs::path src = kQuantDir / "llama_awq_g128" / "quantized";
  const fs::path dir = tmp.path() / "undeclared";
  fs::create_directories(dir);
  for (const auto& entry : fs::directory_iterator(src))
    fs::copy(entry.path(), dir / entry.path().filename());
  // The same config without its quantization_config.
  std::string config = testing_support::read_text(dir / "config.json");
  const size_t at = config.find("\"quantization_config\"");
  ASSERT_NE(at, std::string::npos);
  Result<nlohmann::json> parsed = parse_json(config, "config.json");
  ASSERT_TRUE(parsed.ok());
  parsed->erase("quantization_config");
  fs::remove(dir / "config.json");
  testing_support::write_text(dir / "config.json", parsed->dump());
  const std::string message = load_error(dir);
  EXPECT_NE(
      message.find(".qweight holds AWQ weights but config.json's quantization_config is none"),
      std::string::npos)
      << message;
}

// The routed experts of a layer are stacked into one weight as they load (module by module into
// one buffer): an expert stored in another format than expert 0 is refused, naming both.
TEST(QuantizedCheckpoint, ExpertsOfOneLayerMustShareAFormat) {
  testing_support::TempDir tmp;
  const fs::path src = kQuantDir / "qwen4exp_awq_g32" / "quantized";
  const fs::path dir = tmp.path() / "mixed";
  fs::create_directories(dir);
  for (const auto& entry : fs::directory_iterator(src)) {
    if (entry.path().filename() != "model.safetensors") {
      fs::copy(entry.path(), dir / entry.path().filename());
    }
  }
  Result<SafetensorsFile> file = SafetensorsFile::open(src / "model.safetensors");
  ASSERT_TRUE(file.ok()) << file.message();
  // Expert 1's gate_proj of layer 0 as a dense FP16 weight [out, in] instead of AWQ's three
  // tensors (qweight is [in, out / 8]); zeros will do, the load stops before any math.
  const std::string module = "model.layers.0.mlp.experts.1.gate_proj";
  const SafetensorsTensor* qweight = file->find(module + ".qweight");
  ASSERT_NE(qweight, nullptr);
  const int64_t in = qweight->shape[0];
  const int64_t out = qweight->shape[1] * 8;
  const std::vector<std::byte> dense(size_t(in * out) * 2, std::byte{0});
  std::vector<SafetensorsWriteTensor> tensors;
  for (const SafetensorsTensor& t : file->tensors()) {
    if (t.name.starts_with(module + ".")) continue;
    tensors.push_back({t.name, t.dtype, t.shape, t.bytes});
  }
  tensors.push_back({module + ".weight", DType::kF16, {out, in}, dense});
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", tensors).ok());
  const std::string message = load_error(dir);
  EXPECT_NE(message.find(module + " is stored as"), std::string::npos) << message;
  EXPECT_NE(message.find("must match"), std::string::npos) << message;
}

}  // namespace
}  // namespace e4kv
