// The Qwen4Exp model on the CUDA backend: a synthetic checkpoint with the
// published model's layer structure and the configuration defaults where nothing is published
// (48 layers, every 4th QSA; hidden 2048; 24 q / 2 KV heads x 256, partial rotary 0.25; DeltaNet
// 16 key / 32 value heads x 128, conv 4; indexer 4 heads x 128, budget 2048, ratio 4;
// hyper-connections 4 streams, rank 320; MoE reduced to 64 experts of width 512, top-10, shared
// expert 512; PLE on layer 0 with a small n-gram table; vocab 248320; FP16 weights, about 13B
// parameters), written to a temporary directory and loaded once per cache dtype.
//
// For every cell (batch, context) whose batch * context is at most kMaxCellTokens: `batch`
// sequences prefilled to `context` tokens (forwards of kPrefillChunk tokens), then decode steps of
// one token per sequence, timed two ways, alternating sample by sample: eagerly through
// Model::forward (host launches, logits copied back) and replayed from decode-step graphs
// (engine/step_graphs.h: StepGraphs::forward, then a synchronisation; the graphs are captured in
// the warm-up steps). A step is the wall time of one forward, the median of kSamples samples of
// kStepsPerSample steps; FP16 and E4M3 (unit scales) caches. Prefill tokens/s are timed on the first sequence of the batch-1 cells.
// The batch-1 byte bound: the bytes one decode step must read (every weight but the unused
// experts', the selected K/V rows, the indexer rows it scores, the recurrent and conv states read
// and written) at the device-to-device copy rate measured in the same run.
//
// One decode step of every cell is profiled by section (StepProfiler, backend/profiler.h),
// isolated and in place: the per-layer-kind timeline of where the step's time goes.
//
// Usage: e4kv_bench_qwen4exp [out.json] [--small | --published] [--quant none|awq-g32]
//        [--batches 1,8,32] [--contexts 4096,...] [--cache fp16|e4m3|both]
//        [--keep-checkpoint DIR [--checkpoint-only]] [--calibration-context N] [--print-plan]
// (--small: 8 layers, 8 experts, vocab 8192, contexts 4K and 8K, for a quick check of the harness;
// --published: the published size, 512 experts (published_qwen4exp_options, testing/
// synth_checkpoint.h), in shards of 4 GB; --quant awq-g32: the routed experts in AutoAWQ's GEMM
// layout with groups of 32 columns and zero points (about 45 GB at the published size), the rest
// FP16; --print-plan: print the checkpoint's bytes by tensor kind and exit, writing nothing and
// needing no GPU;
// --keep-checkpoint: write the checkpoint to DIR, or reuse it from there, and keep it;
// --checkpoint-only: only write it (for `e4kv bench` on the same checkpoint, bench/serving_gpu.sh);
// --calibration-context N: also time an FP16 prefill of N tokens with the calibration statistics
// (Model::start_kv_statistics) off and on: the observer's overhead)
// Environment: E4KV_BENCH_PROFILER_STEP set: one more eager decode step per cell between
// cudaProfilerStart and cudaProfilerStop, for ncu (bench/profile_step_gpu.sh);
// E4KV_BENCH_PREFILL_PROFILE set: the last prefill chunk (up to kPrefillChunk tokens) of each
// batch-1 cell profiled by section in place (where long prompts spend their time)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "engine/step_graphs.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "model/model.h"
#include "testing/synth_checkpoint.h"

