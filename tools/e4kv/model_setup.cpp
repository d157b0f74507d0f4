#include "model_setup.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "core/checked.h"
#include "kv/block_allocator.h"
#include "kv/capacity.h"
#include "kv/scale_gate.h"
#include "model/step_context.h"
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
         "--gpu-memory-utilization", [&flags](const double& g) { flags.gpu_memory_utilization = g; },
         "CUDA: the fraction of the card's memory e4kv may take; the KV pool gets what the weights "
         "and the activation peak of a memory-profiling forward leave of it")
      ->transform(finite_number());
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
  const int n_pool_flags = int(flags.kv_cache_memory_bytes.has_value()) +
                           int(flags.num_gpu_blocks_override.has_value()) +
                           int(flags.gpu_memory_utilization.has_value());
  if (n_pool_flags > 1) {
    return Status::error(
        "--kv-cache-memory-bytes, --num-gpu-blocks-override and --gpu-memory-utilization each size "
        "the KV cache pool; give at most one");
  }
  if (flags.kv_cache_memory_bytes &&
      (*flags.kv_cache_memory_bytes < 1 || *flags.kv_cache_memory_bytes > kMaxPoolBytes)) {
    return Status::error(cat("--kv-cache-memory-bytes: expected 1 to ", kMaxPoolBytes,
                             " bytes, got ", *flags.kv_cache_memory_bytes));
  }
  if (flags.num_gpu_blocks_override &&
      (*flags.num_gpu_blocks_override < 1 || *flags.num_gpu_blocks_override > kMaxPoolBlocks)) {
    return Status::error(cat("--num-gpu-blocks-override: expected 1 to ", kMaxPoolBlocks,
                             " blocks, got ", *flags.num_gpu_blocks_override));
  }
  if (flags.gpu_memory_utilization) {
    const double g = *flags.gpu_memory_utilization;
    if (!(g > 0.0 && g <= 1.0)) {
      return Status::error(
          cat("--gpu-memory-utilization: expected a fraction in (0, 1] of the card's memory, got ",
              g));
    }
    if (flags.device == "cpu") {
      return Status::error(
          "--gpu-memory-utilization: the CPU backend has no device memory to take a fraction of "
          "(the pool lives in host memory); size the pool with --kv-cache-memory-bytes or "
          "--num-gpu-blocks-override");
    }
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

namespace {

// The device memory the process holds besides its KV pool, measured the way vLLM does: a
// provisional model (a pool of one max-model-len sequence, the least the real pool may have) runs
// one memory-profiling forward at the largest step, so the weights, the workspaces sized at load
// and whatever the backend allocates on first use (library workspaces) are all in place; then the
// device's used memory, less the provisional pool and states, is what the real pool must leave.
// Returns the blocks the real pool gets; the provisional model is freed before returning.
Result<int64_t> blocks_for_utilization(const ModelFlags& flags, const Checkpoint& ckpt,
                                       Backend& backend, ModelOptions options,
                                       const ModelLimits& limits, const KvCacheLayout& layout) {
  const double utilization = *flags.gpu_memory_utilization;
  auto flag_error = [](const std::string& message) {
    return Status::error(cat("--gpu-memory-utilization: ", message));
  };
  if (Result<DeviceMemoryInfo> probe = backend.device_memory(); !probe.ok()) {
    return flag_error(probe.message());
  }
  // One forward of max_batch_tokens rows, in sequences of at most max_model_len tokens.
  const int64_t rows = limits.max_batch_tokens;
  const int64_t seq_rows = std::min(rows, limits.max_model_len);
  const int64_t n_seqs = std::min({(rows + seq_rows - 1) / seq_rows, limits.max_seqs,
                                   limits.max_logit_rows});
  const int64_t seq_blocks = blocks_for_tokens(seq_rows, options.block_size);
  options.n_blocks = std::max(blocks_for_tokens(limits.max_model_len, options.block_size),
                              n_seqs * seq_blocks);
  if (options.n_blocks > kMaxPoolBlocks) {
    return flag_error(cat("a provisional pool of ", options.n_blocks, " blocks is too large"));
  }
  Result<std::unique_ptr<Model>> provisional = e4kv::load_model(ckpt, backend, options);
  if (!provisional.ok()) {
    return flag_error(cat("the provisional model (a pool of one sequence of the max model "
                          "length, for the memory-profiling forward) does not load: ",
                          provisional.message()));
  }
  Model& model = **provisional;
  std::vector<int32_t> ids, row_seq, row_pos, logit_rows, seq_slots;
  std::vector<BlockTable> tables(static_cast<size_t>(n_seqs));
  std::vector<ScopedSequence> slots;
  ForwardBatch batch;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t n = std::min(seq_rows, rows - s * seq_rows);
    for (int64_t p = 0; p < n; ++p) {
      ids.push_back(int32_t((s * seq_rows + p) % model.vocab_size()));
      row_seq.push_back(int32_t(s));
      row_pos.push_back(int32_t(p));
    }
    logit_rows.push_back(int32_t(ids.size()) - 1);
    BlockTable& table = tables[size_t(s)];
    for (int64_t b = 0; b < blocks_for_tokens(n, options.block_size); ++b) {
      table.blocks.push_back(int32_t(s * seq_blocks + b));
    }
    table.n_tokens = n;
    batch.seqs.push_back(&table);
    E4KV_ASSIGN_OR_RETURN(ScopedSequence slot, ScopedSequence::allocate(model));
    seq_slots.push_back(slot.slot());
    slots.push_back(std::move(slot));
  }
  batch.token_ids = ids;
  batch.row_seq = row_seq;
  batch.row_pos = row_pos;
  batch.logit_rows = logit_rows;
  batch.seq_slots = seq_slots;
  batch.purpose = ForwardPurpose::kMemoryProfile;
  if (Result<std::vector<float>> logits = model.forward(batch); !logits.ok()) {
    return flag_error(cat("the memory-profiling forward failed: ", logits.message()));
  }
  backend.synchronize();
  Result<DeviceMemoryInfo> info = backend.device_memory();
  if (!info.ok()) return flag_error(info.message());
  const int64_t pool_in_use =
      options.n_blocks * layout.block_bytes(options.kv_cache_dtype) +
      limits.max_seqs * model.memory().bytes_per_sequence;
  slots.clear();
  provisional->reset();
  Result<int64_t> budget = kv_budget_for_utilization(
      info->total_bytes, utilization, info->total_bytes - info->free_bytes, pool_in_use);
  if (!budget.ok()) return flag_error(budget.message());
  Result<KvCapacity> capacity =
      kv_capacity(layout, options.kv_cache_dtype, *budget, limits.max_seqs);
  if (!capacity.ok()) return flag_error(capacity.message());
  return capacity->n_blocks;
}

// "1.50 GiB", "12.00 MiB", "20480 bytes".
std::string bytes_text(int64_t bytes) {
  constexpr double kMib = 1024.0 * 1024.0;
  char buf[64];
  if (bytes >= int64_t(1) << 30) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", double(bytes) / (kMib * 1024.0));
  } else if (bytes >= int64_t(1) << 20) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", double(bytes) / kMib);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(bytes));
  }
  return buf;
}

