// The public API (include/e4kv/engine.h) over a synthetic checkpoint with a tokenizer: its outputs
// equal the internal generate() loop's for the same prompts (the greedy and the seeded tokens),
// requests submitted from many threads at once each get their own result, abort from another
// thread and the destructor end requests with exactly one final output, and bad configurations and
// requests are refused naming the field.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "api/model_setup.h"
#include "e4kv/engine.h"
#include "engine/generate.h"
#include "io/tokenizer.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::TempDir;

// Every output a callback saw for one request, checked for the contract: one request id, the
// final output last and exactly once.
struct Recorded {
  std::mutex mu;
  std::vector<api::CompletionOutput> outputs;
  int n_final = 0;
  bool other_request = false;
  bool output_after_final = false;

  api::OutputCallback callback() {
    return [this](const api::CompletionOutput& out) {
      std::lock_guard lock(mu);
      if (!outputs.empty() && out.request_id != outputs.front().request_id) other_request = true;
      if (n_final > 0) output_after_final = true;
      if (out.finished) ++n_final;
      outputs.push_back(out);
    };
  }
  std::vector<int32_t> tokens() {
    std::lock_guard lock(mu);
    std::vector<int32_t> all;
    for (const auto& o : outputs) all.insert(all.end(), o.token_ids.begin(), o.token_ids.end());
    return all;
  }
  std::string text() {
    std::lock_guard lock(mu);
    std::string all;
    for (const auto& o : outputs) all += o.text;
    return all;
  }
  api::CompletionOutput last() {
    std::lock_guard lock(mu);
    return outputs.empty() ? api::CompletionOutput{} : outputs.back();
  }
  void expect_one_final() {
    std::lock_guard lock(mu);
    EXPECT_EQ(n_final, 1);
    EXPECT_FALSE(other_request);
    EXPECT_FALSE(output_after_final);
  }
};

// Waits until `done` says so, at most 60 s (a hang is a failure, not a stuck run).
template <class Pred>
bool wait_until(Pred done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

class LlmEngineApi : public ::testing::Test {
 protected:
  void SetUp() override {
    SynthCheckpointOptions options;
    options.n_layers = 2;
    options.hidden_size = 32;
    options.intermediate_size = 64;
    options.n_heads = 2;
    options.n_kv_heads = 1;
    options.head_dim = 16;
    options.vocab_size = 320;
    options.with_tokenizer = true;
    ASSERT_TRUE(write_synth_checkpoint(model_dir(), options).ok());
    Result<Tokenizer> tok = Tokenizer::from_model_dir(model_dir());
    ASSERT_TRUE(tok.ok()) << tok.message();
    tokenizer_.emplace(std::move(tok).value());
  }

  fs::path model_dir() const { return tmp_.path() / "model"; }

  api::EngineConfig config() const {
    api::EngineConfig c;
    c.model = model_dir().string();
    c.threads = 1;
    return c;
  }

  // The internal loop (engine/generate.h) on a model loaded the same way: the reference.
  std::vector<int32_t> reference(const std::vector<int32_t>& prompt, const api::SamplingParams& p) {
    if (!model_) {
      ModelSetup setup;
      setup.model_dir = model_dir().string();
      setup.threads = 1;
      Result<LoadedModel> loaded = load_model(setup, 4096);
      EXPECT_TRUE(loaded.ok()) << loaded.message();
      if (!loaded.ok()) return {};
      model_ = std::make_unique<LoadedModel>(std::move(loaded).value());
    }
    GenerateOptions options;
    options.max_tokens = p.max_tokens;
    options.sampling.temperature = p.temperature;
    options.sampling.top_p = p.top_p;
    options.sampling.top_k = p.top_k;
    options.sampling.seed = p.seed;
    Result<GenerateResult> r = generate(*model_->model, prompt, options);
    EXPECT_TRUE(r.ok()) << r.message();
    return r.ok() ? r->output_ids : std::vector<int32_t>{};
  }

  const Tokenizer& tokenizer() const { return *tokenizer_; }

  static std::vector<int32_t> prompt_ids(int i) {
    std::vector<int32_t> ids;
    for (int t = 0; t < 2 + (i * 7) % 23; ++t) ids.push_back(3 + (t * 37 + i * 101) % 300);
    return ids;
  }

  TempDir tmp_;
  std::optional<Tokenizer> tokenizer_;
  std::unique_ptr<LoadedModel> model_;
};

TEST_F(LlmEngineApi, GreedyOutputsEqualTheInternalGenerateLoop) {
  auto engine = api::LLMEngine::create(config());
  ASSERT_TRUE(engine.ok()) << engine.message();
  api::SamplingParams params;
  params.max_tokens = 12;
  params.ignore_eos = true;  // the reference loop is given no stop ids

  const std::string text = "The quick brown fox jumps";
  const std::string chat = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n";
  const std::vector<std::vector<int32_t>> prompts = {prompt_ids(1), tokenizer().encode(text, true),
                                                     tokenizer().encode(chat, false)};
  auto done =
      (*engine)->generate({api::Prompt(prompt_ids(1)), api::Prompt(text),
                           api::Prompt(std::vector<api::ChatMessage>{{"user", "Say hello."}})},
                          params);
  ASSERT_TRUE(done.ok()) << done.message();
  ASSERT_EQ(done->size(), 3u);
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    const api::Completion& c = (*done)[i];
    const std::vector<int32_t> want = reference(prompts[i], params);
    ASSERT_EQ(want.size(), 12u);
    EXPECT_EQ(c.token_ids, want);
    EXPECT_EQ(c.text, tokenizer().decode(want, /*skip_special_tokens=*/true));
    EXPECT_EQ(c.finish_reason, "length");
    EXPECT_EQ(c.usage.prompt_tokens, int64_t(prompts[i].size()));
    EXPECT_EQ(c.usage.completion_tokens, 12);
    EXPECT_EQ(c.usage.total_tokens, int64_t(prompts[i].size()) + 12);
  }
}

