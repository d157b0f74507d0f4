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
//              bytes; global [out] FP32: each row's tensor's global scale (per row, so that
//              tensors with different global scales stack, such as the experts of one MoE layer).
//              w = e2m1(q) * (e4m3(scale) / global).
//   kFp8Block  FP8 E4M3 with block scales. data [out, in] E4M3 bytes; scales [out, ceil(in /
//              group)] FP32, each row holding its block row's scales (the checkpoint's
//              [ceil(out / block_out), ceil(in / group)] expanded). w = e4m3(q) * scale.
// Everything is exact given the stored values: dequantization is the formula in fp32, which
// quant/dequantize.h defines on the host for the backends and the tests.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>

#include "backend/backend.h"
#include "quant/linear_view.h"

namespace e4kv {

// A weight's memory, owned: what the layers hold.
class LinearWeight {
 public:
  LinearWeight() = default;
  LinearWeight(LinearView view, BackendBuffer data, BackendBuffer scales, BackendBuffer zeros,
               BackendBuffer global)
      : view_(view),
        data_(std::move(data)),
        scales_(std::move(scales)),
        zeros_(std::move(zeros)),
        global_(std::move(global)) {}
  // A dense weight [out, in] of the backend's activation dtype.
  static LinearWeight dense(BackendBuffer data, int64_t out, int64_t in, int64_t act_size);

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
  BackendBuffer global_;
};

}  // namespace e4kv
