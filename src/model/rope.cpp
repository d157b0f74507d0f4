#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace e4kv {
namespace {

std::vector<double> default_inv_freq(double theta, int64_t rotary_dim) {
  std::vector<double> inv_freq(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    inv_freq[size_t(i)] =
        1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim));
  }
  return inv_freq;
}

void apply_llama3(const RopeConfig& rope, std::vector<double>& inv_freq) {
  const double old_context = static_cast<double>(*rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / rope.low_freq_factor;
  const double high_freq_wavelen = old_context / rope.high_freq_factor;
  for (double& f : inv_freq) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen > low_freq_wavelen) {
      f = f / rope.factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth = (old_context / wavelen - rope.low_freq_factor) /
                            (rope.high_freq_factor - rope.low_freq_factor);
      f = (1.0 - smooth) * f / rope.factor + smooth * f;
    }
  }
}

double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

Status apply_yarn(const ModelConfig& config, RopeTable& table) {
  const RopeConfig& rope = config.rope;
  const double theta = rope.theta;
  const double dim = static_cast<double>(table.rotary_dim);
  double factor = rope.factor;
  double original_context = static_cast<double>(config.max_position_embeddings);
  if (rope.original_max_position_embeddings) {
    original_context = static_cast<double>(*rope.original_max_position_embeddings);
    if (config.max_position_embeddings > 0) {
      factor = static_cast<double>(config.max_position_embeddings) / original_context;
    }
  }
  if (!(original_context > 0.0)) {
    return Status::error(
        "rope type yarn needs max_position_embeddings or "
        "rope_scaling.original_max_position_embeddings in config.json");
  }
  if (rope.attention_factor) {
    table.attention_scaling = *rope.attention_factor;
  } else if (rope.mscale && rope.mscale_all_dim && *rope.mscale != 0.0 &&
             *rope.mscale_all_dim != 0.0) {
    table.attention_scaling =
        yarn_mscale(factor, *rope.mscale) / yarn_mscale(factor, *rope.mscale_all_dim);
  } else {
    table.attention_scaling = yarn_mscale(factor, 1.0);
  }

  // Dimension index at which a frequency turns `rotations` times over the original context.
  auto correction_dim = [&](double rotations) {
    return dim * std::log(original_context / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(theta));
  };
  double low = correction_dim(rope.beta_fast);
  double high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += 0.001;  // as transformers: avoid a zero-width ramp

  for (size_t i = 0; i < table.inv_freq.size(); ++i) {
    const double pos_freq = std::pow(theta, static_cast<double>(2 * i) / dim);
    const double extrapolation = 1.0 / pos_freq;
    const double interpolation = 1.0 / (factor * pos_freq);
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_weight = 1.0 - ramp;
    table.inv_freq[i] =
        interpolation * (1.0 - extrapolation_weight) + extrapolation * extrapolation_weight;
  }
  return ok_status();
}

}  // namespace

Result<RopeTable> make_rope_table(const ModelConfig& config) {
  RopeTable table;
  table.rotary_dim = config.rotary_dim;
  const RopeConfig& rope = config.rope;
  table.inv_freq = default_inv_freq(rope.theta, config.rotary_dim);
  if (rope.type == "default") return table;
  if (rope.type == "linear") {
    for (double& f : table.inv_freq) f /= rope.factor;
    return table;
  }
  if (rope.type == "llama3") {
    if (!rope.original_max_position_embeddings) {
      return Status::error("rope type llama3 needs original_max_position_embeddings");
    }
    apply_llama3(rope, table.inv_freq);
    return table;
  }
  if (rope.type == "yarn") {
    E4KV_RETURN_IF_ERROR(apply_yarn(config, table));
    return table;
  }
  return Status::error(cat("config.json: rope type \"", rope.type,
                           "\" is not supported by the dense runtime; supported: default, linear, "
                           "llama3, yarn"));
}

void rope_cos_sin_rows(const RopeTable& table, std::span<const int32_t> positions, float* cos,
                       float* sin) {
  const size_t half = table.inv_freq.size();
  for (size_t r = 0; r < positions.size(); ++r) {
    const double pos = static_cast<double>(positions[r]);
    for (size_t i = 0; i < half; ++i) {
      const double angle = pos * table.inv_freq[i];
      cos[r * half + i] = static_cast<float>(std::cos(angle) * table.attention_scaling);
      sin[r * half + i] = static_cast<float>(std::sin(angle) * table.attention_scaling);
    }
  }
}

}  // namespace e4kv