// The engine over two tensor-parallel ranks batches requests as over one: the same greedy tokens.
TEST_F(LlmEngineApi, TensorParallelRanksGiveTheSameGreedyOutputs) {
  api::EngineConfig c = config();
  c.threads = 2;
  c.tensor_parallel_size = 2;
  auto engine = api::LLMEngine::create(c);
  ASSERT_TRUE(engine.ok()) << engine.message();
  api::SamplingParams params;
  params.max_tokens = 10;
  params.ignore_eos = true;
  auto done = (*engine)->generate({api::Prompt(prompt_ids(0)), api::Prompt(prompt_ids(1)),
                                   api::Prompt(prompt_ids(2)), api::Prompt(prompt_ids(3))},
                                  params);
  ASSERT_TRUE(done.ok()) << done.message();
  ASSERT_EQ(done->size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ((*done)[size_t(i)].token_ids, reference(prompt_ids(i), params));
  api::EngineConfig bad = config();
  bad.tensor_parallel_size = 0;
  auto refused = api::LLMEngine::create(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().field(), "tensor_parallel_size");
}

TEST_F(LlmEngineApi, StreamsInOrderWithLogprobsAndStopStrings) {
  auto engine = api::LLMEngine::create(config());
  ASSERT_TRUE(engine.ok()) << engine.message();
  api::SamplingParams params;
  params.max_tokens = 10;
  params.ignore_eos = true;
  params.logprobs = 2;
  const std::vector<int32_t> want = reference(prompt_ids(4), params);
  auto stream = (*engine)->stream(prompt_ids(4), params);
  ASSERT_TRUE(stream.ok()) << stream.message();
  std::vector<int32_t> got;
  int n_final = 0;
  while (auto out = (*stream)->next()) {
    EXPECT_EQ(out->request_id, (*stream)->id());
    ASSERT_EQ(out->logprobs.size(), out->token_ids.size());
    for (size_t k = 0; k < out->token_ids.size(); ++k) {
      EXPECT_EQ(out->logprobs[k].token_id, out->token_ids[k]);
      EXPECT_EQ(out->logprobs[k].rank, 1);  // greedy: the most probable token
      ASSERT_EQ(out->logprobs[k].top_logprobs.size(), 2u);
      EXPECT_EQ(out->logprobs[k].top_logprobs[0].token_id, out->token_ids[k]);
    }
    got.insert(got.end(), out->token_ids.begin(), out->token_ids.end());
    EXPECT_EQ(out->usage.completion_tokens, int64_t(got.size()));
    n_final += out->finished;
  }
  EXPECT_EQ(n_final, 1);
  EXPECT_EQ(got, want);

  // A stop string taken from the middle of the greedy text ends the request there.
  const std::string full = tokenizer().decode(want, true);
  ASSERT_GE(full.size(), 6u);
  api::SamplingParams stopping = params;
  stopping.logprobs.reset();
  stopping.stop = {full.substr(full.size() / 2, 2)};
  auto stopped = (*engine)->generate({api::Prompt(prompt_ids(4))}, stopping);
  ASSERT_TRUE(stopped.ok()) << stopped.message();
  EXPECT_EQ((*stopped)[0].finish_reason, "stop");
  EXPECT_EQ((*stopped)[0].stop_string, stopping.stop[0]);
  EXPECT_EQ((*stopped)[0].text, full.substr(0, full.find(stopping.stop[0])));
}

TEST_F(LlmEngineApi, EightThreadsSubmittingConcurrentlyEachGetTheirOwnResult) {
  auto engine = api::LLMEngine::create(config());
  ASSERT_TRUE(engine.ok()) << engine.message();
  constexpr int kThreads = 8;
  constexpr int kPerThread = 4;
  // Request r: its own prompt, max_tokens and (every third) seeded sampling.
  auto params_of = [](int r) {
    api::SamplingParams p;
    p.max_tokens = 3 + r % 9;
    p.ignore_eos = true;
    if (r % 3 == 0) {
      p.temperature = 0.9;
      p.top_k = 40;
      p.seed = 1000 + uint64_t(r);
    }
    return p;
  };
  std::vector<Recorded> recorded(kThreads * kPerThread);
  std::vector<api::RequestId> ids(kThreads * kPerThread);
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kPerThread; ++k) {
        const int r = t * kPerThread + k;
        auto id = (*engine)->submit(prompt_ids(r), params_of(r), recorded[size_t(r)].callback());
        if (!id.ok()) {
          ++refused;
          continue;
        }
        ids[size_t(r)] = *id;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(refused.load(), 0);
  ASSERT_TRUE(wait_until([&] {
    for (Recorded& r : recorded) {
      std::lock_guard lock(r.mu);
      if (r.n_final == 0) return false;
    }
    return true;
  }));
  for (int r = 0; r < kThreads * kPerThread; ++r) {
    SCOPED_TRACE(r);
    Recorded& rec = recorded[size_t(r)];
    rec.expect_one_final();
    EXPECT_EQ(rec.last().request_id, ids[size_t(r)]);
    EXPECT_EQ(rec.last().finish_reason, "length");
    const std::vector<int32_t> want = reference(prompt_ids(r), params_of(r));
    EXPECT_EQ(rec.tokens(), want);
    EXPECT_EQ(rec.text(), tokenizer().decode(want, true));
  }
}

TEST_F(LlmEngineApi, AbortFromAnotherThreadMidDecodeEndsOnlyThatRequest) {
  auto engine = api::LLMEngine::create(config());
  ASSERT_TRUE(engine.ok()) << engine.message();
  api::SamplingParams long_params;
  long_params.max_tokens = 3000;
  long_params.ignore_eos = true;
  api::SamplingParams short_params;
  short_params.max_tokens = 20;
  short_params.ignore_eos = true;

  Recorded victim;
  std::vector<Recorded> others(3);
  auto id = (*engine)->submit(prompt_ids(7), long_params, victim.callback());
  ASSERT_TRUE(id.ok()) << id.message();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        (*engine)->submit(prompt_ids(20 + i), short_params, others[size_t(i)].callback()).ok());
  }
  std::thread aborter([&] {
    ASSERT_TRUE(wait_until([&] { return victim.tokens().size() >= 4; }));
    EXPECT_TRUE((*engine)->abort(*id));
  });
  aborter.join();
  ASSERT_TRUE(wait_until([&] {
    std::lock_guard lock(victim.mu);
    return victim.n_final > 0;
  }));
  victim.expect_one_final();
  EXPECT_EQ(victim.last().finish_reason, "abort");
  const size_t n = victim.tokens().size();
  EXPECT_GE(n, 4u);
  EXPECT_LT(n, 3000u);
  // What it produced before the abort is the greedy continuation's start.
  const std::vector<int32_t> prefix = reference(prompt_ids(7), [&] {
    api::SamplingParams p = long_params;
    p.max_tokens = int64_t(n);
    return p;
  }());
  EXPECT_EQ(victim.tokens(), prefix);
  EXPECT_FALSE((*engine)->abort(*id));  // finished: no longer in flight

  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    Recorded& rec = others[size_t(i)];
    ASSERT_TRUE(wait_until([&] {
      std::lock_guard lock(rec.mu);
      return rec.n_final > 0;
    }));
    rec.expect_one_final();
    EXPECT_EQ(rec.last().finish_reason, "length");
    EXPECT_EQ(rec.tokens(), reference(prompt_ids(20 + i), short_params));
  }
}

