// Graphs of the decode step (engine/step_graphs.h) on CUDA: two copies of a model on one backend
// run the same decode steps, one eagerly padded to the step's bucket (forward_device with pad_to)
// and one through StepGraphs (prepare, then a captured graph replayed). Their logits are
// bit-identical at every step, for both families, at buckets 1, 4 and 8 with padding rows, while
// the contexts grow across attention split boundaries (new captures). A capture fails on an
// allocation or a wait for the device inside the device half, so graphs still being active at the
// end (and every decode step but each pair's first a replay) shows the device half issues neither.
// Workspace growth is forbidden throughout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "engine/step_graphs.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "model/model.h"
#include "require_gpu.h"
#include "testing/files.h"
#include "testing/hf_qwen4exp.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

constexpr int kSeqs = 6;

ModelOptions graph_options() {
  ModelOptions options;
  options.block_size = 16;
  options.n_blocks = 96;
  options.max_model_len = 512;
  options.max_batch_tokens = 64;
  options.max_seqs = 8;
  options.max_logit_rows = 8;
  return options;
}

std::vector<float> host_logits(Backend& backend, const DeviceLogits& logits) {
  std::vector<float> host(size_t(logits.rows * logits.vocab));
  backend.copy_to_host(host.data(), logits.data, host.size() * sizeof(float));
  return host;
}

void run_graphs_against_eager(Model& eager, Model& graphed, Backend& backend) {
  StepGraphs graphs(graphed, /*max_num_seqs=*/8, /*enabled=*/true);
  ASSERT_TRUE(graphs.active());
  ASSERT_EQ(graphs.buckets(), (std::vector<int64_t>{1, 2, 4, 8}));
  BlockAllocator allocator(eager.n_blocks(), eager.block_size());
  BlockTable tables[kSeqs];
  int32_t slots_e[kSeqs], slots_g[kSeqs];
  std::vector<int32_t> next(kSeqs);
  const int64_t vocab = eager.vocab_size();
  std::mt19937 rng(5);
  // Prompts of 20 to 60 tokens, one forward each, on both models.
  for (int s = 0; s < kSeqs; ++s) {
    Result<int32_t> a = eager.allocate_sequence();
    Result<int32_t> b = graphed.allocate_sequence();
    ASSERT_TRUE(a.ok() && b.ok());
    slots_e[s] = *a;
    slots_g[s] = *b;
    const int len = 20 + int(rng() % 41);
    const size_t rows = static_cast<size_t>(len);
    std::vector<int32_t> ids(rows), seq(rows, 0), pos(rows);
    for (int p = 0; p < len; ++p) {
      ids[size_t(p)] = int32_t(3 + rng() % 200);
      pos[size_t(p)] = p;
    }
    allocator.append(tables[s], len);
    const int32_t last[1] = {len - 1};
    ForwardBatch prefill{ids,          seq,  pos,
                         {&tables[s]}, last, std::span<const int32_t>(&slots_e[s], 1)};
    Result<std::vector<float>> le = eager.forward(prefill);
    prefill.seq_slots = std::span<const int32_t>(&slots_g[s], 1);
    Result<std::vector<float>> lg = graphed.forward(prefill);
    ASSERT_TRUE(le.ok() && lg.ok()) << le.message() << lg.message();
    ASSERT_TRUE(*le == *lg);
    next[size_t(s)] = int32_t(std::max_element(le->begin(), le->end()) - le->begin());
  }
  // Decode: 1 sequence (bucket 1), then 3 (bucket 4, one padding row), then 5 and 6 (bucket 8),
  // 40 steps each: the contexts cross split boundaries.
  int steps = 0;
  int64_t padded_since_reset = 0;  // the eager model's scratch state is reset as StepGraphs does
  for (const int n : {1, 3, 5, 6}) {
    for (int k = 0; k < 40; ++k, ++steps) {
      SCOPED_TRACE(testing::Message() << n << " sequences, step " << k);
      const size_t m = static_cast<size_t>(n);
      std::vector<int32_t> ids(m), seq(m), pos(m), rows(m);
      std::vector<const BlockTable*> tabs;
      for (int s = 0; s < n; ++s) {
        ids[size_t(s)] = next[size_t(s)];
        seq[size_t(s)] = rows[size_t(s)] = s;
        pos[size_t(s)] = int32_t(tables[s].n_tokens);
        allocator.append(tables[s], 1);
        tabs.push_back(&tables[s]);
      }
      ForwardBatch batch{ids, seq, pos, tabs, rows, std::span<const int32_t>(slots_e, size_t(n))};
      const int64_t bucket =
          *std::lower_bound(graphs.buckets().begin(), graphs.buckets().end(), int64_t(n));
      batch.pad_to = bucket;
      if (bucket > n && padded_since_reset >= StepGraphs::kPaddingStateResetSteps) {
        eager.reset_padding_state();
        padded_since_reset = 0;
      }
      if (bucket > n) ++padded_since_reset;
      Result<DeviceLogits> de = eager.forward_device(batch);
      ASSERT_TRUE(de.ok()) << de.message();
      const std::vector<float> le = host_logits(backend, *de);
      batch.pad_to = 0;
      batch.seq_slots = std::span<const int32_t>(slots_g, size_t(n));
      Result<DeviceLogits> dg = graphs.forward(batch);
      ASSERT_TRUE(dg.ok()) << dg.message();
      ASSERT_EQ(dg->rows, n);
      const std::vector<float> lg = host_logits(backend, *dg);
      ASSERT_EQ(le.size(), lg.size());
      ASSERT_TRUE(le == lg) << "the replayed logits differ from the eager ones";
      for (int s = 0; s < n; ++s) {
        const auto row = le.begin() + s * vocab;
        next[size_t(s)] = int32_t(std::max_element(row, row + vocab) - row);
      }
    }
  }
  EXPECT_TRUE(graphs.active()) << graphs.capture_error();
  // Each (bucket, signature) runs once eagerly before its capture; every other step replays.
  EXPECT_EQ(graphs.stats().replays + graphs.stats().eager, steps);
  EXPECT_LE(graphs.stats().eager, graphs.stats().captures);
  EXPECT_GT(graphs.stats().padded_rows, 0);
  EXPECT_GE(graphs.stats().captures, 3);
  EXPECT_GT(graphs.stats().last_nodes, 10);  // a whole step's launches, counted by CUDA
  EXPECT_LT(graphs.stats().captures, steps / 4);
  for (int s = 0; s < kSeqs; ++s) {
    EXPECT_TRUE(eager.free_sequence(slots_e[s]).ok());
    EXPECT_TRUE(graphed.free_sequence(slots_g[s]).ok());
  }
}