namespace {

using namespace e4kv;
namespace fs = std::filesystem;

constexpr int64_t kPrefillChunk = 8192;
constexpr int64_t kMaxCellTokens = 262144;
constexpr int kStepsPerSample = 8;
constexpr int kSamples = 5;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_qwen4exp: %s\n", what.c_str());
  std::exit(1);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Cell {
  int batch = 0;
  int64_t context = 0;
};

struct Row {
  std::string cache;
  int batch = 0;
  int64_t context = 0;
  double step_ms = 0;        // eager
  double graph_step_ms = 0;  // replayed from a graph
  int64_t graph_captures = 0;
  int64_t graph_nodes = -1;  // the operations of one step's graph (the launches it replays)
  double prefill_tokens_per_s = 0;  // first sequence, batch-1 cells only
  // One decode step profiled twice (StepProfiler::begin): isolated (each section's own device
  // time and the host's cost to issue it) and in place (the span each section took in a step).
  std::vector<ProfileSection> isolated, in_place;
  // E4KV_BENCH_PREFILL_PROFILE: the first sequence's last prefill chunk, in place.
  std::vector<ProfileSection> prefill_chunk;
};

// Device-to-device copy rate (bytes read per second: a copy reads and writes each byte once, so
// the rate of reading alone is twice the copy's payload rate when both directions share the bus).
double copy_read_rate() {
  const size_t bytes = size_t(1) << 30;
  void* a = nullptr;
  void* b = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&a, bytes));
  E4KV_CUDA_CHECK(cudaMalloc(&b, bytes));
  E4KV_CUDA_CHECK(cudaMemset(a, 1, bytes));
  cudaEvent_t start, stop;
  E4KV_CUDA_CHECK(cudaEventCreate(&start));
  E4KV_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> rates;
  for (int i = 0; i < 6; ++i) {
    E4KV_CUDA_CHECK(cudaEventRecord(start));
    E4KV_CUDA_CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    E4KV_CUDA_CHECK(cudaEventRecord(stop));
    E4KV_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    E4KV_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i > 0) rates.push_back(2.0 * double(bytes) / (double(ms) * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  return median(rates);
}

// Bytes per routed-expert weight: FP16, or AWQ's 4-bit code plus an FP16 scale and a 4-bit zero
// point per group.
double expert_bytes_per_weight(const SynthCheckpointOptions& o) {
  if (o.quant != SynthQuant::kAwq) return 2.0;
  const double g = double(o.quant_group);
  return 0.5 + 2.0 / g + (o.quant_zero_point ? 0.5 / g : 0.0);
}

// Bytes one batch-1 decode step at `context` must read (see the head comment), by the profile
// section that reads them (the sections the model marks: model/families/qwen4exp.cpp; the final
// mixer runs inside the logits head's section).
struct SectionBytes {
  std::string name;
  double bytes = 0;
};

std::vector<SectionBytes> step_bytes_by_section(const SynthCheckpointOptions& o, int64_t context,
                                                KvCacheDtype dtype) {
  const double h = double(o.hidden_size);
  const double width = double(o.hc_count) * h;
  const double q_dim = double(o.n_heads * o.head_dim);
  const double kv_dim = double(o.n_kv_heads * o.head_dim);
  const double kd = double(o.linear_key_heads * o.linear_head_dim);
  const double vd = double(o.linear_value_heads * o.linear_head_dim);
  // Weights in FP16 values (x 2 bytes below); routed experts in FP16-weight equivalents.
  const double hc = 2 * (2 * width * double(o.hc_lowrank) + double(o.hc_count) * width);
  const double moe = double(o.n_experts) * h +
                     double(o.experts_top_k) * 3 * h * double(o.moe_intermediate_size) *
                         expert_bytes_per_weight(o) / 2.0 +
                     3 * h * double(o.shared_expert_intermediate_size) + h;
  const double qsa =
      2 * q_dim * h + 2 * kv_dim * h + q_dim * h + double((o.index_heads + 1) * o.index_dim) * h;
  const double delta = (2 * kd + vd) * h + vd * h + 2 * double(o.linear_value_heads) * h + vd * h;
  int64_t n_qsa = 0;
  for (int64_t i = 0; i < o.n_layers; ++i) n_qsa += (i + 1) % 4 == 0 ? 1 : 0;
  const int64_t n_delta = o.n_layers - n_qsa;
  const double selected = double(std::min<int64_t>(context, o.index_budget + o.index_ratio - 1));
  const double kv = double(n_qsa) * selected * 2 * kv_dim * double(kv_cache_elem_bytes(dtype));
  const double index = double(n_qsa) * double(context / o.index_ratio) * double(o.index_dim) * 2;
  const double states =
      double(n_delta) * 2 *
      (double(o.linear_value_heads) * double(o.linear_head_dim * o.linear_head_dim) * 4 +
       3 * (2 * kd + vd) * 2);
  return {
      {"hyper_connection", 2 * hc * double(o.n_layers)},
      {"qsa", 2 * qsa * double(n_qsa) + kv + index},
      {"delta_net", 2 * delta * double(n_delta) + states},
      {"moe", 2 * moe * double(o.n_layers)},
      {"lm_head", 2 * (2 * width * double(o.hc_lowrank) + h * double(o.vocab_size))},
  };
}

double step_bytes(const SynthCheckpointOptions& o, int64_t context, KvCacheDtype dtype) {
  double total = 0;
  for (const SectionBytes& s : step_bytes_by_section(o, context, dtype)) total += s.bytes;
  return total;
}

// Prefills one sequence (`salt` varies its ids) to `context` tokens in forwards of kPrefillChunk
// tokens; returns the wall time. With `profiler`, the last chunk's forward is profiled in place
// into *last_chunk (and the wall time includes the profiler's synchronisations).
double prefill(Model& model, BlockAllocator& allocator, BlockTable& table, int32_t slot, int salt,
               int64_t context, int64_t vocab, StepProfiler* profiler = nullptr,
               std::vector<ProfileSection>* last_chunk = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t begin = 0; begin < context; begin += kPrefillChunk) {
    const bool profiled = profiler != nullptr && begin + kPrefillChunk >= context;
    const int64_t n = std::min(kPrefillChunk, context - begin);
    allocator.append(table, n);
    std::vector<int32_t> ids(static_cast<size_t>(n)), seq(static_cast<size_t>(n), 0),
        pos(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      ids[size_t(i)] = int32_t(((begin + i) * 7919 + salt * 131) % (vocab - 16) + 1);
      pos[size_t(i)] = int32_t(begin + i);
    }
    const int32_t last = int32_t(n - 1);
    const ForwardBatch fb{ids, seq, pos, {&table}, std::span<const int32_t>(&last, 1),
                          std::span<const int32_t>(&slot, 1)};
    if (profiled) {
      model.set_step_profiler(profiler);
      profiler->begin(/*isolate=*/false);
    }
    Result<std::vector<float>> logits = model.forward(fb);
    if (!logits.ok()) die(logits.message());
    if (profiled) {
      *last_chunk = profiler->end();
      model.set_step_profiler(nullptr);
    }
  }
  return seconds_since(t0);
}

