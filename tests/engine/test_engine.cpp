// The engine (engine/engine.h) on the CPU backend, for both families: requests submitted together
// over a pool small enough to preempt get the greedy tokens each gets alone, up to the first step
// whose top-2 logit margin (alone) is below 1e-3, where batched arithmetic may choose differently.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/generate.h"
#include "io/checkpoint.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::TempDir;

struct Workload {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> max_tokens;
};

Workload make_workload(int64_t vocab, int n, uint64_t seed) {
  std::mt19937_64 rng{seed};
  Workload w;
  for (int i = 0; i < n; ++i) {
    const int64_t len = 2 + int64_t(rng() % 47);
    std::vector<int32_t> p;
    for (int64_t t = 0; t < len; ++t) p.push_back(int32_t(3 + rng() % uint64_t(vocab - 3)));
    w.prompts.push_back(std::move(p));
    w.max_tokens.push_back(4 + int64_t(rng() % 13));
  }
  return w;
}

// The top-2 margin of every row's logits, [rows].
std::vector<float> margins(const std::vector<float>& logits, int64_t vocab) {
  std::vector<float> out;
  for (size_t r = 0; r * size_t(vocab) < logits.size(); ++r) {
    std::vector<float> row(logits.begin() + std::ptrdiff_t(r * vocab),
                           logits.begin() + std::ptrdiff_t((r + 1) * vocab));
    std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<>());
    out.push_back(row[0] - row[1]);
  }
  return out;
}

class EngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    fs::path dir;
    if (GetParam() == "embedded") {
      dir = fs::path(E4KV_SOURCE_DIR) / "models" / "tiny-qwen4exp";
    } else {
      SynthCheckpointOptions options;
      options.family = GetParam() == "qwen4exp" ? SynthFamily::kQwen4Exp : SynthFamily::kLlama;
      options.n_layers = GetParam() == "qwen4exp" ? 4 : 2;
      ASSERT_TRUE(write_synth_checkpoint(tmp_.path(), options).ok());
      dir = tmp_.path();
    }
    Result<Checkpoint> ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    ckpt_ = std::make_unique<Checkpoint>(std::move(ckpt).value());
    backend_ = make_cpu_backend({2});
  }

  std::unique_ptr<Model> load(int64_t n_blocks, int64_t max_seqs, int64_t max_batch_tokens,
                              int64_t max_logit_rows = 0) {
    ModelOptions options;
    options.block_size = 16;
    options.n_blocks = n_blocks;
    options.max_model_len = 128;
    options.max_seqs = max_seqs;
    options.max_batch_tokens = max_batch_tokens;
    options.max_logit_rows = max_logit_rows;
    Result<std::unique_ptr<Model>> model = load_model(*ckpt_, *backend_, options);
    EXPECT_TRUE(model.ok()) << model.message();
    return model.ok() ? std::move(model).value() : nullptr;
  }

  TempDir tmp_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<Backend> backend_;
};

