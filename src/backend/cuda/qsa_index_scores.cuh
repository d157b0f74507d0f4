// QSA index scores on the GPU (DESIGN.md section 4, step 5): for every query row, the score of
// every visible complete group over the paged compressed indexer cache, on tensor cores (within
// fp32 summation error of the CPU reference qsa_index_scores, qsa/selection.h), or bit-identical
// to it with `exact`. Host-only header (no CUDA include beyond the stream type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/status.h"
#include "kv/kv_cache_view.h"

namespace e4kv::cuda {

// Device pointers throughout.
struct QsaIndexScoresArgs {
  IndexerCompressedView compressed;  // data: [n_blocks, block_size / ratio, index_dim] FP16
  BlockTableView block_table;        // blocks: [n_seqs, max_blocks_per_seq]
  QueryBatchView rows;               // row_seq, row_pos: [n_rows]; seq_lens: [n_seqs]
  const uint16_t* index_q =
      nullptr;  // [rows.n_rows, n_index_heads, index_dim] FP16 (normed, roped)
  int64_t n_index_heads = 4;
  // Row stride of `scores`; must be >= the visible groups of every row (the kernel never writes
  // past it: a row with more visible groups would be cut short).
  int64_t max_groups = 0;
  // Rows whose visible groups number at most this are not scored (pass top-k's k to skip the rows
  // that select densely; 0 scores every row).
  int64_t skip_visible_at_most = 0;
  float* scores = nullptr;  // [rows.n_rows, max_groups] fp32; entries >= visible are not written
  // Optional: the largest score of each run of kQsaRunGroups (qsa_topk.cuh) consecutive groups,
  // [rows.n_rows, run_stride] with run_stride >= ceil(max_groups / kQsaRunGroups), written for
  // the runs that hold a scored group (the last run of a row may be shorter), for
  // qsa_top_k_select's QsaTopKArgs::run_maxima. nullptr: not written.
  float* run_maxima = nullptr;
  int64_t run_stride = 0;
  // false (the default): tensor cores. FP16 products are exact in fp32 but the tensor core sums
  // them in its own order, so a score may differ from the CPU reference in its last bits. true:
  // fp32 FMA chains in the reference's order, bit-identical to it, for comparisons of selections
  // with the CPU (14.2 against 12.4 us at 4 rows x 128K tokens, cold, on the H200).
  bool exact = false;
};

// scores[r, c] for c < visible(r) = min((pos + 1) / ratio, seq_len / ratio), per the CPU contract.
// Limits: n_index_heads 1..8, index_dim a multiple of 8 and <= 256. Groups whose block-table entry
// lies outside [0, n_blocks) score 0 (never read). Returns an error for shapes outside the limits;
// launch failures are fatal.
Status qsa_index_scores(const QsaIndexScoresArgs& args, cudaStream_t stream);

}  // namespace e4kv::cuda
