// The engine's per-request sampling on the CPU backend: seeded sampling alone and in a batch,
// min_tokens and ignore_eos, raw log-probabilities and prompt log-probabilities against a full
// forward's logits (log_softmax computed here in double), and a stop string that ends the request
// in the engine through the output processor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
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

// log(exp(l_t) / sum_j exp(l_j)) in double, shifted by the maximum.
double log_softmax_at(std::span<const float> row, int32_t token) {
  double m = -INFINITY;
  for (float l : row) m = std::max(m, double(l));
  double total = 0.0;
  for (float l : row) total += std::exp(double(l) - m);
  return double(row[size_t(token)]) - m - std::log(total);
}

class EngineSampling : public ::testing::TestWithParam<std::string> {
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
    reference_ = load(/*n_blocks=*/8, /*max_seqs=*/1, /*max_batch_tokens=*/128,
                      /*max_logit_rows=*/128);
    ASSERT_NE(reference_, nullptr);
    vocab_ = reference_->vocab_size();
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

  // The logits of every row of one forward over `tokens` in a fresh sequence, [rows * vocab].
  std::vector<float> full_logits(const std::vector<int32_t>& tokens) {
    std::vector<int32_t> seq(tokens.size(), 0), pos(tokens.size());
    for (size_t r = 0; r < tokens.size(); ++r) pos[r] = int32_t(r);
    BlockAllocator allocator(reference_->n_blocks(), reference_->block_size());
    BlockTable table;
    allocator.append(table, int64_t(tokens.size()));
    Result<ScopedSequence> slot = ScopedSequence::allocate(*reference_);
    EXPECT_TRUE(slot.ok());
    const int32_t s = slot->slot();
    Result<std::vector<float>> logits = reference_->forward(
        {tokens, seq, pos, {&table}, pos, std::span<const int32_t>(&s, 1)});
    EXPECT_TRUE(logits.ok()) << logits.message();
    return logits.ok() ? *logits : std::vector<float>{};
  }

  std::span<const float> row(const std::vector<float>& logits, size_t r) const {
    return std::span<const float>(logits).subspan(r * size_t(vocab_), size_t(vocab_));
  }

  struct Run {
    std::vector<int32_t> tokens;
    std::vector<RequestUpdate> updates;
    std::string finish_reason;
  };
  // Runs the requests to the end on one engine; results in request order.
  std::vector<Run> run_all(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                           const std::vector<RequestParams>& params) {
    Engine engine(model, {});
    std::map<RequestId, size_t> index;
    for (size_t i = 0; i < prompts.size(); ++i) {
      Result<RequestId> id = engine.add_request(prompts[i], params[i]);
      EXPECT_TRUE(id.ok()) << id.message();
      if (id.ok()) index[*id] = i;
    }
    std::vector<Run> runs(prompts.size());
    for (int steps = 0; engine.has_unfinished() && steps < 10000; ++steps) {
      Result<std::vector<RequestUpdate>> updates = engine.step();
      EXPECT_TRUE(updates.ok()) << updates.message();
      if (!updates.ok()) break;
      for (const RequestUpdate& u : *updates) {
        Run& run = runs[index.at(u.id)];
        run.tokens.insert(run.tokens.end(), u.new_tokens.begin(), u.new_tokens.end());
        run.updates.push_back(u);
        if (u.finished) run.finish_reason = u.finish_reason;
        EXPECT_NE(u.finish_reason, "error") << u.error;
      }
    }
    preemptions_ = engine.scheduler().n_preemptions();
    return runs;
  }

  std::vector<int32_t> random_prompt(std::mt19937_64& rng, int64_t len) const {
    std::vector<int32_t> p;
    for (int64_t t = 0; t < len; ++t) p.push_back(int32_t(3 + rng() % uint64_t(vocab_ - 3)));
    return p;
  }

