// Decode steps of a dense Llama-3-8B-shaped model on the CUDA backend, launched op by op and
// replayed from step graphs (engine/step_graphs.h), against the step's byte bound.
//
// The model: a synthetic checkpoint with Llama-3-8B's shape (32 layers, hidden 4096, 32 q / 8 KV
// heads x 128, MLP 14336, vocab 128256, rope_theta 500000, untied lm_head; FP16 weights, about
// 8.0B parameters, 16 GB in shards of at most 4 GB), written once (--keep-checkpoint DIR keeps it
// and reuses it on later runs) and loaded once per cache dtype: FP16, and E4M3 with unit scales
// (a speed measure only). The weights are the synthetic checkpoint's (uniform in +-1/sqrt(fan_in),
// norms near 1), which keep FP16 activations finite through the layers; after the timed samples
// the benchmark runs a sample's last step again in each mode and reports whether its logits are
// finite and bit-identical in the two.
//
// Per cell (batch x context): `batch` sequences, each prefilled alone to `context` tokens in
// forwards of at most kPrefillChunk tokens; then decode steps of one token per sequence (every
// row a logit row), each followed by Backend::synchronize (a serving loop waits for the logits it
// samples). A sample is kStepsPerSample steps, the first at position `context`; every sample
// rewinds the sequences to `context` and decodes the same positions again (the dense model keeps
// no per-sequence state beyond the cache rows, which are rewritten), so every sample and both
// launch modes do the same work and every graph is captured in the warm-up. Eager is
// Model::forward_device; graphs is StepGraphs::forward (capture at first use, replay after). The
// two modes alternate sample by sample in the same process; each figure is the median of kSamples
// samples, after one warm-up sample of each mode (graph captures counted before and during the
// timed samples).
//
// The byte bound of a step: every weight byte but the embedding table (of which a step reads one
// row per sequence), plus the K/V rows the step's attention reads (batch x mean context of the
// sample x 2 x layers x KV heads x head_dim x element bytes) and the one row per sequence it
// writes, at the device-to-device copy rate measured in the same run (bench_timing.cuh: bytes read
// and written per second). "% of bound" is bound / step: the fraction of the copy rate a step
// reaches.
//
// Usage: e4kv_bench_dense_decode [out.json] [--cells 1x4096,8x32768] [--cache fp16|e4m3|both]
//        [--keep-checkpoint DIR] [--layers N] [--print-plan]
// Environment: E4KV_BENCH_PROFILER_STEP set: one more eager step per cell between
// cudaProfilerStart and cudaProfilerStop, for ncu (bench/profile_step_gpu.sh BENCH=dense)
// (--layers N: a shallower model of the same width, for a quick check of the harness; its
// checkpoint is another one, so give it another --keep-checkpoint directory. --print-plan: the
// checkpoint's tensors and bytes, and each cell's bytes per step; needs no GPU.)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"
#include "bench_timing.cuh"
#include "engine/step_graphs.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "kv/kv_cache_view.h"
#include "model/model.h"
#include "testing/synth_checkpoint.h"

