#include "model/logits_head.h"

#include <algorithm>

namespace e4kv {

Result<LogitsHead> LogitsHead::create(Backend& backend, const ModelLimits& limits, int64_t width,
                                      int64_t hidden, int64_t vocab, const void* projection) {
  LogitsHead head;
  head.width_ = width;
  head.hidden_ = hidden;
  head.vocab_ = vocab;
  head.projection_ = projection;
  const size_t rows = size_t(std::max<int64_t>(1, limits.max_logit_rows));
  const size_t act = backend.act_size();
  E4KV_ASSIGN_OR_RETURN(head.xs_, backend.allocate(rows * size_t(width) * act));
  if (width != hidden) {
    E4KV_ASSIGN_OR_RETURN(head.hs_, backend.allocate(rows * size_t(hidden) * act));
  }
  E4KV_ASSIGN_OR_RETURN(head.logits_, backend.allocate(rows * size_t(vocab) * 4));
  E4KV_ASSIGN_OR_RETURN(head.non_finite_, backend.allocate(2 * sizeof(unsigned long long)));
  return head;
}

void LogitsHead::begin_step(Backend& b) const {
  b.fill_zero(non_finite_.data(), 2 * sizeof(unsigned long long));
}

Result<DeviceLogits> LogitsHead::logits(Backend& b, const StepContext& step, const void* x,
                                        const FinalNorm& final_norm, StepProfiler* profiler) const {
  const int64_t m = step.n_logits();
  const DeviceLogits logits{logits_.as<float>(), m, vocab_};
  if (m == 0) return logits;
  if (profiler != nullptr) profiler->mark("lm_head");
  E4KV_RETURN_IF_ERROR(b.gather_rows(x, step.logit_rows(), m, width_, xs_.data()));
  void* normed = hs_.empty() ? xs_.data() : hs_.data();
  E4KV_RETURN_IF_ERROR(final_norm(xs_.data(), m, normed));
  E4KV_RETURN_IF_ERROR(
      b.linear(normed, projection_, nullptr, m, hidden_, vocab_, logits_.data(), DType::kF32));
  if (profiler != nullptr) profiler->mark("counters");
  return logits;
}

Status LogitsHead::check_non_finite(Backend& b) const {
  unsigned long long counts[2] = {0, 0};
  b.copy_to_host(counts, non_finite_.data(), sizeof(counts));
  non_finite_total_ += counts[0] + counts[1];
  if (counts[0] != 0 || counts[1] != 0) {
    return Status::error(cat("forward: ", counts[0], " non-finite K and ", counts[1],
                             " non-finite V values reached the KV cache (inf or NaN "
                             "activations: the weights or the input overflow FP16)"));
  }
  return ok_status();
}

}  // namespace e4kv
