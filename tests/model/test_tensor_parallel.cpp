// Tensor parallelism on the CPU backend, ranks as threads (model/tensor_parallel.h): TP 2 and 4
// against TP 1 of the same checkpoint. The only difference allowed is the order of the partial
// sums of the row-parallel projections (fp32 on the CPU; a few 1e-7 per projection, grown by the
// layers to at most ~1e-5 here, where a wrong share of a weight gives errors of order 1): logits
// within relative L2 1e-4, greedy tokens identical.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/generate.h"
#include "io/checkpoint.h"
#include "model/tensor_parallel.h"
#include "testing/compare.h"
#include "testing/files.h"
#include "testing/model_runs.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

ModelOptions options_for_test() { return testing_support::small_model_options(); }

Result<std::unique_ptr<Model>> load_tp(const Checkpoint& ckpt, int size) {
  if (size == 1) {
    static std::unique_ptr<Backend> backend;  // outlives the model of each call's test
    backend = make_cpu_backend({1});
    return load_model(ckpt, *backend, options_for_test());
  }
  std::vector<std::unique_ptr<Backend>> backends;
  for (int r = 0; r < size; ++r) backends.push_back(make_cpu_backend({1}));
  E4KV_ASSIGN_OR_RETURN(std::unique_ptr<TensorParallelModel> tp,
                        TensorParallelModel::load(ckpt, std::move(backends), options_for_test()));
  return std::unique_ptr<Model>(std::move(tp));
}

using Outputs = testing_support::PromptRun;

Outputs run(Model& m, const std::vector<int32_t>& ids) {
  return testing_support::run_prompt(m, ids, 12);
}

void expect_tp_equals_tp1(const fs::path& dir, const std::vector<int>& sizes) {
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  const std::vector<int32_t> ids = {1, 17, 42, 7, 99, 3, 250, 64, 5, 128};
  Result<std::unique_ptr<Model>> one = load_tp(*ckpt, 1);
  ASSERT_TRUE(one.ok()) << one.message();
  const Outputs want = run(**one, ids);
  ASSERT_FALSE(want.logits.empty());
  for (int size : sizes) {
    SCOPED_TRACE(cat("TP ", size));
    Result<std::unique_ptr<Model>> tp = load_tp(*ckpt, size);
    ASSERT_TRUE(tp.ok()) << tp.message();
    // Each rank's pool holds its share of the key/value heads (QSA's index rows are on every
    // rank), so a token takes less of each rank's memory.
    EXPECT_LT((*tp)->memory().bytes_per_token, (*one)->memory().bytes_per_token);
    const Outputs got = run(**tp, ids);
    const double rel = test::compare(got.logits, want.logits, 0.0, 0.0).rel_l2;
    EXPECT_LE(rel, 1e-4);
    EXPECT_EQ(got.greedy, want.greedy);
    std::printf("[ %s TP %d ] logits relative L2 against TP 1: %.3g\n",
                dir.filename().c_str(), size, rel);
  }
}

TEST(TensorParallel, DenseFamiliesEqualTp1) {
  testing_support::TempDir tmp;
  for (SynthFamily family : {SynthFamily::kLlama, SynthFamily::kQwen2, SynthFamily::kQwen3}) {
    SynthCheckpointOptions o;
    o.family = family;
    o.n_layers = 2;
    o.hidden_size = 64;
    o.intermediate_size = 128;
    o.n_heads = 4;
    o.n_kv_heads = 2;  // TP 4: one key/value head per rank, each shared by two ranks
    o.head_dim = 16;
    o.seed = 7;
    const fs::path dir = tmp.path() / std::string(synth_family_name(family));
    ASSERT_TRUE(write_synth_checkpoint(dir, o).ok());
    SCOPED_TRACE(synth_family_name(family));
    expect_tp_equals_tp1(dir, {2, 4});
  }
}

TEST(TensorParallel, Qwen4ExpEqualsTp1) {
  // QSA and GatedDeltaNet heads split, experts spread over the ranks, hyper-connections and PLE
  // on every rank.
  testing_support::TempDir tmp;
  SynthCheckpointOptions o;
  o.family = SynthFamily::kQwen4Exp;
  o.n_layers = 4;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.linear_key_heads = 4;
  o.linear_value_heads = 8;
  o.n_experts = 8;
  o.experts_top_k = 3;
  o.ple_layer = 1;
  o.seed = 11;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path() / "q", o).ok());
  expect_tp_equals_tp1(tmp.path() / "q", {2, 4});
}

