// QSA top-k selection on the GPU (DESIGN.md section 4, steps 6-7): exact top-k of each row's group
// scores with the deterministic tie-break, expanded to token indices with the causal tail and -1
// padding; identical to the CPU reference qsa_select (qsa/selection.h) on the same scores.
// Host-only header (no CUDA include beyond the stream type).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/attention_plan.h"
#include "core/status.h"
#include "kv/kv_cache_view.h"

namespace e4kv::cuda {

// Device pointers throughout.
struct QsaTopKArgs {
  QueryBatchView rows;  // row_seq, row_pos: [n_rows]; seq_lens: [n_seqs] (rows.sel_* ignored)
  int64_t ratio = 4;
  int64_t budget = 2048;          // tokens; k = budget / ratio groups
  const float* scores = nullptr;  // [n_rows, max_groups] (qsa_index_scores); never NaN
  int64_t max_groups = 0;         // row stride of scores, >= every row's visible groups
  // Optional: the largest score of each run of kQsaRunGroups consecutive groups (the last run of a
  // row may be shorter), [n_rows, run_stride], run_stride >= ceil(max_groups / kQsaRunGroups), as
  // qsa_index_scores writes them. kFiltered then reads a row's scores only in the runs that can
  // hold a selected group; without them it reads the whole row once more.
  const float* run_maxima = nullptr;
  int64_t run_stride = 0;
  int32_t* sel_tokens = nullptr;  // [n_rows, budget + ratio - 1]
  int32_t* sel_counts = nullptr;  // [n_rows]
  // Candidate workspace (qsa_top_k_workspace_bytes), or nullptr: then one CTA per row scans the
  // whole row (slower at long contexts, no workspace).
  void* workspace = nullptr;
  QsaTopKMethod method = QsaTopKMethod::kAuto;
};

// Whether kCluster runs on the current device: sm_90+ and sm_90 code in this build.
bool qsa_top_k_cluster_available();

// For each row: visible = min((pos + 1) / ratio, seq_len / ratio) (cut to max_groups); visible <= k
// takes every visible group without reading scores, otherwise the groups scoring strictly above
// the k-th score and then the lowest-index groups equal to it; groups in increasing index, each
// expanded to ratio tokens, then the causal tail ratio * ((pos + 1) / ratio) .. pos, then -1.
// The method is chosen as QsaTopKMethod says; kCluster, then kFiltered, are the fast ones (see
// qsa_topk.cu).
// With kTwoPhase and a workspace, long rows take two phases: chunks of 4096 groups (many CTAs per
// row) each keep their exact local top-k (same order), whose union holds the row's top-k, then one
// CTA per row selects from the candidates. Both paths give identical results. Limits: none beyond
// int32 indices (kFiltered, kCluster: max_groups <= kQsaTopKFilteredMaxGroups; kCluster: an
// sm_90+ device; kTwoPhase: a workspace).
// Returns an error for bad shapes; launch failures are fatal.
Status qsa_top_k_select(const QsaTopKArgs& args, cudaStream_t stream);

}  // namespace e4kv::cuda
