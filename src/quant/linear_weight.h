// Typed weights of a linear layer (y = x W^T): dense, or one of the quantized formats the public
// quantization tools write, held in one canonical layout per format that the loader builds from
// the checkpoint's tensors (quant/quant_loader.h) and every backend reads.
//
// The canonical layouts are row-major over the output rows, so that selecting output rows (a
// fused projection's parts, a tensor-parallel column split, one expert of a stacked MoE weight) is
// an offset, and input columns come in groups of `group` (each group shares one scale):
//   kDense     data [out, in] act (the backend's activation dtype, as Backend::upload_weight).
//   kW4        AWQ W4A16. data [out, in / 2] uint8: element k of a row in byte k / 2, the low
//              nibble for even k; scales [out, in / group] FP16; zeros [out, in / group] uint8
//              (0..15), or none: the symmetric form, every zero 8.
//              w = (q - zero) * scale.
//   kNvfp4     NVFP4 (weight only). data as kW4, each nibble an E2M1 code (bit 3 the sign, bits 0-2
//              the magnitude index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}); scales [out, in / 16] E4M3
//              bytes; global_scale: the tensor's divisor. w = e2m1(q) * (e4m3(scale) / global).
//   kFp8Block  FP8 E4M3 with block scales. data [out, in] E4M3 bytes; scales [out, ceil(in /
//              group)] FP32, each row holding its block row's scales (the checkpoint's
//              [ceil(out / block_out), ceil(in / group)] expanded). w = e4m3(q) * scale.
// Everything is exact given the stored values: dequantization is the formula in fp32, which
// quant/dequantize.h defines on the host for the backends and the tests.
#pragma once

#include <cstdint>
#include <string_view>

#include "backend/backend.h"

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
  const void* zeros = nullptr;  // kW4 only; nullptr: symmetric
  float global_scale = 1.0f;    // kNvfp4 only
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

// A weight's memory, owned: what the layers hold.
class LinearWeight {
 public:
  LinearWeight() = default;
  LinearWeight(LinearView view, BackendBuffer data, BackendBuffer scales, BackendBuffer zeros)
      : view_(view), data_(std::move(data)), scales_(std::move(scales)), zeros_(std::move(zeros)) {}

  const LinearView& view() const { return view_; }
  LinearView rows(int64_t begin, int64_t count) const { return view_.rows(begin, count); }
  int64_t out() const { return view_.out; }
  int64_t in() const { return view_.in; }
  WeightFormat format() const { return view_.format; }
  bool empty() const { return data_.empty(); }

 private:
  LinearView view_;
  BackendBuffer data_;
  BackendBuffer scales_;
  BackendBuffer zeros_;
};

}  // namespace e4kv