TEST(TensorParallel, QuantizedCheckpointEqualsTp1) {
  // NVFP4 groups of 16 columns: o_proj's 64 input columns split into 32 or 16 per rank.
  expect_tp_equals_tp1(fs::path(E4KV_SOURCE_DIR) / "tests/data/quant/llama_nvfp4/quantized",
                       {2, 4});
  expect_tp_equals_tp1(fs::path(E4KV_SOURCE_DIR) / "tests/data/quant/qwen4exp_nvfp4/quantized",
                       {2});
}

TEST(TensorParallel, SizesThatDoNotSplitTheHeadsAreRefusedNamingTheRank) {
  testing_support::TempDir tmp;
  SynthCheckpointOptions o;
  o.n_layers = 1;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path() / "m", o).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path() / "m");
  ASSERT_TRUE(ckpt.ok());
  Result<std::unique_ptr<Model>> three = load_tp(*ckpt, 3);
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.message().find("tensor parallel rank 0 of 3"), std::string::npos)
      << three.message();
  EXPECT_NE(three.message().find("does not split 4 attention heads"), std::string::npos)
      << three.message();
}

TEST(TensorParallel, TheScaleGateRunsOnEveryRankAndAFailureNamesTheRank) {
  testing_support::TempDir tmp;
  SynthCheckpointOptions o;
  o.n_layers = 2;
  o.with_kv_scales = true;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path() / "scaled", o).ok());
  o.with_kv_scales = false;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path() / "bare", o).ok());
  auto load_e4m3 = [](const fs::path& dir) -> Result<std::unique_ptr<TensorParallelModel>> {
    E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(dir));
    static std::vector<std::unique_ptr<Checkpoint>> keep;  // the models read the mapping
    keep.push_back(std::make_unique<Checkpoint>(std::move(ckpt)));
    std::vector<std::unique_ptr<Backend>> backends;
    for (int r = 0; r < 2; ++r) backends.push_back(make_cpu_backend({1}));
    ModelOptions options = options_for_test();
    options.kv_cache_dtype = KvCacheDtype::kE4m3;
    return TensorParallelModel::load(*keep.back(), std::move(backends), options);
  };
  Result<std::unique_ptr<TensorParallelModel>> scaled = load_e4m3(tmp.path() / "scaled");
  ASSERT_TRUE(scaled.ok()) << scaled.message();
  // Every rank passed its own gate with the same per-layer scales.
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ((*scaled)->rank(r).kv_scales().summary, (*scaled)->rank(0).kv_scales().summary);
  }
  Result<std::unique_ptr<TensorParallelModel>> bare = load_e4m3(tmp.path() / "bare");
  ASSERT_FALSE(bare.ok());
  EXPECT_NE(bare.message().find("tensor parallel rank 0 of 2"), std::string::npos)
      << bare.message();
  EXPECT_NE(bare.message().find("k_scale"), std::string::npos) << bare.message();
}

TEST(TensorParallel, CommunicatorSumsInRankOrderAndAbortsWaiters) {
  auto backend = make_cpu_backend({1});
  ThreadCommunicator comm(3);
  std::vector<std::vector<float>> data = {{1.0f, 1e8f}, {2.0f, 1.0f}, {4.0f, -1e8f}};
  std::vector<Status> status(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] { status[size_t(r)] = comm.all_reduce_sum(r, *backend, data[size_t(r)].data(), 2); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(status[size_t(r)].ok()) << status[size_t(r)].message();
    EXPECT_EQ(data[size_t(r)][0], 7.0f);
    // (1e8 + 1) - 1e8 in fp32 is 0: the rank order, the same on every rank.
    EXPECT_EQ(data[size_t(r)][1], (1e8f + 1.0f) + -1e8f);
  }
  // A rank that never arrives: the others wait until abort().
  ThreadCommunicator two(2);
  std::vector<float> x = {1.0f};
  Status waited;
  std::thread waiter([&] { waited = two.all_reduce_sum(0, *backend, x.data(), 1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  two.abort();
  waiter.join();
  ASSERT_FALSE(waited.ok());
  EXPECT_NE(waited.message().find("another rank failed"), std::string::npos);
  EXPECT_EQ(x[0], 1.0f);
}

}  // namespace
}  // namespace e4kv
