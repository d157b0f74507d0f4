// The host cost of a decode step, part by part. The scheduler (engine/scheduler.h): one schedule() and one
// append_token per running sequence, with 1, 64 and 256 sequences decoding at 4K-5K tokens each
// over blocks of 16. The engine's target for the whole host side of a step (scheduling, the host
// half of the forward, sampling, output processing) is 0.3 ms at 256 sequences; this measures the
// first part alone.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/scheduler.h"

namespace {

constexpr int64_t kContext = 4096;
constexpr int64_t kMaxLen = 5120;

std::vector<int32_t> prompt(int64_t n) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[size_t(i)] = int32_t(i % 1000);
  return p;
}

// Admits and prefills one sequence of kContext tokens (untimed by the caller).
void start(e4kv::Scheduler& s, e4kv::SequenceId id) {
  (void)s.add(id, prompt(kContext), kMaxLen);
  while (true) {
    const e4kv::StepPlan plan = s.schedule();
    bool sampled = false;
    for (const e4kv::ScheduledChunk& c : plan.chunks) {
      if (c.samples) {
        s.append_token(c.id, 1);
        sampled = sampled || c.id == id;
      }
    }
    if (sampled) return;
  }
}

void BM_SchedulerDecodeStep(benchmark::State& state) {
  const int64_t n_seqs = state.range(0);
  e4kv::SchedulerConfig config;
  config.max_num_batched_tokens = 8192;
  config.max_num_seqs = n_seqs;
  config.n_state_slots = n_seqs;
  config.block_size = 16;
  config.n_blocks = n_seqs * (kMaxLen / 16 + 1);
  config.max_model_len = kMaxLen;
  e4kv::Scheduler s(config);
  e4kv::SequenceId next = 0;
  for (int64_t i = 0; i < n_seqs; ++i) start(s, next++);
  int64_t rows = 0;
  for (auto _ : state) {
    const e4kv::StepPlan plan = s.schedule();
    std::vector<e4kv::SequenceId> full;
    for (const e4kv::ScheduledChunk& c : plan.chunks) {
      s.append_token(c.id, 2);
      if (int64_t(s.find(c.id)->tokens.size()) >= kMaxLen) full.push_back(c.id);
    }
    rows += plan.n_tokens;
    if (!full.empty()) {  // a sequence at its end is replaced by a fresh one, untimed
      state.PauseTiming();
      for (const e4kv::SequenceId id : full) {
        s.remove(id);
        start(s, next++);
      }
      state.ResumeTiming();
    }
  }
  state.counters["rows_per_step"] = benchmark::Counter(double(rows) / double(state.iterations()));
}
BENCHMARK(BM_SchedulerDecodeStep)->Arg(1)->Arg(64)->Arg(256)->Unit(benchmark::kMicrosecond);

}  // namespace

// The host sampler's cost per row at Llama-3's vocabulary (128,256 logits): what a decode step of
// 256 sequences pays today when every row is sampled on the host (the engine's device sampler is
// to come). Greedy is an argmax; temperature with top-p sorts the vocabulary.
#include "engine/sampler.h"

namespace {

std::vector<float> vocab_logits() {
  std::vector<float> logits(128256);
  uint64_t x = 88172645463325252ull;
  for (float& l : logits) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    l = float(x % 20000) / 1000.0f - 10.0f;
  }
  return logits;
}

void BM_HostSampleRow(benchmark::State& state) {
  const std::vector<float> logits = vocab_logits();
  e4kv::SamplingParams params;
  if (state.range(0) == 1) {
    params.temperature = 0.8;
    params.top_p = 0.95;
  }
  e4kv::Sampler sampler(params);
  for (auto _ : state) benchmark::DoNotOptimize(sampler.sample(logits));
}
BENCHMARK(BM_HostSampleRow)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

}  // namespace

