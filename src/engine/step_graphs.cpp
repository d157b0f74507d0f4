#include "engine/step_graphs.h"

#include <algorithm>

namespace e4kv {

std::vector<int64_t> StepGraphs::buckets_for(int64_t max_num_seqs) {
  std::vector<int64_t> buckets;
  for (int64_t b : {1, 2, 4}) {
    if (b <= max_num_seqs) buckets.push_back(b);
  }
  for (int64_t b = 8; b <= max_num_seqs; b += 8) buckets.push_back(b);
  if (max_num_seqs > 0 && (buckets.empty() || buckets.back() != max_num_seqs)) {
    buckets.push_back(max_num_seqs);
  }
  return buckets;
}

StepGraphs::StepGraphs(Model& model, int64_t max_num_seqs, bool enabled) : model_(model) {
  const ModelLimits& limits = model.limits();
  const int64_t largest =
      std::min({max_num_seqs, limits.max_seqs, limits.max_logit_rows, limits.max_batch_tokens});
  active_ =
      enabled && largest > 0 && model.supports_step_graphs() && model.backend().supports_graphs();
  if (active_) buckets_ = buckets_for(largest);
}

int64_t StepGraphs::bucket_for(const ForwardBatch& batch) const {
  if (!active_ || batch.probe != nullptr || batch.purpose != ForwardPurpose::kServe ||
      batch.pad_to != 0 || model_.collecting_kv_statistics() || model_.step_profiling()) {
    return 0;
  }
  const size_t n = batch.token_ids.size();
  if (n == 0 || int64_t(n) > buckets_.back() || batch.seqs.size() != n ||
      batch.row_seq.size() != n || batch.logit_rows.size() != n) {
    return 0;
  }
  for (size_t r = 0; r < n; ++r) {
    if (batch.row_seq[r] != int32_t(r) || batch.logit_rows[r] != int32_t(r)) return 0;
  }
  return *std::lower_bound(buckets_.begin(), buckets_.end(), int64_t(n));
}

Result<DeviceLogits> StepGraphs::forward(const ForwardBatch& batch) {
  const int64_t bucket = bucket_for(batch);
  if (bucket == 0) {
    ++stats_.eager;
    return model_.forward_device(batch);
  }
  ForwardBatch padded = batch;
  padded.pad_to = bucket;
  const int64_t pad = bucket - int64_t(batch.token_ids.size());
  if (pad > 0 && padded_since_reset_ >= kPaddingStateResetSteps) {
    model_.reset_padding_state();
    padded_since_reset_ = 0;
  }
  E4KV_RETURN_IF_ERROR(model_.prepare(padded));
  const uint64_t signature = model_.backend().launch_signature();

  auto it = std::find_if(graphs_.begin(), graphs_.end(), [&](const Entry& e) {
    return e.bucket == bucket && e.signature == signature;
  });
  if (it != graphs_.end()) {
    graphs_.splice(graphs_.begin(), graphs_, it);
  } else if (std::find(warmed_.begin(), warmed_.end(), std::pair{bucket, signature}) ==
             warmed_.end()) {
    // The first step of a (bucket, signature) runs eagerly: whatever an op does on its first
    // launch of a shape (a kernel attribute, a workspace) happens outside any capture. The next
    // such step is captured.
    warmed_.push_back({bucket, signature});
    if (warmed_.size() > kWarmedKept) warmed_.erase(warmed_.begin());
    ++stats_.eager;
    if (pad > 0) ++padded_since_reset_;
    return model_.finish_step(padded, model_.run_device(padded));
  } else {
    // The graph reads only the device buffers prepare() refreshes; run_device sees the batch's
    // purpose alone (graph forwards never reach the calibration statistics).
    Model* model = &model_;
    Result<std::unique_ptr<BackendGraph>> graph = model_.backend().capture_graph([model] {
      ForwardBatch capture;
      capture.purpose = ForwardPurpose::kGraphCapture;
      return model->run_device(capture);
    });
    if (!graph.ok()) {
      // Nothing ran: the step goes on eagerly from its prepared host half, and so do the later
      // ones (a capture that fails once fails again).
      active_ = false;
      capture_error_ = graph.message();
      ++stats_.eager;
      return model_.finish_step(padded, model_.run_device(padded));
    }
    ++stats_.captures;
    stats_.last_nodes = (*graph)->n_nodes();
    graphs_.push_front(Entry{bucket, signature, std::move(graph).value()});
    int kept = 0;
    for (auto e = graphs_.begin(); e != graphs_.end();) {
      if (e->bucket == bucket && ++kept > kGraphsPerBucket) {
        e = graphs_.erase(e);
      } else {
        ++e;
      }
    }
  }
  const Status replayed = graphs_.front().graph->replay();
  ++stats_.replays;
  stats_.padded_rows += pad;
  if (pad > 0) ++padded_since_reset_;
  return model_.finish_step(padded, replayed);
}

}  // namespace e4kv
