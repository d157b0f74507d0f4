// The per-step metadata (model/step_context.h) on the CPU backend, whose memory the test reads
// back: the limits a model is loaded for, the checks of a batch against them, and the uploaded
// slots, lengths, padded block tables and RoPE rows against values computed here.
#include "model/step_context.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/cpu/cpu_backend.h"

namespace e4kv {
namespace {

TEST(ModelLimits, DefaultsAndRefusals) {
  ModelOptions options;
  options.n_blocks = 1024;  // 65536 tokens of 64: the model length, not the pool, limits a sequence
  Result<ModelLimits> limits = model_limits(options, 32768, "config.json");
  ASSERT_TRUE(limits.ok()) << limits.message();
  EXPECT_EQ(limits->max_model_len, 32768);
  EXPECT_EQ(limits->max_batch_tokens, 8192);
  EXPECT_EQ(limits->max_seqs, 64);
  EXPECT_EQ(limits->max_logit_rows, 64);
  EXPECT_EQ(limits->max_seq_tokens, 32768);
  EXPECT_EQ(limits->max_blocks_per_seq, 32768 / 64);
  // A pool smaller than the model length: no sequence holds more than the pool's 8 blocks, so the
  // block-table stride and the per-position tables follow the pool.
  options.n_blocks = 8;
  limits = model_limits(options, 32768, "config.json");
  ASSERT_TRUE(limits.ok());
  EXPECT_EQ(limits->max_model_len, 32768);
  EXPECT_EQ(limits->max_seq_tokens, 8 * 64);
  EXPECT_EQ(limits->max_blocks_per_seq, 8);
  // The largest int32 model length costs what the pool holds, not 2^31 positions.
  options.max_model_len = 2147483647;
  limits = model_limits(options, 32768, "config.json");
  ASSERT_TRUE(limits.ok());
  EXPECT_EQ(limits->max_model_len, 2147483647);
  EXPECT_EQ(limits->max_seq_tokens, 8 * 64);
  EXPECT_EQ(limits->max_blocks_per_seq, 8);
  options.max_model_len = 0;
  // A short model: every limit within its length.
  limits = model_limits(options, 40, "config.json");
  ASSERT_TRUE(limits.ok());
  EXPECT_EQ(limits->max_batch_tokens, 40);
  EXPECT_EQ(limits->max_seqs, 40);
  EXPECT_EQ(limits->max_blocks_per_seq, 1);

  options.max_seqs = 9000;
  EXPECT_EQ(model_limits(options, 32768, "config.json").status().option(), "max_seqs");
  options.max_seqs = 0;
  options.max_logit_rows = 9000;
  EXPECT_EQ(model_limits(options, 32768, "config.json").status().option(), "max_logit_rows");
  options.max_logit_rows = 0;
  EXPECT_EQ(model_limits(options, 0, "config.json").status().option(), "max_model_len");
  options.n_blocks = 0;
  EXPECT_EQ(model_limits(options, 32768, "config.json").status().option(), "n_blocks");
}

class StepContextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = make_cpu_backend({1});
    ModelOptions options;
    options.block_size = 16;
    options.n_blocks = 8;
    options.max_model_len = 64;
    options.max_batch_tokens = 6;
    options.max_seqs = 2;
    options.max_logit_rows = 2;
    Result<ModelLimits> limits = model_limits(options, 0, "config.json");
    ASSERT_TRUE(limits.ok()) << limits.message();
    rope_.rotary_dim = 4;
    rope_.inv_freq = {1.0, 0.01};
    Result<StepContext> ctx = StepContext::create(*backend_, *limits, rope_.rotary_dim);
    ASSERT_TRUE(ctx.ok()) << ctx.message();
    ctx_ = std::make_unique<StepContext>(std::move(ctx).value());
  }

  template <class T>
  std::vector<T> read(const T* device, int64_t n) {
    std::vector<T> host(static_cast<size_t>(n));
    backend_->copy_to_host(host.data(), device, size_t(n) * sizeof(T));
    return host;
  }

  std::unique_ptr<Backend> backend_;
  RopeTable rope_;
  std::unique_ptr<StepContext> ctx_;
};

