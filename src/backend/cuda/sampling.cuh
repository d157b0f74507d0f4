// Backend::sample_rows on the GPU: one CTA per drawn row, two passes over the row's logits
// (the largest logit and the non-finite count; then the Gumbel-max draw of core/sampling_noise.h
// over the tokens min-p keeps). Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/backend.h"

namespace e4kv::cuda {

void sample_rows_f32(const float* logits, int64_t vocab, const Backend::SampleRowParams* params,
                     int64_t n, int32_t* tokens, int32_t* non_finite, cudaStream_t stream);

}  // namespace e4kv::cuda
