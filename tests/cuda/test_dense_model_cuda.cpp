// The dense model runtime on the CUDA backend against Hugging Face transformers: every checkpoint
// under tests/data/hf (scripts/hf_reference_models.py) loads with FP16 weights, its logits over the
// reference prompt match transformers' fp32 logits (relative L2 <= 1e-2), and the greedy
// continuation of 32 tokens with an FP16 cache is identical. Then the CUDA backend against the
// CPU backend (the oracle) on the same checkpoint with an E4M3 cache (unit scales): the same cache
// contract and gate on both, logits within FP16 rounding of each other.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"
#include "engine/generate.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "model/families/dense.h"
#include "testing/compare.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> hf_cases() {
  std::vector<fs::path> dirs;
  const fs::path root = fs::path(E4KV_SOURCE_DIR) / "tests" / "data" / "hf";
  if (!fs::is_directory(root)) return dirs;
  for (const auto& entry : fs::directory_iterator(root)) {
    if (fs::exists(entry.path() / "reference.json")) dirs.push_back(entry.path());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// Logits of `ids` as one prefill forward in a fresh sequence.
std::vector<float> prompt_logits(DenseModel& model, const std::vector<int32_t>& ids) {
  BlockAllocator allocator(model.n_blocks(), model.block_size());
  BlockTable table;
  allocator.append(table, int64_t(ids.size()));
  std::vector<int32_t> row_seq(ids.size(), 0);
  std::vector<int32_t> row_pos(ids.size());
  std::vector<int32_t> logit_rows(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) row_pos[i] = int32_t(i), logit_rows[i] = int32_t(i);
  ForwardBatch batch;
  batch.token_ids = ids;
  batch.row_seq = row_seq;
  batch.row_pos = row_pos;
  batch.seqs = {&table};
  batch.logit_rows = logit_rows;
  Result<std::vector<float>> logits = model.forward(batch);
  EXPECT_TRUE(logits.ok()) << logits.message();
  return logits.ok() ? *logits : std::vector<float>{};
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  return test::compare(got, ref, 0.0, 0.0).rel_l2;
}

ModelOptions small_cache(KvCacheDtype dtype, KvScalesMode mode) {
  ModelOptions options;
  options.kv_cache_dtype = dtype;
  options.kv_scales_mode = mode;
  options.block_size = 16;
  options.n_blocks = 16;
  options.max_model_len = 128;
  options.max_logit_rows = 128;  // the logits of every prompt row
  return options;
}

TEST(DenseModelCuda, MatchesTransformersLogitsAndGreedy) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<fs::path> cases = hf_cases();
  ASSERT_FALSE(cases.empty()) << "tests/data/hf is missing: run scripts/hf_reference_models.py "
                                 "on the GPU machine";
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  ASSERT_TRUE(backend.ok()) << backend.message();
  for (const fs::path& dir : cases) {
    SCOPED_TRACE(dir.filename().string());
    const nlohmann::json ref = read_json(dir / "reference.json");
    Result<Checkpoint> ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    Result<std::unique_ptr<DenseModel>> model = DenseModel::load(
        *ckpt, **backend, small_cache(KvCacheDtype::kF16, KvScalesMode::kCalibrated));
    ASSERT_TRUE(model.ok()) << model.message();

    const std::vector<int32_t> ids = ref["input_ids"].get<std::vector<int32_t>>();
    std::vector<float> expected;
    for (const auto& row : ref["logits"]) {
      for (const auto& x : row) expected.push_back(x.get<float>());
    }
    const std::vector<float> logits = prompt_logits(**model, ids);
    ASSERT_EQ(logits.size(), expected.size());
    const double err = rel_l2(logits, expected);
    EXPECT_LE(err, 1e-2);
    std::printf("[ info ] %s: logits relative L2 %.3g\n", dir.filename().c_str(), err);

    const std::vector<int32_t> prompt = ref["greedy"]["prompt_ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> want = ref["greedy"]["output_ids"].get<std::vector<int32_t>>();
    GenerateOptions options;
    options.max_tokens = int64_t(want.size());
    Result<GenerateResult> out = generate(**model, prompt, options);
    ASSERT_TRUE(out.ok()) << out.message();
    EXPECT_EQ(out->output_ids, want);
  }
}

TEST(DenseModelCuda, E4m3CacheAgreesWithCpuBackend) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<fs::path> cases = hf_cases();
  ASSERT_FALSE(cases.empty());
  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  for (const fs::path& dir : cases) {
    SCOPED_TRACE(dir.filename().string());
    const nlohmann::json ref = read_json(dir / "reference.json");
    Result<Checkpoint> ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    const ModelOptions options = small_cache(KvCacheDtype::kE4m3, KvScalesMode::kUnit);
    Result<std::unique_ptr<DenseModel>> on_gpu = DenseModel::load(*ckpt, **gpu, options);
    Result<std::unique_ptr<DenseModel>> on_cpu = DenseModel::load(*ckpt, *cpu, options);
    ASSERT_TRUE(on_gpu.ok()) << on_gpu.message();
    ASSERT_TRUE(on_cpu.ok()) << on_cpu.message();
    const std::vector<int32_t> ids = ref["input_ids"].get<std::vector<int32_t>>();
    const std::vector<float> a = prompt_logits(**on_gpu, ids);
    const std::vector<float> b = prompt_logits(**on_cpu, ids);
    ASSERT_EQ(a.size(), b.size());
    const double err = rel_l2(a, b);
    // FP16 activations against fp32 ones over the same E4M3 cache contents; an E4M3 code that
    // rounds differently from K/V that differ by FP16 rounding moves a value by one E4M3 step.
    EXPECT_LE(err, 3e-2);
    std::printf("[ info ] %s: E4M3 cache, CUDA vs CPU logits relative L2 %.3g\n",
                dir.filename().c_str(), err);
  }
}

