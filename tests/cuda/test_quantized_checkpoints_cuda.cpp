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
#include "testing/model_runs.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

const fs::path& kQuantDir = testing_support::quant_data_dir();

// The logits of every prompt position (one forward) of the checkpoint in `dir` on `backend`.
std::vector<float> prompt_logits(const fs::path& dir, Backend& backend,
                                 const std::vector<int32_t>& ids) {
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.message();
  if (!ckpt.ok()) return {};
  Result<std::unique_ptr<Model>> model =
      load_model(*ckpt, backend, testing_support::small_model_options());
  EXPECT_TRUE(model.ok()) << model.message();
  if (!model.ok()) return {};
  Result<std::vector<float>> logits = testing_support::prompt_logits(**model, ids);
  EXPECT_TRUE(logits.ok()) << logits.message();
  return logits.ok() ? *logits : std::vector<float>{};
}

TEST(QuantizedCheckpointCuda, LogitsMatchTheDequantizedCheckpointAndTheCpuBackend) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  const std::vector<int32_t> ids = {1, 17, 42, 7, 99, 3, 250, 64, 5, 128, 33, 2};
  const std::vector<std::string> names = testing_support::quant_case_names();
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