TEST_P(EngineTest, BatchedWithPreemptionEqualsEachRequestAlone) {
  // 16 requests of up to 64 tokens over a pool of 10 blocks (160 tokens): preemption is certain.
  auto batched = load(/*n_blocks=*/10, /*max_seqs=*/16, /*max_batch_tokens=*/48);
  ASSERT_NE(batched, nullptr);
  const int64_t vocab = batched->vocab_size();
  const Workload w = make_workload(vocab, 16, 7);
  Engine engine(*batched, {});
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    RequestParams params;
    params.max_tokens = w.max_tokens[i];
    Result<RequestId> id = engine.add_request(w.prompts[i], params);
    ASSERT_TRUE(id.ok()) << id.message();
    index[*id] = i;
  }
  std::vector<std::vector<int32_t>> got(w.prompts.size());
  std::vector<int> finished(w.prompts.size(), 0);
  int64_t steps = 0;
  while (engine.has_unfinished()) {
    Result<std::vector<RequestUpdate>> updates = engine.step();
    ASSERT_TRUE(updates.ok()) << updates.message();
    for (const RequestUpdate& u : *updates) {
      const size_t i = index.at(u.id);
      got[i].insert(got[i].end(), u.new_tokens.begin(), u.new_tokens.end());
      if (u.finished) {
        EXPECT_EQ(u.finish_reason, "length") << u.error;
        finished[i] += 1;
      }
    }
    ASSERT_LT(++steps, 10000);
  }
  EXPECT_GT(engine.scheduler().n_preemptions(), 0);
  EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
  EXPECT_EQ(engine.scheduler().n_free_slots(), 16);

  // Alone: generate() on a model of one sequence and a pool that needs no preemption; then one
  // forward over prompt + output for every row's logits, whose margins say where ties are close.
  auto alone = load(/*n_blocks=*/8, /*max_seqs=*/1, /*max_batch_tokens=*/128,
                    /*max_logit_rows=*/128);
  ASSERT_NE(alone, nullptr);
  int64_t compared = 0;
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    EXPECT_EQ(finished[i], 1) << "request " << i;
    GenerateOptions options;
    options.max_tokens = w.max_tokens[i];
    Result<GenerateResult> want = generate(*alone, w.prompts[i], options);
    ASSERT_TRUE(want.ok()) << want.message();
    ASSERT_EQ(got[i].size(), want->output_ids.size()) << "request " << i;
    std::vector<int32_t> all = w.prompts[i];
    all.insert(all.end(), want->output_ids.begin(), want->output_ids.end() - 1);
    std::vector<int32_t> seq(all.size(), 0), pos(all.size()), rows(all.size());
    for (size_t r = 0; r < all.size(); ++r) pos[r] = rows[r] = int32_t(r);
    BlockAllocator allocator(alone->n_blocks(), alone->block_size());
    BlockTable table;
    allocator.append(table, int64_t(all.size()));
    Result<ScopedSequence> slot = ScopedSequence::allocate(*alone);
    ASSERT_TRUE(slot.ok());
    const int32_t s = slot->slot();
    Result<std::vector<float>> logits = alone->forward(
        {all, seq, pos, {&table}, rows, std::span<const int32_t>(&s, 1)});
    ASSERT_TRUE(logits.ok()) << logits.message();
    const std::vector<float> m = margins(*logits, vocab);
    for (size_t k = 0; k < got[i].size(); ++k) {
      if (m[w.prompts[i].size() - 1 + k] < 1e-3f) break;  // a near tie: either token is right
      ASSERT_EQ(got[i][k], want->output_ids[k]) << "request " << i << " token " << k;
      ++compared;
    }
  }
  EXPECT_GT(compared, 100);
}

// Abort mid-prefill and mid-decode gives back every block and slot; the others still finish.
TEST_P(EngineTest, AbortFreesEverything) {
  auto model = load(/*n_blocks=*/16, /*max_seqs=*/4, /*max_batch_tokens=*/16);
  ASSERT_NE(model, nullptr);
  const Workload w = make_workload(model->vocab_size(), 3, 11);
  Engine engine(*model, {});
  std::vector<int32_t> long_prompt(40, 5);
  RequestParams params;
  params.max_tokens = 8;
  Result<RequestId> prefilling = engine.add_request(long_prompt, params);
  Result<RequestId> decoding = engine.add_request({1, 2, 3}, params);
  Result<RequestId> other = engine.add_request({4, 5}, params);
  ASSERT_TRUE(prefilling.ok() && decoding.ok() && other.ok());
  ASSERT_TRUE(engine.step().ok());  // 16 rows: the long prompt's first chunk only
  ASSERT_TRUE(engine.step().ok());
  EXPECT_TRUE(engine.abort(*prefilling));   // its prompt is not through yet (40 > 32)
  ASSERT_TRUE(engine.step().ok());
  ASSERT_TRUE(engine.step().ok());
  EXPECT_TRUE(engine.abort(*decoding));
  EXPECT_FALSE(engine.abort(*decoding));
  int64_t tokens = 0;
  while (engine.has_unfinished()) {
    Result<std::vector<RequestUpdate>> updates = engine.step();
    ASSERT_TRUE(updates.ok());
    for (const RequestUpdate& u : *updates) {
      EXPECT_EQ(u.id, *other);
      tokens += int64_t(u.new_tokens.size());
    }
  }
  EXPECT_GT(tokens, 0);
  EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
  EXPECT_EQ(engine.scheduler().n_free_slots(), 4);
  // The model's own slots are all free again: 4 sequences can start.
  for (int32_t s = 0; s < 4; ++s) EXPECT_TRUE(model->begin_sequence(s).ok()) << s;
}