// The calibration observer's cost: prefill of one sequence to `context` with the
// statistics off and on, alternating, kCalibrationReps times each; the medians.
struct CalibrationCost {
  int64_t context = 0;
  double off_s = 0, on_s = 0;
};
constexpr int kCalibrationReps = 3;

CalibrationCost calibration_cost(Model& model, int64_t context, int64_t vocab) {
  std::vector<double> off, on;
  for (int rep = 0; rep < kCalibrationReps; ++rep) {
    for (const bool collect : {false, true}) {
      BlockAllocator allocator(model.n_blocks(), model.block_size());
      BlockTable table;
      Result<ScopedSequence> seq = ScopedSequence::allocate(model);
      if (!seq.ok()) die(seq.message());
      if (collect) {
        if (Status st = model.start_kv_statistics(); !st.ok()) die(st.message());
      }
      const double t = prefill(model, allocator, table, seq->slot(), rep, context, vocab);
      if (collect) {
        Result<std::vector<LayerKvStats>> stats = model.kv_statistics();  // includes the read-back
        if (!stats.ok()) die(stats.message());
        model.stop_kv_statistics();
      }
      (collect ? on : off).push_back(t);
    }
  }
  return CalibrationCost{context, median(off), median(on)};
}

std::vector<Row> run_cache(const Checkpoint& ckpt, Backend& backend, KvCacheDtype dtype,
                           const std::vector<Cell>& cells, int64_t vocab,
                           int64_t calibration_context, CalibrationCost* calibration) {
  int64_t max_tokens = 0;
  int max_batch = 1;
  int64_t max_context = 0;
  for (const Cell& c : cells) {
    max_tokens = std::max(max_tokens, int64_t(c.batch) * c.context);
    max_batch = std::max(max_batch, c.batch);
    max_context = std::max(max_context, c.context);
  }
  const int64_t steps = int64_t(2 * kSamples + 1) * kStepsPerSample + 8;
  ModelOptions options;
  options.kv_cache_dtype = dtype;
  options.kv_scales_mode =
      dtype == KvCacheDtype::kE4m3 ? KvScalesMode::kUnit : KvScalesMode::kCalibrated;
  options.block_size = 64;
  const bool calibrate = calibration_context > 0 && dtype == KvCacheDtype::kF16;
  max_context = std::max(max_context, calibrate ? calibration_context : 0);
  options.max_model_len = max_context + steps;
  options.n_blocks = blocks_for_tokens(
      std::max(max_tokens + int64_t(max_batch) * (steps + 64), calibrate ? max_context : 0),
      options.block_size);
  options.max_batch_tokens = kPrefillChunk;
  options.max_seqs = max_batch;
  const auto t_load = std::chrono::steady_clock::now();
  Result<std::unique_ptr<Model>> loaded = load_model(ckpt, backend, options);
  if (!loaded.ok()) die(loaded.message());
  Model& model = **loaded;
  std::fprintf(stderr, "bench_qwen4exp: %s model loaded in %.1f s\n",
               dtype == KvCacheDtype::kE4m3 ? "E4M3" : "FP16", seconds_since(t_load));

  std::vector<Row> rows;
  for (const Cell& cell : cells) {
    BlockAllocator allocator(options.n_blocks, options.block_size);
    std::vector<BlockTable> tables(size_t(cell.batch));
    std::vector<ScopedSequence> held;
    std::vector<int32_t> slots;
    for (int s = 0; s < cell.batch; ++s) {
      Result<ScopedSequence> seq = ScopedSequence::allocate(model);
      if (!seq.ok()) die(seq.message());
      slots.push_back(seq->slot());
      held.push_back(std::move(seq).value());
    }
    std::vector<int32_t> lengths(size_t(cell.batch), 0);
    // Prefill each sequence alone, in chunks; E4KV_BENCH_PREFILL_PROFILE: the last chunk of the
    // first sequence of a batch-1 cell profiled by section in place.
    double prefill_s = 0;
    Row row;
    StepProfiler* prefill_profiler =
        cell.batch == 1 && std::getenv("E4KV_BENCH_PREFILL_PROFILE") != nullptr
            ? cuda_step_profiler(backend)
            : nullptr;
    for (int s = 0; s < cell.batch; ++s) {
      const double t =
          prefill(model, allocator, tables[size_t(s)], slots[size_t(s)], s, cell.context, vocab,
                  s == 0 ? prefill_profiler : nullptr, &row.prefill_chunk);
      if (s == 0) prefill_s = t;
      lengths[size_t(s)] = int32_t(cell.context);
    }
    std::vector<const BlockTable*> seqs;
    for (const BlockTable& t : tables) seqs.push_back(&t);
    std::vector<int32_t> ids(size_t(cell.batch)), row_seq(size_t(cell.batch)),
        row_pos(size_t(cell.batch)), logit_rows(size_t(cell.batch));
    StepGraphs graphs(model, cell.batch, /*enabled=*/true);
    if (!graphs.active()) die("decode-step graphs are not available on this backend");
    auto step = [&](bool graph) {
      for (int s = 0; s < cell.batch; ++s) {
        allocator.append(tables[size_t(s)], 1);
        ids[size_t(s)] = int32_t((lengths[size_t(s)] * 13 + s) % (vocab - 16) + 1);
        row_seq[size_t(s)] = s;
        row_pos[size_t(s)] = lengths[size_t(s)]++;
        logit_rows[size_t(s)] = s;
      }
      const ForwardBatch fb{ids, row_seq, row_pos, seqs, logit_rows, slots};
      if (graph) {
        Result<DeviceLogits> logits = graphs.forward(fb);
        if (!logits.ok()) die(logits.message());
        backend.synchronize();
      } else {
        Result<std::vector<float>> logits = model.forward(fb);
        if (!logits.ok()) die(logits.message());
      }
    };
    step(false);  // warm-up: first launches, workspaces, the graph's capture
    step(false);
    step(true);
    step(true);
    std::vector<double> samples, graph_samples;
    for (int i = 0; i < kSamples; ++i) {
      for (const bool graph : {false, true}) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int k = 0; k < kStepsPerSample; ++k) step(graph);
        (graph ? graph_samples : samples).push_back(seconds_since(t0) * 1e3 / kStepsPerSample);
      }
    }
    if (!graphs.active()) die(cat("a decode-step graph capture failed: ", graphs.capture_error()));
    StepProfiler* profiler = cuda_step_profiler(backend);
    if (profiler == nullptr) die("the step profile needs the CUDA backend");
    model.set_step_profiler(profiler);
    for (const bool isolate : {true, false}) {
      profiler->begin(isolate);
      step(false);
      (isolate ? row.isolated : row.in_place) = profiler->end();
    }
    model.set_step_profiler(nullptr);
    if (std::getenv("E4KV_BENCH_PROFILER_STEP") != nullptr) {
      // One eager decode step between cudaProfilerStart and Stop: under `ncu
      // --profile-from-start off` (bench/profile_step_gpu.sh) each kernel's own device time.
      backend.synchronize();
      cudaProfilerStart();
      step(false);
      backend.synchronize();
      cudaProfilerStop();
    }
    row.cache = dtype == KvCacheDtype::kE4m3 ? "e4m3" : "fp16";
    row.batch = cell.batch;
    row.context = cell.context;
    row.step_ms = median(samples);
    row.graph_step_ms = median(graph_samples);
    row.graph_captures = graphs.stats().captures;
    row.graph_nodes = graphs.stats().last_nodes;
    row.prefill_tokens_per_s = cell.batch == 1 ? double(cell.context) / prefill_s : 0.0;
    std::fprintf(stderr,
                 "bench_qwen4exp: %s batch %d context %lld: step %.3f ms eager, %.3f ms from "
                 "graphs (%lld captured, %lld operations each)\n",
                 row.cache.c_str(), row.batch, static_cast<long long>(row.context), row.step_ms,
                 row.graph_step_ms, static_cast<long long>(row.graph_captures),
                 static_cast<long long>(row.graph_nodes));
    rows.push_back(row);
  }
  if (calibrate) {
    *calibration = calibration_cost(model, calibration_context, vocab);
    std::fprintf(stderr, "bench_qwen4exp: calibration statistics at %lld: off %.3f s, on %.3f s\n",
                 static_cast<long long>(calibration_context), calibration->off_s,
                 calibration->on_s);
  }
  return rows;
}

