// Dense model decode step on the CUDA backend, with and without programmatic dependent launch
// (launch.cuh): a synthetic Llama checkpoint (8 layers, hidden 1024, 8 heads / 4 KV heads of 128,
// MLP 2816, vocab 8192, FP16 weights; about 110M parameters, written to a temporary directory),
// `batch` sequences prefilled with 512 tokens each, then decode steps of one token per sequence
// through DenseModel::forward (host launches, logits copied back, as the engine decodes). A step is
// the wall time of one forward; each figure is the median of 7 samples of 16 steps, the two launch
// modes alternating sample by sample in the same process. FP16 and E4M3 (unit scales) caches.
// Prints a table and writes JSON (argv[1], default model_decode.json).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "model/families/dense.h"
#include "testing/synth_checkpoint.h"

namespace {

using namespace e4kv;
namespace fs = std::filesystem;

constexpr int64_t kPrompt = 512;
constexpr int kStepsPerSample = 16;
constexpr int kSamples = 7;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_model_decode: %s\n", what.c_str());
  std::exit(1);
}

struct Row {
  std::string cache;
  int batch = 0;
  double pdl_ms = 0;
  double plain_ms = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Row run(const Checkpoint& ckpt, Backend& backend, KvCacheDtype dtype, int batch) {
  ModelOptions options;
  options.kv_cache_dtype = dtype;
  options.kv_scales_mode =
      dtype == KvCacheDtype::kE4m3 ? KvScalesMode::kUnit : KvScalesMode::kCalibrated;
  options.block_size = 64;
  const int64_t max_len = kPrompt + int64_t(2 * kSamples + 2) * kStepsPerSample;
  options.n_blocks = batch * blocks_for_tokens(max_len, options.block_size) + 1;
  options.max_model_len = max_len;
  options.max_batch_tokens = batch * kPrompt;  // every prompt in one forward
  options.max_seqs = batch;
  Result<std::unique_ptr<DenseModel>> loaded = DenseModel::load(ckpt, backend, options);
  if (!loaded.ok()) die(loaded.message());
  DenseModel& model = **loaded;

  BlockAllocator allocator(options.n_blocks, options.block_size);
  std::vector<BlockTable> tables(static_cast<size_t>(batch));
  std::vector<int32_t> lengths(static_cast<size_t>(batch), 0);
  std::vector<const BlockTable*> seqs;
  for (const BlockTable& t : tables) seqs.push_back(&t);

  // Prefill: every sequence's prompt in one forward.
  {
    std::vector<int32_t> ids, row_seq, row_pos, logit_rows;
    for (int s = 0; s < batch; ++s) {
      allocator.append(tables[size_t(s)], kPrompt);
      for (int64_t i = 0; i < kPrompt; ++i) {
        ids.push_back(int32_t((s * 131 + i * 7) % 8000 + 1));
        row_seq.push_back(s);
        row_pos.push_back(int32_t(i));
      }
      logit_rows.push_back(int32_t(ids.size() - 1));
      lengths[size_t(s)] = int32_t(kPrompt);
    }
    ForwardBatch fb{ids, row_seq, row_pos, seqs, logit_rows};
    Result<std::vector<float>> logits = model.forward(fb);
    if (!logits.ok()) die(logits.message());
  }

  std::vector<int32_t> ids(static_cast<size_t>(batch)), row_seq(static_cast<size_t>(batch)),
      row_pos(static_cast<size_t>(batch)), logit_rows(static_cast<size_t>(batch));
  auto step = [&] {
    for (int s = 0; s < batch; ++s) {
      allocator.append(tables[size_t(s)], 1);
      ids[size_t(s)] = int32_t((lengths[size_t(s)] * 13 + s) % 8000 + 1);
      row_seq[size_t(s)] = s;
      row_pos[size_t(s)] = lengths[size_t(s)]++;
      logit_rows[size_t(s)] = s;
    }
    ForwardBatch fb{ids, row_seq, row_pos, seqs, logit_rows};
    Result<std::vector<float>> logits = model.forward(fb);
    if (!logits.ok()) die(logits.message());
  };
  auto sample_ms = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kStepsPerSample; ++i) step();
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::milli>(t1 - t0).count() / kStepsPerSample;
  };
  step();  // warm-up (first decode launches, workspaces)
  step();
  std::vector<double> pdl, plain;
  for (int i = 0; i < kSamples; ++i) {
    cuda::set_programmatic_launch(true);
    pdl.push_back(sample_ms());
    cuda::set_programmatic_launch(false);
    plain.push_back(sample_ms());
  }
  cuda::set_programmatic_launch(true);
  return Row{dtype == KvCacheDtype::kE4m3 ? "e4m3" : "fp16", batch, median(pdl), median(plain)};
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "model_decode.json";
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kLlama;
  synth.n_layers = 8;
  synth.hidden_size = 1024;
  synth.intermediate_size = 2816;
  synth.n_heads = 8;
  synth.n_kv_heads = 4;
  synth.head_dim = 128;
  synth.vocab_size = 8192;
  synth.dtype = DType::kF16;
  const fs::path dir = fs::temp_directory_path() / "e4kv_bench_model_decode";
  fs::remove_all(dir);
  if (Status st = write_synth_checkpoint(dir, synth); !st.ok()) die(st.message());
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  if (!ckpt.ok()) die(ckpt.message());
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  if (!backend.ok()) die(backend.message());

  std::vector<Row> rows;
  for (const KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
    for (const int batch : {1, 16}) rows.push_back(run(*ckpt, **backend, dtype, batch));
  }
  fs::remove_all(dir);

  std::printf(
      "model: Llama, 8 layers, hidden 1024, 8 / 4 heads x 128, MLP 2816, vocab 8192, FP16 "
      "weights; prompt %lld tokens per sequence\n",
      (long long)kPrompt);
  std::printf("programmatic dependent launch usable: %s\n",
              cuda::programmatic_launch_enabled() ? "yes" : "no (plain launches both ways)");
  std::printf("%-6s %6s %14s %16s %8s\n", "cache", "batch", "step_pdl_ms", "step_plain_ms",
              "plain/pdl");
  for (const Row& r : rows) {
    std::printf("%-6s %6d %14.3f %16.3f %7.3fx\n", r.cache.c_str(), r.batch, r.pdl_ms, r.plain_ms,
                r.plain_ms / r.pdl_ms);
  }
  FILE* f = std::fopen(json_path, "w");
  if (f == nullptr) return 1;
  std::fprintf(f, "{\"prompt\": %lld, \"steps_per_sample\": %d, \"samples\": %d, \"rows\": [\n",
               (long long)kPrompt, kStepsPerSample, kSamples);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::fprintf(f,
                 "  {\"cache\": \"%s\", \"batch\": %d, \"step_pdl_ms\": %.5f, "
                 "\"step_plain_ms\": %.5f}%s\n",
                 rows[i].cache.c_str(), rows[i].batch, rows[i].pdl_ms, rows[i].plain_ms,
                 i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return 0;
}
