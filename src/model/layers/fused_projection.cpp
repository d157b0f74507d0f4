#include "model/layers/fused_projection.h"

#include <utility>

namespace e4kv {

Result<FusedProjection> FusedProjection::load(WeightLoader& weights, int64_t in,
                                              const std::vector<LinearPart>& parts) {
  FusedProjection f;
  f.in_ = in;
  int64_t offset = 0;
  for (const LinearPart& part : parts) {
    int64_t rows = part.rows.empty() ? part.out : 0;
    for (const RowRange& r : part.rows) rows += r.count;
    f.out_.push_back(rows);
    f.offset_.push_back(offset);
    offset += rows;
  }
  E4KV_ASSIGN_OR_RETURN(std::vector<WeightLoader::LinearStack> stacks,
                        weights.load_linear_stack(parts, in));
  size_t first = 0;
  for (WeightLoader::LinearStack& s : stacks) {
    for (size_t i = 0; i < s.n_parts; ++i) f.stack_of_.push_back(f.stacks_.size());
    f.stacks_.push_back({std::move(s.weight), first, s.n_parts});
    first += s.n_parts;
  }
  E4KV_ASSERT(first == parts.size(), "FusedProjection::load: the stacks do not cover the parts");
  bool bias = false;
  for (const LinearPart& part : parts) bias = bias || part.bias;
  if (bias) {
    E4KV_ASSIGN_OR_RETURN(f.bias_, weights.load_bias_stack(parts));
  }
  return f;
}

LinearView FusedProjection::view(size_t i) const {
  E4KV_ASSERT(i < out_.size(), "FusedProjection::view: no such part");
  const Stack& s = stacks_[stack_of_[i]];
  return s.weight.rows(offset_[i] - offset_[s.first], out_[i]);
}

std::optional<LinearView> FusedProjection::stacked_view() const {
  if (stacks_.size() != 1 || bias_.data() != nullptr) return std::nullopt;
  return stacks_[0].weight.view();
}

Status FusedProjection::forward(Backend& b, const void* x, int64_t n, void* base,
                                DType out_dtype) const {
  const char* bias = bias_.as<char>();
  const size_t elt = dtype_size(out_dtype);
  auto bias_at = [&](size_t part) {
    return bias == nullptr ? nullptr : bias + size_t(offset_[part]) * b.act_size();
  };
  if (n == 1) {  // the planar layout of one row is the stacked row: one launch per stack
    for (const Stack& s : stacks_) {
      E4KV_RETURN_IF_ERROR(b.linear(x, s.weight.view(), bias_at(s.first), n,
                                    part(base, n, s.first, elt), out_dtype));
    }
    return ok_status();
  }
  for (size_t i = 0; i < out_.size(); ++i) {
    E4KV_RETURN_IF_ERROR(b.linear(x, view(i), bias_at(i), n, part(base, n, i, elt), out_dtype));
  }
  return ok_status();
}

}  // namespace e4kv