std::vector<int64_t> parse_list(const char* flag, const char* text) {
  std::vector<int64_t> values;
  const std::string s = text;
  size_t begin = 0;
  while (begin <= s.size()) {
    const size_t end = std::min(s.find(',', begin), s.size());
    char* stop = nullptr;
    const std::string item = s.substr(begin, end - begin);
    const long long v = std::strtoll(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || v <= 0) {
      die(cat(flag, " ", s, ": expected a comma-separated list of positive integers"));
    }
    values.push_back(v);
    begin = end + 1;
  }
  return values;
}

// One line per section; with `bounds` (batch-1 rows), the section's own byte bound at the copy
// rate beside its device time.
void print_sections(const char* what, const std::vector<ProfileSection>& sections,
                    const std::vector<SectionBytes>& bounds = {}, double rate = 0) {
  double host = 0, device = 0;
  for (const ProfileSection& s : sections) {
    std::printf("    %-18s %-16s x%-4lld host %8.3f ms  device %8.3f ms", what, s.name.c_str(),
                static_cast<long long>(s.count), s.host_ms, s.device_ms);
    for (const SectionBytes& b : bounds) {
      if (b.name != s.name || rate <= 0) continue;
      const double bound_ms = b.bytes / rate * 1e3;
      std::printf("  bound %8.3f ms (%5.1fx)", bound_ms, bound_ms > 0 ? s.device_ms / bound_ms : 0.0);
    }
    std::printf("\n");
    host += s.host_ms;
    device += s.device_ms;
  }
  std::printf("    %-18s %-16s       host %8.3f ms  device %8.3f ms\n", what, "total", host, device);
}

