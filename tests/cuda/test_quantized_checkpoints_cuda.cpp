// The quantized checkpoints of tests/data/quant (AWQ, NVFP4, FP8-block; Llama and Qwen4Exp with
// MoE experts) on the CUDA backend: every case loads (the backend runs every format), and its
// logits over a 12-token prompt match
//   - the same model's dequantized checkpoint on the CUDA backend (the script's FP16 weights,
//     cuBLAS and the FP16 expert GEMMs: an independent path), and
//   - the quantized checkpoint on the CPU backend (the oracle),
// to relative L2 <= 1e-2. The bound: activations are FP16 on CUDA (2^-11 per rounding, compounded
// over a few layers, ~1e-3 on these models, as tests/cuda/test_qwen4exp_cuda.cpp measures), the
// dequantized weights differ from the exact ones by their FP16 rounding (2^-11 relative); a wrong
// group, scale or expert moves the logits by far more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "cuda/require_gpu.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

const fs::path kQuantDir = fs::path(E4KV_SOURCE_DIR) / "tests" / "data" / "quant";

std::vector<std::string> case_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(kQuantDir, ec)) {
    if (fs::exists(entry.path() / "quantized" / "config.json")) {
      names.push_back(entry.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The logits of every prompt position (one forward) of the checkpoint in `dir` on `backend`.
std::vector<float> prompt_logits(const fs::path& dir, Backend& backend,
                                 const std::vector<int32_t>& ids) {
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.message();
  if (!ckpt.ok()) return {};
  ModelOptions options;
  options.kv_cache_dtype = KvCacheDtype::kF16;
  options.block_size = 16;
  options.n_blocks = 8;
  options.max_model_len = 96;
  Result<std::unique_ptr<Model>> model = load_model(*ckpt, backend, options);
  EXPECT_TRUE(model.ok()) << model.message();
  if (!model.ok()) return {};
  Model& m = **model;
  BlockAllocator allocator(m.n_blocks(), m.block_size());
  BlockTable table;
  allocator.append(table, int64_t(ids.size()));
  Result<ScopedSequence> seq = ScopedSequence::allocate(m);
  EXPECT_TRUE(seq.ok()) << seq.message();
  if (!seq.ok()) return {};
  std::vector<int32_t> seqs(ids.size(), 0), pos(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) pos[i] = int32_t(i);
  const int32_t slot = seq->slot();
  Result<std::vector<float>> logits =
      m.forward({ids, seqs, pos, {&table}, pos, std::span<const int32_t>(&slot, 1)});
  EXPECT_TRUE(logits.ok()) << logits.message();
  return logits.ok() ? *logits : std::vector<float>{};
}

TEST(QuantizedCheckpointCuda, LogitsMatchTheDequantizedCheckpointAndTheCpuBackend) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  const std::vector<int32_t> ids = {1, 17, 42, 7, 99, 3, 250, 64, 5, 128, 33, 2};
  const std::vector<std::string> names = case_names();
  ASSERT_GE(names.size(), 7u);
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const std::vector<float> quantized = prompt_logits(kQuantDir / name / "quantized", **gpu, ids);
    const std::vector<float> dequantized =
        prompt_logits(kQuantDir / name / "dequantized", **gpu, ids);
    const std::vector<float> on_cpu = prompt_logits(kQuantDir / name / "quantized", *cpu, ids);
    ASSERT_FALSE(quantized.empty());
    const test::CompareReport vs_dequantized = test::compare(quantized, dequantized, 0.0, 0.0);
    const test::CompareReport vs_cpu = test::compare(quantized, on_cpu, 0.0, 0.0);
    EXPECT_EQ(vs_dequantized.n_nan, 0);
    EXPECT_LE(vs_dequantized.rel_l2, 1e-2) << vs_dequantized.summary();
    EXPECT_LE(vs_cpu.rel_l2, 1e-2) << vs_cpu.summary();
    std::printf("[ %s ] cuda quantized vs cuda dequantized: rel L2 %.3g; vs cpu quantized: %.3g\n",
                name.c_str(), vs_dequantized.rel_l2, vs_cpu.rel_l2);
  }
}

}  // namespace
}  // namespace e4kv
