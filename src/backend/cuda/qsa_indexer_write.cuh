// QSA indexer cache update on the GPU (DESIGN.md section 4, step 4): the compressed row of every
// group completed by a batch of raw index keys, and the raw rings; bit-identical to the CPU
// reference indexer_cache_write (qsa/indexer_cache.h). Host-only header (no CUDA include beyond the
// stream type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/status.h"
#include "kv/kv_cache_view.h"
#include "qsa/indexer_cache.h"

namespace e4kv::cuda {

// Device pointers throughout (batch.index_k, token_offsets, start_pos, ring_index, block tables).
struct QsaIndexerWriteArgs {
  IndexerCompressedView compressed;
  IndexerRingView rings;
  IndexerWriteBatch batch;
  const uint16_t* norm_weight = nullptr;  // [index_dim] FP16, applied as (1 + w)
  float eps = 1e-6f;
  int64_t rotary_dim = 0;  // even, <= index_dim
  // [n_rope_positions, rotary_dim] fp32 from rope_cos_sin on the host: row p holds cos_0..cos_{h-1}
  // then sin_0..sin_{h-1} (h = rotary_dim / 2) of position p.
  const float* rope_table = nullptr;
  int64_t n_rope_positions = 0;    // > every group start 4c written by this batch
  int64_t max_tokens_per_seq = 0;  // >= every sequence's token count in this batch (host plan)
};

// Writes the compressed rows of the groups completed by the batch, then updates the rings, exactly
// as indexer_cache_write. Limits: index_dim a multiple of 2 and <= 512, cap >= ratio. Returns an
// error for shapes outside the limits; launch failures are fatal.
Status qsa_indexer_write(const QsaIndexerWriteArgs& args, cudaStream_t stream);

}  // namespace e4kv::cuda
