#include "quant/linear_weight.h"

#include <utility>

#include "core/check.h"

namespace e4kv {

std::string_view weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kDense:
      return "dense";
    case WeightFormat::kW4:
      return "awq-w4";
    case WeightFormat::kNvfp4:
      return "nvfp4";
    case WeightFormat::kFp8Block:
      return "fp8-block";
  }
  return "?";
}

int64_t LinearView::data_row_bytes() const {
  switch (format) {
    case WeightFormat::kDense:
      return in * act_size;
    case WeightFormat::kW4:
    case WeightFormat::kNvfp4:
      return in / 2;
    case WeightFormat::kFp8Block:
      return in;
  }
  return 0;
}

int64_t LinearView::scale_row_bytes() const {
  switch (format) {
    case WeightFormat::kDense:
      return 0;
    case WeightFormat::kW4:
      return (in / group) * 2;
    case WeightFormat::kNvfp4:
      return in / group;
    case WeightFormat::kFp8Block:
      return ((in + group - 1) / group) * 4;
  }
  return 0;
}

int64_t LinearView::zero_row_bytes() const {
  return format == WeightFormat::kW4 && zeros != nullptr ? in / group : 0;
}

LinearView LinearView::rows(int64_t begin, int64_t count) const {
  E4KV_ASSERT(begin >= 0 && count >= 0 && begin + count <= out, "LinearView::rows out of range");
  LinearView v = *this;
  v.out = count;
  v.data = static_cast<const char*>(data) + begin * data_row_bytes();
  if (scales != nullptr) v.scales = static_cast<const char*>(scales) + begin * scale_row_bytes();
  if (zeros != nullptr) v.zeros = static_cast<const char*>(zeros) + begin * zero_row_bytes();
  if (global != nullptr) v.global = global + begin;
  return v;
}

int64_t LinearView::bytes() const {
  return out * (data_row_bytes() + scale_row_bytes() + zero_row_bytes() +
                (global != nullptr ? 4 : 0));
}

LinearWeight LinearWeight::dense(BackendBuffer data, int64_t out, int64_t in, int64_t act_size) {
  LinearView v;
  v.out = out;
  v.in = in;
  v.act_size = act_size;
  v.data = data.data();
  return LinearWeight(v, std::move(data), {}, {}, {});
}

}  // namespace e4kv
