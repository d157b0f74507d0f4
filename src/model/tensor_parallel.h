// Tensor parallelism over N ranks in one process: one model per rank, each holding its share of
// the heads, channels and experts (ModelOptions::tp) on its own backend, run together. Rank 0's
// caller schedules; every forward, sequence and block operation is handed to all ranks, and the
// row-parallel projections' partial sums meet in the communicator's all-reduce.
//
// ThreadCommunicator is the stand-in for NCCL on backends whose memory the host reads (the CPU
// backend): ranks are threads, the all-reduce sums the ranks' buffers in rank order, so every
// rank holds the same bits, and TP N equals TP 1 up to the order of the partial sums.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "model/model.h"

namespace e4kv {

class ThreadCommunicator final : public Communicator {
 public:
  explicit ThreadCommunicator(int size);
  int size() const override { return size_; }
  // Requires act_dtype() kF32 and host-addressable memory (the CPU backend).
  Status all_reduce_sum(int rank, Backend& backend, void* data, int64_t n) override;
  // Wakes every rank waiting in a collective with an error (a rank failed); reset() re-arms.
  void abort();
  void reset();

 private:
  Status barrier();

  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<const float*> buffers_;
};

class TensorParallelModel final : public Model {
 public:
  // Loads the checkpoint once per backend (rank r on backends[r]) with options.tp set to each
  // rank's share. Errors name the rank; the scale gate runs on every rank (the same per-layer
  // scales), and one rank's failure fails the load.
  static Result<std::unique_ptr<TensorParallelModel>> load(
      const Checkpoint& ckpt, std::vector<std::unique_ptr<Backend>> backends,
      const ModelOptions& options);
  ~TensorParallelModel() override;

  int size() const { return int(ranks_.size()); }
  Model& rank(int r) { return *ranks_[size_t(r)]; }

  // The whole model's config; limits, scales, pool and memory are rank 0's (every rank's pool has
  // the same blocks, each holding its share of the heads: memory() is per rank).
  const ModelConfig& config() const override { return config_; }
  const ModelLimits& limits() const override { return ranks_[0]->limits(); }
  const KvScales& kv_scales() const override { return ranks_[0]->kv_scales(); }
  KvCacheDtype kv_cache_dtype() const override { return ranks_[0]->kv_cache_dtype(); }
  int64_t block_size() const override { return ranks_[0]->block_size(); }
  int64_t n_blocks() const override { return ranks_[0]->n_blocks(); }
  ModelMemory memory() const override { return ranks_[0]->memory(); }
  Backend& backend() const override { return ranks_[0]->backend(); }

  Result<DeviceLogits> forward_device(const ForwardBatch& batch) override;
  std::vector<std::string> load_notes() const override { return ranks_[0]->load_notes(); }
  std::string input_token_problem(int32_t id) const override {
    return ranks_[0]->input_token_problem(id);
  }
  uint64_t kv_nonfinite_inputs() const override;
  void set_step_profiler(StepProfiler* profiler) override { ranks_[0]->set_step_profiler(profiler); }

  Result<int32_t> allocate_sequence() override;
  Status begin_sequence(int32_t slot) override;
  Status free_sequence(int32_t slot) override;
  Status copy_sequence_state(int32_t src_slot, int32_t dst_slot) override;
  Status copy_blocks(std::span<const BlockCopy> copies) override;

  // Calibration measures the whole layer's K and V; it runs at tensor-parallel size 1.
  Status start_kv_statistics() override;
  KvCacheView kv_cache(int64_t layer) const override { return ranks_[0]->kv_cache(layer); }
  Result<std::vector<LayerKvStats>> kv_statistics() override;
  void stop_kv_statistics() override {
    if (size() == 1) ranks_[0]->stop_kv_statistics();
  }

 private:
  TensorParallelModel() = default;
  // Runs fn on every rank at once (rank 0 on the calling thread); a rank that fails aborts the
  // collectives so that none waits for it. Returns the lowest failing rank's error.
  Status run_all(const std::function<Status(int rank, Model& model)>& fn);
  void worker(int rank);

  ModelConfig config_;
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::unique_ptr<Model>> ranks_;
  std::unique_ptr<ThreadCommunicator> comm_;

  // Workers for ranks 1..N-1: each runs the current job once per generation.
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  const std::function<Status(int, Model&)>* job_ = nullptr;
  uint64_t job_generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
  std::vector<Status> results_;
  std::vector<std::thread> threads_;
};

}  // namespace e4kv
