// The view of a typed linear weight (quant/linear_weight.h describes the formats and layouts):
// what the backend ops take. No backend dependency.
#pragma once

#include <cstdint>
#include <string_view>

namespace e4kv {

enum class WeightFormat : uint8_t { kDense, kW4, kNvfp4, kFp8Block };

std::string_view weight_format_name(WeightFormat format);  // "dense", "awq-w4", "nvfp4", "fp8-block"

// A weight as the ops read it: pointers into backend memory (or host memory, for
// quant/dequantize.h). Non-owning; rows() selects output rows.
struct LinearView {
  WeightFormat format = WeightFormat::kDense;
  int64_t out = 0;
  int64_t in = 0;
  int64_t group = 0;  // input columns per scale (0 for kDense)
  const void* data = nullptr;
  const void* scales = nullptr;
  const void* zeros = nullptr;    // kW4 only; nullptr: symmetric
  const float* global = nullptr;  // kNvfp4 only: each row's global divisor [out] (its tensor's)
  int64_t act_size = 0;         // kDense: bytes of one element of data

  // Bytes of one row of each plane.
  int64_t data_row_bytes() const;
  int64_t scale_row_bytes() const;
  int64_t zero_row_bytes() const;
  // Output rows [begin, begin + count) of this weight.
  LinearView rows(int64_t begin, int64_t count) const;
  // The weight's bytes in memory (data, scales, zeros).
  int64_t bytes() const;
  bool dense() const { return format == WeightFormat::kDense; }
};

}  // namespace e4kv
