// The dequantization of every weight format (quant/linear_weight.h) on the host: the definition
// the backends' kernels and the tests follow. fp32 throughout: each element is the format's
// formula evaluated once in fp32, so a kernel that evaluates the same formula gets the same bits.
#pragma once

#include <array>
#include <cstdint>

#include "quant/linear_weight.h"

namespace e4kv {

// The E2M1 (FP4) values of the 16 codes: bit 3 the sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4,
// 6}.
const std::array<float, 16>& e2m1_values();

// The weight's element (row, col) for every col of rows [row_begin, row_begin + n_rows), as fp32,
// into out [n_rows, w.in]. `w` points to host memory. kDense views hold fp32 (act_size 4) or FP16
// (act_size 2) elements.
void dequantize_rows(const LinearView& w, int64_t row_begin, int64_t n_rows, float* out);

}  // namespace e4kv