TEST_F(StepContextTest, UploadsTheRowsOfAMixedBatch) {
  // Sequence 0: 20 tokens in blocks 5, 2 (a 3-row chunk at 17..19); sequence 1: 3 tokens in block
  // 7 (a decode row at 2).
  BlockTable a{{5, 2}, 20};
  BlockTable b{{7}, 3};
  const std::vector<int32_t> ids{1, 2, 3, 4};
  const std::vector<int32_t> seq{0, 0, 0, 1};
  const std::vector<int32_t> pos{17, 18, 19, 2};
  const std::vector<int32_t> logit_rows{2, 3};
  ForwardBatch batch{ids, seq, pos, {&a, &b}, logit_rows};
  ASSERT_TRUE(ctx_->build(batch, &rope_, 10, 16, 8).ok());
  EXPECT_EQ(ctx_->n_rows(), 4);
  EXPECT_EQ(ctx_->n_seqs(), 2);
  EXPECT_EQ(ctx_->n_logits(), 2);
  EXPECT_EQ(read(ctx_->ids(), 4), ids);
  // Slot = block * 16 + pos % 16.
  EXPECT_EQ(read(ctx_->slots(), 4), (std::vector<int64_t>{2 * 16 + 1, 2 * 16 + 2, 2 * 16 + 3, 7 * 16 + 2}));
  EXPECT_EQ(read(ctx_->logit_rows(), 2), logit_rows);
  const QueryBatchView rows = ctx_->rows();
  EXPECT_EQ(read(rows.row_seq, 4), seq);
  EXPECT_EQ(read(rows.row_pos, 4), pos);
  EXPECT_EQ(read(rows.seq_lens, 2), (std::vector<int32_t>{20, 3}));
  // The table's stride is the longest sequence the model allows (64 tokens = 4 blocks), not the
  // step's longest (2 blocks).
  const BlockTableView table = ctx_->block_table();
  EXPECT_EQ(table.max_blocks_per_seq, 4);
  EXPECT_EQ(read(table.blocks, 8), (std::vector<int32_t>{5, 2, -1, -1, 7, -1, -1, -1}));
  // cos/sin of each row's position at each frequency, in double then rounded.
  const std::vector<float> cos = read(ctx_->cos(), 8);
  const std::vector<float> sin = read(ctx_->sin(), 8);
  for (size_t r = 0; r < 4; ++r) {
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(cos[r * 2 + i], float(std::cos(pos[r] * rope_.inv_freq[i])));
      EXPECT_EQ(sin[r * 2 + i], float(std::sin(pos[r] * rope_.inv_freq[i])));
    }
  }
  // The host rows the backend plans from.
  EXPECT_EQ(ctx_->host_rows().n_rows, 4);
  EXPECT_EQ(ctx_->host_rows().row_pos[3], 2);
  EXPECT_EQ(ctx_->host_rows().seq_lens[0], 20);
}

// Launch shapes do not follow the step: one decode row of a 1-block sequence, then of a 4-block
// one, then two sequences, all at the stride of the model's limit; rows past a sequence's blocks
// are -1 again after a longer sequence used them.
TEST_F(StepContextTest, BlockTablesHaveTheStrideOfTheLongestSequenceAllowed) {
  const std::vector<int32_t> one{1}, zero{0};
  BlockTable shorter{{3}, 5};
  BlockTable longest{{6, 0, 4, 1}, 64};
  const std::vector<int32_t> pos4{4}, pos63{63};
  ASSERT_TRUE(ctx_->build({one, zero, pos4, {&shorter}, {}}, &rope_, 10, 16, 8).ok());
  EXPECT_EQ(ctx_->block_table().max_blocks_per_seq, 4);
  EXPECT_EQ(read(ctx_->block_table().blocks, 4), (std::vector<int32_t>{3, -1, -1, -1}));
  ASSERT_TRUE(ctx_->build({one, zero, pos63, {&longest}, {}}, &rope_, 10, 16, 8).ok());
  EXPECT_EQ(ctx_->block_table().max_blocks_per_seq, 4);
  EXPECT_EQ(read(ctx_->block_table().blocks, 4), (std::vector<int32_t>{6, 0, 4, 1}));
  const std::vector<int32_t> two{1, 2}, seqs{0, 1}, pos{4, 63};
  ASSERT_TRUE(ctx_->build({two, seqs, pos, {&shorter, &longest}, {}}, &rope_, 10, 16, 8).ok());
  const BlockTableView table = ctx_->block_table();
  EXPECT_EQ(table.n_seqs, 2);
  EXPECT_EQ(table.max_blocks_per_seq, 4);
  EXPECT_EQ(read(table.blocks, 8), (std::vector<int32_t>{3, -1, -1, -1, 6, 0, 4, 1}));
}

