#include "quant/dequantize.h"

#include <cstring>

#include "core/check.h"
#include "core/half.h"
#include "e4kv/e4m3.h"

namespace e4kv {

const std::array<float, 16>& e2m1_values() {
  static const std::array<float, 16> table = [] {
    const float magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    std::array<float, 16> t{};
    for (int code = 0; code < 16; ++code) {
      t[size_t(code)] = (code & 8) != 0 ? -magnitude[code & 7] : magnitude[code & 7];
    }
    return t;
  }();
  return table;
}

namespace {

uint8_t nibble(const uint8_t* row, int64_t k) {
  const uint8_t byte = row[k / 2];
  return (k % 2 == 0) ? uint8_t(byte & 0x0F) : uint8_t(byte >> 4);
}

}  // namespace

void dequantize_rows(const LinearView& w, int64_t row_begin, int64_t n_rows, float* out) {
  E4KV_ASSERT(row_begin >= 0 && n_rows >= 0 && row_begin + n_rows <= w.out,
              "dequantize_rows: rows out of range");
  const int64_t in = w.in;
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t row = row_begin + r;
    float* dst = out + r * in;
    const auto* data = static_cast<const uint8_t*>(w.data) + row * w.data_row_bytes();
    switch (w.format) {
      case WeightFormat::kDense:
        if (w.act_size == 4) {
          std::memcpy(dst, data, size_t(in) * 4);
        } else {
          E4KV_ASSERT(w.act_size == 2, "dequantize_rows: dense rows must be F32 or F16");
          for (int64_t k = 0; k < in; ++k) {
            uint16_t h;
            std::memcpy(&h, data + 2 * k, 2);
            dst[k] = f16_to_f32(h);
          }
        }
        break;
      case WeightFormat::kW4: {
        const auto* scales = static_cast<const uint16_t*>(w.scales) + row * (in / w.group);
        const auto* zeros = static_cast<const uint8_t*>(w.zeros);
        for (int64_t k = 0; k < in; ++k) {
          const int64_t g = k / w.group;
          const float zero = zeros != nullptr ? float(zeros[row * (in / w.group) + g]) : 8.0f;
          dst[k] = (float(nibble(data, k)) - zero) * f16_to_f32(scales[g]);
        }
        break;
      }
      case WeightFormat::kNvfp4: {
        const auto* scales = static_cast<const uint8_t*>(w.scales) + row * (in / w.group);
        const std::array<float, 16>& fp4 = e2m1_values();
        const float global = w.global[row];
        for (int64_t k = 0; k < in; ++k) {
          const float scale = e4m3_decode(scales[k / w.group]) / global;
          dst[k] = fp4[nibble(data, k)] * scale;
        }
        break;
      }
      case WeightFormat::kFp8Block: {
        const int64_t n_groups = (in + w.group - 1) / w.group;
        const auto* scales = static_cast<const float*>(w.scales) + row * n_groups;
        for (int64_t k = 0; k < in; ++k) dst[k] = e4m3_decode(data[k]) * scales[k / w.group];
        break;
      }
    }
  }
}

}  // namespace e4kv