namespace {

using namespace e4kv;
namespace fs = std::filesystem;

constexpr int64_t kPrefillChunk = 8192;
constexpr int kStepsPerSample = 16;
constexpr int kSamples = 7;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_dense_decode: %s\n", what.c_str());
  std::exit(1);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const char* cache_name(KvCacheDtype dtype) {
  return dtype == KvCacheDtype::kE4m3 ? "e4m3" : "fp16";
}

struct Cell {
  int batch = 0;
  int64_t context = 0;
};

struct Row {
  KvCacheDtype cache = KvCacheDtype::kF16;
  Cell cell;
  double prefill_s = 0;  // every sequence of the cell
  double eager_ms = 0;
  double graph_ms = 0;
  double bound_ms = 0;
  int64_t captures = 0;           // graphs recorded in the cell, warm-up included
  int64_t captures_timed = 0;     // of which during the timed samples (0 when the warm-up saw all)
  int64_t graph_nodes = -1;       // the operations of one step's graph (the launches it replays)
  int64_t graph_eager_steps = 0;  // steps StepGraphs ran op by op (0 while graphs work)
  std::string capture_error;      // why graphs stopped, if they did
  bool logits_finite = false;     // the checked step's logits, both modes
  bool graph_equals_eager = false;  // the checked step's logits are bit-identical in both modes
};

// The Llama-3-8B shape (the published config's sizes) with FP16 weights.
SynthCheckpointOptions llama3_8b_options(int64_t n_layers) {
  SynthCheckpointOptions o;
  o.family = SynthFamily::kLlama;
  o.n_layers = n_layers;
  o.hidden_size = 4096;
  o.intermediate_size = 14336;
  o.n_heads = 32;
  o.n_kv_heads = 8;
  o.head_dim = 128;
  o.vocab_size = 128256;
  o.rope_theta = 500000.0;
  o.rope_type = "default";
  o.dtype = DType::kF16;
  o.max_total_bytes = uint64_t(16) << 30;  // 16.06e9 bytes of weights at 32 layers
  o.max_shard_bytes = 4000000000ull;
  return o;
}

// Weight bytes a decode step reads: every tensor but the embedding table.
double step_weight_bytes(const SynthPlan& plan) {
  double bytes = 0;
  for (const SynthPlanTensor& t : plan.tensors) {
    if (t.name != "model.embed_tokens.weight") bytes += double(t.bytes);
  }
  return bytes;
}

// K/V bytes one step of a sample reads and writes, averaged over the sample's positions.
double step_kv_bytes(const SynthCheckpointOptions& o, const Cell& cell, KvCacheDtype dtype) {
  const double per_token =
      2.0 * double(o.n_layers * o.n_kv_heads * o.head_dim) * double(kv_cache_elem_bytes(dtype));
  // The step at position context + k attends over context + k + 1 tokens, k = 0 .. steps - 1.
  const double mean_read = double(cell.context) + double(kStepsPerSample + 1) / 2.0;
  return double(cell.batch) * (mean_read + 1.0) * per_token;  // + the row each sequence writes
}

// Writes the checkpoint into `dir`, or (keep) reuses the one a previous run kept there; returns
// the seconds spent writing.
double ensure_checkpoint(const fs::path& dir, const SynthCheckpointOptions& synth,
                         const SynthPlan& plan, bool keep) {
  if (keep && fs::exists(dir / "config.json")) {
    std::ifstream in(dir / "config.json");
    std::stringstream text;
    text << in.rdbuf();
    if (text.str() != plan.config_json) {
      die(cat("--keep-checkpoint ", dir.string(),
              ": holds another checkpoint (its config.json differs from this benchmark's); give "
              "another directory"));
    }
    // config.json is written first and each shard renamed into place when complete, the index
    // last: a write that was cut short lacks one of them.
    bool complete =
        plan.shard_names.size() <= 1 || fs::exists(dir / "model.safetensors.index.json");
    for (const std::string& shard : plan.shard_names)
      complete = complete && fs::exists(dir / shard);
    if (!complete) {
      die(cat("--keep-checkpoint ", dir.string(),
              ": the checkpoint there is incomplete (an earlier write was cut short); remove the "
              "directory and run again"));
    }
    std::fprintf(stderr, "bench_dense_decode: reusing the checkpoint in %s\n", dir.c_str());
    return 0.0;
  }
  if (keep && fs::exists(dir) && !fs::is_empty(dir)) {
    die(cat("--keep-checkpoint ", dir.string(),
            ": the directory exists and holds no checkpoint; give a new or empty one"));
  }
  if (!keep) fs::remove_all(dir);
  const auto t0 = std::chrono::steady_clock::now();
  if (Status st = write_synth_checkpoint(dir, synth); !st.ok()) die(st.message());
  const double write_s = seconds_since(t0);
  std::fprintf(stderr, "bench_dense_decode: checkpoint written in %.1f s (%.2f GB, %.2f GB/s)\n",
               write_s, double(plan.total_bytes) / 1e9, double(plan.total_bytes) / 1e9 / write_s);
  return write_s;
}

// Prefills one sequence (`salt` varies its ids) to `context` tokens in forwards of kPrefillChunk.
void prefill(Model& model, BlockAllocator& allocator, BlockTable& table, int32_t slot, int salt,
             int64_t context) {
  const int64_t vocab = model.vocab_size();
  for (int64_t begin = 0; begin < context; begin += kPrefillChunk) {
    const int64_t n = std::min(kPrefillChunk, context - begin);
    allocator.append(table, n);
    const size_t rows = static_cast<size_t>(n);
    std::vector<int32_t> ids(rows), seq(rows, 0), pos(rows);
    for (int64_t i = 0; i < n; ++i) {
      ids[size_t(i)] = int32_t(((begin + i) * 7919 + salt * 131) % (vocab - 16) + 1);
      pos[size_t(i)] = int32_t(begin + i);
    }
    const int32_t last = int32_t(n - 1);
    const std::span<const int32_t> logit_row(&last, 1), slots(&slot, 1);
    const ForwardBatch fb{ids, seq, pos, {&table}, logit_row, slots};
    Result<DeviceLogits> logits = model.forward_device(fb);
    if (!logits.ok()) die(logits.message());
  }
  model.backend().synchronize();
}

std::vector<float> host_logits(Backend& backend, const DeviceLogits& logits) {
  std::vector<float> host(size_t(logits.rows * logits.vocab));
  backend.copy_to_host(host.data(), logits.data, host.size() * sizeof(float));
  return host;
}

Row run_cell(Model& model, KvCacheDtype dtype, const Cell& cell) {
  Backend& backend = model.backend();
  const int64_t vocab = model.vocab_size();
  const size_t n = size_t(cell.batch);
  BlockAllocator allocator(model.n_blocks(), model.block_size());
  std::vector<BlockTable> tables(n);
  std::vector<ScopedSequence> held;
  std::vector<int32_t> slots;
  for (size_t s = 0; s < n; ++s) {
    Result<ScopedSequence> seq = ScopedSequence::allocate(model);
    if (!seq.ok()) die(seq.message());
    slots.push_back(seq->slot());
    held.push_back(std::move(seq).value());
  }
  Row row;
  row.cache = dtype;
  row.cell = cell;
  const auto t_prefill = std::chrono::steady_clock::now();
  for (size_t s = 0; s < n; ++s) {
    prefill(model, allocator, tables[s], slots[s], int(s), cell.context);
    // The blocks of every position a sample decodes, taken once: samples rewind n_tokens.
    allocator.append(tables[s], kStepsPerSample);
  }
  row.prefill_s = seconds_since(t_prefill);
  std::fprintf(stderr, "bench_dense_decode: %s %d x %lld prefilled in %.1f s\n", cache_name(dtype),
               cell.batch, static_cast<long long>(cell.context), row.prefill_s);

  StepGraphs graphs(model, cell.batch, /*enabled=*/true);
  if (!graphs.active()) die("step graphs are not active on this model and backend");
  std::vector<const BlockTable*> seqs;
  for (const BlockTable& t : tables) seqs.push_back(&t);
  std::vector<int32_t> ids(n), row_seq(n), row_pos(n), logit_rows(n);
  // Decode step k of a sample (position context + k of every sequence), in one of the two modes.
  auto step = [&](int k, bool graphed) -> DeviceLogits {
    for (size_t s = 0; s < n; ++s) {
      const int64_t pos = cell.context + k;
      tables[s].n_tokens = pos + 1;
      ids[s] = int32_t((pos * 13 + int64_t(s)) % (vocab - 16) + 1);
      row_seq[s] = int32_t(s);
      row_pos[s] = int32_t(pos);
      logit_rows[s] = int32_t(s);
    }
    const ForwardBatch fb{ids, row_seq, row_pos, seqs, logit_rows, slots};
    Result<DeviceLogits> logits = graphed ? graphs.forward(fb) : model.forward_device(fb);
    if (!logits.ok()) die(logits.message());
    backend.synchronize();
    return *logits;
  };
  auto sample_ms = [&](bool graphed) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < kStepsPerSample; ++k) step(k, graphed);
    return seconds_since(t0) * 1e3 / kStepsPerSample;
  };
  sample_ms(false);  // warm-up: first launches, and every graph of the sample's positions
  sample_ms(true);
  const int64_t captures_warm = graphs.stats().captures;
  const int64_t eager_warm = graphs.stats().eager;
  std::vector<double> eager, graph;
  for (int i = 0; i < kSamples; ++i) {
    eager.push_back(sample_ms(false));
    graph.push_back(sample_ms(true));
  }
  row.eager_ms = median(eager);
  row.graph_ms = median(graph);
  row.captures = graphs.stats().captures;
  row.captures_timed = graphs.stats().captures - captures_warm;
  row.graph_nodes = graphs.stats().last_nodes;
  row.graph_eager_steps = graphs.stats().eager - eager_warm;
  row.capture_error = graphs.capture_error();
  // The last step again in both modes: the same position and ids, so the same logits.
  const std::vector<float> le = host_logits(backend, step(kStepsPerSample - 1, false));
  const std::vector<float> lg = host_logits(backend, step(kStepsPerSample - 1, true));
  const auto finite = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
  };
  row.logits_finite = finite(le) && finite(lg);
  row.graph_equals_eager = le == lg;
  if (std::getenv("E4KV_BENCH_PROFILER_STEP") != nullptr) {
    // One more eager step between cudaProfilerStart and Stop: under `ncu --profile-from-start
    // off` (bench/profile_step_gpu.sh BENCH=dense) each kernel's own device time.
    backend.synchronize();
    cudaProfilerStart();
    (void)host_logits(backend, step(kStepsPerSample - 1, false));
    cudaProfilerStop();
  }
  std::fprintf(stderr,
               "bench_dense_decode: %s %d x %lld: eager %.3f ms, graphs %.3f ms (%lld captures, "
               "%lld during the timed samples; %lld operations per graph)\n",
               cache_name(dtype), cell.batch, static_cast<long long>(cell.context), row.eager_ms,
               row.graph_ms, static_cast<long long>(row.captures),
               static_cast<long long>(row.captures_timed), static_cast<long long>(row.graph_nodes));
  return row;
}