// The per-sequence rows and the launch facts decided once for the step (SequenceRowsView): a
// prefill chunk makes max_seq_rows > 1, a decode step 1.
TEST_F(StepContextTest, SequenceRowsCarryTheStepsLaunchFacts) {
  SequenceSlots slots(2);
  Result<int32_t> s0 = slots.allocate();
  Result<int32_t> s1 = slots.allocate();
  ASSERT_TRUE(s0.ok() && s1.ok());
  BlockTable a{{5}, 3};
  BlockTable b{{7}, 1};
  const std::vector<int32_t> ids{1, 2, 3, 4}, seq{0, 0, 0, 1}, pos{0, 1, 2, 0};
  const std::vector<int32_t> seq_slots{*s0, *s1};
  ForwardBatch batch{ids, seq, pos, {&a, &b}, {}};
  batch.seq_slots = seq_slots;
  ASSERT_TRUE(ctx_->build(batch, &rope_, 10, 16, 8).ok());
  ASSERT_TRUE(ctx_->build_sequences(batch, slots).ok());
  const SequenceRowsView& rows = ctx_->sequences();
  EXPECT_EQ(rows.n_seqs, 2);
  EXPECT_EQ(rows.first_row, 0);
  EXPECT_EQ(rows.end_row, 4);
  EXPECT_EQ(rows.max_seq_rows, 3);
  EXPECT_EQ(rows.max_end_pos, 3);
  EXPECT_EQ(read(rows.row_begin, 3), (std::vector<int32_t>{0, 3, 4}));
  EXPECT_EQ(
      std::vector<int32_t>(ctx_->host_seq_row_begin().begin(), ctx_->host_seq_row_begin().end()),
      (std::vector<int32_t>{0, 3, 4}));
  EXPECT_EQ(std::vector<int32_t>(ctx_->host_seq_slots().begin(), ctx_->host_seq_slots().end()),
            seq_slots);
  ctx_->commit_sequences(slots);
  // The next step decodes one row of each.
  a.n_tokens = 4;
  b.n_tokens = 2;
  const std::vector<int32_t> ids2{5, 6}, seq2{0, 1}, pos2{3, 1};
  ForwardBatch decode{ids2, seq2, pos2, {&a, &b}, {}};
  decode.seq_slots = seq_slots;
  ASSERT_TRUE(ctx_->build(decode, &rope_, 10, 16, 8).ok());
  ASSERT_TRUE(ctx_->build_sequences(decode, slots).ok());
  EXPECT_EQ(ctx_->sequences().max_seq_rows, 1);
  EXPECT_EQ(ctx_->sequences().max_end_pos, 4);
  EXPECT_EQ(ctx_->sequences().end_row, 2);
}

TEST_F(StepContextTest, RefusesBatchesBeyondTheLimitsOrTheirOwnMetadata) {
  BlockTable a{{5, 2}, 20};
  BlockTable b{{7}, 3};
  BlockTable c{{1}, 1};
  const std::vector<int32_t> seven(7, 1), seq7(7, 0), pos7{13, 14, 15, 16, 17, 18, 19};
  EXPECT_EQ(ctx_->build({seven, seq7, pos7, {&a}, {}}, &rope_, 10, 16, 8).option(),
            "max_batch_tokens");
  const std::vector<int32_t> one{1}, zero{0}, pos0{0};
  EXPECT_EQ(ctx_->build({one, zero, pos0, {&c, &b, &a}, {}}, &rope_, 10, 16, 8).option(),
            "max_seqs");
  const std::vector<int32_t> three_rows{0, 0, 0};
  const std::vector<int32_t> ids3{1, 2, 3}, seq3{0, 0, 0}, pos3{17, 18, 19};
  EXPECT_EQ(ctx_->build({ids3, seq3, pos3, {&a}, three_rows}, &rope_, 10, 16, 8).option(),
            "max_logit_rows");
  // The batch's own metadata.
  const std::vector<int32_t> bad_id{10};
  EXPECT_NE(ctx_->build({bad_id, zero, pos0, {&c}, {}}, &rope_, 10, 16, 8).message().find(
                "outside the vocabulary"),
            std::string::npos);
  const std::vector<int32_t> far{1};
  EXPECT_NE(ctx_->build({one, zero, far, {&c}, {}}, &rope_, 10, 16, 8).message().find(
                "outside sequence 0"),
            std::string::npos);
  BlockTable bad_block{{8}, 1};
  EXPECT_NE(ctx_->build({one, zero, pos0, {&bad_block}, {}}, &rope_, 10, 16, 8).message().find(
                "names block 8"),
            std::string::npos);
  BlockTable too_many{{0, 1, 2, 3, 4}, 65};
  EXPECT_NE(ctx_->build({one, zero, pos0, {&too_many}, {}}, &rope_, 10, 16, 8).message().find(
                "more than the max model length"),
            std::string::npos);
  const std::vector<int32_t> bad_logit{1};
  EXPECT_NE(ctx_->build({one, zero, pos0, {&c}, bad_logit}, &rope_, 10, 16, 8).message().find(
                "logit row 1 outside"),
            std::string::npos);
}

}  // namespace
}  // namespace e4kv
