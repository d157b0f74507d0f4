#include "api/model_setup.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "core/checked.h"
#include "kv/block_allocator.h"
#include "kv/capacity.h"
#include "kv/scale_gate.h"
#include "model/step_context.h"
#include "model/tensor_parallel.h"
#if defined(E4KV_HAVE_CUDA_BACKEND)
#include "backend/cuda/cuda_backend.h"
#endif

namespace e4kv {

namespace {

// The option's name in messages: the field's, or the front end's spelling of it.
std::string name_of(const ModelSetup& setup, std::string_view field) {
  return setup.option_name != nullptr ? setup.option_name(field) : std::string(field);
}

}  // namespace

Status validate_model_setup(const ModelSetup& setup) {
  auto name = [&](std::string_view field) { return name_of(setup, field); };
  if (setup.block_size <= 0 || setup.block_size % 16 != 0 || setup.block_size > kMaxBlockSize) {
    return Status::error(cat(name("block_size"),
                             ": expected a positive multiple of 16 no larger than ", kMaxBlockSize,
                             ", got ", setup.block_size));
  }
  if (setup.max_model_len < 0 || setup.max_model_len > kMaxTokenCount) {
    return Status::error(cat(name("max_model_len"), ": expected 0 (max_position_embeddings) to ",
                             kMaxTokenCount, " tokens, got ", setup.max_model_len));
  }
  if (setup.threads < 0 || setup.threads > kMaxThreads) {
    return Status::error(cat(name("threads"), ": expected 0 (one per hardware thread) to ",
                             kMaxThreads, ", got ", setup.threads));
  }
  if (setup.tensor_parallel_size < 1 || setup.tensor_parallel_size > kMaxTensorParallelSize) {
    return Status::error(cat(name("tensor_parallel_size"), ": expected 1 to ",
                             kMaxTensorParallelSize, " ranks, got ", setup.tensor_parallel_size));
  }
  if (setup.tensor_parallel_size > 1 && setup.device != "cpu") {
    return Status::error(cat(name("tensor_parallel_size"), ": ", setup.tensor_parallel_size,
                             " ranks on ", setup.device,
                             ": tensor parallelism runs on the CPU backend (ranks as threads) in "
                             "this build; GPU ranks need the NCCL communicator, not built yet"));
  }
  if (setup.max_seqs < 0 || setup.max_seqs > kMaxTokenCount) {
    return Status::error(cat(name("max_seqs"), ": expected 0 (the model's default) to ",
                             kMaxTokenCount, ", got ", setup.max_seqs));
  }
  if (setup.max_batch_tokens < 0 || setup.max_batch_tokens > kMaxTokenCount) {
    return Status::error(cat(name("max_batch_tokens"), ": expected 0 (the model's default) to ",
                             kMaxTokenCount, " tokens, got ", setup.max_batch_tokens));
  }
  if (Result<PleDtype> ple = parse_ple_dtype(setup.ple_dtype); !ple.ok()) {
    return Status::error(cat(name("ple_dtype"), ": ", ple.status().detail()));
  }
  const int n_pool_options = int(setup.kv_cache_memory_bytes.has_value()) +
                             int(setup.num_gpu_blocks_override.has_value()) +
                             int(setup.gpu_memory_utilization.has_value());
  if (n_pool_options > 1) {
    return Status::error(cat(name("kv_cache_memory_bytes"), ", ", name("num_gpu_blocks_override"),
                             " and ", name("gpu_memory_utilization"),
                             " each size the KV cache pool; give at most one"));
  }
  if (setup.kv_cache_memory_bytes &&
      (*setup.kv_cache_memory_bytes < 1 || *setup.kv_cache_memory_bytes > kMaxPoolBytes)) {
    return Status::error(cat(name("kv_cache_memory_bytes"), ": expected 1 to ", kMaxPoolBytes,
                             " bytes, got ", *setup.kv_cache_memory_bytes));
  }
  if (setup.num_gpu_blocks_override &&
      (*setup.num_gpu_blocks_override < 1 || *setup.num_gpu_blocks_override > kMaxPoolBlocks)) {
    return Status::error(cat(name("num_gpu_blocks_override"), ": expected 1 to ", kMaxPoolBlocks,
                             " blocks, got ", *setup.num_gpu_blocks_override));
  }
  if (setup.gpu_memory_utilization) {
    const double g = *setup.gpu_memory_utilization;
    if (!(g > 0.0 && g <= 1.0)) {
      return Status::error(cat(name("gpu_memory_utilization"),
                               ": expected a fraction in (0, 1] of the card's memory, got ", g));
    }
    if (setup.device == "cpu") {
      return Status::error(cat(name("gpu_memory_utilization"),
                               ": the CPU backend has no device memory to take a fraction of "
                               "(the pool lives in host memory); size the pool with ",
                               name("kv_cache_memory_bytes"), " or ",
                               name("num_gpu_blocks_override")));
    }
  }
  return ok_status();
}

Result<std::unique_ptr<Backend>> make_backend(const ModelSetup& setup) {
  const std::string& device = setup.device;
  const std::string name = name_of(setup, "device");
  if (device == "cpu") {
    CpuBackendOptions options;
    options.n_threads = setup.threads;
    return make_cpu_backend(options);
  }
  if (device == "cuda" || device.starts_with("cuda:")) {
    int index = 0;
    if (device.size() > 5) {
      const std::string digits = device.substr(5);
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
      if (ec != std::errc() || end != digits.data() + digits.size() || index < 0) {
        return Status::error(cat(name, " \"", device, "\": expected cpu, cuda or cuda:N"));
      }
    }
#if defined(E4KV_HAVE_CUDA_BACKEND)
    CudaBackendOptions options;
    options.device = index;
    return make_cuda_backend(options);
#else
    return Status::error(cat(name, " ", device,
                             ": this e4kv was built without the CUDA backend (no CUDA toolkit at "
                             "configure time); use ",
                             name,
                             " cpu, or rebuild with nvcc available "
                             "and -DE4KV_ENABLE_CUDA=ON"));
#endif
  }
  return Status::error(cat(name, " \"", device, "\": expected cpu, cuda or cuda:N"));
}

namespace {

// The device memory the process holds besides its KV pool, measured the way vLLM does: a
// provisional model (a pool of one max-model-len sequence, the least the real pool may have) runs
// one memory-profiling forward at the largest step, so the weights, the workspaces sized at load
// and whatever the backend allocates on first use (library workspaces) are all in place; then the
// device's used memory, less the provisional pool and states, is what the real pool must leave.
// Returns the blocks the real pool gets; the provisional model is freed before returning.
Result<int64_t> blocks_for_utilization(const ModelSetup& setup, const Checkpoint& ckpt,
                                       Backend& backend, ModelOptions options,
                                       const ModelLimits& limits, const KvCacheLayout& layout) {
  const double utilization = *setup.gpu_memory_utilization;
  auto flag_error = [&](const std::string& message) {
    return Status::error(cat(name_of(setup, "gpu_memory_utilization"), ": ", message));
  };
  if (Result<DeviceMemoryInfo> probe = backend.device_memory(); !probe.ok()) {
    return flag_error(probe.message());
  }
  // One forward of max_batch_tokens rows, in sequences of at most max_model_len tokens.
  const int64_t rows = limits.max_batch_tokens;
  const int64_t seq_rows = std::min(rows, limits.max_model_len);
  const int64_t n_seqs =
      std::min({(rows + seq_rows - 1) / seq_rows, limits.max_seqs, limits.max_logit_rows});
  const int64_t seq_blocks = blocks_for_tokens(seq_rows, options.block_size);
  options.n_blocks =
      std::max(blocks_for_tokens(limits.max_model_len, options.block_size), n_seqs * seq_blocks);
  if (options.n_blocks > kMaxPoolBlocks) {
    return flag_error(cat("a provisional pool of ", options.n_blocks, " blocks is too large"));
  }
  Result<std::unique_ptr<Model>> provisional = e4kv::load_model(ckpt, backend, options);
  if (!provisional.ok()) {
    return flag_error(
        cat("the provisional model (a pool of one sequence of the max model "
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
  // The model holds one scratch block and one scratch state slot beyond the pool (the padding rows
  // of graph-replayed decode steps, ForwardBatch::pad_to): counted here and left out of the budget.
  const int64_t block_bytes = layout.block_bytes(options.kv_cache_dtype);
  const int64_t pool_in_use = (options.n_blocks + 1) * block_bytes +
                              (limits.max_seqs + 1) * model.memory().bytes_per_sequence;
  slots.clear();
  provisional->reset();
  Result<int64_t> budget = kv_budget_for_utilization(
      info->total_bytes, utilization, info->total_bytes - info->free_bytes, pool_in_use);
  if (!budget.ok()) return flag_error(budget.message());
  Result<KvCapacity> capacity =
      kv_capacity(layout, options.kv_cache_dtype, std::max<int64_t>(0, *budget - block_bytes),
                  limits.max_seqs + 1);
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

std::string pool_line(const Model& model, const Result<KvPoolSummary>& pool) {
  if (!pool.ok()) return "";  // a pool that loaded has bytes that fit; nothing to say otherwise
  char concurrency[32];
  std::snprintf(concurrency, sizeof(concurrency), "%.2f", pool->max_concurrency);
  return cat("KV cache pool: ", pool->n_blocks, " block", pool->n_blocks == 1 ? "" : "s", " x ",
             model.block_size(), " = ", pool->n_tokens, " tokens (",
             kv_cache_dtype_name(model.kv_cache_dtype()), ", ", bytes_text(pool->pool_bytes),
             "; FP16 would hold ", pool->fp16_equivalent_tokens,
             " tokens in the same bytes); maximum concurrency for ", model.max_model_len(),
             " tokens per request: ", concurrency, "x");
}

}  // namespace

Result<LoadedModel> load_model(const ModelSetup& setup, int64_t tokens, int64_t all_rows,
                               int64_t n_seqs) {
  E4KV_ASSIGN_OR_RETURN(KvCacheDtype dtype, parse_kv_cache_dtype(setup.kv_cache_dtype));
  E4KV_ASSIGN_OR_RETURN(KvScalesMode mode, parse_kv_scales_mode(setup.kv_scales));
  Result<PleDtype> ple_dtype = parse_ple_dtype(setup.ple_dtype);
  if (!ple_dtype.ok()) {
    return Status::error(cat(name_of(setup, "ple_dtype"), ": ", ple_dtype.status().detail()));
  }
  E4KV_RETURN_IF_ERROR(validate_model_setup(setup));
  std::error_code ec;
  if (!std::filesystem::is_directory(setup.model_dir, ec)) {
    return Status::error(cat(setup.model_dir.empty() ? "\"\"" : setup.model_dir,
                             ": not a directory; the model is a Hugging Face model directory "
                             "(config.json, *.safetensors)"));
  }
  LoadedModel loaded;
  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(setup.model_dir));
  loaded.checkpoint = std::make_unique<Checkpoint>(std::move(ckpt));
  const int tp_size = setup.tensor_parallel_size;
  if (tp_size == 1) {
    E4KV_ASSIGN_OR_RETURN(loaded.backend, make_backend(setup));
  }
  const ModelConfig& config = loaded.checkpoint->config();
  const std::string config_path = (std::filesystem::path(setup.model_dir) / "config.json").string();

  ModelOptions options;
  options.kv_cache_dtype = dtype;
  options.kv_scales_mode = mode;
  options.ple_dtype = *ple_dtype;
  // The provisional model of gpu_memory_utilization and the real one share the E4M3 tables.
  if (*ple_dtype == PleDtype::kE4m3) options.ple_cache = std::make_shared<PleE4m3Cache>();
  options.block_size = setup.block_size;
  options.max_model_len =
      setup.max_model_len > 0 ? setup.max_model_len : config.max_position_embeddings;
  options.max_seqs = setup.max_seqs;
  options.max_batch_tokens = setup.max_batch_tokens;
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
  // Under tensor parallelism each rank's pool holds its share of the key/value heads: a pool
  // option sizes each rank's pool.
  ModelConfig rank_config = config;
  if (tp_size > 1 && config.n_kv_heads > 0) {
    rank_config.n_kv_heads = config.n_kv_heads >= tp_size ? config.n_kv_heads / tp_size : 1;
  }
  Result<KvCacheLayout> layout = kv_cache_layout(rank_config, setup.block_size);
  if (!layout.ok()) return Status::error(cat(config_path, ": ", layout.message()));

  std::string pool_flag;
  if (setup.num_gpu_blocks_override) {
    pool_flag = name_of(setup, "num_gpu_blocks_override");
    options.n_blocks = *setup.num_gpu_blocks_override;
  } else if (setup.kv_cache_memory_bytes) {
    pool_flag = name_of(setup, "kv_cache_memory_bytes");
    Result<KvCapacity> capacity =
        kv_capacity(*layout, dtype, *setup.kv_cache_memory_bytes, limits.max_seqs);
    if (!capacity.ok()) return Status::error(cat(pool_flag, ": ", capacity.message()));
    options.n_blocks = capacity->n_blocks;
  } else if (setup.gpu_memory_utilization) {
    pool_flag = name_of(setup, "gpu_memory_utilization");
    E4KV_ASSIGN_OR_RETURN(options.n_blocks,
                          blocks_for_utilization(setup, *loaded.checkpoint, *loaded.backend,
                                                 options, limits, *layout));
  } else {
    const int64_t cached =
        std::max<int64_t>(1, std::min(tokens, std::max<int64_t>(1, options.max_model_len)));
    options.n_blocks = std::max<int64_t>(1, n_seqs) * blocks_for_tokens(cached, setup.block_size);
  }
  if (!pool_flag.empty()) {
    if (options.n_blocks > kMaxPoolBlocks) {
      return Status::error(cat(pool_flag, ": a pool of ", options.n_blocks, " blocks of ",
                               setup.block_size, " tokens; a KV cache indexes at most ",
                               kMaxPoolBlocks, " blocks (give it less, or a larger ",
                               name_of(setup, "block_size"), ")"));
    }
    E4KV_RETURN_IF_ERROR(check_pool_holds_max_model_len(options.n_blocks, setup.block_size,
                                                        limits.max_model_len, pool_flag));
  }
  if (tp_size == 1) {
    options.load_progress = setup.load_progress;
    E4KV_ASSIGN_OR_RETURN(loaded.model,
                          e4kv::load_model(*loaded.checkpoint, *loaded.backend, options));
  } else {
    // One CPU backend per rank, the threads shared among them.
    std::vector<std::unique_ptr<Backend>> backends;
    ModelSetup rank_setup = setup;
    const int threads =
        setup.threads > 0 ? setup.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    rank_setup.threads = std::max(1, threads / tp_size);
    for (int r = 0; r < tp_size; ++r) {
      E4KV_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, make_backend(rank_setup));
      backends.push_back(std::move(backend));
    }
    E4KV_ASSIGN_OR_RETURN(
        std::unique_ptr<TensorParallelModel> tp,
        TensorParallelModel::load(*loaded.checkpoint, std::move(backends), options));
    loaded.model = std::move(tp);
  }
  loaded.notes = loaded.model->load_notes();
  if (*ple_dtype == PleDtype::kE4m3 && loaded.model->ple_tables().layers.empty()) {
    loaded.notes.push_back(cat(name_of(setup, "ple_dtype"),
                               " fp8_e4m3: this model has no PLE n-gram table; nothing to store "
                               "as E4M3"));
  }
  Result<KvPoolSummary> pool =
      kv_pool_summary(*layout, loaded.model->kv_cache_dtype(), loaded.model->n_blocks(),
                      loaded.model->max_model_len());
  if (pool.ok()) loaded.pool = *pool;
  if (std::string line = pool_line(*loaded.model, pool); !line.empty()) {
    loaded.notes.push_back(std::move(line));
  }
  if (dtype == KvCacheDtype::kE4m3) loaded.notes.push_back(loaded.model->kv_scales().summary);
  return loaded;
}

}  // namespace e4kv
