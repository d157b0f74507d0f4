#include "model_setup.h"

#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <limits>

#include "numeric_flags.h"
#include "option_flags.h"

namespace e4kv::cli {

namespace {

std::string flag_name(std::string_view field) {
  return flag_for_option(field);
}

ModelSetup with_flag_names(const ModelFlags& flags) {
  ModelSetup setup = flags;
  setup.option_name = &flag_name;
  return setup;
}

}  // namespace

void add_model_flags(CLI::App* cmd, ModelFlags& flags) {
  cmd->add_option("MODEL", flags.model_dir, "Hugging Face model directory")->required();
  cmd->add_option("--device", flags.device, "cpu, or cuda / cuda:N (a CUDA build)")
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype", flags.kv_cache_dtype, "KV cache dtype: fp16 or fp8_e4m3")
      ->capture_default_str();
  cmd->add_option("--kv-scales", flags.kv_scales,
                  "E4M3 cache scales: calibrated (from the checkpoint; fails closed) or unit "
                  "(1.0, a negative control)")
      ->capture_default_str();
  cmd->add_option("--ple-dtype", flags.ple_dtype,
                  "PLE n-gram tables in host memory: auto (the checkpoint's dtype, read in place) "
                  "or fp8_e4m3 (an E4M3 copy with an FP32 scale per row, half the memory)")
      ->capture_default_str();
  cmd->add_option("--block-size", flags.block_size, "Tokens per KV cache block (multiple of 16)")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--max-model-len", flags.max_model_len,
                  "Longest sequence (prompt + output); default: max_position_embeddings")
      ->transform(decimal_integer<int64_t>(0, kMaxTokenCount));
  cmd->add_option("--threads", flags.threads, "CPU threads (0: all)")
      ->transform(decimal_integer<int>(0, int(kMaxThreads)))
      ->capture_default_str();
  cmd->add_option("--tensor-parallel-size", flags.tensor_parallel_size,
                  "Ranks of tensor parallelism, each holding its share of the heads and channels "
                  "(and of the KV pool); CPU ranks in this build")
      ->transform(decimal_integer<int>(1, kMaxTensorParallelSize))
      ->capture_default_str();
}

void add_pool_flags(CLI::App* cmd, ModelFlags& flags) {
  cmd->add_option_function<int64_t>(
         "--kv-cache-memory-bytes", [&flags](const int64_t& n) { flags.kv_cache_memory_bytes = n; },
         "Bytes of the KV cache pool: whole blocks after the per-sequence states of the maximum "
         "number of sequences (as `e4kv capacity` counts)")
      ->transform(decimal_integer<int64_t>(1, kMaxPoolBytes));
  cmd->add_option_function<int64_t>(
         "--num-gpu-blocks-override",
         [&flags](const int64_t& n) { flags.num_gpu_blocks_override = n; },
         "Blocks of the KV cache pool, exactly (any device)")
      ->transform(decimal_integer<int64_t>(1, kMaxPoolBlocks));
  cmd->add_option_function<double>(
         "--gpu-memory-utilization",
         [&flags](const double& g) { flags.gpu_memory_utilization = g; },
         "CUDA: the fraction of the card's memory e4kv may take; the KV pool gets what the weights "
         "and the activation peak of a memory-profiling forward leave of it")
      ->transform(finite_number());
  cmd->add_flag("--enforce-eager", flags.enforce_eager,
                "Run every step op by op: no CUDA graphs of the decode step (on by default on "
                "CUDA)");
}

Status validate_model_flags(const ModelFlags& flags) {
  return validate_model_setup(with_flag_names(flags));
}

Result<std::unique_ptr<Backend>> make_backend(const std::string& device, int threads) {
  ModelSetup setup;
  setup.device = device;
  setup.threads = threads;
  setup.option_name = &flag_name;
  return e4kv::make_backend(setup);
}

Result<LoadedModel> load_model(const ModelFlags& flags, int64_t tokens, int64_t all_rows,
                               int64_t n_seqs) {
  ModelSetup setup = with_flag_names(flags);
  LoadProgressLine progress;
  setup.load_progress = progress.callback();
  Result<LoadedModel> result = e4kv::load_model(setup, tokens, all_rows, n_seqs);
  progress.finish(result.ok());
  E4KV_ASSIGN_OR_RETURN(LoadedModel loaded, std::move(result));
  for (const std::string& note : loaded.notes) std::fprintf(stderr, "e4kv: %s\n", note.c_str());
  return loaded;
}

LoadProgressLine::LoadProgressLine()
    : terminal_(isatty(fileno(stderr)) != 0), start_(std::chrono::steady_clock::now()) {}

std::function<void(uint64_t, uint64_t)> LoadProgressLine::callback() {
  if (!terminal_) return nullptr;
  return [this](uint64_t done, uint64_t total) {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "\re4kv: loading weights %6.2f / %.2f GB (%3d%%) %6.1f s",
                 double(done) / 1e9, double(total) / 1e9, total > 0 ? int(100 * done / total) : 100,
                 s);
    std::fflush(stderr);
    drawn_ = true;
  };
}

void LoadProgressLine::finish(bool ok) {
  if (drawn_) std::fprintf(stderr, "%s\n", ok ? ", done" : "");
  drawn_ = false;
}

Result<std::vector<int32_t>> parse_id_list(const std::string& flag, const std::string& text) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(pos, comma - pos);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    int64_t value = -1;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || value < 0 ||
        value > std::numeric_limits<int32_t>::max()) {
      return Status::error(cat(flag, " \"", text, "\": entry ", ids.size(), " (\"", item,
                               "\") is not a token id; expected comma-separated non-negative "
                               "integers like 1,2,3"));
    }
    ids.push_back(static_cast<int32_t>(value));
    pos = comma + 1;
  }
  return ids;
}

}  // namespace e4kv::cli
