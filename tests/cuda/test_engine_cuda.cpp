// The engine on the CUDA backend: 16 requests submitted together over a pool that forces
// preemption get the greedy tokens each gets alone on the same backend, up to the first step whose
// top-2 logit margin (alone) is below 1e-2 (FP16 activations in batches of other sizes may choose
// differently inside that margin). Dense (synthetic) and Qwen4Exp (the embedded model), FP16 cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "io/checkpoint.h"
#include "require_gpu.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<Model> load(const Checkpoint& ckpt, Backend& backend, int64_t n_blocks,
                            int64_t max_seqs, int64_t max_batch_tokens, int64_t max_logit_rows) {
  ModelOptions options;
  options.block_size = 16;
  options.n_blocks = n_blocks;
  options.max_model_len = 128;
  options.max_seqs = max_seqs;
  options.max_batch_tokens = max_batch_tokens;
  options.max_logit_rows = max_logit_rows;
  Result<std::unique_ptr<Model>> model = load_model(ckpt, backend, options);
  EXPECT_TRUE(model.ok()) << model.message();
  return model.ok() ? std::move(model).value() : nullptr;
}

void batched_equals_alone(const fs::path& dir) {
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  ASSERT_TRUE(backend.ok()) << backend.message();
  auto batched = load(*ckpt, **backend, 10, 16, 48, 0);
  ASSERT_NE(batched, nullptr);
  const int64_t vocab = batched->vocab_size();
  std::mt19937_64 rng{7};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> max_tokens;
  Engine engine(*batched, {});
  std::map<RequestId, size_t> index;
  for (int i = 0; i < 16; ++i) {
    std::vector<int32_t> p;
    for (int64_t t = 0, n = 2 + int64_t(rng() % 47); t < n; ++t) {
      p.push_back(int32_t(3 + rng() % uint64_t(vocab - 3)));
    }
    prompts.push_back(p);
    max_tokens.push_back(4 + int64_t(rng() % 13));
    RequestParams params;
    params.max_tokens = max_tokens.back();
    Result<RequestId> id = engine.add_request(p, params);
    ASSERT_TRUE(id.ok()) << id.message();
    index[*id] = size_t(i);
  }
  std::vector<std::vector<int32_t>> got(prompts.size());
  while (engine.has_unfinished()) {
    Result<std::vector<RequestUpdate>> updates = engine.step();
    ASSERT_TRUE(updates.ok()) << updates.message();
    for (const RequestUpdate& u : *updates) {
      ASSERT_NE(u.finish_reason, "error") << u.error;
      auto& out = got[index.at(u.id)];
      out.insert(out.end(), u.new_tokens.begin(), u.new_tokens.end());
    }
  }
  EXPECT_GT(engine.scheduler().n_preemptions(), 0);
  EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);

  auto alone = load(*ckpt, **backend, 8, 1, 128, 128);
  ASSERT_NE(alone, nullptr);
  int64_t compared = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateOptions options;
    options.max_tokens = max_tokens[i];
    Result<GenerateResult> want = generate(*alone, prompts[i], options);
    ASSERT_TRUE(want.ok()) << want.message();
    ASSERT_EQ(got[i].size(), want->output_ids.size()) << "request " << i;
    std::vector<int32_t> all = prompts[i];
    all.insert(all.end(), want->output_ids.begin(), want->output_ids.end() - 1);
    std::vector<int32_t> seq(all.size(), 0), pos(all.size()), rows(all.size());
    for (size_t r = 0; r < all.size(); ++r) pos[r] = rows[r] = int32_t(r);
    BlockAllocator allocator(alone->n_blocks(), alone->block_size());
    BlockTable table;
    allocator.append(table, int64_t(all.size()));
    Result<ScopedSequence> slot = ScopedSequence::allocate(*alone);
    ASSERT_TRUE(slot.ok());
    const int32_t s = slot->slot();
    Result<std::vector<float>> logits =
        alone->forward({all, seq, pos, {&table}, rows, std::span<const int32_t>(&s, 1)});
    ASSERT_TRUE(logits.ok()) << logits.message();
    for (size_t k = 0; k < got[i].size(); ++k) {
      const size_t r = prompts[i].size() - 1 + k;
      std::vector<float> row(logits->begin() + std::ptrdiff_t(r * size_t(vocab)),
                             logits->begin() + std::ptrdiff_t((r + 1) * size_t(vocab)));
      std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<>());
      if (row[0] - row[1] < 1e-2f) break;
      ASSERT_EQ(got[i][k], want->output_ids[k]) << "request " << i << " token " << k;
      ++compared;
    }
  }
  EXPECT_GT(compared, 60);
}

TEST(EngineCuda, DenseBatchedWithPreemptionEqualsAlone) {
  E4KV_REQUIRE_GPU();
  testing_support::TempDir tmp;
  SynthCheckpointOptions options;
  options.n_layers = 2;
  options.head_dim = 64;  // the CUDA attention routes take head_dim 64, 128 and 256
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), options).ok());
  batched_equals_alone(tmp.path());
}

TEST(EngineCuda, EmbeddedQwen4ExpBatchedWithPreemptionEqualsAlone) {
  E4KV_REQUIRE_GPU();
  batched_equals_alone(fs::path(E4KV_SOURCE_DIR) / "models" / "tiny-qwen4exp");
}

}  // namespace
}  // namespace e4kv
