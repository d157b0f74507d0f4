// QSA decode benchmark, end to end: one decode step of the target shape (batch 4, 16 q heads, 2 KV
// heads, head_dim 256, 128K context, block size 64; QSA budget 2048, indexer 4 heads x 128 dims,
// ratio 4; --batch N for other batch sizes), dense FP16 paged decode beside the full QSA step in
// one process. The QSA step is
// qsa_index_scores (writing the run maxima; rows with at most k = budget / ratio visible groups are
// skipped) -> qsa_top_k_select (kAuto, given the maxima) -> paged_decode_attention over that
// selection (width budget + 3, planned for budget + 3 keys by choose_decode_attention_plan: the
// splits merged in a thread-block cluster where that applies), with the main cache in FP16, E4M3
// through the software decoder (native_e4m3 = false) and E4M3 native where usable, then the last
// of these again with the splits merged by the second kernel ("-mk", side by side). Prints a table
// and writes JSON (argv[1], default qsa_decode.json); exits non-zero when the sanity check fails
// (after the warm-up every row selects budget + 3 tokens, the attention output holds no NaN).
// The decode rows sit at pos = kCtx - 2 with seq_len = pos + 1 (131071 tokens, in a cache sized for
// 131072): (pos + 1) % ratio == 3 gives the 3-token causal tail, so the selection is the widest
// one (budget + 3 keys, what the attention is planned for); at pos = kCtx - 1 the last group is
// complete and a row selects budget keys. Dense attends the same 131071 keys.
//
// Cold data: in a model the other layers evict the indexer cache and the KV between two steps of a
// layer. The QSA step rotates over `copies` compressed indexer caches (32 MB each; L2 is 60 MB),
// each filled from its own seed, so each copy selects other groups and the attention reads other
// KV tokens: a step reads an indexer copy and KV rows that the last copies - 1 steps did not. The
// copies are enough that the indexer caches together, and also the KV rows the copies' selections
// read (8.4 MB a step in E4M3), exceed 160 MB, so the attention timed alone is cold too (20 copies,
// 640 MB of indexer cache). Each copy has its own scores, run maxima and selection buffers, so the
// kernels can be timed alone on the same rotation. Dense reads its whole 1 GiB cache every step.
// "warm" is the QSA step on one copy (its indexer cache and selected KV stay in L2), for reference.
//
// Timing, every figure for one step: "stream" is time_ms (bench_timing.cuh: launches from the host
// on the default stream, back to back, median of 7 samples of 10 steps); "graph" captures, once on
// a non-default stream, ONE CUDA graph holding a sequence of steps over copies 0, 1, ..,
// copies - 1, 0, .. (whole rounds, at least 20 steps, so back-to-back replays keep the rotation),
// then times replays with CUDA events (median of 7 replays / steps). The per-kernel figures (scores
// with maxima, top-k, attention) run each kernel alone on the same rotation and in both modes.
// Kernels go out as programmatic dependents where the device has them (sm_90+, launch.cuh); the
// cold step and dense decode are timed again with plain launches (set_programmatic_launch(false))
// in the same process, for the side-by-side ratio.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "backend/cuda/qsa_index_scores.cuh"
#include "backend/cuda/qsa_topk.cuh"
#include "backend/cuda/timeline.cuh"
#include "bench_data.cuh"
#include "bench_timing.cuh"

