// The single-request generation loop over a synthetic Llama on the CPU backend.
#include "engine/generate.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/families/dense.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

using testing_support::TempDir;

class Generate : public ::testing::Test {
 protected:
  void SetUp() override {
    SynthCheckpointOptions options;
    options.n_layers = 2;
    ASSERT_TRUE(write_synth_checkpoint(tmp_.path(), options).ok());
    Result<Checkpoint> ckpt = Checkpoint::open(tmp_.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    ckpt_ = std::make_unique<Checkpoint>(std::move(ckpt).value());
    backend_ = make_cpu_backend({2});
  }

  std::unique_ptr<DenseModel> load(int64_t max_model_len = 128, int64_t max_batch_tokens = 0) {
    ModelOptions options;
    options.block_size = 16;
    options.n_blocks = 8;
    options.max_model_len = max_model_len;
    options.max_batch_tokens = max_batch_tokens;
    Result<std::unique_ptr<DenseModel>> model = DenseModel::load(*ckpt_, *backend_, options);
    EXPECT_TRUE(model.ok()) << model.message();
    return model.ok() ? std::move(model).value() : nullptr;
  }

  TempDir tmp_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<Backend> backend_;
};

const std::vector<int32_t> kPrompt{72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33};

// The generation loop by hand: one forward over the whole sequence each step, the repetition
// penalty (1: off) over every id so far, argmax of the last row. Returns the generated ids.
std::vector<int32_t> argmax_loop_by_hand(DenseModel& model, size_t steps, float penalty) {
  std::vector<int32_t> ids = kPrompt;
  for (size_t step = 0; step < steps; ++step) {
    BlockAllocator allocator(model.n_blocks(), model.block_size());
    BlockTable table;
    allocator.append(table, int64_t(ids.size()));
    std::vector<int32_t> seq(ids.size(), 0), pos(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) pos[i] = int32_t(i);
    const int32_t last = int32_t(ids.size() - 1);
    Result<std::vector<float>> logits =
        model.forward({ids, seq, pos, {&table}, std::span<const int32_t>(&last, 1)});
    EXPECT_TRUE(logits.ok()) << logits.message();
    if (!logits.ok()) return {};
    if (penalty != 1.0f) {
      for (int32_t id : std::set<int32_t>(ids.begin(), ids.end())) {
        float& l = (*logits)[size_t(id)];
        l = l > 0.0f ? l / penalty : l * penalty;
      }
    }
    ids.push_back(argmax_logit(*logits));
  }
  return std::vector<int32_t>(ids.begin() + long(kPrompt.size()), ids.end());
}

TEST_F(Generate, GreedyEqualsAnArgmaxLoopAndIsNotDegenerate) {
  auto model = load();
  ASSERT_NE(model, nullptr);
  GenerateOptions options;
  options.max_tokens = 16;
  std::vector<int32_t> streamed;
  Result<GenerateResult> result =
      generate(*model, kPrompt, options, [&](int32_t id) { streamed.push_back(id); });
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(result->output_ids, streamed);
  EXPECT_EQ(result->output_ids.size(), 16u);
  EXPECT_EQ(result->finish_reason, "length");
  // A random model whose greedy run is one token repeated would hide bugs in everything above.
  const std::set<int32_t> distinct(result->output_ids.begin(), result->output_ids.end());
  EXPECT_GE(distinct.size(), 4u);

  // The same loop by hand.
  auto fresh = load();
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(argmax_loop_by_hand(*fresh, 16, 1.0f), result->output_ids);
}

// With a repetition penalty, each greedy step is the argmax of the last row's logits after the
// penalty over the prompt and the tokens so far: the same loop by hand.
TEST_F(Generate, RepetitionPenaltyEqualsAPenalisedArgmaxLoop) {
  auto model = load();
  ASSERT_NE(model, nullptr);
  GenerateOptions options;
  options.max_tokens = 12;
  options.sampling.repetition_penalty = 1.8;
  Result<GenerateResult> result = generate(*model, kPrompt, options);
  ASSERT_TRUE(result.ok()) << result.message();
  options.sampling.repetition_penalty = 1.0;
  Result<GenerateResult> plain = generate(*model, kPrompt, options);
  ASSERT_TRUE(plain.ok()) << plain.message();
  EXPECT_NE(result->output_ids, plain->output_ids) << "the penalty changed nothing";

  auto fresh = load();
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(argmax_loop_by_hand(*fresh, 12, 1.8f), result->output_ids);
}

TEST_F(Generate, ChunkedPrefillGivesTheSameTokens) {
  auto model = load();
  GenerateOptions options;
  options.max_tokens = 10;
  Result<GenerateResult> whole = generate(*model, kPrompt, options);
  options.prefill_chunk = 4;
  Result<GenerateResult> chunked = generate(*model, kPrompt, options);
  ASSERT_TRUE(whole.ok() && chunked.ok());
  EXPECT_EQ(whole->output_ids, chunked->output_ids);
}

TEST_F(Generate, APromptLongerThanTheBatchLimitIsCutIntoForwards) {
  GenerateOptions options;
  options.max_tokens = 10;
  Result<GenerateResult> whole = generate(*load(), kPrompt, options);
  // 13 prompt tokens through a model loaded for 5 rows per forward: 5 + 5 + 3.
  auto small = load(128, /*max_batch_tokens=*/5);
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small->limits().max_batch_tokens, 5);
  Result<GenerateResult> cut = generate(*small, kPrompt, options);
  ASSERT_TRUE(whole.ok() && cut.ok()) << cut.message();
  EXPECT_EQ(whole->output_ids, cut->output_ids);
  // A forward of more rows than the limit is refused, naming it.
  BlockAllocator allocator(small->n_blocks(), small->block_size());
  BlockTable table;
  allocator.append(table, 6);
  const std::vector<int32_t> ids(6, 1), seq(6, 0), pos{0, 1, 2, 3, 4, 5}, last{5};
  EXPECT_EQ(small->forward({ids, seq, pos, {&table}, last}).status().option(), "max_batch_tokens");
}

