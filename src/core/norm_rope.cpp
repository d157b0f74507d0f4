#include "core/norm_rope.h"

#include <cmath>

#include "core/check.h"
#include "core/half.h"

namespace e4kv {

void rms_norm_row_f16(const uint16_t* x, const uint16_t* weight, int64_t dim, float eps,
                      RmsNormForm form, uint16_t* out) {
  E4KV_ASSERT(dim > 0, "rms_norm_row_f16: dim must be positive");
  float sum_squares = 0.0f;
  for (int64_t j = 0; j < dim; ++j) {
    const float value = f16_to_f32(x[j]);
    const float square = value * value;
    sum_squares += square;
  }
  const float mean_square = sum_squares / static_cast<float>(dim);
  const float inv_rms = 1.0f / std::sqrt(mean_square + eps);
  for (int64_t j = 0; j < dim; ++j) {
    const float w = f16_to_f32(weight[j]);
    const float gain = form == RmsNormForm::kOnePlusWeight ? 1.0f + w : w;
    const float normed = f16_to_f32(x[j]) * inv_rms;
    const float scaled = normed * gain;
    out[j] = f32_to_f16(scaled);
  }
}

std::vector<double> rope_inv_freq(double theta, int64_t rotary_dim) {
  E4KV_ASSERT(rotary_dim > 0 && rotary_dim % 2 == 0, "rope_inv_freq: rotary_dim must be even");
  E4KV_ASSERT(theta > 0.0, "rope_inv_freq: theta must be positive");
  std::vector<double> inv_freq(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    inv_freq[static_cast<size_t>(i)] =
        std::pow(theta, -static_cast<double>(2 * i) / static_cast<double>(rotary_dim));
  }
  return inv_freq;
}

void rope_cos_sin(int64_t pos, const double* inv_freq, int64_t n_freq, float* cos, float* sin) {
  for (int64_t i = 0; i < n_freq; ++i) {
    const double angle = static_cast<double>(pos) * inv_freq[i];
    cos[i] = static_cast<float>(std::cos(angle));
    sin[i] = static_cast<float>(std::sin(angle));
  }
}

void rope_neox_row_f16(const uint16_t* x, int64_t dim, int64_t rotary_dim, const float* cos,
                       const float* sin, uint16_t* out) {
  E4KV_ASSERT(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= dim,
              "rope_neox_row_f16: rotary_dim must be even and in (0, dim]");
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = f16_to_f32(x[i]);
    const float b = f16_to_f32(x[i + half]);
    // Separate statements: each product is rounded to fp32 (no FMA), see the header.
    const float a_cos = a * cos[i];
    const float b_sin = b * sin[i];
    const float b_cos = b * cos[i];
    const float a_sin = a * sin[i];
    out[i] = f32_to_f16(a_cos - b_sin);
    out[i + half] = f32_to_f16(b_cos + a_sin);
  }
  if (out != x) {
    for (int64_t j = rotary_dim; j < dim; ++j) out[j] = x[j];
  }
}

}  // namespace e4kv
