// Projections of one input stored as one weight (q, k and v; gate and up; a GatedDeltaNet's four
// input projections), so that a step of one row reads all of them in one launch.
//
// The output of an n-row step is planar: part i is [n, out(i)] contiguous at element
// n * offset(i) of the output buffer. For n = 1 that is exactly the row of the stacked
// projection, so one linear writes every part; for n > 1 each part is its own linear over its
// rows of the stacked weight (row layouts would need every consumer to take a row stride). A
// checkpoint whose parts have different formats (some left unquantized) keeps one weight per
// part and one launch per part.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "model/weights.h"
#include "quant/linear_weight.h"

namespace e4kv {

class FusedProjection {
 public:
  // The parts' weights (WeightLoader::load_linear_stack) and, when some part has a bias, the
  // stacked biases (zeros for the others).
  static Result<FusedProjection> load(WeightLoader& weights, int64_t in,
                                      const std::vector<LinearPart>& parts);

  size_t n_parts() const { return out_.size(); }
  int64_t out(size_t i) const { return out_[i]; }
  int64_t offset(size_t i) const { return offset_[i]; }
  int64_t total() const { return offset_.back() + out_.back(); }
  int64_t in() const { return in_; }
  // The launches of a one-row step.
  size_t n_stacks() const { return stacks_.size(); }
  // Part i's weight.
  LinearView view(size_t i) const;
  // Every part's rows as one weight [total, in] where they are one stack without a bias (what one
  // launch over all parts reads), else nothing.
  std::optional<LinearView> stacked_view() const;

  // Part i of an n-row output at `base` (elements of elt bytes).
  template <class T = void>
  T* part(void* base, int64_t n, size_t i, size_t elt) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + size_t(n * offset_[i]) * elt);
  }
  // Every part of x [n, in] act (+ its bias) into the planar layout at `base`, of out_dtype.
  Status forward(Backend& b, const void* x, int64_t n, void* base, DType out_dtype) const;

 private:
  int64_t in_ = 0;
  struct Stack {
    LinearWeight weight;  // the rows of parts [first, first + n_parts)
    size_t first = 0;
    size_t n_parts = 0;
  };
  std::vector<Stack> stacks_;
  BackendBuffer bias_;  // [total] act, or empty
  std::vector<int64_t> out_;
  std::vector<int64_t> offset_;
  std::vector<size_t> stack_of_;  // part -> its stack
};

}  // namespace e4kv
