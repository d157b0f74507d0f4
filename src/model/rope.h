// RoPE frequency tables on the host, computed in double as transformers' rope init functions
// compute them (modeling_rope_utils): default, linear, llama3 and yarn. The backend's rope op takes
// per-token cos/sin rows built here, so no op hard-codes a frequency formula.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "io/model_config.h"

namespace e4kv {

struct RopeTable {
  int64_t rotary_dim = 0;
  std::vector<double> inv_freq;    // [rotary_dim / 2]
  double attention_scaling = 1.0;  // multiplies cos and sin (yarn's attention factor)
};

// The table of `config.rope`:
//   default: inv_freq_i = 1 / theta^(2i / rotary_dim)
//   linear:  default / factor
//   llama3:  default, with wavelengths above original_max_position_embeddings / low_freq_factor
//            divided by factor, those below original / high_freq_factor kept, and a smooth
//            interpolation between
//   yarn:    a ramp between interpolated (1 / (factor * theta^(2i/d))) and extrapolated
//            frequencies over the correction range of beta_fast..beta_slow rotations at the
//            original context; attention_scaling = attention_factor, or
//            mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given, or
//            0.1 ln(factor) + 1. As transformers does, when original_max_position_embeddings is
//            given the factor used is max_position_embeddings / original_max_position_embeddings.
// Other types (dynamic, longrope, ...) are errors naming the type.
Result<RopeTable> make_rope_table(const ModelConfig& config);

// cos[r, i] = fp32(cos(positions[r] * inv_freq_i) * attention_scaling), sin likewise; the angle and
// both functions in double. cos, sin: [positions.size(), rotary_dim / 2]
void rope_cos_sin_rows(const RopeTable& table, std::span<const int32_t> positions, float* cos,
                       float* sin);

}  // namespace e4kv
