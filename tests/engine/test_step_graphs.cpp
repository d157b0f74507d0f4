// Graphs of the decode step (engine/step_graphs.h) on the CPU: padding rows (ForwardBatch::pad_to)
// change nothing for the real rows, and the engine's graph path (buckets, padding, signatures,
// the model's split forward) gives the tokens the eager engine gives. The CPU backend emulates the
// graphs (cpu_backend_emulate_graphs: a replay calls the captured function again); the CUDA tests
// replay real CUDA graphs against eager forwards.
#include "engine/step_graphs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/engine.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::TempDir;

TEST(StepGraphs, BucketsAreOneTwoFourThenMultiplesOfEight) {
  EXPECT_EQ(StepGraphs::buckets_for(1), (std::vector<int64_t>{1}));
  EXPECT_EQ(StepGraphs::buckets_for(3), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(StepGraphs::buckets_for(8), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(StepGraphs::buckets_for(20), (std::vector<int64_t>{1, 2, 4, 8, 16, 20}));
  EXPECT_EQ(StepGraphs::buckets_for(32), (std::vector<int64_t>{1, 2, 4, 8, 16, 24, 32}));
  EXPECT_TRUE(StepGraphs::buckets_for(0).empty());
}

class StepGraphsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    SynthCheckpointOptions options;
    options.family = GetParam() == "qwen4exp" ? SynthFamily::kQwen4Exp : SynthFamily::kLlama;
    options.n_layers = GetParam() == "qwen4exp" ? 4 : 2;
    ASSERT_TRUE(write_synth_checkpoint(tmp_.path(), options).ok());
    Result<Checkpoint> ckpt = Checkpoint::open(tmp_.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    ckpt_ = std::make_unique<Checkpoint>(std::move(ckpt).value());
    backend_ = make_cpu_backend({2});
  }

  std::unique_ptr<Model> load(int64_t n_blocks, int64_t max_seqs, int64_t max_batch_tokens) {
    ModelOptions options;
    options.block_size = 16;
    options.n_blocks = n_blocks;
    options.max_model_len = 128;
    options.max_seqs = max_seqs;
    options.max_batch_tokens = max_batch_tokens;
    Result<std::unique_ptr<Model>> model = load_model(*ckpt_, *backend_, options);
    EXPECT_TRUE(model.ok()) << model.message();
    return model.ok() ? std::move(model).value() : nullptr;
  }

  TempDir tmp_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<Backend> backend_;
};

// Relative L2 distance of b from a.
double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(a[i]) * a[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Three sequences on two copies of a model: one decodes unpadded, the other padded to 4 and to 8
// rows in turn. Every step's logits of the real rows agree, and so do the steps after (the
// padding rows wrote nothing the real sequences read). Then a padded prefill is refused.
TEST_P(StepGraphsTest, PaddingRowsChangeNothingForTheRealRows) {
  auto plain = load(/*n_blocks=*/16, /*max_seqs=*/8, /*max_batch_tokens=*/64);
  auto padded = load(/*n_blocks=*/16, /*max_seqs=*/8, /*max_batch_tokens=*/64);
  ASSERT_TRUE(plain && padded);
  BlockAllocator allocator(plain->n_blocks(), plain->block_size());
  BlockTable tables[3];
  std::vector<int32_t> slots_a, slots_b;
  for (int s = 0; s < 3; ++s) {
    Result<int32_t> a = plain->allocate_sequence();
    Result<int32_t> b = padded->allocate_sequence();
    ASSERT_TRUE(a.ok() && b.ok());
    slots_a.push_back(*a);
    slots_b.push_back(*b);
  }
  // Prefill: prompts of 5, 9 and 14 tokens in one forward.
  std::mt19937 rng(3);
  std::vector<int32_t> ids, row_seq, row_pos, logit_rows;
  const int lengths[3] = {5, 9, 14};
  for (int s = 0; s < 3; ++s) {
    allocator.append(tables[s], lengths[s]);
    for (int p = 0; p < lengths[s]; ++p) {
      ids.push_back(int32_t(3 + rng() % 200));
      row_seq.push_back(s);
      row_pos.push_back(p);
    }
    logit_rows.push_back(int32_t(ids.size()) - 1);
  }
  ForwardBatch prefill{ids,        row_seq, row_pos, {&tables[0], &tables[1], &tables[2]},
                       logit_rows, slots_a};
  Result<std::vector<float>> first_a = plain->forward(prefill);
  prefill.seq_slots = slots_b;
  Result<std::vector<float>> first_b = padded->forward(prefill);
  ASSERT_TRUE(first_a.ok() && first_b.ok()) << first_a.message() << first_b.message();
  EXPECT_EQ(*first_a, *first_b);

  // A padded prefill is refused, naming the rule.
  prefill.pad_to = 64;
  Result<std::vector<float>> refused = padded->forward(prefill);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("decode rows"), std::string::npos) << refused.message();

  const int64_t vocab = plain->vocab_size();
  std::vector<float> last = *first_a;
  double worst = 0.0;
  for (int step = 0; step < 10; ++step) {
    SCOPED_TRACE(testing::Message() << "decode step " << step);
    std::vector<int32_t> d_ids(3), d_seq{0, 1, 2}, d_pos(3), d_rows{0, 1, 2};
    for (int s = 0; s < 3; ++s) {
      const float* row = last.data() + s * vocab;
      d_ids[size_t(s)] = int32_t(std::max_element(row, row + vocab) - row);
      d_pos[size_t(s)] = int32_t(tables[s].n_tokens);
      allocator.append(tables[s], 1);
    }
    ForwardBatch batch{d_ids, d_seq, d_pos, {&tables[0], &tables[1], &tables[2]}, d_rows, slots_a};
    Result<std::vector<float>> a = plain->forward(batch);
    batch.seq_slots = slots_b;
    batch.pad_to = step % 2 == 0 ? 4 : 8;
    Result<std::vector<float>> b = padded->forward(batch);
    ASSERT_TRUE(a.ok()) << a.message();
    ASSERT_TRUE(b.ok()) << b.message();
    ASSERT_EQ(a->size(), size_t(3 * vocab));  // the padding rows' logits are not returned
    ASSERT_EQ(b->size(), a->size());
    worst = std::max(worst, rel_l2(*a, *b));
    for (int s = 0; s < 3; ++s) {
      const auto row_a = a->begin() + s * vocab, row_b = b->begin() + s * vocab;
      EXPECT_EQ(std::max_element(row_a, row_a + vocab) - row_a,
                std::max_element(row_b, row_b + vocab) - row_b);
    }
    last = *a;
  }
  EXPECT_LE(worst, 1e-5);
}

// The engine with step graphs (emulated on the CPU) against the eager engine: the same requests,
// a pool small enough to preempt, up to 6 sequences (buckets 1, 2, 4, 6): identical tokens, decode
// steps replayed from graphs, prefill steps eager, every block and slot back at the end.
TEST_P(StepGraphsTest, EngineWithGraphsGivesTheEagerTokens) {
  auto model = load(/*n_blocks=*/12, /*max_seqs=*/6, /*max_batch_tokens=*/48);
  ASSERT_NE(model, nullptr);
  std::mt19937_64 rng(17);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> max_tokens;
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> p(size_t(2 + rng() % 40));
    for (int32_t& t : p) t = int32_t(3 + rng() % uint64_t(model->vocab_size() - 3));
    prompts.push_back(std::move(p));
    max_tokens.push_back(int64_t(6 + rng() % 12));
  }
  auto run = [&](bool graphs, StepGraphStats* stats, int64_t* preemptions) {
    cpu_backend_emulate_graphs(*backend_, graphs);
    EngineConfig config;
    config.enforce_eager = !graphs;
    Engine engine(*model, config);
    EXPECT_EQ(engine.step_graphs().active(), graphs);
    std::map<RequestId, size_t> index;
    for (size_t i = 0; i < prompts.size(); ++i) {
      RequestParams params;
      params.max_tokens = max_tokens[i];
      Result<RequestId> id = engine.add_request(prompts[i], params);
      EXPECT_TRUE(id.ok()) << id.message();
      if (id.ok()) index[*id] = i;
    }
    std::vector<std::vector<int32_t>> out(prompts.size());
    for (int steps = 0; engine.has_unfinished() && steps < 5000; ++steps) {
      Result<std::vector<RequestUpdate>> updates = engine.step();
      EXPECT_TRUE(updates.ok()) << updates.message();
      if (!updates.ok()) break;
      for (const RequestUpdate& u : *updates) {
        EXPECT_NE(u.finish_reason, "error") << u.error;
        auto& o = out[index.at(u.id)];
        o.insert(o.end(), u.new_tokens.begin(), u.new_tokens.end());
      }
    }
    EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
    *stats = engine.step_graphs().stats();
    *preemptions = engine.scheduler().n_preemptions();
    cpu_backend_emulate_graphs(*backend_, false);
    return out;
  };
  StepGraphStats eager_stats, graph_stats;
  int64_t eager_preemptions = 0, graph_preemptions = 0;
  const auto eager = run(false, &eager_stats, &eager_preemptions);
  const auto graphed = run(true, &graph_stats, &graph_preemptions);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(eager[i].size(), size_t(max_tokens[i])) << "request " << i;
    EXPECT_EQ(graphed[i], eager[i]) << "request " << i;
  }
  EXPECT_GT(eager_preemptions, 0);
  EXPECT_EQ(eager_stats.replays, 0);
  EXPECT_GT(graph_stats.replays, 20);
  EXPECT_GT(graph_stats.padded_rows, 0);
  EXPECT_GE(graph_stats.captures, 1);
  EXPECT_LE(graph_stats.captures, 4);  // one per bucket: the CPU plans nothing per step
  EXPECT_GT(graph_stats.eager, 0);     // the prefill steps
}

