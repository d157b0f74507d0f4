#include "model/tensor_parallel.h"

#include <algorithm>
#include <utility>

#include "core/check.h"

namespace e4kv {

// ---- ThreadCommunicator ------------------------------------------------------------------------

ThreadCommunicator::ThreadCommunicator(int size) : size_(size), buffers_(size_t(size)) {}

Status ThreadCommunicator::barrier() {
  std::unique_lock lock(mu_);
  if (aborted_) return Status::error("tensor parallel collective aborted: another rank failed");
  const uint64_t generation = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return ok_status();
  }
  cv_.wait(lock, [&] { return generation_ != generation || aborted_; });
  if (generation_ == generation) {
    return Status::error("tensor parallel collective aborted: another rank failed");
  }
  return ok_status();
}

Status ThreadCommunicator::all_reduce_sum(int rank, Backend& backend, void* data, int64_t n) {
  if (backend.act_dtype() != DType::kF32) {
    return Status::error(cat(backend.name(),
                             ": the in-process communicator reduces fp32 host memory (the CPU "
                             "backend); GPUs need the NCCL communicator"));
  }
  auto* mine = static_cast<float*>(data);
  buffers_[size_t(rank)] = mine;
  E4KV_RETURN_IF_ERROR(barrier());
  // Every rank sums the buffers in rank order into its own copy, so all hold the same bits.
  std::vector<float> sum(buffers_[0], buffers_[0] + n);
  for (int r = 1; r < size_; ++r) {
    const float* other = buffers_[size_t(r)];
    for (int64_t i = 0; i < n; ++i) sum[size_t(i)] += other[i];
  }
  // No rank writes its buffer before every rank has read them all.
  E4KV_RETURN_IF_ERROR(barrier());
  std::copy(sum.begin(), sum.end(), mine);
  return ok_status();
}

void ThreadCommunicator::abort() {
  std::lock_guard lock(mu_);
  aborted_ = true;
  cv_.notify_all();
}

void ThreadCommunicator::reset() {
  std::lock_guard lock(mu_);
  aborted_ = false;
  arrived_ = 0;
}

// ---- TensorParallelModel -----------------------------------------------------------------------

Result<std::unique_ptr<TensorParallelModel>> TensorParallelModel::load(
    const Checkpoint& ckpt, std::vector<std::unique_ptr<Backend>> backends,
    const ModelOptions& options) {
  const int size = int(backends.size());
  E4KV_ASSERT(size >= 1, "TensorParallelModel: no backend");
  std::unique_ptr<TensorParallelModel> tp(new TensorParallelModel());
  tp->config_ = ckpt.config();
  tp->backends_ = std::move(backends);
  tp->comm_ = std::make_unique<ThreadCommunicator>(size);
  for (int r = 0; r < size; ++r) {
    ModelOptions rank_options = options;
    rank_options.tp = TpShard{r, size, size > 1 ? tp->comm_.get() : nullptr};
    Result<std::unique_ptr<Model>> model = load_model(ckpt, *tp->backends_[size_t(r)], rank_options);
    if (!model.ok()) {
      return Status::error(cat("tensor parallel rank ", r, " of ", size, ": ", model.message()));
    }
    tp->ranks_.push_back(std::move(model).value());
  }
  tp->results_.resize(size_t(size));
  for (int r = 1; r < size; ++r) tp->threads_.emplace_back([raw = tp.get(), r] { raw->worker(r); });
  return tp;
}

TensorParallelModel::~TensorParallelModel() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void TensorParallelModel::worker(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<Status(int, Model&)>* job = nullptr;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || job_generation_ != seen; });
      if (stopping_) return;
      seen = job_generation_;
      job = job_;
    }
    Status status = (*job)(rank, *ranks_[size_t(rank)]);
    if (!status.ok()) comm_->abort();
    {
      std::lock_guard lock(mu_);
      results_[size_t(rank)] = std::move(status);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
}

