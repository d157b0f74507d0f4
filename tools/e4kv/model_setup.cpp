#include "model_setup.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "core/checked.h"
#include "kv/block_allocator.h"
#include "kv/scale_gate.h"
#include "numeric_flags.h"
#if defined(E4KV_HAVE_CUDA_BACKEND)
#include "backend/cuda/cuda_backend.h"
#endif

namespace e4kv::cli {

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
  cmd->add_option("--block-size", flags.block_size, "Tokens per KV cache block (multiple of 16)")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--max-model-len", flags.max_model_len,
                  "Longest sequence (prompt + output); default: max_position_embeddings")
      ->transform(decimal_integer<int64_t>(0, kMaxTokenCount));
  cmd->add_option("--threads", flags.threads, "CPU threads (0: all)")
      ->transform(decimal_integer<int>(0, int(kMaxThreads)))
      ->capture_default_str();
}

Status validate_model_flags(const ModelFlags& flags) {
  if (flags.block_size <= 0 || flags.block_size % 16 != 0 || flags.block_size > kMaxBlockSize) {
    return Status::error(cat("--block-size: expected a positive multiple of 16 no larger than ",
                             kMaxBlockSize, ", got ", flags.block_size));
  }
  if (flags.max_model_len < 0 || flags.max_model_len > kMaxTokenCount) {
    return Status::error(cat("--max-model-len: expected 0 (max_position_embeddings) to ",
                             kMaxTokenCount, " tokens, got ", flags.max_model_len));
  }
  if (flags.threads < 0 || flags.threads > kMaxThreads) {
    return Status::error(cat("--threads: expected 0 (one per hardware thread) to ", kMaxThreads,
                             ", got ", flags.threads));
  }
  return ok_status();
}

Result<std::unique_ptr<Backend>> make_backend(const std::string& device, int threads) {
  if (device == "cpu") {
    CpuBackendOptions options;
    options.n_threads = threads;
    return make_cpu_backend(options);
  }
  if (device == "cuda" || device.starts_with("cuda:")) {
    int index = 0;
    if (device.size() > 5) {
      const std::string digits = device.substr(5);
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
      if (ec != std::errc() || end != digits.data() + digits.size() || index < 0) {
        return Status::error(cat("--device \"", device, "\": expected cpu, cuda or cuda:N"));
      }
    }
#if defined(E4KV_HAVE_CUDA_BACKEND)
    CudaBackendOptions options;
    options.device = index;
    return make_cuda_backend(options);
#else
    return Status::error(cat("--device ", device,
                             ": this e4kv binary was built without the CUDA backend (no CUDA "
                             "toolkit at configure time); use --device cpu, or rebuild with nvcc "
                             "available and -DE4KV_ENABLE_CUDA=ON"));
#endif
  }
  return Status::error(cat("--device \"", device, "\": expected cpu, cuda or cuda:N"));
}

Result<LoadedModel> load_model(const ModelFlags& flags, int64_t tokens, int64_t all_rows,
                               int64_t max_requests) {
  E4KV_ASSIGN_OR_RETURN(KvCacheDtype dtype, parse_kv_cache_dtype(flags.kv_cache_dtype));
  E4KV_ASSIGN_OR_RETURN(KvScalesMode mode, parse_kv_scales_mode(flags.kv_scales));
  E4KV_RETURN_IF_ERROR(validate_model_flags(flags));
  std::error_code ec;
  if (!std::filesystem::is_directory(flags.model_dir, ec)) {
    return Status::error(cat(flags.model_dir,
                             ": not a directory; MODEL is a Hugging Face model directory "
                             "(config.json, *.safetensors)"));
  }
  LoadedModel loaded;
  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(flags.model_dir));
  loaded.checkpoint = std::make_unique<Checkpoint>(std::move(ckpt));
  E4KV_ASSIGN_OR_RETURN(loaded.backend, make_backend(flags.device, flags.threads));

  ModelOptions options;
  options.kv_cache_dtype = dtype;
  options.kv_scales_mode = mode;
  options.block_size = flags.block_size;
  options.max_model_len = flags.max_model_len > 0
                              ? flags.max_model_len
                              : loaded.checkpoint->config().max_position_embeddings;
  const int64_t cached = std::max<int64_t>(
      1, std::min(tokens, checked_mul(std::max<int64_t>(1, options.max_model_len),
                                      std::max<int64_t>(1, max_requests))
                              .value_or(std::numeric_limits<int64_t>::max())));
  options.n_blocks = blocks_for_tokens(cached, flags.block_size);
  if (all_rows > 0) {
    options.max_batch_tokens = all_rows;
    options.max_logit_rows = all_rows;
  }
  E4KV_ASSIGN_OR_RETURN(loaded.model,
                        e4kv::load_model(*loaded.checkpoint, *loaded.backend, options));
  for (const std::string& note : loaded.model->load_notes()) {
    std::fprintf(stderr, "e4kv: %s\n", note.c_str());
  }
  if (dtype == KvCacheDtype::kE4m3) {
    std::fprintf(stderr, "e4kv: %s\n", loaded.model->kv_scales().summary.c_str());
  }
  return loaded;
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
