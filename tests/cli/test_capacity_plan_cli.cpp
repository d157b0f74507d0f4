// `e4kv capacity --gpu-memory-gib` through the built program (E4KV_CLI_PATH) on a hand-made
// Qwen4Exp checkpoint (FP8-block DeltaNet, BF16 attention and experts, a PLE table): the plan's
// weights, PLE host bytes, KV pool and the concurrency at 128K / 256K tokens equal the figures
// computed here from the tensors' shapes and the layout's own block and sequence bytes; the flags'
// misuse is one error line naming the flag.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/status.h"
#include "io/safetensors.h"
#include "testing/cli.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

// Weights on the device: 2 * 512 (embeddings) + 4096 + 64 * 4 * 4 (FP8 DeltaNet and its block
// scales expanded to one row per output row) + 2 * 2048 (attention) + 2 * 8 * 1024 (experts).
constexpr int64_t kDeviceBytes = 1024 + (4096 + 1024) + 4096 + 16384;
constexpr int64_t kPleRows = 1000, kPleDim = 8;

fs::path write_model(const fs::path& dir) {
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kQwen4Exp;
  synth.n_layers = 4;
  synth.ple_layer = 1;
  Result<SynthCheckpoint> made = make_synth_checkpoint(synth);
  EXPECT_TRUE(made.ok()) << made.message();
  const std::vector<Tensor> tensors = {
      {"model.embed_tokens.weight", DType::kBF16, {32, 16}},
      {"model.layers.0.linear_attn.in_proj_qkvz.weight", DType::kF8E4M3, {64, 64}},
      {"model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv", DType::kF32, {1, 4}},
      {"model.layers.3.self_attn.q_proj.weight", DType::kBF16, {64, 32}},
      {"model.layers.0.mlp.experts.down_proj", DType::kBF16, {8, 32, 32}},
      {"model.layers.1.ple.ple_embedding.ngram_embedding.weight", DType::kBF16,
       {kPleRows, kPleDim}},
  };
  std::vector<std::vector<std::byte>> data;
  std::vector<SafetensorsWriteTensor> views;
  for (const Tensor& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    data.emplace_back(size_t(n) * dtype_size(t.dtype));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    views.push_back({tensors[i].name, tensors[i].dtype, tensors[i].shape, data[i]});
  }
  fs::create_directories(dir);
  write_text(dir / "config.json", made->config_json);
  EXPECT_TRUE(write_safetensors(dir / "model.safetensors", views).ok());
  return dir;
}

TEST(CapacityPlanCli, JsonFiguresFromTheHeadersAndTheLayout) {
  TempDir tmp;
  const fs::path model = write_model(tmp.path() / "m");
  const RunResult r = run_cli(tmp.path(), {"capacity", model.string(), "--gpu-memory-gib", "2",
                                           "--gpu-memory-utilization", "0.5", "--ple-dtype",
                                           "fp8_e4m3", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  const json& plan = j["memory_plan"];
  ASSERT_TRUE(plan.is_object()) << r.out;
  EXPECT_EQ(plan["quantization"], "none");
  EXPECT_EQ(plan["weights_device_bytes"], kDeviceBytes);
  EXPECT_EQ(plan["weights_device"]["deltanet"]["bytes"], 4096 + 64 * 4 * 4);
  EXPECT_EQ(plan["weights_device"]["moe_experts"]["bytes"], 8 * 32 * 32 * 2);
  EXPECT_EQ(plan["ple_rows"], kPleRows);
  EXPECT_EQ(plan["ple_checkpoint_bytes"], kPleRows * kPleDim * 2);
  EXPECT_EQ(plan["ple_host_bytes"], kPleRows * kPleDim + kPleRows * 4);
  const int64_t card = int64_t(2) << 30;
  EXPECT_EQ(plan["card_bytes"], card);
  EXPECT_EQ(plan["share_bytes"], card / 2);
  const int64_t pool = card / 2 - kDeviceBytes;
  EXPECT_EQ(plan["kv_pool_bytes"], pool);
  EXPECT_EQ(j["budget_bytes"], pool);  // no --budget-gib: the pool is the budget above
  const int64_t block = j["block_size"].get<int64_t>();
  const int64_t per_seq = j["bytes_per_seq"].get<int64_t>();
  ASSERT_EQ(plan["contexts"].size(), 2u);
  const int64_t contexts[] = {131072, 262144};
  for (size_t i = 0; i < 2; ++i) {
    const json& c = plan["contexts"][i];
    EXPECT_EQ(c["tokens"], contexts[i]);
    const int64_t blocks = (contexts[i] + block - 1) / block;
    for (const char* dtype : {"fp16", "e4m3"}) {
      const int64_t request = blocks * j[std::string("block_bytes_") + dtype].get<int64_t>() +
                              per_seq;
      EXPECT_NEAR(c[std::string("max_concurrency_") + dtype].get<double>(),
                  double(pool) / double(request), 1e-9 * double(pool) / double(request))
          << dtype << " " << contexts[i];
      EXPECT_EQ(c[std::string("max_requests_") + dtype], pool / request);
    }
  }

  // The text form carries the same plan.
  const RunResult text = run_cli(tmp.path(), {"capacity", model.string(), "--gpu-memory-gib", "2",
                                              "--gpu-memory-utilization", "0.5"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("memory plan (quantization: none)"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find(cat("KV pool ", pool, " bytes")), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("--ple-dtype auto: 16000 bytes"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("131072 tokens"), std::string::npos) << text.out;
  // Without --gpu-memory-gib there is no plan.
  const RunResult plain =
      run_cli(tmp.path(), {"capacity", model.string(), "--budget-gib", "1", "--json"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_TRUE(json::parse(plain.out)["memory_plan"].is_null());
}

TEST(CapacityPlanCli, MisuseIsOneErrorLineNamingTheFlag) {
  TempDir tmp;
  const fs::path model = write_model(tmp.path() / "m");
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{}, "give --budget-gib"},
      {{"--gpu-memory-gib", "0"}, "--gpu-memory-gib: expected a positive number"},
      {{"--gpu-memory-gib", "1", "--gpu-memory-utilization", "1.5"},
       "--gpu-memory-utilization: expected a fraction"},
      {{"--budget-gib", "1", "--gpu-memory-utilization", "0.5"}, "--gpu-memory-utilization: "},
      {{"--budget-gib", "1", "--ple-dtype", "fp8_e4m3"}, "--ple-dtype: "},
      {{"--gpu-memory-gib", "1", "--ple-dtype", "e4m3"}, "--ple-dtype: unknown value \"e4m3\""},
      // 1e-7 GiB (107 bytes) x 0.9 is less than the weights.
      {{"--gpu-memory-gib", "1e-7"}, "nothing is left for the KV cache"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"capacity", model.string()};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const RunResult r = run_cli(tmp.path(), args);
    EXPECT_EQ(r.exit_code, 1) << c.message << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_EQ(r.err.rfind("e4kv: error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace e4kv