// Calibration statistics come from eager forwards only: while the model collects them, an engine
// with graphs available (emulated) replays nothing, and what it collects equals what the eager
// engine collects from the same requests.
TEST_P(StepGraphsTest, NoGraphsWhileCalibrationStatisticsAreCollected) {
  auto model = load(/*n_blocks=*/16, /*max_seqs=*/4, /*max_batch_tokens=*/48);
  ASSERT_NE(model, nullptr);
  auto collect = [&](bool graphs, int64_t* replays) {
    cpu_backend_emulate_graphs(*backend_, graphs);
    EXPECT_TRUE(model->start_kv_statistics().ok());
    EngineConfig config;
    config.enforce_eager = !graphs;
    Engine engine(*model, config);
    for (int i = 0; i < 4; ++i) {
      RequestParams params;
      params.max_tokens = 6;
      std::vector<int32_t> prompt(size_t(5 + 7 * i));
      for (size_t t = 0; t < prompt.size(); ++t)
        prompt[t] = int32_t(3 + (t * 31 + size_t(i)) % 200);
      EXPECT_TRUE(engine.add_request(prompt, params).ok());
    }
    for (int steps = 0; engine.has_unfinished() && steps < 1000; ++steps) {
      EXPECT_TRUE(engine.step().ok());
    }
    *replays = engine.step_graphs().stats().replays;
    Result<std::vector<LayerKvStats>> stats = model->kv_statistics();
    EXPECT_TRUE(stats.ok()) << stats.message();
    model->stop_kv_statistics();
    cpu_backend_emulate_graphs(*backend_, false);
    return stats.ok() ? *stats : std::vector<LayerKvStats>{};
  };
  int64_t graph_replays = -1, eager_replays = -1;
  const std::vector<LayerKvStats> with_graphs = collect(true, &graph_replays);
  const std::vector<LayerKvStats> eager = collect(false, &eager_replays);
  EXPECT_EQ(graph_replays, 0);
  ASSERT_FALSE(eager.empty());
  ASSERT_EQ(with_graphs.size(), eager.size());
  for (size_t l = 0; l < eager.size(); ++l) {
    EXPECT_GT(eager[l].k.count(), 0);
    EXPECT_TRUE(with_graphs[l].k == eager[l].k && with_graphs[l].v == eager[l].v) << "layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, StepGraphsTest, ::testing::Values("llama", "qwen4exp"));

}  // namespace
}  // namespace e4kv
