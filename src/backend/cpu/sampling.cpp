#include "backend/cpu/sampling.h"

#include <cmath>
#include <limits>

#include "core/sampling_noise.h"

namespace e4kv {

int32_t sample_row(std::span<const float> logits, const Backend::SampleRowParams& params,
                   int32_t* non_finite) {
  // Pass 1: the largest finite logit (its first index) and the non-finite count.
  int32_t count = 0;
  float top = -std::numeric_limits<float>::infinity();
  int32_t top_index = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    if (!std::isfinite(v)) {
      ++count;
    } else if (top_index < 0 || v > top) {
      top = v;
      top_index = int32_t(i);
    }
  }
  *non_finite = count;
  if (params.inv_temperature == 0.0f || top_index < 0) return top_index;
  // Pass 2: the Gumbel-max draw over the tokens min-p keeps.
  const float threshold = top * params.inv_temperature + params.log_min_p;
  const uint64_t key = sampling_draw_key(params.seed, params.counter);
  float best = -std::numeric_limits<float>::infinity();
  int32_t best_index = top_index;
  bool any = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    if (!std::isfinite(v)) continue;
    const float s = v * params.inv_temperature;
    if (s < threshold) continue;
    const float u = sampling_uniform(key, uint32_t(i));
    const float k = s - std::log(-std::log(u));
    if (!any || k > best) {
      best = k;
      best_index = int32_t(i);
      any = true;
    }
  }
  return best_index;
}

}  // namespace e4kv
