// Graphs of the decode step (DESIGN.md section 11): a decode step's device half (every layer and
// the logits head, about 1,500 launches for Qwen4Exp) issued from one recorded graph instead of
// one host call per op.
//
// A step whose rows are all decode rows (one per sequence, each sampled) and that fits the largest
// bucket runs padded to its bucket (1, 2, 4, 8, then multiples of 8 up to the engine's
// max_num_seqs, vLLM's capture sizes): the model's host half runs on the padded batch, the graph
// of (bucket, launch signature) runs eagerly the first time that pair is met (whatever an op does
// on its first launch of a shape happens outside a capture), is captured the second time and
// replayed from then on, and the model's tail commits the real sequences and returns their
// logits. Every other step (prefill, mixed, probes, calibration statistics, a backend without
// graphs) runs eagerly. The
// launch signature (Backend::launch_signature: the attention plans' split counts) changes as the
// contexts grow, so each bucket keeps its few most recent graphs.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "model/model.h"

namespace e4kv {

struct StepGraphStats {
  int64_t captures = 0;     // graphs recorded
  int64_t replays = 0;      // steps run from a graph
  int64_t eager = 0;        // steps run op by op
  int64_t padded_rows = 0;  // padding rows run (summed over the replays)
  int64_t last_nodes = -1;  // the operations of the last graph recorded (-1: not counted)
};

class StepGraphs {
 public:
  // Graphs for decode steps of up to max_num_seqs sequences when `enabled` and the model and its
  // backend support them (--enforce-eager: not enabled).
  StepGraphs(Model& model, int64_t max_num_seqs, bool enabled);

  // The bucket sizes for max_num_seqs: 1, 2, 4, 8, 16, 24, ... (multiples of 8), the last
  // max_num_seqs itself.
  static std::vector<int64_t> buckets_for(int64_t max_num_seqs);

  // Whether steps may replay graphs at all here.
  bool active() const { return active_; }
  const std::vector<int64_t>& buckets() const { return buckets_; }
  const StepGraphStats& stats() const { return stats_; }
  // Why graphs stopped (a capture failed; the steps run eagerly since), empty while they work.
  const std::string& capture_error() const { return capture_error_; }

  // The padding rows share one scratch state slot (Model::reset_padding_state): it is zeroed
  // before a padded step once this many padded steps ran since the last reset.
  static constexpr int64_t kPaddingStateResetSteps = 64;

  // Model::forward_device, from a graph where the batch allows (see above).
  Result<DeviceLogits> forward(const ForwardBatch& batch);

 private:
  // The bucket a batch replays in, 0 when it runs eagerly.
  int64_t bucket_for(const ForwardBatch& batch) const;

  struct Entry {
    int64_t bucket = 0;
    uint64_t signature = 0;
    std::unique_ptr<BackendGraph> graph;
  };
  // Graphs kept per bucket (a context crossing a split-count boundary needs a new one; the old
  // ones are kept for the sequences still short enough to use them).
  static constexpr int kGraphsPerBucket = 4;

  Model& model_;
  bool active_ = false;
  std::vector<int64_t> buckets_;
  std::list<Entry> graphs_;  // most recently used first
  // (bucket, signature) pairs whose first step ran eagerly (the next one is captured), oldest
  // first, at most kWarmedKept.
  static constexpr size_t kWarmedKept = 256;
  std::vector<std::pair<int64_t, uint64_t>> warmed_;
  StepGraphStats stats_;
  int64_t padded_since_reset_ = 0;
  std::string capture_error_;
};

}  // namespace e4kv