  // Six seeded requests (prompts of 5-34 tokens, 12 tokens each; make(i) gives request i's
  // parameters) batched over a pool that preempts each get the tokens they get alone, and at least
  // one differs from its greedy run. With on_host, each also equals its run with logprobs asked,
  // which sends its rows to the host sampler.
  void expect_seeded_batch_equals_alone(uint64_t seed,
                                        const std::function<RequestParams(int)>& make,
                                        bool on_host) {
    std::mt19937_64 rng{seed};
    std::vector<std::vector<int32_t>> prompts;
    std::vector<RequestParams> params;
    for (int i = 0; i < 6; ++i) {
      prompts.push_back(random_prompt(rng, 5 + int64_t(rng() % 30)));
      params.push_back(make(i));
      params.back().max_tokens = 12;
    }
    auto batched = load(/*n_blocks=*/10, /*max_seqs=*/8, /*max_batch_tokens=*/32);
    ASSERT_NE(batched, nullptr);
    const std::vector<Run> together = run_all(*batched, prompts, params);
    EXPECT_GT(preemptions_, 0);
    int differs_from_greedy = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::vector<Run> alone = run_all(*reference_, {prompts[i]}, {params[i]});
      EXPECT_EQ(together[i].tokens, alone[0].tokens) << "request " << i;
      EXPECT_EQ(together[i].tokens.size(), 12u);
      if (on_host) {
        RequestParams host = params[i];
        host.logprobs = 0;
        EXPECT_EQ(run_all(*reference_, {prompts[i]}, {host})[0].tokens, alone[0].tokens)
            << "request " << i;
      }
      RequestParams greedy = params[i];
      greedy.sampling.temperature = 0.0;
      differs_from_greedy +=
          run_all(*reference_, {prompts[i]}, {greedy})[0].tokens != alone[0].tokens;
    }
    EXPECT_GT(differs_from_greedy, 0) << "the draws were all greedy";
  }

  TempDir tmp_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> reference_;
  int64_t vocab_ = 0;
  int64_t preemptions_ = 0;
};

// Each seeded request draws with its own seed and draw numbers: batched with others (chunked prefill, a pool
// small enough to preempt), it samples the tokens it samples alone.
TEST_P(EngineSampling, SeededSamplingIsTheSameAloneAndInABatch) {
  expect_seeded_batch_equals_alone(5, [](int i) {
    RequestParams p;
    p.sampling.temperature = 0.9;
    p.sampling.top_k = 50;
    p.sampling.top_p = 0.95;
    p.sampling.min_p = 0.01;
    p.sampling.presence_penalty = 0.2;
    p.sampling.frequency_penalty = 0.1;
    p.sampling.repetition_penalty = 1.1;
    p.sampling.seed = 100 + uint64_t(i);
    return p;
  }, /*on_host=*/false);
}

// Rows that need only the logits (temperature, min_p, a seed) are drawn by the backend
// (Backend::sample_rows) next to the logits; asking for logprobs sends the same request's rows to
// the host sampler. Both apply one draw rule with the same draw numbers, so the tokens are the
// same on either path, alone or batched with preemption.
TEST_P(EngineSampling, BackendDrawsEqualHostDrawsAloneAndInABatch) {
  expect_seeded_batch_equals_alone(9, [](int i) {
    RequestParams p;
    p.sampling.temperature = 0.8 + 0.1 * i;
    p.sampling.min_p = i % 2 == 0 ? 0.0 : 0.02;
    p.sampling.seed = 500 + uint64_t(i);
    return p;
  }, /*on_host=*/true);
}

TEST_P(EngineSampling, MinTokensSuppressesEosAndIgnoreEosRunsOn) {
  std::mt19937_64 rng{9};
  const std::vector<int32_t> prompt = random_prompt(rng, 12);
  RequestParams free_run;
  free_run.max_tokens = 6;
  const std::vector<int32_t> g = run_all(*reference_, {prompt}, {free_run})[0].tokens;
  ASSERT_EQ(g.size(), 6u);
  const int32_t eos = g[0];

  RequestParams p = free_run;
  p.eos_ids = {eos};
  Run stopped = run_all(*reference_, {prompt}, {p})[0];
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>{eos});
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.updates.back().stop_token, eos);

  p.min_tokens = 3;
  const Run held = run_all(*reference_, {prompt}, {p})[0];
  ASSERT_GE(held.tokens.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_NE(held.tokens[k], eos) << k;
  if (held.finish_reason == "stop") {
    EXPECT_EQ(held.tokens.back(), eos);
  }
  // The first token: the argmax of the prompt's last row with the EOS id left out.
  const std::vector<float> logits = full_logits(prompt);
  std::vector<float> last(row(logits, prompt.size() - 1).begin(),
                          row(logits, prompt.size() - 1).end());
  last[size_t(eos)] = -INFINITY;
  EXPECT_EQ(held.tokens[0], int32_t(std::max_element(last.begin(), last.end()) - last.begin()));

  p.min_tokens = 0;
  p.ignore_eos = true;
  const Run ignored = run_all(*reference_, {prompt}, {p})[0];
  EXPECT_EQ(ignored.tokens, g);
  EXPECT_EQ(ignored.finish_reason, "length");
  p.stop_ids = {eos};  // stop_token_ids stop whatever ignore_eos says
  EXPECT_EQ(run_all(*reference_, {prompt}, {p})[0].tokens, std::vector<int32_t>{eos});
}

