// Paged prefill / chunked attention: many query rows of one sequence against its paged KV cache
// (FP16 or E4M3), dense causal or over each row's QSA selection, on tensor cores. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/attention_params.h"
#include "backend/attention_plan.h"
#include "core/status.h"

namespace e4kv::cuda {

// out rows of every item = attention of those rows, exactly what paged_attention (CPU) computes.
// items: device array [n_items]. Rows outside the items are not written. Limits: head_dim 64, 128
// or 256; GQA group <= 16; block_size a multiple of 8. E4M3 uses the native conversion when
// `native_e4m3` (decode_attention_native_e4m3_usable) and the software decoder otherwise. Returns
// an error for shapes outside the limits; launch failures are fatal.
Status paged_prefill_attention(const PagedAttentionParams& params,
                               const PrefillAttentionItem* items, int64_t n_items,
                               bool native_e4m3, cudaStream_t stream);

}  // namespace e4kv::cuda
