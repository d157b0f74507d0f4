// n > 1 completions of one prompt (RequestParams::n) on the CPU backend, for both families: the
// prompt is computed once (rows counted through a wrapper of the model), greedy completions equal
// the n = 1 greedy run, seeded completion i equals an n = 1 request seeded with seed + i run alone
// (sampled completions write different tokens into the shared partly filled last block: without
// the copy on write, or without the Qwen4Exp state copy, they would read each other's K/V or a
// zero state), and blocks and slots come back after the end, an abort and preemption. The
// Qwen4Exp model has a QSA budget below the sequences' lengths and a PLE layer, so that every
// per-sequence buffer (DeltaNet conv and recurrent states, the QSA raw ring, the PLE window and
// n-gram history) reaches the tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/engine.h"
#include "engine/output.h"
#include "io/checkpoint.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"
#include "testing/synth_tokenizer.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::TempDir;

// A model that counts what the engine asks of the one it wraps.
class CountingModel final : public Model {
 public:
  explicit CountingModel(Model& inner) : inner_(inner) {}

  const ModelConfig& config() const override { return inner_.config(); }
  const ModelLimits& limits() const override { return inner_.limits(); }
  const KvScales& kv_scales() const override { return inner_.kv_scales(); }
  KvCacheDtype kv_cache_dtype() const override { return inner_.kv_cache_dtype(); }
  int64_t block_size() const override { return inner_.block_size(); }
  int64_t n_blocks() const override { return inner_.n_blocks(); }
  ModelMemory memory() const override { return inner_.memory(); }
  Backend& backend() const override { return inner_.backend(); }
  Result<DeviceLogits> forward_device(const ForwardBatch& batch) override {
    rows += int64_t(batch.token_ids.size());
    return inner_.forward_device(batch);
  }
  std::string input_token_problem(int32_t id) const override {
    return inner_.input_token_problem(id);
  }
  Result<int32_t> allocate_sequence() override { return inner_.allocate_sequence(); }
  Status begin_sequence(int32_t slot) override { return inner_.begin_sequence(slot); }
  Status free_sequence(int32_t slot) override { return inner_.free_sequence(slot); }
  Status copy_sequence_state(int32_t src_slot, int32_t dst_slot) override {
    state_copies += 1;
    return inner_.copy_sequence_state(src_slot, dst_slot);
  }
  Status copy_blocks(std::span<const BlockCopy> copies) override {
    block_copies += int64_t(copies.size());
    return inner_.copy_blocks(copies);
  }
  Status start_kv_statistics() override { return inner_.start_kv_statistics(); }
  KvCacheView kv_cache(int64_t layer) const override { return inner_.kv_cache(layer); }
  Result<std::vector<LayerKvStats>> kv_statistics() override { return inner_.kv_statistics(); }
  void stop_kv_statistics() override { inner_.stop_kv_statistics(); }
  void set_step_profiler(StepProfiler* profiler) override { inner_.set_step_profiler(profiler); }

  int64_t rows = 0;
  int64_t state_copies = 0;
  int64_t block_copies = 0;

 private:
  Model& inner_;
};

