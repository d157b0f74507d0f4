#include "backend/cpu/ple.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/status.h"

namespace e4kv {
namespace {

// PyTorch's fp32 silu and sigmoid, written as gated_delta_net.cpp writes them.
inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}
inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

// sign(g) * sqrt(max(|g|, min)): torch.sign gives 0 for 0 (and NaN for NaN).
inline float signed_sqrt(float g) {
  const float magnitude = std::sqrt(std::max(std::fabs(g), kPleGateMinMagnitude));
  if (g > 0.0f) return magnitude;
  if (g < 0.0f) return -magnitude;
  return g * magnitude;  // +-0 (a zero of either sign times a positive) or NaN
}

}  // namespace

void ple_gate(const float* kn, const float* qn, const float* val, int64_t n_rows, int64_t n_streams,
              int64_t hidden, float* out) {
  E4KV_ASSERT(
      n_rows >= 0 && n_streams > 0 && hidden > 0,
      cat("ple_gate: bad shape n_rows=", n_rows, " n_streams=", n_streams, " hidden=", hidden));
  E4KV_ASSERT(n_rows == 0 || (kn != nullptr && qn != nullptr && val != nullptr && out != nullptr),
              "ple_gate: null input or output");
  E4KV_ASSERT(n_rows == 0 || out != val, "ple_gate: out aliases val");
  const float sqrt_hidden = float(std::sqrt(double(hidden)));  // math.sqrt(H) as an fp32 scalar
  const int64_t width = n_streams * hidden;
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* v = val + r * hidden;
    for (int64_t s = 0; s < n_streams; ++s) {
      const float* k = kn + r * width + s * hidden;
      const float* q = qn + r * width + s * hidden;
      float dot = 0.0f;
      for (int64_t i = 0; i < hidden; ++i) dot += k[i] * q[i];
      const float gate = sigmoid(signed_sqrt(dot / sqrt_hidden));
      float* o = out + r * width + s * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = gate * v[i];
    }
  }
}

void dilated_conv1d_silu(const float* x, int64_t n_tokens, int64_t channels, const float* weight,
                         int64_t kernel, int64_t dilation, float* state, float* out) {
  E4KV_ASSERT(n_tokens >= 0 && channels > 0 && kernel > 0 && dilation > 0,
              cat("dilated_conv1d_silu: bad shape n_tokens=", n_tokens, " channels=", channels,
                  " kernel=", kernel, " dilation=", dilation));
  const int64_t n_state = (kernel - 1) * dilation;
  E4KV_ASSERT(weight != nullptr && (n_state == 0 || state != nullptr),
              "dilated_conv1d_silu: null weight or state");
  E4KV_ASSERT(n_tokens == 0 || (x != nullptr && out != nullptr && x != out),
              "dilated_conv1d_silu: null or aliased x / out");
  // Input j of this call's window: j < 0 reaches back into the state (its row n_state + j).
  auto input = [&](int64_t j, int64_t c) {
    return j < 0 ? state[(n_state + j) * channels + c] : x[j * channels + c];
  };
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      const float* w = weight + c * kernel;
      float sum = 0.0f;
      for (int64_t k = 0; k < kernel; ++k) sum += w[k] * input(t - (kernel - 1 - k) * dilation, c);
      out[t * channels + c] = silu(sum);
    }
  }
  // The new state is the last n_state rows of [state | x]. Ascending rows read only rows at or
  // after the one written, so the shift is safe in place.
  for (int64_t r = 0; r < n_state; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      state[r * channels + c] = input(r + n_tokens - n_state, c);
    }
  }
}

}  // namespace e4kv
