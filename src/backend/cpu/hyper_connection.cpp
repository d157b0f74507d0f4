#include "backend/cpu/hyper_connection.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/status.h"

namespace e4kv {
namespace {

inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}
inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}

// One row, the CPU backend's rms_norm arithmetic step for step (cpu_backend.cpp): each square and
// product in its own statement, so no FMA contraction can change a bit. out may alias x.
void rms_norm_row(const float* x, const float* weight, int64_t dim, float eps, RmsNormForm form,
                  float* out) {
  float sum_squares = 0.0f;
  for (int64_t j = 0; j < dim; ++j) {
    const float square = x[j] * x[j];
    sum_squares += square;
  }
  const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(dim) + eps);
  for (int64_t j = 0; j < dim; ++j) {
    const float gain = form == RmsNormForm::kOnePlusWeight ? 1.0f + weight[j] : weight[j];
    const float normed = x[j] * inv_rms;
    out[j] = normed * gain;
  }
}

void check_rows(const char* op, int64_t n_rows, int64_t n_streams, int64_t hidden) {
  E4KV_ASSERT(n_rows >= 0 && n_streams > 0 && hidden > 0,
              cat(op, ": bad shape n_rows=", n_rows, " n_streams=", n_streams, " hidden=", hidden));
}

}  // namespace

void rms_norm_grouped(const float* x, const float* weight, int64_t n_rows, int64_t n_groups,
                      int64_t dim, float eps, RmsNormForm form, float* out) {
  E4KV_ASSERT(
      n_rows >= 0 && n_groups > 0 && dim > 0,
      cat("rms_norm_grouped: bad shape n_rows=", n_rows, " n_groups=", n_groups, " dim=", dim));
  E4KV_ASSERT(n_rows == 0 || (x != nullptr && weight != nullptr && out != nullptr),
              "rms_norm_grouped: null input or output");
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t g = 0; g < n_groups; ++g) {
      const int64_t offset = (r * n_groups + g) * dim;
      rms_norm_row(x + offset, weight + g * dim, dim, eps, form, out + offset);
    }
  }
}

void silu_scaled(const float* x, int64_t n, float scale, float* out) {
  E4KV_ASSERT(n >= 0, cat("silu_scaled: bad size ", n));
  E4KV_ASSERT(n == 0 || (x != nullptr && out != nullptr), "silu_scaled: null input or output");
  for (int64_t i = 0; i < n; ++i) {
    const float scaled = x[i] * scale;
    out[i] = silu(scaled);
  }
}

void hc_mix(const float* up_logits, const float* xn, int64_t n_rows, int64_t n_streams,
            int64_t hidden, float* mix) {
  check_rows("hc_mix", n_rows, n_streams, hidden);
  E4KV_ASSERT(n_rows == 0 || (up_logits != nullptr && xn != nullptr && mix != nullptr),
              "hc_mix: null input or output");
  const int64_t width = n_streams * hidden;
  const float streams = static_cast<float>(n_streams);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* u = up_logits + r * width;
    const float* v = xn + r * width;
    float* m = mix + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      float sum = sigmoid(u[i]) * v[i];
      for (int64_t s = 1; s < n_streams; ++s) {
        const float weighted = sigmoid(u[s * hidden + i]) * v[s * hidden + i];
        sum += weighted;
      }
      m[i] = sum / streams;
    }
  }
}

void hc_inject(float* x, const float* y, const float* inj_logits, int64_t n_rows, int64_t n_streams,
               int64_t hidden) {
  check_rows("hc_inject", n_rows, n_streams, hidden);
  E4KV_ASSERT(n_rows == 0 || (x != nullptr && y != nullptr && inj_logits != nullptr),
              "hc_inject: null input or output");
  const int64_t width = n_streams * hidden;
  const float streams = static_cast<float>(n_streams);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* yr = y + r * hidden;
    for (int64_t s = 0; s < n_streams; ++s) {
      const float inj = 2.0f * sigmoid(inj_logits[r * n_streams + s] / streams);
      float* xs = x + r * width + s * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const float injected = inj * yr[i];
        xs[i] += injected;
      }
    }
  }
}

void hc_expand(const float* e, int64_t n_rows, int64_t n_streams, int64_t hidden, float* x) {
  check_rows("hc_expand", n_rows, n_streams, hidden);
  E4KV_ASSERT(n_rows == 0 || (e != nullptr && x != nullptr), "hc_expand: null input or output");
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t s = 0; s < n_streams; ++s) {
      std::copy_n(e + r * hidden, hidden, x + (r * n_streams + s) * hidden);
    }
  }
}

}  // namespace e4kv