void json_sections(FILE* f, const char* key, const std::vector<ProfileSection>& sections) {
  std::fprintf(f, "\"%s\": [", key);
  for (size_t i = 0; i < sections.size(); ++i) {
    const ProfileSection& s = sections[i];
    std::fprintf(f, "%s{\"name\": \"%s\", \"count\": %lld, \"host_ms\": %.5f, \"device_ms\": %.5f}",
                 i > 0 ? ", " : "", s.name.c_str(), static_cast<long long>(s.count), s.host_ms,
                 s.device_ms);
  }
  std::fprintf(f, "]");
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = "qwen4exp.json";
  bool small = false;
  bool published = false;
  bool print_plan = false;
  std::string quant = "none";
  std::vector<int64_t> batches = {1, 8, 32};
  std::vector<int64_t> contexts;
  std::vector<KvCacheDtype> caches = {KvCacheDtype::kF16, KvCacheDtype::kE4m3};
  std::string keep;
  bool checkpoint_only = false;
  int64_t calibration_context = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--small") {
      small = true;
    } else if (arg == "--published") {
      published = true;
    } else if (arg == "--print-plan") {
      print_plan = true;
    } else if (arg == "--quant" && has_value) {
      quant = argv[++i];
      if (quant != "none" && quant != "awq-g32") die("--quant " + quant + ": expected none or awq-g32");
    } else if (arg == "--batches" && has_value) {
      batches = parse_list("--batches", argv[++i]);
    } else if (arg == "--contexts" && has_value) {
      contexts = parse_list("--contexts", argv[++i]);
    } else if (arg == "--cache" && has_value) {
      const std::string v = argv[++i];
      if (v == "fp16") {
        caches = {KvCacheDtype::kF16};
      } else if (v == "e4m3") {
        caches = {KvCacheDtype::kE4m3};
      } else if (v != "both") {
        die("--cache " + v + ": expected fp16, e4m3 or both");
      }
    } else if (arg == "--calibration-context" && has_value) {
      calibration_context = parse_list("--calibration-context", argv[++i]).at(0);
    } else if (arg == "--keep-checkpoint" && has_value) {
      keep = argv[++i];
    } else if (arg == "--checkpoint-only") {
      checkpoint_only = true;
    } else if (!arg.empty() && arg[0] != '-') {
      json_path = argv[i];
    } else {
      die("unknown argument " + arg +
          "; usage: e4kv_bench_qwen4exp [out.json] [--small | --published] [--quant "
          "none|awq-g32] [--batches 1,8,32] [--contexts 4096,32768,131072] [--cache "
          "fp16|e4m3|both] [--keep-checkpoint DIR [--checkpoint-only]] [--calibration-context N] "
          "[--print-plan]");
    }
  }
  if (small && published) die("--small and --published: pass one of them");
  if (checkpoint_only && keep.empty()) die("--checkpoint-only needs --keep-checkpoint DIR");
  if (contexts.empty()) {
    contexts = small ? std::vector<int64_t>{4096, 8192} : std::vector<int64_t>{4096, 32768, 131072};
  }
  // The published shape; by default with 64 experts in one file (the earlier runs' checkpoint).
  SynthCheckpointOptions synth = published_qwen4exp_options();
  if (!published) {
    synth.n_experts = 64;
    synth.max_shard_bytes = 0;
  }
  if (small) {
    synth.n_layers = 8;
    synth.vocab_size = 8192;
    synth.n_experts = 8;
    synth.experts_top_k = 2;
  }
  if (quant == "awq-g32") {
    synth.quant = SynthQuant::kAwq;
    synth.quant_group = 32;
    synth.quant_scope = SynthQuantScope::kExperts;
  }
  const std::string weights_text =
      quant == "awq-g32" ? "AWQ W4A16 g32 experts, FP16 other weights" : "FP16 weights";
  if (print_plan) {
    Result<SynthPlan> plan = plan_synth_checkpoint(synth);
    if (!plan.ok()) die(plan.message());
    std::printf("Qwen4Exp synthetic, %lld layers, %lld experts top-%lld, %s\n%s",
                static_cast<long long>(synth.n_layers), static_cast<long long>(synth.n_experts),
                static_cast<long long>(synth.experts_top_k), weights_text.c_str(),
                format_synth_plan(*plan).c_str());
    return 0;
  }
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  // --keep-checkpoint DIR: written there (or reused when DIR already holds it) and kept, so
  // that transformers can load the same checkpoint (bench/peer_qwen4exp.py).
  const fs::path dir = keep.empty() ? fs::temp_directory_path() / "e4kv_bench_qwen4exp" : fs::path(keep);
  if (keep.empty() || !fs::exists(dir / "config.json")) {
    if (!keep.empty() && fs::exists(dir) && !fs::is_empty(dir)) {
      die(cat("--keep-checkpoint ", keep, ": the directory exists and holds no checkpoint; give a new one"));
    }
    if (keep.empty()) fs::remove_all(dir);
    const auto t_write = std::chrono::steady_clock::now();
    if (Status st = write_synth_checkpoint(dir, synth); !st.ok()) die(st.message());
    const double write_s = seconds_since(t_write);
    uint64_t bytes = 0;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) bytes += entry.file_size();
    }
    std::fprintf(stderr, "bench_qwen4exp: checkpoint written in %.1f s (%.2f GB, %.2f GB/s)\n",
                 write_s, double(bytes) / 1e9, double(bytes) / 1e9 / write_s);
  }
  if (checkpoint_only) return 0;
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  if (!ckpt.ok()) die(ckpt.message());
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  if (!backend.ok()) die(backend.message());

  std::vector<Cell> cells;
  for (const int64_t batch : batches) {
    for (const int64_t context : contexts) {
      if (batch * context <= kMaxCellTokens) cells.push_back({int(batch), context});
    }
  }
  const double rate = copy_read_rate();
  std::vector<Row> rows;
  CalibrationCost calibration;
  for (const KvCacheDtype dtype : caches) {
    std::vector<Row> part = run_cache(*ckpt, **backend, dtype, cells, synth.vocab_size,
                                      calibration_context, &calibration);
    rows.insert(rows.end(), part.begin(), part.end());
  }
  if (keep.empty()) fs::remove_all(dir);

  std::printf(
      "model: Qwen4Exp synthetic, %lld layers, %lld experts top-%lld, %s; "
      "copy read rate %.0f GB/s\n",
      static_cast<long long>(synth.n_layers), static_cast<long long>(synth.n_experts),
      static_cast<long long>(synth.experts_top_k), weights_text.c_str(), rate / 1e9);
  std::printf("%-6s %6s %8s %10s %10s %12s %12s %12s %14s\n", "cache", "batch", "context",
              "step_ms", "graph_ms", "bound_ms", "step/bound", "graph/bound", "prefill_tok/s");
  FILE* f = std::fopen(json_path, "w");
  if (f == nullptr) return 1;
  std::fprintf(f,
               "{\"layers\": %lld, \"experts\": %lld, \"top_k\": %lld, \"weights\": \"%s\", "
               "\"copy_read_rate\": %.0f, \"rows\": [\n",
               static_cast<long long>(synth.n_layers), static_cast<long long>(synth.n_experts),
               static_cast<long long>(synth.experts_top_k), quant.c_str(), rate);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const KvCacheDtype dtype = r.cache == "e4m3" ? KvCacheDtype::kE4m3 : KvCacheDtype::kF16;
    const double bound_ms = r.batch == 1 ? step_bytes(synth, r.context, dtype) / rate * 1e3 : 0.0;
    std::printf("%-6s %6d %8lld %10.3f %10.3f %12.3f %12.2f %12.2f %14.0f\n", r.cache.c_str(),
                r.batch, static_cast<long long>(r.context), r.step_ms, r.graph_step_ms, bound_ms,
                bound_ms > 0 ? r.step_ms / bound_ms : 0.0,
                bound_ms > 0 ? r.graph_step_ms / bound_ms : 0.0, r.prefill_tokens_per_s);
    std::fprintf(f,
                 "  {\"cache\": \"%s\", \"batch\": %d, \"context\": %lld, \"step_ms\": %.5f, "
                 "\"graph_step_ms\": %.5f, \"graph_captures\": %lld, \"graph_nodes\": %lld, "
                 "\"bound_ms\": %.5f, \"prefill_tokens_per_s\": %.1f, ",
                 r.cache.c_str(), r.batch, static_cast<long long>(r.context), r.step_ms,
                 r.graph_step_ms, static_cast<long long>(r.graph_captures),
                 static_cast<long long>(r.graph_nodes), bound_ms,
                 r.prefill_tokens_per_s);
    json_sections(f, "isolated", r.isolated);
    std::fprintf(f, ", ");
    json_sections(f, "in_place", r.in_place);
    std::fprintf(f, ", ");
    json_sections(f, "prefill_chunk", r.prefill_chunk);
    std::fprintf(f, "}%s\n", i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "],\n\"calibration\": {\"context\": %lld, \"off_s\": %.4f, \"on_s\": %.4f}}\n",
               static_cast<long long>(calibration.context), calibration.off_s, calibration.on_s);
  std::fclose(f);
  if (calibration.context > 0) {
    std::printf("\ncalibration statistics, FP16 prefill of %lld tokens (median of %d): off %.3f s, "
                "on %.3f s, overhead %+.2f%%\n",
                static_cast<long long>(calibration.context), kCalibrationReps, calibration.off_s,
                calibration.on_s, 100.0 * (calibration.on_s / calibration.off_s - 1.0));
  }
  std::printf("\nper-section timeline of one decode step (isolated: each section's own device time "
              "and the host's cost to issue it; in place: the span it took in a normal step; batch 1: "
              "each section's own byte bound at the copy rate beside it)\n");
  for (const Row& r : rows) {
    std::printf("  %s batch %d context %lld\n", r.cache.c_str(), r.batch,
                static_cast<long long>(r.context));
    const KvCacheDtype dtype = r.cache == "e4m3" ? KvCacheDtype::kE4m3 : KvCacheDtype::kF16;
    const std::vector<SectionBytes> bounds =
        r.batch == 1 ? step_bytes_by_section(synth, r.context, dtype) : std::vector<SectionBytes>{};
    print_sections("isolated", r.isolated, bounds, rate);
    print_sections("in place", r.in_place, bounds, rate);
    if (!r.prefill_chunk.empty()) {
      const int64_t chunk = (r.context - 1) % kPrefillChunk + 1;
      std::printf("  %s prefill, last chunk of %lld tokens (from %lld), in place\n",
                  r.cache.c_str(), static_cast<long long>(chunk),
                  static_cast<long long>(r.context - chunk));
      print_sections("prefill chunk", r.prefill_chunk);
    }
  }
  return 0;
}