TEST_F(LlmEngineApi, DestructorWithRequestsInFlightGivesEachOneFinalOutput) {
  std::vector<Recorded> recorded(6);
  {
    auto engine = api::LLMEngine::create(config());
    ASSERT_TRUE(engine.ok()) << engine.message();
    api::SamplingParams params;
    params.max_tokens = 3000;
    params.ignore_eos = true;
    for (size_t i = 0; i < recorded.size(); ++i) {
      ASSERT_TRUE((*engine)->submit(prompt_ids(int(i)), params, recorded[i].callback()).ok());
    }
    ASSERT_TRUE(wait_until([&] { return !recorded[0].tokens().empty(); }));
    // The engine goes out of scope here with every request still running.
  }
  for (size_t i = 0; i < recorded.size(); ++i) {
    SCOPED_TRACE(i);
    recorded[i].expect_one_final();
    EXPECT_EQ(recorded[i].last().finish_reason, "abort");
  }
}

TEST_F(LlmEngineApi, NCompletionsAreTheSeededRunsAndEndOnce) {
  auto engine = api::LLMEngine::create(config());
  ASSERT_TRUE(engine.ok()) << engine.message();
  api::SamplingParams params;
  params.n = 3;
  params.max_tokens = 9;
  params.temperature = 1.0;
  params.seed = 40;
  params.ignore_eos = true;
  auto stream = (*engine)->stream(prompt_ids(3), params);
  ASSERT_TRUE(stream.ok()) << stream.message();
  std::vector<api::CompletionOutput> outs;
  while (std::optional<api::CompletionOutput> out = (*stream)->next()) outs.push_back(*out);
  // Each completion ends once; the request's last output is the only one with request_finished.
  std::map<int32_t, int> finals;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs[i].finished) ++finals[outs[i].index];
    EXPECT_EQ(outs[i].request_finished, i + 1 == outs.size()) << i;
  }
  EXPECT_EQ(finals, (std::map<int32_t, int>{{0, 1}, {1, 1}, {2, 1}}));
  EXPECT_EQ(outs.back().usage.completion_tokens, 27);
  EXPECT_EQ(outs.back().usage.prompt_tokens, int64_t(prompt_ids(3).size()));
  EXPECT_GE(outs.back().queue_seconds, 0.0);
  // Completion i is the request alone with seed + i.
  for (int32_t i = 0; i < 3; ++i) {
    std::vector<int32_t> tokens;
    for (const auto& o : outs) {
      if (o.index == i) tokens.insert(tokens.end(), o.token_ids.begin(), o.token_ids.end());
    }
    api::SamplingParams alone = params;
    alone.n = 1;
    alone.seed = 40 + uint64_t(i);
    EXPECT_EQ(tokens, reference(prompt_ids(3), alone)) << "completion " << i;
  }
  // n beyond max_num_seqs is refused at submit.
  api::SamplingParams too_many = params;
  too_many.n = 65;
  EXPECT_EQ((*engine)->submit(prompt_ids(1), too_many, {}).status().field(), "n");
  // Aborted mid-way: every completion still running gets its final "abort", the last one ends
  // the request.
  api::SamplingParams long_params = params;
  long_params.max_tokens = 3000;
  Recorded rec;
  auto id = (*engine)->submit(prompt_ids(5), long_params, rec.callback());
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(wait_until([&] { return rec.tokens().size() >= 6; }));
  EXPECT_TRUE((*engine)->abort(*id));
  ASSERT_TRUE(wait_until([&] {
    std::lock_guard lock(rec.mu);
    return !rec.outputs.empty() && rec.outputs.back().request_finished;
  }));
  std::lock_guard lock(rec.mu);
  std::map<int32_t, std::string> reasons;
  for (const auto& o : rec.outputs) {
    if (o.finished) reasons[o.index] = o.finish_reason;
  }
  EXPECT_EQ(reasons, (std::map<int32_t, std::string>{{0, "abort"}, {1, "abort"}, {2, "abort"}}));
  EXPECT_TRUE(wait_until([&] {
    const api::EngineStats s = (*engine)->stats();
    return s.running == 0 && s.waiting == 0 && s.kv_blocks_used == 0;
  }));
}