namespace {

using e4kv::bench::check;
using e4kv::bench::fill_cache_bytes;
using e4kv::bench::fill_f16;
using e4kv::bench::graph_ms;
using e4kv::bench::time_ms;
using e4kv::bench::upload;

using namespace e4kv;
using namespace e4kv::cuda;

// Decode rows (sequences), one per row: 4 by default (the 128K target shape), --batch N.
int64_t g_batch = 4;
constexpr int64_t kHeads = 16;
constexpr int64_t kKvHeads = 2;
constexpr int64_t kHeadDim = 256;
constexpr int64_t kCtx = 131072;
constexpr int64_t kBlock = 64;
constexpr int64_t kBudget = 2048;
constexpr int64_t kRatio = 4;
constexpr int64_t kIndexHeads = 4;
constexpr int64_t kIndexDim = 128;
constexpr int64_t kWidth = kBudget + kRatio - 1;  // selection row: budget + the causal tail
constexpr int64_t kPos = kCtx - 2;                // every decode row's position; seq_len = kPos + 1
constexpr int64_t kMaxGroups = kCtx / kRatio;
constexpr int kGraphMinSteps = 20;

// One step's time in both modes, ms.
struct Timing {
  double ms = 0;
  double graph_ms = 0;
};

// `step(stream, copy)` enqueues one step reading copy `copy`; both modes rotate over the copies.
template <class F>
Timing time_step(F&& step, int copies) {
  int next_copy = 0;
  Timing t;
  t.ms = time_ms([&] {
    step(cudaStream_t(nullptr), next_copy);
    next_copy = (next_copy + 1) % copies;
  });
  // One graph of whole rounds over the copies (step i reads copy i % copies), at least
  // kGraphMinSteps steps, so back-to-back replays keep the rotation.
  const int steps = copies * ((kGraphMinSteps + copies - 1) / copies);
  t.graph_ms = graph_ms([&](cudaStream_t stream, int i) { step(stream, i % copies); }, steps);
  return t;
}

// "fp16", "e4m3-soft" or "e4m3-native".
std::string kv_name(KvCacheDtype dtype, const DecodeAttentionConfig& config) {
  return dtype == KvCacheDtype::kF16 ? "fp16" : config.native_e4m3 ? "e4m3-native" : "e4m3-soft";
}

// Split-K workspace for `n_splits` splits of every row (cudaFree .m).
DecodeAttentionWorkspace make_workspace(int64_t n_splits) {
  float* d_ws = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(
      &d_ws, decode_attention_workspace_floats(g_batch, n_splits, kHeads, kHeadDim) * 4));
  return DecodeAttentionWorkspace{d_ws,
                                  d_ws + g_batch * n_splits * kHeads,
                                  d_ws + 2 * g_batch * n_splits * kHeads,
                                  g_batch,
                                  n_splits,
                                  kHeads,
                                  kHeadDim};
}

DecodeAttentionPlan plan_for(const KvCacheGeometry& geo, const DecodeAttentionConfig& config,
                             int64_t max_keys) {
  const Result<int64_t> resident = decode_attention_resident_ctas(geo, kHeads, config, 0);
  if (!resident.ok()) check(resident.status());
  const Result<DecodeClusterMerge> cluster = decode_attention_cluster_merge(geo, kHeads, config, 0);
  if (!cluster.ok()) check(cluster.status());
  return choose_decode_attention_plan(g_batch, kKvHeads, max_keys, *resident, *cluster);
}

// True when no element of the [g_batch, kHeads, kHeadDim] fp32 output is NaN (or infinite).
bool output_finite(const float* d_out) {
  std::vector<float> out(size_t(g_batch * kHeads * kHeadDim));
  E4KV_CUDA_CHECK(cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost));
  return std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); });
}

struct QsaResult {
  std::string kv;
  int64_t splits = 0;
  bool cluster_merge = false;  // the attention's splits merged in a thread-block cluster
  Timing attention;            // alone, over each copy's selection
  Timing step;                 // scores + top-k + attention, cold (copies rotating)
  Timing step_warm;            // the same on one copy
  Timing step_plain;           // step, cold, with plain launches (no programmatic dependent launch)
};

