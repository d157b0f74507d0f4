// The CUDA attention op, planned on the host once per step and run by every layer (DESIGN.md
// section 11): plan() cuts the step's query rows over the CUDA routes (qsa/route_planner.h:
// tensor-core prefill tiles for runs of rows of one sequence, the split-K decode kernel for single
// rows) for every reserved layer shape and uploads the prefill items from page-locked staging;
// run() only launches. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "backend/attention_params.h"
#include "backend/attention_plan.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "backend/cuda/paged_prefill_attention.cuh"
#include "core/status.h"
#include "qsa/route_planner.h"

namespace e4kv::cuda {

// Owns the decode workspace, the prefill items (device and page-locked host) and the step's plans,
// all sized by reserve(). Not copyable; one per stream (launches reuse the buffers).
class PagedAttentionRunner {
 public:
  // device: the CUDA device the launches run on. E4M3 caches use the native conversion where
  // decode_attention_native_e4m3_usable(device), unless force_software_e4m3.
  explicit PagedAttentionRunner(int device, bool force_software_e4m3 = false);
  ~PagedAttentionRunner();
  PagedAttentionRunner(const PagedAttentionRunner&) = delete;
  PagedAttentionRunner& operator=(const PagedAttentionRunner&) = delete;

  bool native_e4m3() const { return decode_config_.native_e4m3; }

  // Sizes every buffer for steps of at most max_rows rows whose rows attend at most max_seq_tokens
  // keys (a QSA shape: its sel_width), for these layer shapes and those reserved before (models
  // sharing the backend; the limits are the largest asked). Waits for the stream and allocates:
  // call it at load. Errors: a shape outside the kernels' limits, no memory.
  Status reserve(std::span<const AttentionLayerShape> shapes, int64_t max_rows,
                 int64_t max_seq_tokens, cudaStream_t stream);

  // Plans the step's rows (host arrays: row_seq, row_pos) for every reserved shape and uploads the
  // prefill items (one copy, ordered on `stream`). No allocation and no wait; the staging is
  // rewritten by the next plan(), which must come after the stream has passed this one's copy.
  // Errors: more rows than reserved, a shape no route runs.
  Status plan(const QueryBatchView& host_rows, cudaStream_t stream);

  // out = attention of every row, as paged_attention (CPU) computes it, with the step's plan of the
  // params' shape. params: device pointers. Launches only. Errors: a shape that was not reserved,
  // a row count that differs from the plan's.
  Status run(const PagedAttentionParams& params, cudaStream_t stream);

  // One call planned on its own (tests and benchmarks of the op): reserves for its shape and rows
  // where the buffers are too small (an allocation and a wait), plans, runs. host_rows: row_seq and
  // row_pos on the host; sel_width bounds a QSA row's keys.
  Status run(const PagedAttentionParams& params, const QueryBatchView& host_rows,
             cudaStream_t stream);

  // A hash of every launch parameter of the step's plans (prefill item counts, decode runs and
  // their splits, the buffers' addresses): a CUDA graph of a step replays correctly after the
  // plan() of another step only where the two hashes are equal, since the launches hold the values
  // they were captured with (a reserve() for another model moves the buffers).
  uint64_t plan_signature() const;

  // The route plan of the last run(), for tests and logs.
  const RoutePlan& last_plan() const { return last_plan_; }

 private:
  struct ShapePlan {
    AttentionLayerShape shape;
    DecodeDeviceLimits device;
    AttentionStepPlan step;
    int64_t first_item = 0;  // of this shape's prefill items in the item buffers
  };

  int device_ = 0;
  DecodeAttentionConfig decode_config_;
  std::vector<AttentionRouteLimits> routes_;
  std::vector<ShapePlan> shapes_;
  int64_t max_rows_ = 0;
  int64_t max_seq_tokens_ = 0;
  int64_t planned_rows_ = -1;  // rows of the last plan(); -1 before the first
  RoutePlan last_plan_;
  PrefillAttentionItem* h_items_ = nullptr;  // [shapes * max_rows] page-locked
  PrefillAttentionItem* d_items_ = nullptr;  // [shapes * max_rows]
  float* d_workspace_ = nullptr;
  size_t d_workspace_floats_ = 0;
};

}  // namespace e4kv::cuda