class EngineN : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    SynthCheckpointOptions options;
    options.family = GetParam() == "qwen4exp" ? SynthFamily::kQwen4Exp : SynthFamily::kLlama;
    options.n_layers = GetParam() == "qwen4exp" ? 4 : 2;
    // Every per-sequence state in play: a QSA budget below the sequences' lengths (the selection
    // reads the compressed rows, hence the raw ring of a group in progress) and a PLE layer.
    options.index_budget = 8;
    options.ple_layer = 1;
    ASSERT_TRUE(write_synth_checkpoint(tmp_.path(), options).ok());
    Result<Checkpoint> ckpt = Checkpoint::open(tmp_.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    ckpt_ = std::make_unique<Checkpoint>(std::move(ckpt).value());
    backend_ = make_cpu_backend({2});
    reference_ = load(/*n_blocks=*/8, /*max_seqs=*/1, /*max_batch_tokens=*/128);
    ASSERT_NE(reference_, nullptr);
    vocab_ = reference_->vocab_size();
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

  // Completion tokens of each request: [request][index].
  struct Run {
    std::vector<std::vector<std::vector<int32_t>>> tokens;
    std::vector<std::vector<std::string>> finish_reason;
    int64_t preemptions = 0;
  };
  Run run_all(Model& model, const std::vector<std::vector<int32_t>>& prompts,
              const std::vector<RequestParams>& params) {
    Engine engine(model, {});
    std::map<RequestId, size_t> index;
    Run run;
    for (size_t i = 0; i < prompts.size(); ++i) {
      Result<RequestId> id = engine.add_request(prompts[i], params[i]);
      EXPECT_TRUE(id.ok()) << id.message();
      if (id.ok()) index[*id] = i;
      run.tokens.emplace_back(size_t(params[i].n));
      run.finish_reason.emplace_back(size_t(params[i].n));
    }
    std::vector<int> requests_finished(prompts.size(), 0);
    for (int steps = 0; engine.has_unfinished() && steps < 10000; ++steps) {
      Result<std::vector<RequestUpdate>> updates = engine.step();
      EXPECT_TRUE(updates.ok()) << updates.message();
      if (!updates.ok()) break;
      for (const RequestUpdate& u : *updates) {
        const size_t i = index.at(u.id);
        EXPECT_GE(u.index, 0);
        EXPECT_LT(u.index, params[i].n);
        std::vector<int32_t>& t = run.tokens[i][size_t(u.index)];
        EXPECT_TRUE(run.finish_reason[i][size_t(u.index)].empty()) << "an update after the end";
        t.insert(t.end(), u.new_tokens.begin(), u.new_tokens.end());
        if (u.finished) run.finish_reason[i][size_t(u.index)] = u.finish_reason;
        EXPECT_TRUE(!u.request_finished || u.finished);
        requests_finished[i] += u.request_finished;
        EXPECT_NE(u.finish_reason, "error") << u.error;
      }
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(requests_finished[i], 1) << "request " << i;
      for (const std::string& reason : run.finish_reason[i]) EXPECT_FALSE(reason.empty());
    }
    EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
    EXPECT_EQ(engine.scheduler().n_free_slots(), model.limits().max_seqs);
    run.preemptions = engine.scheduler().n_preemptions();
    return run;
  }

  // The tokens of an n = 1 request with `params` (n ignored) and `seed`, alone.
  std::vector<int32_t> alone(const std::vector<int32_t>& prompt, RequestParams params,
                             uint64_t seed) {
    params.n = 1;
    params.sampling.seed = seed;
    return run_all(*reference_, {prompt}, {params}).tokens.at(0).at(0);
  }

  std::vector<int32_t> random_prompt(std::mt19937_64& rng, int64_t len) const {
    std::vector<int32_t> p;
    for (int64_t t = 0; t < len; ++t) p.push_back(int32_t(3 + rng() % uint64_t(vocab_ - 3)));
    return p;
  }

  // Sampled, with penalties: completions diverge at once and depend on their own outputs.
  static RequestParams sampled(int64_t n, int64_t max_tokens, uint64_t seed) {
    RequestParams p;
    p.n = n;
    p.max_tokens = max_tokens;
    p.sampling.temperature = 1.0;
    p.sampling.top_k = 50;
    p.sampling.presence_penalty = 0.3;
    p.sampling.seed = seed;
    return p;
  }

  TempDir tmp_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> reference_;
  int64_t vocab_ = 0;
};

TEST_P(EngineN, GreedyCompletionsAreTheSingleGreedyRunAndThePromptRunsOnce) {
  std::mt19937_64 rng{21};
  const std::vector<int32_t> prompt = random_prompt(rng, 21);  // 16 + 5: a partly filled block
  auto model = load(/*n_blocks=*/16, /*max_seqs=*/4, /*max_batch_tokens=*/64);
  ASSERT_NE(model, nullptr);
  CountingModel counting(*model);
  RequestParams one;
  one.max_tokens = 9;
  const Run single = run_all(counting, {prompt}, {one});
  ASSERT_EQ(single.tokens[0][0].size(), 9u);
  // The last token is never fed: prompt + 8 rows.
  EXPECT_EQ(counting.rows, 21 + 8);
  EXPECT_EQ(counting.block_copies, 0);

  counting.rows = 0;
  RequestParams three = one;
  three.n = 3;
  const Run forked = run_all(counting, {prompt}, {three});
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(forked.tokens[0][size_t(i)], single.tokens[0][0]) << "completion " << i;
    EXPECT_EQ(forked.finish_reason[0][size_t(i)], "length");
  }
  // The prompt once, then 8 decode rows per completion.
  EXPECT_EQ(counting.rows, 21 + 3 * 8);
  EXPECT_EQ(counting.state_copies, 2);
  // Two of the three sharers of the partly filled block copy it before their first write.
  EXPECT_EQ(counting.block_copies, 2);
  EXPECT_EQ(alone(prompt, one, 0), single.tokens[0][0]);
}

