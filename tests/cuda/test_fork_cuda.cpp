// Forking sequences on the CUDA backend (n > 1 completions of one prompt): the block-copy op
// against the CPU backend's (the oracle) on the same random bytes, with copies that depend on each
// other and more pairs than one launch takes; the launch plan on the host; the Qwen4Exp state
// copy (a forked slot continues exactly as its parent on the same backend, and as the CPU backend
// computes the same continuation, within FP16 rounding); and the engine's seeded completions equal
// to requests seeded alone on the same backend.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/block_copy.cuh"
#include "backend/cuda/cuda_backend.h"
#include "engine/engine.h"
#include "io/checkpoint.h"
#include "require_gpu.h"
#include "testing/compare.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

using testing_support::TempDir;

TEST(BlockCopyPlan, LaunchesSplitAtDependenciesAndAtTheParameterLimit) {
  const std::vector<BlockCopy> copies{{2, 5}, {3, 6}, {5, 0}, {7, 1}, {1, 8}, {9, 4}, {10, 4}};
  // {5, 0} reads the 5 that {2, 5} writes; {1, 8} reads the 1 that {7, 1} writes; {10, 4} writes
  // the 4 that {9, 4} writes.
  using Ranges = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(cuda::plan_block_copy_launches(copies), (Ranges{{0, 2}, {2, 4}, {4, 6}, {6, 7}}));
  // A launch that writes a block an earlier pair of it reads: {0, 3} then {4, 0}.
  const std::vector<BlockCopy> war{{0, 3}, {4, 0}};
  EXPECT_EQ(cuda::plan_block_copy_launches(war), (Ranges{{0, 1}, {1, 2}}));
  std::vector<BlockCopy> many;
  for (int32_t i = 0; i < 150; ++i) many.push_back({i, 1000 + i});
  EXPECT_EQ(cuda::plan_block_copy_launches(many), (Ranges{{0, 64}, {64, 128}, {128, 150}}));
  EXPECT_TRUE(cuda::plan_block_copy_launches({}).empty());
}

TEST(BlockCopyCuda, EqualsTheCpuBackend) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  std::unique_ptr<Backend> cpu = make_cpu_backend({1});
  std::mt19937_64 rng{11};
  // 1 and 6 bytes: byte copies; 4100: 4-byte units; 64 and 256 KiB: 16-byte units.
  for (const size_t block_bytes :
       {size_t(1), size_t(6), size_t(64), size_t(4100), size_t(256) << 10}) {
    SCOPED_TRACE(block_bytes);
    const int64_t n_blocks = 200;
    std::vector<unsigned char> host(size_t(n_blocks) * block_bytes);
    for (unsigned char& b : host) b = static_cast<unsigned char>(rng());
    // Dependent pairs first, then 130 independent ones (three launches).
    std::vector<BlockCopy> copies{{2, 5}, {5, 0}, {7, 2}, {1, 0}, {8, 3}};
    for (int32_t i = 0; i < 130; ++i) copies.push_back({10 + i, 199 - (i % 50)});
    Result<BackendBuffer> on_gpu = (*gpu)->allocate(host.size());
    Result<BackendBuffer> on_cpu = cpu->allocate(host.size());
    ASSERT_TRUE(on_gpu.ok() && on_cpu.ok());
    (*gpu)->copy_from_host(on_gpu->data(), host.data(), host.size());
    cpu->copy_from_host(on_cpu->data(), host.data(), host.size());
    ASSERT_TRUE((*gpu)->copy_blocks(on_gpu->data(), n_blocks, block_bytes, copies).ok());
    ASSERT_TRUE(cpu->copy_blocks(on_cpu->data(), n_blocks, block_bytes, copies).ok());
    std::vector<unsigned char> got(host.size()), want(host.size());
    (*gpu)->copy_to_host(got.data(), on_gpu->data(), got.size());
    cpu->copy_to_host(want.data(), on_cpu->data(), want.size());
    EXPECT_TRUE(got == want);
    EXPECT_FALSE(got == host);  // something was copied
  }
  // Refusals, as on the CPU.
  Result<BackendBuffer> small = (*gpu)->allocate(64);
  ASSERT_TRUE(small.ok());
  const BlockCopy bad[1] = {{0, 4}};
  EXPECT_FALSE((*gpu)->copy_blocks(small->data(), 4, 16, bad).ok());
}