// Logprobs are the raw model's: a bias of 100 on the least likely token makes greedy pick it, and
// its logprob is still the model's (the lowest), with rank and top-n of the unprocessed row.
TEST_P(EngineSampling, LogprobsAreTheRawModelsLogSoftmax) {
  std::mt19937_64 rng{13};
  const std::vector<int32_t> prompt = random_prompt(rng, 9);
  const std::vector<float> first = full_logits(prompt);
  const std::span<const float> last = row(first, prompt.size() - 1);
  const int32_t unlikely = int32_t(std::min_element(last.begin(), last.end()) - last.begin());
  RequestParams p;
  p.max_tokens = 5;
  p.logprobs = 5;
  p.sampling.logit_bias = {{unlikely, 100.0}};
  const Run run = run_all(*reference_, {prompt}, {p})[0];
  ASSERT_EQ(run.tokens, std::vector<int32_t>(5, unlikely));
  std::vector<TokenLogprobs> got;
  for (const RequestUpdate& u : run.updates) {
    EXPECT_EQ(u.logprobs.size(), u.new_tokens.size());
    got.insert(got.end(), u.logprobs.begin(), u.logprobs.end());
  }
  ASSERT_EQ(got.size(), 5u);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), run.tokens.begin(), run.tokens.end() - 1);
  const std::vector<float> logits = full_logits(all);
  for (size_t k = 0; k < got.size(); ++k) {
    const std::span<const float> r = row(logits, prompt.size() - 1 + k);
    EXPECT_EQ(got[k].token, unlikely);
    const double want = log_softmax_at(r, unlikely);
    EXPECT_NEAR(got[k].logprob, want, 1e-3) << k;
    if (k == 0) {
      EXPECT_LT(got[k].logprob, -std::log(double(vocab_))) << "not the raw logprob";
    }
    // Rank: 1 + the tokens more probable, up to near ties of the two forwards' arithmetic.
    const float x = r[size_t(unlikely)];
    const int64_t surely =
        std::count_if(r.begin(), r.end(), [&](float v) { return v > x + 1e-3f; });
    const int64_t maybe = std::count_if(r.begin(), r.end(), [&](float v) { return v > x - 1e-3f; });
    EXPECT_GE(got[k].rank, 1 + surely);
    EXPECT_LE(got[k].rank, maybe + 1);
    std::vector<double> sorted;
    for (size_t t = 0; t < r.size(); ++t) sorted.push_back(log_softmax_at(r, int32_t(t)));
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    ASSERT_EQ(got[k].top.size(), 5u);
    for (size_t n = 0; n < 5; ++n) {
      EXPECT_NEAR(got[k].top[n].logprob, sorted[n], 1e-3) << k << " " << n;
      EXPECT_NEAR(got[k].top[n].logprob, log_softmax_at(r, got[k].top[n].token), 1e-3);
    }
  }
}

// Prompt logprobs through a model that returns at most 4 logit rows per forward: the engine cuts
// its steps into several forwards; every prompt token after the first is scored once (also across
// a preemption), as one full forward scores it, and the tokens generated are those generated
// without prompt logprobs.
TEST_P(EngineSampling, PromptLogprobsEqualAFullForwardAcrossSplitForwards) {
  std::mt19937_64 rng{17};
  const std::vector<std::vector<int32_t>> prompts{random_prompt(rng, 40), random_prompt(rng, 25),
                                                  random_prompt(rng, 30)};
  std::vector<RequestParams> params(3);
  params[0].max_tokens = 4;
  params[0].prompt_logprobs = 3;
  params[1].max_tokens = 12;
  params[2].max_tokens = 6;
  params[2].prompt_logprobs = 0;
  auto small = load(/*n_blocks=*/6, /*max_seqs=*/4, /*max_batch_tokens=*/16,
                    /*max_logit_rows=*/4);
  ASSERT_NE(small, nullptr);
  ASSERT_EQ(small->limits().max_logit_rows, 4);
  const std::vector<Run> runs = run_all(*small, prompts, params);
  EXPECT_GT(preemptions_, 0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::vector<TokenLogprobs> got;
    int64_t next = 1;
    for (const RequestUpdate& u : runs[i].updates) {
      if (u.prompt_logprobs.empty()) continue;
      EXPECT_EQ(u.prompt_logprobs_start, next) << "request " << i;
      next += int64_t(u.prompt_logprobs.size());
      got.insert(got.end(), u.prompt_logprobs.begin(), u.prompt_logprobs.end());
    }
    std::vector<RequestParams> plain{params[i]};
    plain[0].prompt_logprobs = -1;
    EXPECT_EQ(runs[i].tokens, run_all(*reference_, {prompts[i]}, plain)[0].tokens) << i;
    if (params[i].prompt_logprobs < 0) {
      EXPECT_TRUE(got.empty());
      continue;
    }
    ASSERT_EQ(got.size(), prompts[i].size() - 1) << "request " << i;
    const std::vector<float> logits = full_logits(prompts[i]);
    for (size_t p = 1; p < prompts[i].size(); ++p) {
      const TokenLogprobs& lp = got[p - 1];
      const std::span<const float> r = row(logits, p - 1);
      EXPECT_EQ(lp.token, prompts[i][p]);
      EXPECT_NEAR(lp.logprob, log_softmax_at(r, prompts[i][p]), 1e-3) << i << " " << p;
      ASSERT_EQ(int64_t(lp.top.size()), params[i].prompt_logprobs);
      for (const TokenLogprob& t : lp.top) {
        EXPECT_NEAR(t.logprob, log_softmax_at(r, t.token), 1e-3);
      }
    }
  }
}

