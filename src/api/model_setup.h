// Loading a model from a Hugging Face directory, as the command line and the public API
// (include/e4kv/engine.h) both do: the backend from a device name, the KV cache dtype and scales
// (an E4M3 cache without calibrated scales fails closed at the scale gate), the pool sized by at
// most one of three options, and the lines worth telling the user (the pool, the K/V scales).
//
// Errors name the option by its field name ("block_size: ..."); a front end with its own spelling
// passes option_name (the command line's "--block-size").
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "io/checkpoint.h"
#include "kv/capacity.h"
#include "model/model.h"

namespace e4kv {

// The most tokens a token count takes (max_model_len, max_tokens, ...): positions are int32 in a
// forward batch, so no sequence is longer.
inline constexpr int64_t kMaxTokenCount = std::numeric_limits<int32_t>::max();
// The most bytes kv_cache_memory_bytes takes (1 PiB: beyond any device's memory).
inline constexpr int64_t kMaxPoolBytes = int64_t(1) << 50;
// The most blocks a KV pool has (block ids are int32).
inline constexpr int64_t kMaxPoolBlocks = std::numeric_limits<int32_t>::max();
// The most CPU threads `threads` takes (0 is one per hardware thread).
inline constexpr int64_t kMaxThreads = 4096;
// The most ranks tensor_parallel_size takes.
inline constexpr int kMaxTensorParallelSize = 64;

struct ModelSetup {
  std::string model_dir;
  std::string device = "cpu";  // "cpu", "cuda" or "cuda:N"
  std::string kv_cache_dtype = "fp16";
  std::string kv_scales = "calibrated";  // or "unit" (1.0, a negative control)
  // The PLE n-gram tables in host memory: "auto" (the checkpoint's dtype, read in place) or
  // "fp8_e4m3" (an E4M3 copy with a scale per row). A model without PLE takes either; with
  // fp8_e4m3 a note says it has no PLE table.
  std::string ple_dtype = "auto";
  int64_t block_size = 64;
  int64_t max_model_len = 0;  // 0: config.json's max_position_embeddings
  int threads = 0;            // CPU backend threads; 0: one per hardware thread
  // Ranks of tensor parallelism (model/tensor_parallel.h): each holds its share of the heads and
  // channels; a pool option then sizes each rank's pool. CPU ranks (threads) today; the GPU ranks
  // need the NCCL communicator, not built yet.
  int tensor_parallel_size = 1;
  // The KV pool's size, at most one of them; none: a pool for the run's tokens (load_model).
  std::optional<int64_t> kv_cache_memory_bytes;    // the pool (blocks and states) takes this
  std::optional<int64_t> num_gpu_blocks_override;  // exactly this many blocks
  std::optional<double> gpu_memory_utilization;    // this fraction of the device (CUDA only)
  // The model's limits (ModelOptions::max_seqs, max_batch_tokens); 0: the model's defaults.
  int64_t max_seqs = 0;
  int64_t max_batch_tokens = 0;
  // The engine runs every step op by op (EngineConfig::enforce_eager; no decode-step graphs).
  // Read by the commands that build an engine; loading ignores it.
  bool enforce_eager = false;
  // How an error names an option given its field name ("block_size"); null: the field name.
  std::string (*option_name)(std::string_view field) = nullptr;
  // The weights' load progress (ModelOptions::load_progress) of the model load_model returns
  // (not of a memory-profiling load before it). Null: none.
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> load_progress;
};

// The ranges of the numeric fields above and the pool options' exclusivity; errors name the
// option. load_model checks them too.
Status validate_model_setup(const ModelSetup& setup);

struct LoadedModel {
  // The model's backend (rank 0's under tensor parallelism: model->backend(); then this is null,
  // the model owns its ranks' backends).
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<Model> model;
  // For the user, in order: the model's load notes, the pool line (blocks, tokens, FP16-equivalent
  // tokens, the maximum concurrency at the max model length), then for an E4M3 cache the K/V
  // scale summary (in unit mode it is the NEGATIVE CONTROL line).
  std::vector<std::string> notes;
  // The pool's size (blocks, tokens, bytes, FP16-equivalent tokens), as the pool line says.
  KvPoolSummary pool;
};

// "cpu", "cuda" or "cuda:N". A library built without the CUDA backend says so for cuda. Errors
// name the option as setup.option_name says ("device" by default).
Result<std::unique_ptr<Backend>> make_backend(const ModelSetup& setup);

// Opens the checkpoint, picks the backend and loads the model. The KV pool: as a pool option says
// (refused when it cannot hold one sequence of the max model length), or else enough blocks for
// `n_seqs` sequences of `tokens` tokens each (capped at the max model length). all_rows > 0: one
// forward of that many rows returns the logits of every row (the logits command); otherwise the
// model's limits as the setup says.
Result<LoadedModel> load_model(const ModelSetup& setup, int64_t tokens, int64_t all_rows = 0,
                               int64_t n_seqs = 1);

}  // namespace e4kv