// A BF16 weight beyond FP16's range cannot run on the FP16 backend: the load fails and names the
// tensor (the CPU backend, fp32, loads the same checkpoint).
TEST(DenseModelCuda, Bf16BeyondFp16RangeIsALoadError) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  SynthCheckpointOptions options;
  options.family = SynthFamily::kLlama;
  options.n_layers = 2;
  options.head_dim = 64;
  options.dtype = DType::kBF16;
  Result<SynthCheckpoint> synth = make_synth_checkpoint(options);
  ASSERT_TRUE(synth.ok()) << synth.message();
  const std::string bad = "model.layers.1.mlp.down_proj.weight";
  std::vector<SafetensorsWriteTensor> tensors;
  for (SynthTensor& t : synth->tensors) {
    if (t.name == bad) {
      const uint16_t big = 0x47C3;  // BF16 99840, beyond 65504
      t.data[6] = std::byte(big & 0xFF);
      t.data[7] = std::byte(big >> 8);
    }
    tensors.push_back({t.name, t.dtype, t.shape, std::span<const std::byte>(t.data)});
  }
  const fs::path dir = fs::temp_directory_path() / "e4kv_bf16_range_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream config(dir / "config.json");
    config << synth->config_json;
  }
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", tensors).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();

  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  const ModelOptions cache = small_cache(KvCacheDtype::kF16, KvScalesMode::kCalibrated);
  Result<std::unique_ptr<DenseModel>> on_gpu = DenseModel::load(*ckpt, **gpu, cache);
  ASSERT_FALSE(on_gpu.ok());
  EXPECT_NE(on_gpu.message().find(bad), std::string::npos) << on_gpu.message();
  EXPECT_NE(on_gpu.message().find("FP16 range"), std::string::npos) << on_gpu.message();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  EXPECT_TRUE(DenseModel::load(*ckpt, *cpu, cache).ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace e4kv