TEST_F(LlmEngineApi, BadConfigurationsAreRefusedNamingTheFieldOrFile) {
  api::EngineConfig missing = config();
  missing.model = (tmp_.path() / "no-such-model").string();
  auto r = api::LLMEngine::create(missing);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().field(), "model");
  EXPECT_NE(r.message().find("no-such-model: not a directory"), std::string::npos) << r.message();
  api::EngineConfig no_template = config();
  no_template.chat_template = (tmp_.path() / "missing.jinja").string();
  r = api::LLMEngine::create(no_template);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().field(), "chat_template");
  EXPECT_NE(r.message().find("missing.jinja: not a file"), std::string::npos) << r.message();

  api::EngineConfig empty = config();
  empty.model.clear();
  EXPECT_EQ(api::LLMEngine::create(empty).status().field(), "model");

  // An E4M3 cache over a checkpoint without K/V scales: the scale gate's message, nothing loaded.
  api::EngineConfig e4m3 = config();
  e4m3.kv_cache_dtype = "fp8_e4m3";
  r = api::LLMEngine::create(e4m3);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("KV scale gate: loaded 0/"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("missing: "), std::string::npos) << r.message();
  // Unit scales are the negative control: they load, and say so.
  e4m3.kv_scales_mode = "unit";
  r = api::LLMEngine::create(e4m3);
  ASSERT_TRUE(r.ok()) << r.message();
  bool control = false;
  for (const std::string& note : (*r)->notes()) {
    control = control || note.find("NEGATIVE CONTROL") != std::string::npos;
  }
  EXPECT_TRUE(control);

  struct Case {
    std::function<void(api::EngineConfig&)> change;
    std::string field;
    std::string text;
  };
  const std::vector<Case> cases = {
      {[](auto& c) { c.kv_cache_dtype = "fp8_e5m2"; }, "kv_cache_dtype", "fp8_e5m2"},
      {[](auto& c) { c.kv_scales_mode = "guess"; }, "kv_scales_mode", "guess"},
      {[](auto& c) { c.block_size = 24; }, "", "block_size: expected a positive multiple of 16"},
      {[](auto& c) { c.max_num_seqs = -1; }, "max_num_seqs", "must be >= 0"},
      {[](auto& c) { c.device = "tpu"; }, "", "device \"tpu\": expected cpu, cuda or cuda:N"},
      {[](auto& c) {
         c.kv_cache_memory_bytes = 1 << 20;
         c.num_gpu_blocks_override = 8;
       },
       "", "kv_cache_memory_bytes, num_gpu_blocks_override and gpu_memory_utilization each size"},
      {[](auto& c) { c.num_gpu_blocks_override = 2; }, "",
       "num_gpu_blocks_override: the KV cache pool holds 2 blocks"},
      {[](auto& c) { c.gpu_memory_utilization = 0.5; }, "",
       "gpu_memory_utilization: the CPU backend has no device memory"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    api::EngineConfig bad = config();
    c.change(bad);
    auto refused = api::LLMEngine::create(bad);
    ASSERT_FALSE(refused.ok());
    if (!c.field.empty()) {
      EXPECT_EQ(refused.status().field(), c.field);
    }
    EXPECT_NE(refused.message().find(c.text), std::string::npos) << refused.message();
  }
}

