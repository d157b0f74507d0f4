// The scheduler's share of a decode step's host cost (engine/scheduler.h): one schedule() and one
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