// The host side of a whole decode step, part by part, at 1, 64 and 256 running sequences:
//   BM_EngineDecodeStepHost  Engine::step over a model whose forward costs nothing (its logits are
//                            left ready in backend memory): scheduling, assembling the batch,
//                            the backend draw's bookkeeping (upload of the draw rows, readback of
//                            the tokens), appending tokens, finish checks. A tiny vocabulary, so
//                            the draw itself (device work on a GPU) costs nothing here.
//   BM_StepContextBuild      the host half of the forward's metadata for the dense 8B shape
//                            (Llama-3-8B: 32 layers, 8 KV heads x 128, RoPE 128, vocabulary
//                            128,256): checks, slot mapping, block tables, RoPE rows, the upload.
//   BM_OutputProcessorStep   the output processor on one token per sequence (incremental
//                            detokenization, stop-string scan against two stop strings).
// Their sum is the host cost per step the engine's target (0.3 ms at 256) is about; launching the
// forward's kernels is the device half's cost (CUDA graphs replace it), measured on the GPU.
#include "backend/cpu/cpu_backend.h"
#include "engine/engine.h"
#include "engine/output.h"
#include "io/tokenizer.h"
#include "model/rope.h"
#include "model/step_context.h"
#include "testing/synth_tokenizer.h"

namespace {

constexpr int64_t kHostVocab = 32;

// A model whose forward only checks the batch's shape and returns logits already in memory.
class FreeForwardModel final : public e4kv::Model {
 public:
  FreeForwardModel(e4kv::Backend& backend, int64_t n_seqs) : backend_(&backend) {
    config_.vocab_size = kHostVocab;
    limits_.max_model_len = kMaxLen;
    limits_.max_batch_tokens = 8192;
    limits_.max_seqs = n_seqs;
    limits_.max_logit_rows = n_seqs;
    limits_.max_seq_tokens = kMaxLen;
    limits_.max_blocks_per_seq = kMaxLen / 16;
    n_blocks_ = n_seqs * (kMaxLen / 16 + 1);
    logits_ = backend.allocate(size_t(n_seqs * kHostVocab) * sizeof(float)).value();
    std::vector<float> host(size_t(n_seqs * kHostVocab));
    for (size_t i = 0; i < host.size(); ++i) host[i] = float((i * 7919) % 97) / 10.0f;
    backend.copy_from_host(logits_.data(), host.data(), host.size() * sizeof(float));
  }
  const e4kv::ModelConfig& config() const override { return config_; }
  const e4kv::ModelLimits& limits() const override { return limits_; }
  const e4kv::KvScales& kv_scales() const override { return scales_; }
  e4kv::KvCacheDtype kv_cache_dtype() const override { return e4kv::KvCacheDtype::kF16; }
  int64_t block_size() const override { return 16; }
  int64_t n_blocks() const override { return n_blocks_; }
  e4kv::ModelMemory memory() const override { return {}; }
  e4kv::Backend& backend() const override { return *backend_; }
  e4kv::Result<e4kv::DeviceLogits> forward_device(const e4kv::ForwardBatch& batch) override {
    return e4kv::DeviceLogits{logits_.as<float>(), int64_t(batch.logit_rows.size()), kHostVocab};
  }
  e4kv::Result<int32_t> allocate_sequence() override { return 0; }
  e4kv::Status begin_sequence(int32_t) override { return e4kv::ok_status(); }
  e4kv::Status free_sequence(int32_t) override { return e4kv::ok_status(); }
  e4kv::Status copy_sequence_state(int32_t, int32_t) override { return e4kv::ok_status(); }
  e4kv::Status copy_blocks(std::span<const e4kv::BlockCopy>) override { return e4kv::ok_status(); }
  e4kv::Status start_kv_statistics() override { return e4kv::ok_status(); }
  e4kv::KvCacheView kv_cache(int64_t) const override { return {}; }
  e4kv::Result<std::vector<e4kv::LayerKvStats>> kv_statistics() override {
    return std::vector<e4kv::LayerKvStats>{};
  }
  void stop_kv_statistics() override {}
  void set_step_profiler(e4kv::StepProfiler*) override {}