std::vector<Row> run_cache(const Checkpoint& ckpt, Backend& backend, KvCacheDtype dtype,
                           const std::vector<Cell>& cells) {
  int max_batch = 1;
  int64_t max_context = 0;
  int64_t max_blocks = 0;
  ModelOptions options;
  options.block_size = 64;
  for (const Cell& c : cells) {
    max_batch = std::max(max_batch, c.batch);
    max_context = std::max(max_context, c.context);
    const int64_t per_seq = blocks_for_tokens(c.context + kStepsPerSample, options.block_size);
    max_blocks = std::max(max_blocks, int64_t(c.batch) * per_seq);
  }
  options.kv_cache_dtype = dtype;
  options.kv_scales_mode =
      dtype == KvCacheDtype::kE4m3 ? KvScalesMode::kUnit : KvScalesMode::kCalibrated;
  options.max_model_len = max_context + kStepsPerSample;
  options.n_blocks = max_blocks;
  options.max_batch_tokens = kPrefillChunk;
  options.max_seqs = max_batch;
  const auto t_load = std::chrono::steady_clock::now();
  Result<std::unique_ptr<Model>> loaded = load_model(ckpt, backend, options);
  if (!loaded.ok()) die(loaded.message());
  std::fprintf(stderr, "bench_dense_decode: %s model loaded in %.1f s (%lld cache blocks)\n",
               cache_name(dtype), seconds_since(t_load), static_cast<long long>(max_blocks));
  std::vector<Row> rows;
  for (const Cell& cell : cells) rows.push_back(run_cell(**loaded, dtype, cell));
  return rows;
}