class Qwen4ExpForkCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    SynthCheckpointOptions options;
    options.family = SynthFamily::kQwen4Exp;
    options.n_layers = 4;
    options.head_dim = 64;  // the CUDA attention kernels' smallest head
    options.index_budget = 8;  // the selection reads the compressed rows and the ring
    options.ple_layer = 1;
    ASSERT_TRUE(write_synth_checkpoint(tmp_.path(), options).ok());
    Result<Checkpoint> ckpt = Checkpoint::open(tmp_.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    ckpt_ = std::make_unique<Checkpoint>(std::move(ckpt).value());
  }

  std::unique_ptr<Model> load(Backend& backend) {
    ModelOptions options;
    options.block_size = 16;
    options.n_blocks = 16;
    options.max_model_len = 128;
    options.max_seqs = 4;
    options.max_batch_tokens = 64;
    Result<std::unique_ptr<Model>> model = load_model(*ckpt_, backend, options);
    EXPECT_TRUE(model.ok()) << model.message();
    return model.ok() ? std::move(model).value() : nullptr;
  }

  // One forward of tokens [start, start + n) of `tokens` in `slot` over `table` (which already
  // holds them: n_tokens = start + n); the logits of its last row.
  static std::vector<float> run(Model& model, const BlockTable& table, int32_t slot,
                                const std::vector<int32_t>& tokens, int64_t start, int64_t n) {
    std::vector<int32_t> ids(tokens.begin() + start, tokens.begin() + start + n);
    std::vector<int32_t> seq(static_cast<size_t>(n), 0), pos(static_cast<size_t>(n));
    for (int64_t r = 0; r < n; ++r) pos[size_t(r)] = int32_t(start + r);
    const int32_t last = int32_t(n - 1);
    Result<std::vector<float>> logits = model.forward({ids,
                                                       seq,
                                                       pos,
                                                       {&table},
                                                       std::span<const int32_t>(&last, 1),
                                                       std::span<const int32_t>(&slot, 1)});
    EXPECT_TRUE(logits.ok()) << logits.message();
    return logits.ok() ? *logits : std::vector<float>{};
  }

  // A prompt of 21 tokens in slot 0 (its second block partly filled); slot 1, after another
  // sequence ran in it, becomes a copy of slot 0, with a fork of its block table whose shared last
  // block is copied before the fork writes position 21. Returns the logits of token 21 in the
  // fork, then in the parent (which writes it into the original block).
  std::pair<std::vector<float>, std::vector<float>> fork_and_continue(Model& model) {
    std::mt19937_64 rng{31};
    std::vector<int32_t> tokens, other;
    for (int t = 0; t < 22; ++t) tokens.push_back(int32_t(3 + rng() % 250));
    for (int t = 0; t < 9; ++t) other.push_back(int32_t(3 + rng() % 250));
    BlockAllocator allocator(model.n_blocks(), model.block_size());
    BlockTable parent, scratch;
    EXPECT_TRUE(model.begin_sequence(0).ok());
    EXPECT_TRUE(model.begin_sequence(1).ok());
    allocator.append(parent, 21);
    run(model, parent, 0, tokens, 0, 21);
    allocator.append(scratch, 9);
    run(model, scratch, 1, other, 0, 9);  // state in slot 1 that the copy must replace
    EXPECT_TRUE(model.copy_sequence_state(0, 1).ok());
    BlockTable child = allocator.fork(parent);
    const std::vector<BlockCopy> cow = allocator.append(child, 1);
    EXPECT_EQ(cow.size(), 1u);
    EXPECT_TRUE(model.copy_blocks(cow).ok());
    const std::vector<float> forked = run(model, child, 1, tokens, 21, 1);
    EXPECT_TRUE(allocator.append(parent, 1).empty());  // the parent holds the original alone now
    const std::vector<float> original = run(model, parent, 0, tokens, 21, 1);
    EXPECT_TRUE(model.free_sequence(0).ok());
    EXPECT_TRUE(model.free_sequence(1).ok());
    return {forked, original};
  }

  TempDir tmp_;
  std::unique_ptr<Checkpoint> ckpt_;
};