 private:
  e4kv::Backend* backend_;
  e4kv::ModelConfig config_;
  e4kv::ModelLimits limits_;
  e4kv::KvScales scales_;
  int64_t n_blocks_ = 0;
  e4kv::BackendBuffer logits_;
};

void BM_EngineDecodeStepHost(benchmark::State& state) {
  const int64_t n_seqs = state.range(0);
  std::unique_ptr<e4kv::Backend> backend = e4kv::make_cpu_backend({1});
  FreeForwardModel model(*backend, n_seqs);
  e4kv::Engine engine(model, {});
  e4kv::RequestParams params;
  params.max_tokens = kMaxLen - kContext - 8;
  params.ignore_eos = true;
  // Greedy: the draw's own work (the Gumbel noise of every token) is device work on a GPU; here
  // the CPU backend runs it, so a sampling draw would be counted as host cost.
  std::vector<int32_t> ids = prompt(kContext);
  for (int32_t& id : ids) id %= int32_t(kHostVocab);
  for (int64_t i = 0; i < n_seqs; ++i) {
    if (!engine.add_request(ids, params).ok()) {
      state.SkipWithError("a request was refused");
      return;
    }
  }
  // A request at its max_tokens is replaced by a fresh one (untimed, its prefill included).
  auto replace_finished = [&](const std::vector<e4kv::RequestUpdate>& updates) {
    int64_t finished = 0;
    for (const e4kv::RequestUpdate& u : updates) {
      if (u.finished) {
        (void)engine.add_request(ids, params);
        ++finished;
      }
    }
    return finished;
  };
  // Untimed: until every sequence decodes one row per step.
  auto settle = [&] {
    for (int i = 0; i < 100000; ++i) {
      auto u = engine.step();
      if (!u.ok()) return;
      replace_finished(*u);
      if (int64_t(u->size()) == n_seqs) return;
    }
  };
  settle();
  int64_t rows = 0, steps = 0;
  for (auto _ : state) {
    auto updates = engine.step();
    ++steps;
    if (!updates.ok()) {
      state.SkipWithError(updates.message().c_str());
      break;
    }
    rows += int64_t(updates->size());
    state.PauseTiming();
    if (replace_finished(*updates) > 0) settle();
    state.ResumeTiming();
  }
  state.counters["rows_per_step"] = double(rows) / double(std::max<int64_t>(steps, 1));
}
BENCHMARK(BM_EngineDecodeStepHost)->Arg(1)->Arg(64)->Arg(256)->Unit(benchmark::kMicrosecond);

void BM_StepContextBuild(benchmark::State& state) {
  const int64_t n_seqs = state.range(0);
  std::unique_ptr<e4kv::Backend> backend = e4kv::make_cpu_backend({1});
  e4kv::ModelLimits limits;
  limits.max_model_len = kMaxLen;
  limits.max_batch_tokens = 8192;
  limits.max_seqs = 256;
  limits.max_logit_rows = 256;
  limits.max_seq_tokens = kMaxLen;
  limits.max_blocks_per_seq = kMaxLen / 16;
  const int64_t n_blocks = 256 * (kMaxLen / 16);
  e4kv::RopeTable rope;
  rope.rotary_dim = 128;
  for (int i = 0; i < 64; ++i) rope.inv_freq.push_back(std::pow(500000.0, -2.0 * i / 128.0));
  auto step = e4kv::StepContext::create(*backend, limits, rope.rotary_dim);
  if (!step.ok()) {
    state.SkipWithError(step.message().c_str());
    return;
  }
  // n_seqs sequences at kContext tokens, each decoding one row, blocks spread over the pool.
  std::vector<e4kv::BlockTable> tables(static_cast<size_t>(n_seqs));
  std::vector<int32_t> ids, row_seq, row_pos, logit_rows, slots;
  for (int64_t s = 0; s < n_seqs; ++s) {
    e4kv::BlockTable& t = tables[size_t(s)];
    t.n_tokens = kContext + 1;
    for (int64_t b = 0; b < (kContext + 1 + 15) / 16; ++b) {
      t.blocks.push_back(int32_t((b * 256 + s) % n_blocks));
    }
    ids.push_back(int32_t(s % 1000));
    row_seq.push_back(int32_t(s));
    row_pos.push_back(int32_t(kContext));
    logit_rows.push_back(int32_t(s));
    slots.push_back(int32_t(s));
  }
  e4kv::ForwardBatch batch;
  batch.token_ids = ids;
  batch.row_seq = row_seq;
  batch.row_pos = row_pos;
  batch.logit_rows = logit_rows;
  batch.seq_slots = slots;
  for (const e4kv::BlockTable& t : tables) batch.seqs.push_back(&t);
  for (auto _ : state) {
    const e4kv::Status st = step->build(batch, &rope, 128256, 16, n_blocks);
    if (!st.ok()) {
      state.SkipWithError(st.message().c_str());
      break;
    }
  }
}
BENCHMARK(BM_StepContextBuild)->Arg(1)->Arg(64)->Arg(256)->Unit(benchmark::kMicrosecond);

void BM_OutputProcessorStep(benchmark::State& state) {
  const int64_t n_seqs = state.range(0);
  auto json = e4kv::make_synth_tokenizer_json(4096);
  auto tokenizer = e4kv::Tokenizer::from_json(*json, "synthetic");
  if (!tokenizer.ok()) {
    state.SkipWithError(tokenizer.message().c_str());
    return;
  }
  e4kv::OutputProcessor processor(*tokenizer);
  e4kv::RequestParams params;
  params.stop = {"</answer>", "\n\nUser:"};
  for (int64_t i = 0; i < n_seqs; ++i) processor.add_request(i, params);
  std::vector<e4kv::RequestUpdate> updates(static_cast<size_t>(n_seqs));
  uint64_t x = 1;
  for (auto _ : state) {
    for (int64_t i = 0; i < n_seqs; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      updates[size_t(i)].id = i;
      updates[size_t(i)].new_tokens.assign(1, int32_t(3 + (x >> 33) % 4000));
    }
    auto outputs = processor.process(updates, nullptr);
    benchmark::DoNotOptimize(outputs);
  }
}
BENCHMARK(BM_OutputProcessorStep)->Arg(1)->Arg(64)->Arg(256)->Unit(benchmark::kMicrosecond);

}  // namespace

