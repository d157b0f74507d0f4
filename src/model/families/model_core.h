// What every family holds the same way, by composition: the config and options it was loaded
// with, the limits its workspaces are sized for, the K/V scales behind the gate, the RoPE table,
// the per-step context, the sequence slots, the calibration statistics and the logits head. A
// family adds its weights, its memory and the composition of its layers.
#pragma once

#include <cstdint>
#include <optional>

#include "backend/backend.h"
#include "backend/profiler.h"
#include "core/status.h"
#include "io/checkpoint.h"
#include "kv/kv_cache_view.h"
#include "kv/scale_gate.h"
#include "model/kv_statistics.h"
#include "model/logits_head.h"
#include "model/model.h"
#include "model/rope.h"
#include "model/sequence_slots.h"
#include "model/step_context.h"

namespace e4kv {

struct ModelCore {
  ModelConfig config;
  ModelOptions options;
  ModelLimits limits;
  KvScales kv_scales;
  RopeTable rope;
  Backend* backend = nullptr;
  StepProfiler* profiler = nullptr;  // optional (Model::set_step_profiler)
  SequenceSlots slots;
  KvStatisticsCollector kv_stats;
  std::optional<StepContext> step;  // create_step_and_head
  std::optional<LogitsHead> head;   // create_step_and_head

  // The config, the options and the backend; the limits (errors name the option out of range)
  // and a pool of limits.max_seqs slots.
  Status init(const Checkpoint& ckpt, Backend& backend, const ModelOptions& options);
  // The RoPE table and the K/V scales (the scale gate, for an E4M3 cache).
  Status load_rope_and_scales(const Checkpoint& ckpt);
  // The step context and the logits head for the limits. width: the last hidden rows' width;
  // projection: the output projection [vocab, hidden] act (lm_head, or the embedding when tied).
  Status create_step_and_head(int64_t width, const void* projection);

  // The main KV cache of `layer` over `data`: the model's geometry and, for an E4M3 cache, the
  // layer's scales.
  KvCacheView kv_cache_view(void* data, size_t layer) const;

  // Opens the profile's section `section` when profiling.
  void mark(const char* section) const {
    if (profiler != nullptr) profiler->mark(section);
  }

  // Checks `batch` and builds the step's metadata (StepContext::build).
  Status build_step(const ForwardBatch& batch);

  Status start_kv_statistics() {
    return kv_stats.start(*backend, config.n_layers, config.kv_cache_layers(),
                          options.kv_cache_dtype);
  }
};

// The Model methods every family answers from its ModelCore alone. A family derives from this and
// adds its weights, memory, forward and per-sequence state.
class CoreModel : public Model {
 public:
  const ModelConfig& config() const final { return core_.config; }
  const ModelLimits& limits() const final { return core_.limits; }
  const KvScales& kv_scales() const final { return core_.kv_scales; }
  KvCacheDtype kv_cache_dtype() const final { return core_.options.kv_cache_dtype; }
  int64_t block_size() const final { return core_.options.block_size; }
  int64_t n_blocks() const final { return core_.options.n_blocks; }
  Backend& backend() const final { return *core_.backend; }
  void set_step_profiler(StepProfiler* profiler) final { core_.profiler = profiler; }
  Status start_kv_statistics() final { return core_.start_kv_statistics(); }
  Result<std::vector<LayerKvStats>> kv_statistics() final { return core_.kv_stats.read(); }
  void stop_kv_statistics() final { core_.kv_stats.stop(); }
  uint64_t kv_nonfinite_inputs() const final {
    return core_.head ? core_.head->non_finite_total() : 0;
  }

  bool supports_step_graphs() const final { return true; }
  bool collecting_kv_statistics() const final { return core_.kv_stats.collecting(); }
  bool step_profiling() const final { return core_.profiler != nullptr; }
  // The halves of forward_device (DESIGN.md section 11; Model::prepare, run_device, finish_step):
  // prepare() checks the batch and builds, plans and uploads everything the step's ops read;
  // run_layers() then only launches (no allocation, no wait for the device, no decision on host
  // data), and run_device() is run_layers() and the logits head, so a decode step can be captured
  // once and replayed after each prepare() of a batch of the same shape.
  Result<DeviceLogits> forward_device(const ForwardBatch& batch) final {
    E4KV_RETURN_IF_ERROR(prepare(batch));
    return finish_step(batch, run_device(batch));
  }
  virtual Status run_layers(const ForwardBatch& batch) = 0;

 protected:
  ModelCore core_;
};

}  // namespace e4kv
