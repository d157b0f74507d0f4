// Tensor parallelism inside one model: which share of the heads, channels and experts this rank
// holds, and the communicator its partial sums are reduced over (model/tensor_parallel.h runs the
// ranks). Rank r of N holds the r-th N-th of every split dimension; a layer whose output
// projection is split over its input (row-parallel: o_proj, down_proj, out_proj, the experts)
// leaves a partial sum that Communicator::all_reduce_sum completes on every rank.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/status.h"

namespace e4kv {

// The collective the ranks of one model share. One call per rank for every collective, in the
// same order on every rank.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  // data: [n] of act_dtype() in `backend`'s memory (the calling rank's); on return every rank's
  // data holds the element-wise sum over the ranks, summed in rank order (the same bits on every
  // rank). Errors: the collective was aborted (another rank failed).
  virtual Status all_reduce_sum(int rank, Backend& backend, void* data, int64_t n) = 0;
};

struct TpShard {
  int rank = 0;
  int size = 1;
  Communicator* comm = nullptr;  // null when size == 1

  bool split() const { return size > 1; }
  // The share of `n` units (heads, channels, experts): [begin, begin + count). n % size == 0.
  int64_t count(int64_t n) const { return n / size; }
  int64_t begin(int64_t n) const { return rank * (n / size); }
  Status all_reduce(Backend& backend, void* data, int64_t n) const {
    if (!split()) return ok_status();
    return comm->all_reduce_sum(rank, backend, data, n);
  }
};

// A rank's attention heads: its N-th of the query heads and the key/value heads they read (its
// N-th of those when there are at least N, else the one its query heads share: replicated, as
// vLLM does). Errors: heads that do not split so.
struct HeadShare {
  int64_t q_begin = 0;
  int64_t q_count = 0;
  int64_t kv_begin = 0;
  int64_t kv_count = 0;
};
inline Result<HeadShare> share_heads(int64_t n_heads, int64_t n_kv_heads, const TpShard& tp) {
  if (n_heads % tp.size != 0 || (n_kv_heads % tp.size != 0 && tp.size % n_kv_heads != 0)) {
    return Status::error(cat("tensor parallel size ", tp.size, " does not split ", n_heads,
                             " attention heads and ", n_kv_heads,
                             " key/value heads evenly; choose a size that divides the heads"));
  }
  HeadShare share;
  share.q_count = n_heads / tp.size;
  share.q_begin = tp.begin(n_heads);
  if (n_kv_heads >= tp.size) {
    share.kv_count = n_kv_heads / tp.size;
    share.kv_begin = tp.begin(n_kv_heads);
  } else {
    share.kv_count = 1;
    share.kv_begin = share.q_begin / (n_heads / n_kv_heads);
  }
  return share;
}

}  // namespace e4kv