// A stop string that spans two tokens of a greedy run: the output processor cuts the text before
// it, reports "stop" with the string, and ends the request in the engine (its blocks come back).
TEST_P(EngineSampling, StopStringEndsTheRequestInTheEngine) {
  Result<std::string> json = make_synth_tokenizer_json(vocab_);
  ASSERT_TRUE(json.ok()) << json.message();
  Result<Tokenizer> tokenizer = Tokenizer::from_json(*json, "synth");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.message();
  std::mt19937_64 rng{21};
  const std::vector<int32_t> prompt = random_prompt(rng, 10);
  RequestParams p;
  p.max_tokens = 40;
  const std::vector<int32_t> g = run_all(*reference_, {prompt}, {p})[0].tokens;
  // Text after each token; a boundary whose neighbours are ASCII gives a two-byte stop string.
  StreamingDecoder decoder(*tokenizer, true);
  std::vector<std::string> text_after;
  std::string text;
  for (int32_t t : g) {
    text += decoder.push(t);
    text_after.push_back(text);
  }
  std::string stop;
  size_t stop_token = 0;
  for (size_t k = 1; k + 1 < g.size() && stop.empty(); ++k) {
    const std::string& before = text_after[k - 1];
    if (before.empty() || text_after[k].size() == before.size()) continue;
    const std::string candidate = text.substr(before.size() - 1, 2);
    if (static_cast<unsigned char>(candidate[0]) < 0x80 &&
        static_cast<unsigned char>(candidate[1]) < 0x80 &&
        text.find(candidate) == before.size() - 1) {
      stop = candidate;
      stop_token = k;
    }
  }
  ASSERT_FALSE(stop.empty()) << "no ASCII token boundary in the greedy text";

  Engine engine(*reference_, {});
  OutputProcessor processor(*tokenizer);
  p.stop = {stop};
  Result<RequestId> id = engine.add_request(prompt, p);
  ASSERT_TRUE(id.ok());
  processor.add_request(*id, p);
  std::string got;
  std::vector<int32_t> tokens;
  RequestOutput last;
  for (int steps = 0; engine.has_unfinished() && steps < 1000; ++steps) {
    Result<std::vector<RequestUpdate>> updates = engine.step();
    ASSERT_TRUE(updates.ok());
    for (const RequestOutput& out : processor.process(*updates, &engine)) {
      got += out.new_text;
      tokens.insert(tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
      last = out;
    }
  }
  EXPECT_TRUE(last.finished);
  EXPECT_EQ(last.finish_reason, "stop");
  EXPECT_EQ(last.stop_string, stop);
  EXPECT_EQ(got, text.substr(0, text.find(stop)));
  EXPECT_EQ(tokens, std::vector<int32_t>(g.begin(), g.begin() + std::ptrdiff_t(stop_token) + 1));
  EXPECT_FALSE(engine.has_unfinished());
  EXPECT_EQ(engine.scheduler().n_used_blocks(), 0);
  EXPECT_EQ(processor.n_requests(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Families, EngineSampling, ::testing::Values("llama", "qwen4exp"));

}  // namespace
}  // namespace e4kv