#ifdef E4KV_TIMELINE
// One cold step per copy from its own one-step CUDA graph, the probes reset before each; prints
// the median over the copies of every probe, in us after the score kernel's first entry.
template <class F>
void run_timeline(F&& step, int copies, const std::string& kv) {
  unsigned long long* d_tl = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_tl, kTimelineWords * 8));
  timeline_attach_scores(d_tl);
  timeline_attach_top_k(d_tl);
  timeline_attach_decode(d_tl);
  std::vector<unsigned long long> init(kTimelineWords, 0ull);
  for (int k = 0; k < kTimelineKernels; ++k) {
    for (int e : {kTlEntryMin, kTlStartMin, kTlExitMin}) {
      for (int i = 0; i < kTimelineSpread; ++i) {
        init[size_t((k * kTimelineEvents + e) * kTimelineSpread + i)] = ~0ull;
      }
    }
  }
  cudaStream_t stream;
  E4KV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<cudaGraphExec_t> execs(copies);
  for (int c = 0; c < copies; ++c) {
    cudaGraph_t graph;
    E4KV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    step(stream, c);
    E4KV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    E4KV_CUDA_CHECK(cudaGraphInstantiate(&execs[c], graph, 0));
    E4KV_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  constexpr int kKernels = 4;
  const char* names[kKernels] = {"scores", "top-k", "decode", "merge"};
  const char* events[5] = {"entry", "start_first", "start_last", "exit_first", "exit_last"};
  std::vector<std::vector<double>> values(kKernels * 5 + kTimelinePhases);
  std::vector<unsigned long long> host(kTimelineWords);
  for (int round = 0; round < 3; ++round) {
    for (int c = 0; c < copies; ++c) {
      E4KV_CUDA_CHECK(
          cudaMemcpyAsync(d_tl, init.data(), kTimelineWords * 8, cudaMemcpyHostToDevice, stream));
      E4KV_CUDA_CHECK(cudaGraphLaunch(execs[c], stream));
      E4KV_CUDA_CHECK(
          cudaMemcpyAsync(host.data(), d_tl, kTimelineWords * 8, cudaMemcpyDeviceToHost, stream));
      E4KV_CUDA_CHECK(cudaStreamSynchronize(stream));
      if (round == 0) continue;  // the first round warms the graphs
      auto reduce = [&](int k, int e) {
        unsigned long long v = (e == kTlStartMax || e == kTlExitMax) ? 0ull : ~0ull;
        for (int i = 0; i < kTimelineSpread; ++i) {
          const unsigned long long x =
              host[size_t((k * kTimelineEvents + e) * kTimelineSpread + i)];
          v = (e == kTlStartMax || e == kTlExitMax) ? std::max(v, x) : std::min(v, x);
        }
        return v;
      };
      const unsigned long long t0 = reduce(kTlScores, kTlEntryMin);
      for (int k = 0; k < kKernels; ++k) {
        for (int e = 0; e < 5; ++e)
          values[k * 5 + e].push_back((double(reduce(k, e)) - double(t0)) / 1e3);
      }
      const size_t phase0 = size_t(kTimelineKernels * kTimelineEvents * kTimelineSpread);
      for (int i = 0; i < kTimelinePhases; ++i) {
        values[kKernels * 5 + i].push_back((double(host[phase0 + i]) - double(t0)) / 1e3);
      }
    }
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf(
      "timeline %s (median of %zu cold one-step graphs, us after the scores' first entry)\n",
      kv.c_str(), values[0].size());
  for (int k = 0; k < kKernels; ++k) {
    std::printf("  %-7s", names[k]);
    for (int e = 0; e < 5; ++e) std::printf(" %s %7.2f", events[e], med(values[k * 5 + e]));
    std::printf("\n");
  }
  std::printf("  phases (top-k, row 0, CTA 0):");
  for (int i = 0; i < 11; ++i) std::printf(" %d:%.2f", i, med(values[kKernels * 5 + i]));
  std::printf("\n  raw ns of one copy (resolution check):");
  for (int e = 0; e < 5; ++e) std::printf(" %llu", (unsigned long long)(values[e].back() * 1e3));
  std::printf("\n");
  for (cudaGraphExec_t e : execs) E4KV_CUDA_CHECK(cudaGraphExecDestroy(e));
  E4KV_CUDA_CHECK(cudaStreamDestroy(stream));
  unsigned long long* none = nullptr;
  timeline_attach_scores(none);
  timeline_attach_top_k(none);
  timeline_attach_decode(none);
  E4KV_CUDA_CHECK(cudaFree(d_tl));
}
#endif

}  // namespace