Status TensorParallelModel::run_all(const std::function<Status(int rank, Model& model)>& fn) {
  {
    std::lock_guard lock(mu_);
    job_ = &fn;
    pending_ = size() - 1;
    ++job_generation_;
  }
  cv_.notify_all();
  Status first = fn(0, *ranks_[0]);
  if (!first.ok()) comm_->abort();
  {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
  }
  comm_->reset();
  if (!first.ok()) return first;
  for (int r = 1; r < size(); ++r) {
    if (!results_[size_t(r)].ok()) {
      return Status::error(cat("tensor parallel rank ", r, ": ", results_[size_t(r)].message()));
    }
  }
  return ok_status();
}

Result<DeviceLogits> TensorParallelModel::forward_device(const ForwardBatch& batch) {
  DeviceLogits logits;
  E4KV_RETURN_IF_ERROR(run_all([&](int rank, Model& model) -> Status {
    ForwardBatch mine = batch;
    if (rank != 0) mine.probe = nullptr;  // a probe sees rank 0's share
    Result<DeviceLogits> out = model.forward_device(mine);
    if (!out.ok()) return out.status();
    if (rank == 0) logits = *out;
    return ok_status();
  }));
  return logits;
}

uint64_t TensorParallelModel::kv_nonfinite_inputs() const {
  uint64_t total = 0;
  for (const auto& model : ranks_) total += model->kv_nonfinite_inputs();
  return total;
}

Result<int32_t> TensorParallelModel::allocate_sequence() {
  E4KV_ASSIGN_OR_RETURN(const int32_t slot, ranks_[0]->allocate_sequence());
  for (int r = 1; r < size(); ++r) {
    Status status = ranks_[size_t(r)]->begin_sequence(slot);
    if (!status.ok()) {
      for (int q = r - 1; q >= 0; --q) (void)ranks_[size_t(q)]->free_sequence(slot);
      return Status::error(cat("tensor parallel rank ", r, ": ", status.message()));
    }
  }
  return slot;
}

Status TensorParallelModel::begin_sequence(int32_t slot) {
  for (int r = 0; r < size(); ++r) {
    Status status = ranks_[size_t(r)]->begin_sequence(slot);
    if (!status.ok()) {
      for (int q = r - 1; q >= 0; --q) (void)ranks_[size_t(q)]->free_sequence(slot);
      return r == 0 ? status : Status::error(cat("tensor parallel rank ", r, ": ", status.message()));
    }
  }
  return ok_status();
}

Status TensorParallelModel::free_sequence(int32_t slot) {
  Status first;
  for (int r = 0; r < size(); ++r) {
    Status status = ranks_[size_t(r)]->free_sequence(slot);
    if (!status.ok() && first.ok()) first = std::move(status);
  }
  return first;
}

Status TensorParallelModel::copy_sequence_state(int32_t src_slot, int32_t dst_slot) {
  for (int r = 0; r < size(); ++r) {
    E4KV_RETURN_IF_ERROR(ranks_[size_t(r)]->copy_sequence_state(src_slot, dst_slot));
  }
  return ok_status();
}

Status TensorParallelModel::copy_blocks(std::span<const BlockCopy> copies) {
  for (int r = 0; r < size(); ++r) E4KV_RETURN_IF_ERROR(ranks_[size_t(r)]->copy_blocks(copies));
  return ok_status();
}

Status TensorParallelModel::start_kv_statistics() {
  if (size() == 1) return ranks_[0]->start_kv_statistics();
  return Status::error(cat("calibration measures every key/value head of a layer; run it at "
                           "tensor parallel size 1 (this model runs on ",
                           size(), " ranks)"));
}

Result<std::vector<LayerKvStats>> TensorParallelModel::kv_statistics() {
  if (size() == 1) return ranks_[0]->kv_statistics();
  return Status::error("calibration runs at tensor parallel size 1");
}

}  // namespace e4kv
