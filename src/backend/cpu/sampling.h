// The reference of Backend::sample_rows: one row's draw on the host (greedy, or the Gumbel-max
// draw of core/sampling_noise.h over the tokens min-p keeps). The host sampler
// (engine/sampler.h) uses it for rows without top-k / top-p, so the engine draws the same token
// whether a row is sampled on the host or by a backend.
#pragma once

#include <cstdint>
#include <span>

#include "backend/backend.h"

namespace e4kv {

// The token of one row (Backend::sample_rows's contract); *non_finite gets the number of NaN or
// infinite logits. -1 when no logit is finite.
int32_t sample_row(std::span<const float> logits, const Backend::SampleRowParams& params,
                   int32_t* non_finite);

}  // namespace e4kv
