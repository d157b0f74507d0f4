// The end of every family's forward: the rows asked for (StepContext::logit_rows) gathered from
// the last hidden rows, the family's final norm, the output projection (lm_head, or the embedding
// when tied) into fp32 logits, left in backend memory (the engine samples them there); and the
// non-finite counters of the step's cache
// writes, zeroed before the layers and checked after them. One place, so that where the logits go
// (host or device) is decided once for all families.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "backend/backend.h"
#include "backend/profiler.h"
#include "core/status.h"
#include "model/model.h"
#include "model/step_context.h"

namespace e4kv {

class LogitsHead {
 public:
  // The family's final norm of the gathered rows: in [m, width] act -> out [m, hidden] act (out
  // is `in` itself when width == hidden).
  using FinalNorm = std::function<Status(const void* in, int64_t m, void* out)>;

  // Sized for limits.max_logit_rows rows. width: the last hidden rows' width (hidden, or the
  // residual streams' width); projection: [vocab, hidden] act, kept by the caller.
  static Result<LogitsHead> create(Backend& backend, const ModelLimits& limits, int64_t width,
                                   int64_t hidden, int64_t vocab, const void* projection);

  // Zeroes the cache writes' counters; before the step's first cache write.
  void begin_step(Backend& backend) const;
  // The cache writes' counters: [2] (K, V) non-finite values.
  unsigned long long* non_finite() const { return non_finite_.as<unsigned long long>(); }

  // logits [step.n_logits(), vocab] fp32, row-major, in backend memory (valid until the next
  // step), of the rows step.logit_rows() of x [step.n_rows(), width] act. profiler: nullptr or the
  // step's profile.
  Result<DeviceLogits> logits(Backend& backend, const StepContext& step, const void* x,
                                    const FinalNorm& final_norm, StepProfiler* profiler) const;
  // Errors when a cache write of the step met a non-finite K or V value.
  Status check_non_finite(Backend& backend) const;
  // The first `rows` rows of the last logits() (a step's padding rows come after the rows asked).
  DeviceLogits output(int64_t rows) const { return DeviceLogits{logits_.as<float>(), rows, vocab_}; }
  // What check_non_finite() found, summed over every check.
  uint64_t non_finite_total() const { return non_finite_total_; }

 private:
  int64_t width_ = 0;
  int64_t hidden_ = 0;
  int64_t vocab_ = 0;
  const void* projection_ = nullptr;
  BackendBuffer xs_;          // [logit rows, width] act
  BackendBuffer hs_;          // [logit rows, hidden] act; empty when width == hidden
  BackendBuffer logits_;      // [logit rows, vocab] fp32
  BackendBuffer non_finite_;  // [2] unsigned long long
  mutable uint64_t non_finite_total_ = 0;
};

}  // namespace e4kv