TEST_F(LlmEngineApi, BadRequestsAreRefusedAtSubmitNamingTheField) {
  api::EngineConfig small = config();
  small.max_model_len = 64;
  auto engine = api::LLMEngine::create(small);
  ASSERT_TRUE(engine.ok()) << engine.message();
  struct Case {
    api::Prompt prompt;
    std::function<void(api::SamplingParams&)> change;
    std::string field;
  };
  const std::vector<int32_t> ok_prompt = {5, 6, 7};
  const std::vector<Case> cases = {
      {ok_prompt, [](auto& p) { p.top_p = 1.5; }, "top_p"},
      {ok_prompt, [](auto& p) { p.temperature = -1; }, "temperature"},
      {ok_prompt, [](auto& p) { p.max_tokens = -1; }, "max_tokens"},
      {ok_prompt,
       [](auto& p) {
         p.min_tokens = 20;
         p.max_tokens = 10;
       },
       "min_tokens"},
      {ok_prompt, [](auto& p) { p.stop_token_ids = {320}; }, "stop_token_ids"},
      {ok_prompt, [](auto& p) { p.stop = {""}; }, "stop"},
      {ok_prompt, [](auto& p) { p.logprobs = 21; }, "logprobs"},
      {ok_prompt, [](auto& p) { p.prompt_logprobs = -2; }, "prompt_logprobs"},
      {ok_prompt, [](auto& p) { p.logit_bias[7] = 500; }, "logit_bias"},
      {std::vector<int32_t>{}, [](auto&) {}, "prompt"},
      {std::vector<int32_t>{1, 320}, [](auto&) {}, "prompt"},
      {std::vector<int32_t>(64, 5), [](auto&) {}, "prompt"},
      {std::string("\xff bad"), [](auto&) {}, "prompt"},
      {std::vector<api::ChatMessage>{}, [](auto&) {}, "messages"},
  };
  std::atomic<int> calls{0};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    api::SamplingParams p;
    c.change(p);
    auto id = (*engine)->submit(c.prompt, p, [&](const api::CompletionOutput&) { ++calls; });
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().field(), c.field) << id.message();
    EXPECT_EQ(id.message().rfind(c.field + ": ", 0), 0u) << id.message();
  }
  // generate() says which prompt, and queues none of them.
  api::SamplingParams p;
  p.max_tokens = 4;
  auto batch =
      (*engine)->generate({api::Prompt(ok_prompt), api::Prompt(std::vector<int32_t>{})}, p);
  ASSERT_FALSE(batch.ok());
  EXPECT_EQ(batch.message().rfind("prompts[1]: prompt: ", 0), 0u) << batch.message();
  EXPECT_EQ(calls.load(), 0);
}

}  // namespace
}  // namespace e4kv