TEST_P(EngineN, SeededCompletionIIsTheRequestSeededWithSeedPlusIAlone) {
  std::mt19937_64 rng{22};
  const std::vector<int32_t> prompt = random_prompt(rng, 19);
  const RequestParams p = sampled(/*n=*/4, /*max_tokens=*/12, /*seed=*/700);
  auto model = load(/*n_blocks=*/24, /*max_seqs=*/4, /*max_batch_tokens=*/64);
  ASSERT_NE(model, nullptr);
  CountingModel counting(*model);
  const Run run = run_all(counting, {prompt}, {p});
  EXPECT_EQ(counting.block_copies, 3);
  EXPECT_EQ(run.preemptions, 0);
  std::set<std::vector<int32_t>> distinct;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(run.tokens[0][i], alone(prompt, p, 700 + i)) << "completion " << i;
    EXPECT_EQ(run.tokens[0][i].size(), 12u);
    distinct.insert(run.tokens[0][i]);
  }
  EXPECT_EQ(distinct.size(), 4u) << "the completions did not diverge: the test shows nothing";
  // Completion 0 is the n = 1 request with the same seed.
  RequestParams single = p;
  single.n = 1;
  EXPECT_EQ(run_all(*model, {prompt}, {single}).tokens[0][0], run.tokens[0][0]);
}

// A pool too small for every completion at once: forks are preempted (their shared blocks only
// lose a reference) and recompute from the prompt and their own tokens; forks that find no free
// sequence slot wait and recompute. The tokens are those of each completion alone.
TEST_P(EngineN, PreemptedAndWaitingForksContinueAsAlone) {
  std::mt19937_64 rng{23};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestParams> params;
  for (int r = 0; r < 3; ++r) {
    prompts.push_back(random_prompt(rng, 10 + 7 * r));
    params.push_back(sampled(/*n=*/3, /*max_tokens=*/14 + 3 * r, /*seed=*/40 + 10 * uint64_t(r)));
  }
  params[1].sampling.temperature = 0.0;  // greedy: three equal completions
  // 8 blocks of 16 (128 tokens) for 9 sequences of up to 41; 4 sequences at once.
  auto model = load(/*n_blocks=*/8, /*max_seqs=*/4, /*max_batch_tokens=*/24);
  ASSERT_NE(model, nullptr);
  const Run run = run_all(*model, prompts, params);
  EXPECT_GT(run.preemptions, 0);
  for (size_t r = 0; r < prompts.size(); ++r) {
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(run.tokens[r][i], alone(prompts[r], params[r], params[r].sampling.seed + i))
          << "request " << r << " completion " << i;
    }
  }
  // The model's own slots are all free again.
  for (int32_t s = 0; s < 4; ++s) EXPECT_TRUE(model->begin_sequence(s).ok()) << s;
}

TEST_P(EngineN, AbortEndsEveryCompletionAndFreesEverything) {
  std::mt19937_64 rng{24};
  auto model = load(/*n_blocks=*/16, /*max_seqs=*/4, /*max_batch_tokens=*/32);
  ASSERT_NE(model, nullptr);
  Engine engine(*model, {});
  Result<RequestId> id = engine.add_request(random_prompt(rng, 20), sampled(3, 30, 1));
  ASSERT_TRUE(id.ok()) << id.message();
  std::set<int32_t> indices;
  for (int s = 0; s < 4; ++s) {
    Result<std::vector<RequestUpdate>> updates = engine.step();
    ASSERT_TRUE(updates.ok()) << updates.message();
    for (const RequestUpdate& u : *updates) indices.insert(u.index);
  }
  EXPECT_EQ(indices, (std::set<int32_t>{0, 1, 2}));
  EXPECT_EQ(engine.scheduler().n_running(), 3);
  EXPECT_GT(engine.scheduler().n_used_blocks(), 0);
  // One completion ends alone; then the whole request.
  EXPECT_TRUE(engine.abort(*id, 1));
  EXPECT_FALSE(engine.abort(*id, 1));
  EXPECT_EQ(engine.scheduler().n_running(), 2);
  ASSERT_TRUE(engine.step().ok());
  EXPECT_TRUE(engine.abort(*id));
  EXPECT_FALSE(engine.abort(*id));
  EXPECT_FALSE(engine.has_unfinished());
  EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
  EXPECT_EQ(engine.scheduler().n_free_slots(), 4);
  for (int32_t s = 0; s < 4; ++s) EXPECT_TRUE(model->begin_sequence(s).ok()) << s;
}

TEST_P(EngineN, AbortBeforeTheForkFreesThePrompt) {
  auto model = load(/*n_blocks=*/16, /*max_seqs=*/4, /*max_batch_tokens=*/16);
  ASSERT_NE(model, nullptr);
  Engine engine(*model, {});
  Result<RequestId> id = engine.add_request(std::vector<int32_t>(40, 7), sampled(3, 8, 1));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(engine.step().ok());  // 16 of 40 prompt tokens
  EXPECT_TRUE(engine.abort(*id));
  EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
  EXPECT_EQ(engine.scheduler().n_free_slots(), 4);
  EXPECT_FALSE(engine.has_unfinished());
}