TEST_F(Generate, StopsAtAStopIdAndKeepsIt) {
  auto model = load();
  GenerateOptions options;
  options.max_tokens = 16;
  Result<GenerateResult> free_run = generate(*model, kPrompt, options);
  ASSERT_TRUE(free_run.ok());
  const int32_t stop = free_run->output_ids[5];
  options.stop_ids = {stop};
  Result<GenerateResult> stopped = generate(*model, kPrompt, options);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->finish_reason, "stop");
  ASSERT_FALSE(stopped->output_ids.empty());
  EXPECT_EQ(stopped->output_ids.back(), stop);
  EXPECT_LE(stopped->output_ids.size(), 6u);
}

TEST_F(Generate, StopsAtTheMaxModelLength) {
  auto model = load(/*max_model_len=*/16);
  GenerateOptions options;
  options.max_tokens = 100;
  Result<GenerateResult> result = generate(*model, kPrompt, options);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(kPrompt.size() + result->output_ids.size(), 16u);
  EXPECT_EQ(result->finish_reason, "length");
}

TEST_F(Generate, SeededSamplingIsReproducible) {
  auto model = load();
  GenerateOptions options;
  options.max_tokens = 12;
  options.sampling.temperature = 1.0;
  options.sampling.top_p = 0.9;
  options.sampling.seed = 11;
  Result<GenerateResult> a = generate(*model, kPrompt, options);
  Result<GenerateResult> b = generate(*model, kPrompt, options);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->output_ids, b->output_ids);
}

TEST_F(Generate, RejectsBadRequests) {
  auto model = load();
  GenerateOptions options;
  EXPECT_NE(generate(*model, {}, options).message().find("the prompt is empty"), std::string::npos);
  const std::vector<int32_t> bad{1, 2, 256};
  EXPECT_NE(generate(*model, bad, options).message().find("prompt token 2 is id 256, outside"),
            std::string::npos);
  options.sampling.top_p = 2.0;
  EXPECT_EQ(generate(*model, kPrompt, options).status().option(), "top_p");
  auto short_model = load(/*max_model_len=*/13);
  EXPECT_NE(generate(*short_model, kPrompt, {}).message().find("max model length is 13"),
            std::string::npos);
}

}  // namespace
}  // namespace e4kv