#include "backend/attention_plan.h"
#include "qsa/route_planner.h"

namespace {

// The CUDA backend's per-step attention plan (backend/attention_plan.h, plain C++ run on the host
// half of a step): the dense 8B shape (32 query heads of 128 over 8 KV heads, blocks of 64, FP16),
// `n` decode rows of `n` sequences at 4K-5K tokens, an H100's 132 SMs x 4 resident decode CTAs and
// cluster merge, the workspace sized at load. One plan serves every layer of the shape.
void BM_AttentionStepPlan(benchmark::State& state) {
  const int64_t n = state.range(0);
  e4kv::AttentionLayerShape shape;
  shape.head_dim = 128;
  shape.block_size = 64;
  shape.dtype = e4kv::KvCacheDtype::kF16;
  shape.n_heads = 32;
  shape.n_kv_heads = 8;
  e4kv::DecodeDeviceLimits device;
  device.resident_ctas = 132 * 4;
  device.cluster = e4kv::DecodeClusterMerge{132, 16};
  device.workspace_floats = e4kv::decode_workspace_floats_for_limits(shape, 256, kMaxLen, device);
  const std::vector<e4kv::AttentionRouteLimits> routes = e4kv::cuda_attention_routes();
  std::vector<int32_t> seq(static_cast<size_t>(n)), pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    seq[size_t(i)] = int32_t(i);
    pos[size_t(i)] = int32_t(kContext + (i * 37) % (kMaxLen - kContext));
  }
  e4kv::QueryBatchView rows;
  rows.n_rows = n;
  rows.row_seq = seq.data();
  rows.row_pos = pos.data();
  for (auto _ : state) {
    e4kv::Result<e4kv::AttentionStepPlan> plan =
        e4kv::plan_attention_step(routes, shape, rows, device);
    if (!plan.ok()) {
      state.SkipWithError(plan.message().c_str());
      break;
    }
    benchmark::DoNotOptimize(plan->decode_runs.data());
  }
}
BENCHMARK(BM_AttentionStepPlan)->Arg(1)->Arg(64)->Arg(256)->Unit(benchmark::kMicrosecond);

}  // namespace
