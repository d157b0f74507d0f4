// The host cost of a decode step, part by part. The scheduler (engine/scheduler.h): one schedule() and one
// append_token per running sequence, with 1, 64 and 256 sequences decoding at 4K-5K tokens each
// over blocks of 16. The engine's target for the whole host side of a step (scheduling, the host
// half of the forward, sampling, output processing) is 0.3 ms at 256 sequences; this measures the
// first part alone.
#include <benchmark/benchmark.h>

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