TEST_F(Qwen4ExpForkCuda, AForkedSlotContinuesAsItsParentAndAsTheCpu) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  std::unique_ptr<Backend> cpu = make_cpu_backend({2});
  auto on_gpu = load(**gpu);
  auto on_cpu = load(*cpu);
  ASSERT_TRUE(on_gpu && on_cpu);
  const auto [gpu_fork, gpu_parent] = fork_and_continue(*on_gpu);
  const auto [cpu_fork, cpu_parent] = fork_and_continue(*on_cpu);
  // The same rows on the same backend: the same numbers (the CPU's bits; on the GPU a bound far
  // below what a missing state or block copy moves, in case an op's reduction order varies).
  EXPECT_EQ(cpu_fork, cpu_parent);
  const test::CompareReport same = test::compare(gpu_fork, gpu_parent, 0.0, 0.0);
  EXPECT_LE(same.rel_l2, 1e-5) << same.summary();
  // FP16 activations against fp32: the bound of the model's other CUDA-vs-CPU tests.
  const test::CompareReport report = test::compare(gpu_fork, cpu_fork, 0.0, 0.0);
  EXPECT_LE(report.rel_l2, 1e-2) << report.summary();
}

// The engine on the GPU: completion i of a seeded n = 3 request is the request seeded with
// seed + i alone, on both families.
TEST(EngineForkCuda, SeededCompletionsEqualRequestsSeededAlone) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  for (const SynthFamily family : {SynthFamily::kLlama, SynthFamily::kQwen4Exp}) {
    SCOPED_TRACE(synth_family_name(family));
    TempDir tmp;
    SynthCheckpointOptions synth;
    synth.family = family;
    synth.n_layers = 4;
    synth.head_dim = 64;  // the CUDA attention kernels' smallest head
    ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
    Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    ModelOptions options;
    options.block_size = 16;
    options.n_blocks = 32;
    options.max_model_len = 128;
    options.max_seqs = 4;
    options.max_batch_tokens = 64;
    Result<std::unique_ptr<Model>> model = load_model(*ckpt, **gpu, options);
    ASSERT_TRUE(model.ok()) << model.message();
    std::mt19937_64 rng{41};
    std::vector<int32_t> prompt;
    for (int t = 0; t < 19; ++t) prompt.push_back(int32_t(3 + rng() % 250));
    RequestParams params;
    params.n = 3;
    params.max_tokens = 10;
    params.sampling.temperature = 1.0;
    params.sampling.top_k = 40;
    params.sampling.seed = 900;
    auto run = [&](const RequestParams& p) {
      Engine engine(**model, {});
      std::vector<std::vector<int32_t>> out(size_t(p.n));
      EXPECT_TRUE(engine.add_request(prompt, p).ok());
      for (int steps = 0; engine.has_unfinished() && steps < 1000; ++steps) {
        Result<std::vector<RequestUpdate>> updates = engine.step();
        EXPECT_TRUE(updates.ok()) << updates.message();
        if (!updates.ok()) break;
        for (const RequestUpdate& u : *updates) {
          out[size_t(u.index)].insert(out[size_t(u.index)].end(), u.new_tokens.begin(),
                                      u.new_tokens.end());
        }
      }
      EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
      return out;
    };
    const std::vector<std::vector<int32_t>> forked = run(params);
    for (size_t i = 0; i < 3; ++i) {
      RequestParams one = params;
      one.n = 1;
      one.sampling.seed = 900 + i;
      EXPECT_EQ(forked[i], run(one)[0]) << "completion " << i;
    }
  }
}

}  // namespace
}  // namespace e4kv