TEST(StepGraphsCuda, DenseReplayEqualsEagerWithPaddingRows) {
  E4KV_REQUIRE_GPU();
  testing_support::TempDir tmp;
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kQwen3;
  synth.head_dim = 64;
  synth.dtype = DType::kF16;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  ASSERT_TRUE(backend.ok()) << backend.message();
  (*backend)->allow_workspace_growth(false);
  for (const KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
    SCOPED_TRACE(dtype == KvCacheDtype::kF16 ? "FP16 cache" : "E4M3 cache");
    ModelOptions options = graph_options();
    options.kv_cache_dtype = dtype;
    options.kv_scales_mode = KvScalesMode::kUnit;
    Result<std::unique_ptr<Model>> eager = load_model(*ckpt, **backend, options);
    Result<std::unique_ptr<Model>> graphed = load_model(*ckpt, **backend, options);
    ASSERT_TRUE(eager.ok()) << eager.message();
    ASSERT_TRUE(graphed.ok()) << graphed.message();
    run_graphs_against_eager(**eager, **graphed, **backend);
  }
}

TEST(StepGraphsCuda, Qwen4ExpReplayEqualsEagerWithPaddingRows) {
  E4KV_REQUIRE_GPU();
  const std::vector<fs::path> dirs = test::qwen4exp_cases();
  ASSERT_FALSE(dirs.empty());
  Result<Checkpoint> ckpt = Checkpoint::open(dirs.front());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  ASSERT_TRUE(backend.ok()) << backend.message();
  (*backend)->allow_workspace_growth(false);
  ModelOptions options = graph_options();
  options.max_model_len = 256;
  Result<std::unique_ptr<Model>> eager = load_model(*ckpt, **backend, options);
  Result<std::unique_ptr<Model>> graphed = load_model(*ckpt, **backend, options);
  ASSERT_TRUE(eager.ok()) << eager.message();
  ASSERT_TRUE(graphed.ok()) << graphed.message();
  run_graphs_against_eager(**eager, **graphed, **backend);
}

}  // namespace
}  // namespace e4kv