TEST_P(EngineN, ParameterLimits) {
  auto model = load(/*n_blocks=*/16, /*max_seqs=*/4, /*max_batch_tokens=*/32);
  ASSERT_NE(model, nullptr);
  Engine engine(*model, {});
  RequestParams p;
  p.n = 0;
  Result<RequestId> id = engine.add_request({1, 2, 3}, p);
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.message().find("n"), std::string::npos) << id.message();
  p.n = kMaxCompletions + 1;
  EXPECT_FALSE(validate_request_params(p, 0).ok());
  p.n = 5;  // more than max_seqs = 4
  id = engine.add_request({1, 2, 3}, p);
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.message().find("max_num_seqs"), std::string::npos) << id.message();
  p.n = 4;
  EXPECT_TRUE(engine.add_request({1, 2, 3}, p).ok());
  // max_tokens 0: every completion finishes without a forward.
  p.max_tokens = 0;
  p.n = 2;
  Result<RequestId> empty = engine.add_request({1, 2, 3}, p);
  ASSERT_TRUE(empty.ok());
  Result<std::vector<RequestUpdate>> updates = engine.step();
  ASSERT_TRUE(updates.ok());
  int ended = 0;
  for (const RequestUpdate& u : *updates) {
    if (u.id != *empty) continue;
    EXPECT_TRUE(u.finished);
    EXPECT_EQ(u.finish_reason, "length");
    EXPECT_EQ(u.request_finished, u.index == 1);
    ++ended;
  }
  EXPECT_EQ(ended, 2);
}

// A stop string ends only the completion whose text holds it (the output processor ends it in
// the engine); the others run on, and the request ends with the last.
TEST_P(EngineN, StopStringEndsOneCompletion) {
  Result<std::string> json = make_synth_tokenizer_json(vocab_);
  ASSERT_TRUE(json.ok()) << json.message();
  Result<Tokenizer> tok = Tokenizer::from_json(*json, "synth");
  ASSERT_TRUE(tok.ok()) << tok.message();
  std::mt19937_64 rng{25};
  const std::vector<int32_t> prompt = random_prompt(rng, 11);
  RequestParams p = sampled(/*n=*/3, /*max_tokens=*/20, /*seed=*/5);
  p.ignore_eos = true;
  // A stop string from completion 1's own text (alone) that completion 0's text lacks.
  std::vector<std::string> texts;
  for (uint64_t i = 0; i < 3; ++i) {
    StreamingDecoder decoder(*tok, true);
    std::string text;
    for (int32_t t : alone(prompt, p, 5 + i)) text += decoder.push(t);
    texts.push_back(text + decoder.finish());
  }
  std::string stop;
  for (size_t at = 2; at + 2 <= texts[1].size() && stop.empty(); ++at) {
    const std::string candidate = texts[1].substr(at, 2);
    if (texts[0].find(candidate) == std::string::npos &&
        texts[2].find(candidate) == std::string::npos &&
        static_cast<unsigned char>(candidate[0]) < 0x80 &&
        static_cast<unsigned char>(candidate[1]) < 0x80) {
      stop = candidate;
    }
  }
  ASSERT_FALSE(stop.empty()) << "no stop string only completion 1 has";
  p.stop = {stop};
  auto model = load(/*n_blocks=*/16, /*max_seqs=*/4, /*max_batch_tokens=*/32);
  ASSERT_NE(model, nullptr);
  Engine engine(*model, {});
  OutputProcessor processor(*tok);
  Result<RequestId> id = engine.add_request(prompt, p);
  ASSERT_TRUE(id.ok());
  processor.add_request(*id, p);
  std::vector<std::string> got(3);
  std::vector<std::string> reason(3);
  int request_finished = 0;
  for (int steps = 0; engine.has_unfinished() && steps < 1000; ++steps) {
    Result<std::vector<RequestUpdate>> updates = engine.step();
    ASSERT_TRUE(updates.ok());
    for (const RequestOutput& out : processor.process(*updates, &engine)) {
      got[size_t(out.index)] += out.new_text;
      if (out.finished) reason[size_t(out.index)] = out.finish_reason;
      request_finished += out.request_finished;
    }
  }
  EXPECT_EQ(request_finished, 1);
  EXPECT_EQ(reason[0], "length");
  EXPECT_EQ(reason[1], "stop");
  EXPECT_EQ(reason[2], "length");
  EXPECT_EQ(got[0], texts[0]);
  EXPECT_EQ(got[1], texts[1].substr(0, texts[1].find(stop)));
  EXPECT_EQ(got[2], texts[2]);
  EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
  EXPECT_EQ(processor.n_requests(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Families, EngineN, ::testing::Values("llama", "qwen4exp"));

}  // namespace
}  // namespace e4kv