// "1x4096,8x32768" -> cells.
std::vector<Cell> parse_cells(const std::string& text) {
  std::vector<Cell> cells;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    char* stop = nullptr;
    const long long batch = std::strtoll(item.c_str(), &stop, 10);
    long long context = 0;
    bool ok = stop != item.c_str() && *stop == 'x';
    if (ok) {
      const char* rest = stop + 1;
      context = std::strtoll(rest, &stop, 10);
      ok = stop != rest && *stop == '\0';
    }
    if (!ok || batch <= 0 || batch > 256 || context <= 0 || context > (int64_t(1) << 24)) {
      die(cat("--cells ", text,
              ": expected BATCHxCONTEXT[,BATCHxCONTEXT...] with batch 1-256 and "
              "context 1-16777216, e.g. 1x4096,8x32768"));
    }
    cells.push_back({int(batch), context});
    begin = end + 1;
  }
  return cells;
}

std::string device_name() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "unknown";
  return prop.name;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path = "dense_decode.json";
  std::vector<Cell> cells = parse_cells("1x4096,8x32768");
  std::vector<KvCacheDtype> caches = {KvCacheDtype::kF16, KvCacheDtype::kE4m3};
  std::string keep;
  int64_t n_layers = 32;
  bool print_plan = false;
  const char* usage =
      "usage: e4kv_bench_dense_decode [out.json] [--cells 1x4096,8x32768] [--cache "
      "fp16|e4m3|both] [--keep-checkpoint DIR] [--layers N] [--print-plan]";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--cells" && has_value) {
      cells = parse_cells(argv[++i]);
    } else if (arg == "--cache" && has_value) {
      const std::string v = argv[++i];
      if (v == "fp16") {
        caches = {KvCacheDtype::kF16};
      } else if (v == "e4m3") {
        caches = {KvCacheDtype::kE4m3};
      } else if (v == "both") {
        caches = {KvCacheDtype::kF16, KvCacheDtype::kE4m3};
      } else {
        die("--cache " + v + ": expected fp16, e4m3 or both");
      }
    } else if (arg == "--keep-checkpoint" && has_value) {
      keep = argv[++i];
    } else if (arg == "--layers" && has_value) {
      const std::string v = argv[++i];
      char* stop = nullptr;
      n_layers = std::strtoll(v.c_str(), &stop, 10);
      if (v.empty() || *stop != '\0' || n_layers <= 0 || n_layers > 32) {
        die("--layers " + v + ": expected 1 to 32");
      }
    } else if (arg == "--print-plan") {
      print_plan = true;
    } else if (!arg.empty() && arg[0] != '-') {
      json_path = arg;
    } else {
      die("unknown argument " + arg + "; " + usage);
    }
  }
  const auto t_start = std::chrono::steady_clock::now();
  const SynthCheckpointOptions synth = llama3_8b_options(n_layers);
  Result<SynthPlan> plan = plan_synth_checkpoint(synth);
  if (!plan.ok()) die(plan.message());
  if (print_plan) {
    std::printf("%s", format_synth_plan(*plan).c_str());
    for (const Cell& c : cells) {
      for (const KvCacheDtype dtype : caches) {
        std::printf("%s %d x %lld: %.3f GB of weights + %.3f GB of K/V per step\n",
                    cache_name(dtype), c.batch, static_cast<long long>(c.context),
                    step_weight_bytes(*plan) / 1e9, step_kv_bytes(synth, c, dtype) / 1e9);
      }
    }
    return 0;
  }
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "bench_dense_decode: no CUDA device\n");
    return 1;
  }

  const fs::path dir =
      keep.empty() ? fs::temp_directory_path() / "e4kv_bench_dense_decode" : fs::path(keep);
  const double write_s = ensure_checkpoint(dir, synth, *plan, !keep.empty());
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  if (!ckpt.ok()) die(ckpt.message());
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  if (!backend.ok()) die(backend.message());

  // Measured before any model holds device memory (the copy takes two 2 GiB buffers).
  const double copy_bytes_per_s = bench::copy_bandwidth_tbs() * 1e12;
  const double weight_bytes = step_weight_bytes(*plan);
  std::vector<Row> rows;
  for (const KvCacheDtype dtype : caches) {
    std::vector<Row> part = run_cache(*ckpt, **backend, dtype, cells);
    for (Row& r : part) {
      r.bound_ms = (weight_bytes + step_kv_bytes(synth, r.cell, dtype)) / copy_bytes_per_s * 1e3;
    }
    rows.insert(rows.end(), part.begin(), part.end());
  }
  if (keep.empty()) fs::remove_all(dir);

  const std::string device = device_name();
  std::printf(
      "model: Llama-3-8B-shaped synthetic, %lld layers, hidden 4096, 32 q / 8 KV heads x 128, "
      "MLP 14336, vocab 128256, FP16 weights (%.2f GB read per step); %s; copy rate %.2f TB/s "
      "(read + written); %d samples of %d steps, each step synchronised\n",
      static_cast<long long>(synth.n_layers), weight_bytes / 1e9, device.c_str(),
      copy_bytes_per_s / 1e12, kSamples, kStepsPerSample);
  std::printf("%-6s %6s %8s %10s %10s %10s %8s %8s %9s %7s %6s\n", "cache", "batch", "context",
              "eager_ms", "graph_ms", "bound_ms", "eager%", "graph%", "captures", "finite",
              "equal");
  for (const Row& r : rows) {
    std::printf("%-6s %6d %8lld %10.3f %10.3f %10.3f %7.1f%% %7.1f%% %5lld/%-3lld %7s %6s\n",
                cache_name(r.cache), r.cell.batch, static_cast<long long>(r.cell.context),
                r.eager_ms, r.graph_ms, r.bound_ms, 100.0 * r.bound_ms / r.eager_ms,
                100.0 * r.bound_ms / r.graph_ms, static_cast<long long>(r.captures),
                static_cast<long long>(r.captures_timed), r.logits_finite ? "yes" : "NO",
                r.graph_equals_eager ? "yes" : "NO");
    if (!r.capture_error.empty()) {
      std::printf("    graphs stopped: %s (%lld steps of the timed samples ran eagerly)\n",
                  r.capture_error.c_str(), static_cast<long long>(r.graph_eager_steps));
    }
  }
  std::printf("(captures: all / during the timed samples; %% of bound: bound / step)\n");

  // E4M3 over FP16 per cell, where both ran.
  struct Ratio {
    Cell cell;
    double graph = 0, eager = 0;
  };
  std::vector<Ratio> ratios;
  for (const Row& f : rows) {
    if (f.cache != KvCacheDtype::kF16) continue;
    for (const Row& e : rows) {
      if (e.cache == KvCacheDtype::kE4m3 && e.cell.batch == f.cell.batch &&
          e.cell.context == f.cell.context) {
        ratios.push_back({f.cell, e.graph_ms / f.graph_ms, e.eager_ms / f.eager_ms});
      }
    }
  }
  for (const Ratio& r : ratios) {
    std::printf("E4M3 / FP16 step, %d x %lld: graphs %.3f, eager %.3f\n", r.cell.batch,
                static_cast<long long>(r.cell.context), r.graph, r.eager);
  }

  FILE* f = std::fopen(json_path.c_str(), "w");
  if (f == nullptr) die(cat(json_path, ": cannot open for writing"));
  std::fprintf(f,
               "{\"model\": \"llama-3-8b-shaped synthetic\", \"layers\": %lld, \"weights\": "
               "\"fp16\", \"step_weight_bytes\": %.0f, \"device\": \"%s\", \"copy_tbs\": %.4f, "
               "\"checkpoint_write_s\": %.2f, \"steps_per_sample\": %d, \"samples\": %d, "
               "\"rows\": [\n",
               static_cast<long long>(synth.n_layers), weight_bytes, device.c_str(),
               copy_bytes_per_s / 1e12, write_s, kStepsPerSample, kSamples);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(
        f,
        "  {\"cache\": \"%s\", \"batch\": %d, \"context\": %lld, \"eager_ms\": %.5f, "
        "\"graph_ms\": %.5f, \"byte_bound_ms\": %.5f, \"eager_pct_of_bound\": %.2f, "
        "\"graph_pct_of_bound\": %.2f, \"captures\": %lld, \"captures_timed\": %lld, "
        "\"graph_nodes\": %lld, "
        "\"graph_eager_steps\": %lld, \"graphs_active\": %s, \"logits_finite\": %s, "
        "\"graph_equals_eager\": %s, \"prefill_s\": %.2f}%s\n",
        cache_name(r.cache), r.cell.batch, static_cast<long long>(r.cell.context), r.eager_ms,
        r.graph_ms, r.bound_ms, 100.0 * r.bound_ms / r.eager_ms, 100.0 * r.bound_ms / r.graph_ms,
        static_cast<long long>(r.captures), static_cast<long long>(r.captures_timed),
        static_cast<long long>(r.graph_nodes), static_cast<long long>(r.graph_eager_steps), r.capture_error.empty() ? "true" : "false",
        r.logits_finite ? "true" : "false", r.graph_equals_eager ? "true" : "false", r.prefill_s,
        i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "],\n\"e4m3_over_fp16\": [");
  for (size_t i = 0; i < ratios.size(); ++i) {
    std::fprintf(f, "%s{\"batch\": %d, \"context\": %lld, \"graph\": %.4f, \"eager\": %.4f}",
                 i > 0 ? ", " : "", ratios[i].cell.batch,
                 static_cast<long long>(ratios[i].cell.context), ratios[i].graph, ratios[i].eager);
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  std::printf("run time %.0f s (checkpoint write %.0f s)\n", seconds_since(t_start), write_s);
  return 0;
}