// A request's own bad input is refused when it is added; the others run.
TEST_P(EngineTest, BadRequestsAreRefusedAtAdmission) {
  auto model = load(/*n_blocks=*/4, /*max_seqs=*/2, /*max_batch_tokens=*/64);
  ASSERT_NE(model, nullptr);
  Engine engine(*model, {});
  RequestParams params;
  EXPECT_NE(engine.add_request({}, params).message().find("empty"), std::string::npos);
  EXPECT_NE(engine.add_request({1, int32_t(model->vocab_size())}, params).message().find(
                "outside the model's vocabulary"),
            std::string::npos);
  EXPECT_NE(engine.add_request(std::vector<int32_t>(128, 1), params).message().find(
                "max model length is 128"),
            std::string::npos);
  params.max_tokens = 100;  // 20 + 100 tokens > the pool's 64
  EXPECT_NE(engine.add_request(std::vector<int32_t>(20, 1), params).message().find("KV pool"),
            std::string::npos);
  params.sampling.temperature = -1;
  EXPECT_FALSE(engine.add_request({1}, params).ok());
  EXPECT_FALSE(engine.has_unfinished());
}

// Qwen4Exp's image and video placeholders need the vision tower e4kv does not run: a prompt with
// one is refused at admission, and a request that samples one ends with an error at that token,
// while the request batched with it runs on as it does alone.
TEST(EngineInputTokens, MediaPlaceholdersNeverReachAForwardThatRunsOthers) {
  TempDir tmp;
  SynthCheckpointOptions options;
  options.family = SynthFamily::kQwen4Exp;
  options.n_layers = 4;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), options).ok());
  auto backend = make_cpu_backend({2});
  ModelOptions model_options;
  model_options.block_size = 16;
  model_options.n_blocks = 16;
  model_options.max_model_len = 128;
  model_options.max_seqs = 4;
  auto run = [&](const std::vector<std::vector<int32_t>>& prompts) {
    Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
    EXPECT_TRUE(ckpt.ok()) << ckpt.message();
    auto model = load_model(*ckpt, *backend, model_options);
    EXPECT_TRUE(model.ok()) << model.message();
    Engine engine(**model, {});
    RequestParams params;
    params.max_tokens = 6;
    std::vector<std::vector<int32_t>> tokens(prompts.size());
    std::vector<std::string> reasons(prompts.size()), errors(prompts.size());
    for (const auto& p : prompts) EXPECT_TRUE(engine.add_request(p, params).ok());
    while (engine.has_unfinished()) {
      auto updates = engine.step();
      EXPECT_TRUE(updates.ok()) << updates.message();
      if (!updates.ok()) break;
      for (const RequestUpdate& u : *updates) {
        auto& t = tokens[size_t(u.id)];
        t.insert(t.end(), u.new_tokens.begin(), u.new_tokens.end());
        if (u.finished) {
          reasons[size_t(u.id)] = u.finish_reason;
          errors[size_t(u.id)] = u.error;
        }
      }
    }
    return std::make_tuple(tokens, reasons, errors);
  };
  const std::vector<int32_t> a = {5, 6, 7, 8}, b = {9, 10, 11};
  const auto [alone, alone_reasons, alone_errors] = run({a, b});
  ASSERT_EQ(alone[0].size(), 6u);
  // The second token request a samples becomes an image placeholder (b must not sample it).
  const int32_t placeholder = alone[0][1];
  ASSERT_EQ(std::count(alone[1].begin(), alone[1].end(), placeholder), 0)
      << "pick other prompts: both requests sample the placeholder";
  ASSERT_EQ(std::count(a.begin(), a.end(), placeholder) + std::count(b.begin(), b.end(), placeholder), 0);
  std::string config = testing_support::read_text(tmp.path() / "config.json");
  const size_t brace = config.find('{');
  config.insert(brace + 1, "\"image_token_id\": " + std::to_string(placeholder) + ", ");
  testing_support::write_text(tmp.path() / "config.json", config);

  const auto [tokens, reasons, errors] = run({a, b});
  EXPECT_EQ(reasons[0], "error");
  EXPECT_NE(errors[0].find("image or video placeholder"), std::string::npos) << errors[0];
  EXPECT_EQ(tokens[0], std::vector<int32_t>(alone[0].begin(), alone[0].begin() + 2));
  EXPECT_EQ(reasons[1], "length");
  EXPECT_EQ(tokens[1], alone[1]);

  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok());
  auto model = load_model(*ckpt, *backend, model_options);
  ASSERT_TRUE(model.ok());
  Engine engine(**model, {});
  const Result<RequestId> refused = engine.add_request({5, placeholder, 7}, RequestParams{});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("prompt token 1: id " + std::to_string(placeholder)),
            std::string::npos)
      << refused.message();
}

INSTANTIATE_TEST_SUITE_P(Families, EngineTest,
                         ::testing::Values("llama", "qwen4exp", "embedded"));

}  // namespace
}  // namespace e4kv