// Usage: e4kv_bench_qsa_decode [--batch N] [--exact-scores] [OUT.json | --profile | --timeline]
// --batch N: N decode rows (1..64, default 4), each its own 128K sequence; the cold rotation's
// copies adapt (more of them at small batches), dense decode reads N x 256 MB (FP16).
// --exact-scores: the index scores from the exact FFMA kernel (QsaIndexScoresArgs::exact), for
// the side-by-side against the tensor-core default.
// --timeline (a build configured with -DE4KV_TIMELINE=ON): no timing; the last KV kind's cold step
// from one-step CUDA graphs with the in-kernel probes (timeline.cuh), then the same with the top-k
// run twice; prints when each kernel's CTAs entered, started (after griddepcontrol.wait) and
// exited, and the phase marks of the top-k.
// --profile: no timing; after the warm-up, two steps on each copy with the last KV kind (E4M3
// native where usable), for a profiler (ncu -k filtering one kernel with --launch-skip past the
// warm-up; RESULTS-archive.md session 11 used 30 for the decode kernel).
int main(int argc, char** argv) {
  bool profile = false;
  bool exact_scores = false;
  bool timeline = false;
  const char* json_path = "qsa_decode.json";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--profile") {
      profile = true;
    } else if (arg == "--timeline") {
#ifndef E4KV_TIMELINE
      std::fprintf(stderr,
                   "--timeline: this build has no timeline probes; configure with "
                   "-DE4KV_TIMELINE=ON (the probes slow the kernels: time with a normal build)\n");
      return 1;
#endif
      timeline = true;
    } else if (arg == "--exact-scores") {
      exact_scores = true;
    } else if (arg == "--batch" && i + 1 < argc) {
      g_batch = std::atoll(argv[++i]);
      if (g_batch < 1 || g_batch > 64) {
        std::fprintf(stderr, "--batch %s: give 1..64 decode rows\n", argv[i]);
        return 1;
      }
    } else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr,
                   "unknown option %s (usage: [--profile | --timeline] [--batch N] "
                   "[--exact-scores] [JSON path])\n",
                   arg.c_str());
      return 1;
    } else {
      json_path = argv[i];
    }
  }
  if (device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const DecodeAttentionConfig best = decode_attention_config(0, false);

  // Main caches (FP16 1 GiB, E4M3 512 MB) and the block table they share with the indexer cache.
  const int64_t blocks_per_seq = (kCtx + kBlock - 1) / kBlock;
  const int64_t n_blocks = blocks_per_seq * g_batch;
  const KvCacheGeometry geo_f16{n_blocks, kBlock, kKvHeads, kHeadDim, KvCacheDtype::kF16};
  const KvCacheGeometry geo_e4m3{n_blocks, kBlock, kKvHeads, kHeadDim, KvCacheDtype::kE4m3};
  uint8_t* d_cache_f16 = nullptr;
  uint8_t* d_cache_e4m3 = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_cache_f16, geo_f16.total_bytes()));
  E4KV_CUDA_CHECK(cudaMalloc(&d_cache_e4m3, geo_e4m3.total_bytes()));
  fill_cache_bytes(d_cache_f16, geo_f16.total_bytes(), 12345u, false);
  fill_cache_bytes(d_cache_e4m3, geo_e4m3.total_bytes(), 12345u, true);

  // Indexer cache copies, each from its own seed: more than 160 MB together (L2: 60 MB), and
  // enough that the E4M3 KV rows their selections read exceed that too.
  const size_t compressed_elems = size_t(n_blocks * (kBlock / kRatio) * kIndexDim);
  const size_t selected_e4m3_bytes = size_t(g_batch * kWidth * kKvHeads * kHeadDim * 2);
  const size_t cold_bytes = size_t(160) << 20;
  const int copies =
      int(std::max(cold_bytes / (compressed_elems * 2) + 1, cold_bytes / selected_e4m3_bytes + 1));
  uint16_t* d_compressed = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_compressed, compressed_elems * 2 * size_t(copies)));
  for (int c = 0; c < copies; ++c) {
    // Random FP16 values in a modest range (sign, exponent 2^-6..2^1, random mantissa), as in
    // bench_qsa_indexer.cu: index scores spread enough that the top-k is not decided by ties.
    fill_f16(d_compressed + compressed_elems * size_t(c), compressed_elems,
             1000u + 7919u * uint32_t(c), 9u, 8u);
  }

  std::mt19937 rng(7);
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<int32_t> row_seq(g_batch), row_pos(g_batch, int32_t(kPos)),
      seq_lens(g_batch, int32_t(kPos + 1));
  std::iota(row_seq.begin(), row_seq.end(), 0);
  int32_t* d_table = upload(table);
  int32_t* d_row_seq = upload(row_seq);
  int32_t* d_row_pos = upload(row_pos);
  int32_t* d_seq_lens = upload(seq_lens);

  // Queries, output, and per-copy scores, run maxima and selections.
  const size_t q_elems = size_t(g_batch * kHeads * kHeadDim);
  const int64_t run_stride = (kMaxGroups + kQsaRunGroups - 1) / kQsaRunGroups;
  uint16_t* d_q = nullptr;
  uint16_t* d_index_q = nullptr;
  float* d_out = nullptr;
  float* d_scores = nullptr;
  float* d_maxima = nullptr;
  int32_t* d_sel = nullptr;
  int32_t* d_counts = nullptr;
  void* d_top_k_ws = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_q, q_elems * 2));
  E4KV_CUDA_CHECK(cudaMalloc(&d_index_q, size_t(g_batch * kIndexHeads * kIndexDim) * 2));
  E4KV_CUDA_CHECK(cudaMalloc(&d_out, q_elems * 4));
  E4KV_CUDA_CHECK(cudaMalloc(&d_scores, size_t(copies * g_batch * kMaxGroups) * 4));
  E4KV_CUDA_CHECK(cudaMalloc(&d_maxima, size_t(copies * g_batch * run_stride) * 4));
  E4KV_CUDA_CHECK(cudaMalloc(&d_sel, size_t(copies * g_batch * kWidth) * 4));
  E4KV_CUDA_CHECK(cudaMalloc(&d_counts, size_t(copies * g_batch) * 4));
  E4KV_CUDA_CHECK(cudaMalloc(
      &d_top_k_ws,
      std::max<size_t>(1, qsa_top_k_workspace_bytes(g_batch, kMaxGroups, kBudget, kRatio))));
  fill_cache_bytes(d_q, q_elems * 2, 99u, false);
  fill_f16(d_index_q, size_t(g_batch * kIndexHeads * kIndexDim), 99u, 9u, 8u);

  QueryBatchView rows;
  rows.n_rows = g_batch;
  rows.row_seq = d_row_seq;
  rows.row_pos = d_row_pos;
  rows.seq_lens = d_seq_lens;
  const BlockTableView block_table{d_table, g_batch, blocks_per_seq};
  std::vector<QsaIndexScoresArgs> scores_args(copies);
  std::vector<QsaTopKArgs> top_k_args(copies);
  for (int c = 0; c < copies; ++c) {
    QsaIndexScoresArgs& sa = scores_args[c];
    sa.compressed = IndexerCompressedView{d_compressed + compressed_elems * size_t(c), n_blocks,
                                          kBlock, kRatio, kIndexDim};
    sa.block_table = block_table;
    sa.rows = rows;
    sa.index_q = d_index_q;
    sa.n_index_heads = kIndexHeads;
    sa.max_groups = kMaxGroups;
    sa.skip_visible_at_most = kBudget / kRatio;
    sa.scores = d_scores + c * g_batch * kMaxGroups;
    sa.run_maxima = d_maxima + c * g_batch * run_stride;
    sa.run_stride = run_stride;
    sa.exact = exact_scores;
    QsaTopKArgs& ta = top_k_args[c];
    ta.rows = rows;
    ta.ratio = kRatio;
    ta.budget = kBudget;
    ta.scores = sa.scores;
    ta.max_groups = kMaxGroups;
    ta.run_maxima = sa.run_maxima;
    ta.run_stride = run_stride;
    ta.sel_tokens = d_sel + c * g_batch * kWidth;
    ta.sel_counts = d_counts + c * g_batch;
    ta.workspace = d_top_k_ws;
    ta.method = QsaTopKMethod::kAuto;
  }
  auto scores_step = [&](cudaStream_t stream, int c) {
    check(qsa_index_scores(scores_args[c], stream));
  };
  auto top_k_step = [&](cudaStream_t stream, int c) {
    check(qsa_top_k_select(top_k_args[c], stream));
  };

  PagedAttentionParams dense;
  dense.cache = KvCacheView{d_cache_f16, geo_f16, 1.0f, 1.0f};
  dense.block_table = block_table;
  dense.rows = rows;
  dense.n_heads = kHeads;
  dense.q = d_q;
  dense.out = d_out;

  // Dense FP16 decode: the whole 1 GiB cache per step, so cold without copies.
  bool sane = true;
  const DecodeAttentionPlan dense_plan = plan_for(geo_f16, best, kPos + 1);
  Timing dense_time;
  Timing dense_plain;  // with plain launches
  if (!profile && !timeline) {
    const DecodeAttentionWorkspace ws = make_workspace(dense_plan.n_splits);
    auto dense_step = [&](cudaStream_t stream, int) {
      check(paged_decode_attention(dense, dense_plan, ws, best, stream));
    };
    dense_step(nullptr, 0);
    if (!output_finite(d_out)) {
      std::fprintf(stderr, "dense fp16: the attention output holds NaN or inf\n");
      sane = false;
    }
    dense_time = time_step(dense_step, 1);
    set_programmatic_launch(false);
    dense_plain = time_step(dense_step, 1);
    set_programmatic_launch(true);
    E4KV_CUDA_CHECK(cudaFree(ws.m));
  }

  // Warm-up: scores and selection of every copy; then the selection check on the host.
  for (int c = 0; c < copies; ++c) {
    scores_step(nullptr, c);
    top_k_step(nullptr, c);
  }
  std::vector<int32_t> counts(size_t(copies * g_batch));
  std::vector<int32_t> sel(size_t(copies * g_batch * kWidth));
  E4KV_CUDA_CHECK(cudaMemcpy(counts.data(), d_counts, counts.size() * 4, cudaMemcpyDeviceToHost));
  E4KV_CUDA_CHECK(cudaMemcpy(sel.data(), d_sel, sel.size() * 4, cudaMemcpyDeviceToHost));
  const auto bad =
      std::find_if(counts.begin(), counts.end(), [](int32_t n) { return n != kWidth; });
  if (bad != counts.end()) {
    const size_t i = size_t(bad - counts.begin());
    std::fprintf(stderr,
                 "%zu of %zu selection rows have sel_count != %lld (copy %zu row %zu: %d)\n",
                 size_t(counts.size() - std::count(counts.begin(), counts.end(), int32_t(kWidth))),
                 counts.size(), (long long)kWidth, i / g_batch, i % g_batch, *bad);
    sane = false;
  }
  // Row 0's tokens that copies 0 and 1 both select (random groups: about budget^2 / ctx + tail).
  std::vector<int32_t> shared;
  if (copies > 1) {
    std::set_intersection(sel.begin(), sel.begin() + kWidth, sel.begin() + g_batch * kWidth,
                          sel.begin() + (g_batch + 1) * kWidth, std::back_inserter(shared));
  }

  // merge_kernel: the attention's splits merged by the second kernel even where the planner would
  // merge them in a cluster (the side-by-side row "-mk").
  struct Kind {
    KvCacheDtype dtype;
    DecodeAttentionConfig config;
    bool merge_kernel;
  };
  std::vector<Kind> kinds{{KvCacheDtype::kF16, {false, best.load}, false},
                          {KvCacheDtype::kE4m3, {false, best.load}, false}};
  if (best.native_e4m3) kinds.push_back({KvCacheDtype::kE4m3, {true, best.load}, false});
  Timing scores_time;
  Timing top_k_time;
  const Kind fastest = kinds.back();
  if (!profile && !timeline) {
    scores_time = time_step(scores_step, copies);
    top_k_time = time_step(top_k_step, copies);
    kinds.push_back({KvCacheDtype::kE4m3, fastest.config, true});
  } else {
    kinds.clear();
    kinds.push_back(fastest);
  }

  std::vector<QsaResult> results;
  for (const auto& [dtype, config, merge_kernel] : kinds) {
    const bool e4m3 = dtype == KvCacheDtype::kE4m3;
    const KvCacheGeometry& geo = e4m3 ? geo_e4m3 : geo_f16;
    set_cluster_merge(!merge_kernel);
    const DecodeAttentionPlan plan = plan_for(geo, config, kWidth);
    set_cluster_merge(true);
    const DecodeAttentionWorkspace ws = make_workspace(plan.n_splits);
    std::vector<PagedAttentionParams> attention(copies, dense);
    for (int c = 0; c < copies; ++c) {
      attention[c].cache = KvCacheView{e4m3 ? d_cache_e4m3 : d_cache_f16, geo, e4m3 ? 0.01f : 1.0f,
                                       e4m3 ? 0.01f : 1.0f};
      attention[c].rows.sel_tokens = top_k_args[c].sel_tokens;
      attention[c].rows.sel_counts = top_k_args[c].sel_counts;
      attention[c].rows.sel_width = kWidth;
    }
    auto attention_step = [&](cudaStream_t stream, int c) {
      check(paged_decode_attention(attention[c], plan, ws, config, stream));
    };
    auto qsa_step = [&](cudaStream_t stream, int c) {
      scores_step(stream, c);
      top_k_step(stream, c);
      attention_step(stream, c);
    };
    QsaResult r;
    r.kv = kv_name(dtype, config) + (merge_kernel ? "-mk" : "");
    r.splits = plan.n_splits;
    r.cluster_merge = plan.merge_in_cluster;
    for (int c = 0; c < copies; ++c) qsa_step(nullptr, c);
    if (profile) {
      for (int c = 0; c < copies; ++c) qsa_step(nullptr, c);
      E4KV_CUDA_CHECK(cudaDeviceSynchronize());
      sane = sane && output_finite(d_out);
      continue;
    }
#ifdef E4KV_TIMELINE
    if (timeline) {
      run_timeline(qsa_step, copies, r.kv);
      // The same with the top-k run twice: its phase marks are then the second run's (warm
      // instruction cache, the scores in L2 either way).
      run_timeline(
          [&](cudaStream_t stream, int c) {
            scores_step(stream, c);
            top_k_step(stream, c);
            top_k_step(stream, c);
            attention_step(stream, c);
          },
          copies, r.kv + " (top-k twice)");
      continue;
    }
#endif
    if (!output_finite(d_out)) {
      std::fprintf(stderr, "qsa %s: the attention output holds NaN or inf\n", r.kv.c_str());
      sane = false;
    }
    r.attention = time_step(attention_step, copies);
    r.step = time_step(qsa_step, copies);
    r.step_warm = time_step(qsa_step, 1);
    set_programmatic_launch(false);
    r.step_plain = time_step(qsa_step, copies);
    set_programmatic_launch(true);
    results.push_back(r);
    E4KV_CUDA_CHECK(cudaFree(ws.m));
  }

  if (timeline || profile) return sane ? 0 : 1;
  std::printf(
      "shape: batch %lld, heads %lld / %lld kv, head_dim %lld, ctx %lld (pos %lld), block %lld; "
      "QSA budget %lld, index %lld x %lld, ratio %lld\n",
      (long long)g_batch, (long long)kHeads, (long long)kKvHeads, (long long)kHeadDim,
      (long long)kCtx, (long long)kPos, (long long)kBlock, (long long)kBudget,
      (long long)kIndexHeads, (long long)kIndexDim, (long long)kRatio);
  std::printf(
      "cold: %d indexer cache copies x %.1f MB = %.1f MB; row 0 tokens selected by both "
      "copy 0 and copy 1: %zu of %lld\n",
      copies, compressed_elems * 2 / 1e6, copies * compressed_elems * 2 / 1e6, shared.size(),
      (long long)kWidth);
  const bool pdl = programmatic_launch_enabled();
  std::printf("programmatic dependent launch: %s\n", pdl ? "on" : "off (plain launches)");
  std::printf(
      "dense fp16 (%lld splits): stream %.1f us, graph %.1f us; plain launches: stream "
      "%.1f us, graph %.1f us\n",
      (long long)dense_plan.n_splits, dense_time.ms * 1e3, dense_time.graph_ms * 1e3,
      dense_plain.ms * 1e3, dense_plain.graph_ms * 1e3);
  std::printf("%-12s %-6s %7s %10s %7s %9s %7s %9s %9s %8s %10s %10s %11s\n", "qsa kv", "mode",
              "splits", "scores+max", "top-k", "attention", "sum", "step_cold", "step_warm",
              "dense", "dense/cold", "dense/warm", "cold_plain");
  for (const QsaResult& r : results) {
    for (const bool graph : {false, true}) {
      auto us = [&](const Timing& t) { return (graph ? t.graph_ms : t.ms) * 1e3; };
      const double top_k = us(top_k_time);
      const double sum = us(scores_time) + top_k + us(r.attention);
      std::printf(
          "%-12s %-6s %7lld %10.1f %7.1f %9.1f %7.1f %9.1f %9.1f %8.1f %9.2fx %9.2fx %11.1f\n",
          r.kv.c_str(), graph ? "graph" : "stream", (long long)r.splits, us(scores_time), top_k,
          us(r.attention), sum, us(r.step), us(r.step_warm), us(dense_time),
          us(dense_time) / us(r.step), us(dense_time) / us(r.step_warm), us(r.step_plain));
    }
  }
  if (!sane) {
    std::fprintf(stderr, "sanity check failed\n");
    return 1;
  }

  FILE* f = std::fopen(json_path, "w");
  if (f == nullptr) return 1;
  std::fprintf(f,
               "{\"shape\": {\"batch\": %lld, \"n_heads\": %lld, \"n_kv_heads\": %lld, "
               "\"head_dim\": %lld, \"ctx\": %lld, \"row_pos\": %lld, \"seq_len\": %lld, "
               "\"block_size\": %lld, \"budget\": %lld, \"index_heads\": %lld, "
               "\"index_dim\": %lld, \"ratio\": %lld},\n",
               (long long)g_batch, (long long)kHeads, (long long)kKvHeads, (long long)kHeadDim,
               (long long)kCtx, (long long)kPos, (long long)(kPos + 1), (long long)kBlock,
               (long long)kBudget, (long long)kIndexHeads, (long long)kIndexDim, (long long)kRatio);
  std::fprintf(f,
               " \"cold_copies\": %d, \"indexer_copy_bytes\": %zu, \"graph_min_steps\": %d, "
               "\"shared_selected_tokens_copy0_copy1_row0\": %zu,\n",
               copies, compressed_elems * 2, kGraphMinSteps, shared.size());
  std::fprintf(f, " \"programmatic_dependent_launch\": %s,\n", pdl ? "true" : "false");
  std::fprintf(f,
               " \"dense_fp16\": {\"splits\": %lld, \"stream_us\": %.2f, \"graph_us\": %.2f, "
               "\"plain_stream_us\": %.2f, \"plain_graph_us\": %.2f},\n",
               (long long)dense_plan.n_splits, dense_time.ms * 1e3, dense_time.graph_ms * 1e3,
               dense_plain.ms * 1e3, dense_plain.graph_ms * 1e3);
  std::fprintf(f, " \"qsa\": [\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const QsaResult& r = results[i];
    std::fprintf(f, "  {\"kv\": \"%s\", \"splits\": %lld, \"cluster_merge\": %s", r.kv.c_str(),
                 (long long)r.splits, r.cluster_merge ? "true" : "false");
    for (const bool graph : {false, true}) {
      auto us = [&](const Timing& t) { return (graph ? t.graph_ms : t.ms) * 1e3; };
      const double top_k = us(top_k_time);
      std::fprintf(f,
                   ", \"%s\": {\"scores_maxima_us\": %.2f, \"top_k_us\": %.2f, "
                   "\"attention_us\": %.2f, \"sum_us\": %.2f, \"step_cold_us\": %.2f, "
                   "\"step_warm_us\": %.2f, \"step_cold_plain_us\": %.2f, \"dense_us\": %.2f, "
                   "\"dense_over_step_cold\": %.3f, \"dense_over_step_warm\": %.3f}",
                   graph ? "graph" : "stream", us(scores_time), top_k, us(r.attention),
                   us(scores_time) + top_k + us(r.attention), us(r.step), us(r.step_warm),
                   us(r.step_plain), us(dense_time), us(dense_time) / us(r.step),
                   us(dense_time) / us(r.step_warm));
    }
    std::fprintf(f, "}%s\n", i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, " ]}\n");
  std::fclose(f);

  for (void* ptr : {(void*)d_cache_f16, (void*)d_cache_e4m3, (void*)d_compressed, (void*)d_table,
                    (void*)d_row_seq, (void*)d_row_pos, (void*)d_seq_lens, (void*)d_q,
                    (void*)d_index_q, (void*)d_out, (void*)d_scores, (void*)d_maxima, (void*)d_sel,
                    (void*)d_counts, d_top_k_ws}) {
    E4KV_CUDA_CHECK(cudaFree(ptr));
  }
  return 0;
}
