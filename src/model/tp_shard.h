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

}  // namespace e4kv
