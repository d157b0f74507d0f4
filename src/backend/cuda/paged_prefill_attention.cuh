// Paged prefill / chunked attention: many query rows of one sequence against its paged KV cache
// (FP16 or E4M3), dense causal or over each row's QSA selection, on tensor cores. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "backend/attention_params.h"
#include "core/status.h"
#include "qsa/route_planner.h"

namespace e4kv::cuda {

// One CTA's rows: params.rows rows [first_row, first_row + n_rows), all of one sequence (the same
// row_seq), n_rows <= prefill_rows_per_item(gqa_group). Positions need not be consecutive.
struct PrefillAttentionItem {
  int32_t first_row = 0;
  int32_t n_rows = 0;
};

// Query rows one CTA takes: 64 query-head slots / the GQA group (64 rows for MHA, 8 for group 8).
int64_t prefill_rows_per_item(int64_t gqa_group);

// Cuts route tiles (rows of one sequence) into CTA items of at most prefill_rows_per_item rows.
std::vector<PrefillAttentionItem> plan_prefill_items(std::span<const RouteTile> tiles,
                                                     int64_t gqa_group);

// out rows of every item = attention of those rows, exactly what paged_attention (CPU) computes.
// items: device array [n_items]. Rows outside the items are not written. Limits: head_dim 64, 128
// or 256; GQA group <= 16; block_size a multiple of 8. E4M3 uses the native conversion when
// `native_e4m3` (decode_attention_native_e4m3_usable) and the software decoder otherwise. Returns
// an error for shapes outside the limits; launch failures are fatal.
Status paged_prefill_attention(const PagedAttentionParams& params,
                               const PrefillAttentionItem* items, int64_t n_items,
                               bool native_e4m3, cudaStream_t stream);

}  // namespace e4kv::cuda