void print_pool_line(const Model& model, const KvCacheLayout& layout) {
  Result<KvPoolSummary> pool = kv_pool_summary(layout, model.kv_cache_dtype(), model.n_blocks(),
                                               model.max_model_len());
  if (!pool.ok()) return;  // a pool that loaded has bytes that fit; nothing to say otherwise
  std::fprintf(stderr,
               "e4kv: KV cache pool: %lld block%s x %lld = %lld tokens (%s, %s; FP16 would "
               "hold %lld tokens in the same bytes); maximum concurrency for %lld tokens per "
               "request: %.2fx\n",
               static_cast<long long>(pool->n_blocks), pool->n_blocks == 1 ? "" : "s",
               static_cast<long long>(model.block_size()),
               static_cast<long long>(pool->n_tokens),
               std::string(kv_cache_dtype_name(model.kv_cache_dtype())).c_str(),
               bytes_text(pool->pool_bytes).c_str(),
               static_cast<long long>(pool->fp16_equivalent_tokens),
               static_cast<long long>(model.max_model_len()), pool->max_concurrency);
}

}  // namespace

Result<LoadedModel> load_model(const ModelFlags& flags, int64_t tokens, int64_t all_rows,
                               int64_t n_seqs) {
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
  const ModelConfig& config = loaded.checkpoint->config();
  const std::string config_path =
      (std::filesystem::path(flags.model_dir) / "config.json").string();

  ModelOptions options;
  options.kv_cache_dtype = dtype;
  options.kv_scales_mode = mode;
  options.block_size = flags.block_size;
  options.max_model_len =
      flags.max_model_len > 0 ? flags.max_model_len : config.max_position_embeddings;
  if (all_rows > 0) {
    options.max_batch_tokens = all_rows;
    options.max_logit_rows = all_rows;
  }
  // The limits the model will have (max_seqs reserves state; the pool must hold max_model_len);
  // they do not depend on the pool's size.
  ModelOptions sizing = options;
  sizing.n_blocks = 1;
  E4KV_ASSIGN_OR_RETURN(const ModelLimits limits,
                        model_limits(sizing, config.max_position_embeddings, config_path));
  Result<KvCacheLayout> layout = kv_cache_layout(config, flags.block_size);
  if (!layout.ok()) return Status::error(cat(config_path, ": ", layout.message()));

  std::string pool_flag;
  if (flags.num_gpu_blocks_override) {
    pool_flag = "--num-gpu-blocks-override";
    options.n_blocks = *flags.num_gpu_blocks_override;
  } else if (flags.kv_cache_memory_bytes) {
    pool_flag = "--kv-cache-memory-bytes";
    Result<KvCapacity> capacity =
        kv_capacity(*layout, dtype, *flags.kv_cache_memory_bytes, limits.max_seqs);
    if (!capacity.ok()) return Status::error(cat(pool_flag, ": ", capacity.message()));
    options.n_blocks = capacity->n_blocks;
  } else if (flags.gpu_memory_utilization) {
    pool_flag = "--gpu-memory-utilization";
    E4KV_ASSIGN_OR_RETURN(options.n_blocks,
                          blocks_for_utilization(flags, *loaded.checkpoint, *loaded.backend,
                                                 options, limits, *layout));
  } else {
    const int64_t cached =
        std::max<int64_t>(1, std::min(tokens, std::max<int64_t>(1, options.max_model_len)));
    options.n_blocks = std::max<int64_t>(1, n_seqs) * blocks_for_tokens(cached, flags.block_size);
  }
  if (!pool_flag.empty()) {
    if (options.n_blocks > kMaxPoolBlocks) {
      return Status::error(cat(pool_flag, ": a pool of ", options.n_blocks, " blocks of ",
                               flags.block_size, " tokens; a KV cache indexes at most ",
                               kMaxPoolBlocks, " blocks (give it less, or a larger --block-size)"));
    }
    E4KV_RETURN_IF_ERROR(check_pool_holds_max_model_len(options.n_blocks, flags.block_size,
                                                        limits.max_model_len, pool_flag));
  }
  E4KV_ASSIGN_OR_RETURN(loaded.model,
                        e4kv::load_model(*loaded.checkpoint, *loaded.backend, options));
  for (const std::string& note : loaded.model->load_notes()) {
    std::fprintf(stderr, "e4kv: %s\n", note.c_str());
  }
  print_pool_line(*loaded.model, *layout);
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
