// The per-step metadata of one forward, built once on the host and uploaded once, shared by every
// layer: the rows (ids, sequences, positions), each row's cache slot, the sequences' lengths and
// block tables, the RoPE cos/sin of each row, and the step's attention launch plan (planned by the
// backend from the host rows). Its device buffers and host staging are sized at load from the
// model's limits, so a forward never allocates.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "kv/block_allocator.h"
#include "kv/kv_cache_view.h"
#include "model/model.h"
#include "model/rope.h"
#include "model/sequence_slots.h"

namespace e4kv {

class StepContext {
 public:
  // Allocates the device buffers and the host staging for `limits` (rotary_dim: the RoPE table's
  // width, 0 for none).
  static Result<StepContext> create(Backend& backend, const ModelLimits& limits,
                                    int64_t rotary_dim);

  // Checks `batch` against the limits, the vocabulary, the cache (block ids below n_blocks,
  // tokens within the blocks and max_model_len) and itself (rows name their sequences, positions
  // inside them, logit rows inside the batch); then builds the metadata, plans the step's
  // attention launches (Backend::plan_attention) and uploads both (ordered with the backend's
  // ops). Errors name the row, sequence or limit.
  Status build(const ForwardBatch& batch, const RopeTable* rope, int64_t vocab_size,
               int64_t block_size, int64_t n_blocks);

  // For a model with per-sequence state, after build: checks that each sequence's rows are
  // contiguous in the batch, at consecutive positions starting at the tokens its slot has seen,
  // and that its slot is valid, not poisoned and named once; then builds and uploads the
  // per-sequence row ranges (sequences()). Errors name the sequence.
  Status build_sequences(const ForwardBatch& batch, const SequenceSlots& slots);
  // After a successful forward: every slot of the batch has seen its rows.
  void commit_sequences(SequenceSlots& slots) const;
  const SequenceRowsView& sequences() const { return seq_rows_; }
  // The same row ranges and slots on the host, for the host half of a forward (build_sequences).
  std::span<const int32_t> host_seq_row_begin() const {
    return seq_begin_host_.first(size_t(n_seqs_ + 1));
  }
  std::span<const int32_t> host_seq_slots() const { return seq_slot_host_.first(size_t(n_seqs_)); }

  // Rows, sequences and logit rows of the step, padding included (ForwardBatch::pad_to: the
  // padding rows and sequences come last).
  int64_t n_rows() const { return n_rows_; }
  int64_t n_padding() const { return n_padding_; }
  // The token ids of every row, padding included, on the host.
  std::span<const int32_t> host_ids() const { return ids_host_.first(size_t(n_rows_)); }
  int64_t n_seqs() const { return n_seqs_; }
  int64_t n_logits() const { return n_logits_; }

  // Device pointers.
  const int32_t* ids() const { return ids_.as<int32_t>(); }
  const int64_t* slots() const { return slots_.as<int64_t>(); }
  const float* cos() const { return cos_.as<float>(); }
  const float* sin() const { return sin_.as<float>(); }
  const int32_t* logit_rows() const { return logit_rows_.as<int32_t>(); }
  // Rows and block tables for attention (row_seq, row_pos, seq_lens; no selection). The block
  // table's stride is the longest sequence the pool allows (ModelLimits::max_blocks_per_seq),
  // whatever the step's sequences hold, so launch shapes do not change from step to step.
  QueryBatchView rows() const;
  BlockTableView block_table() const;
  // The same rows with host pointers (row_seq, row_pos, seq_lens).
  const QueryBatchView& host_rows() const { return host_rows_; }

 private:
  StepContext() = default;

  Backend* backend_ = nullptr;
  ModelLimits limits_;
  int64_t rotary_dim_ = 0;
  int64_t n_rows_ = 0;
  int64_t n_padding_ = 0;
  int64_t n_seqs_ = 0;
  int64_t n_logits_ = 0;

  // Host staging of every upload, carved from one Backend::allocate_host block (page-locked on
  // CUDA, so the copies are asynchronous and a graph's metadata can be refreshed in place). The
  // backend reads it asynchronously: a build writes it only after the previous forward has
  // synchronised (forward_device reads the non-finite counters back; the logits stay on the
  // device).
  HostBuffer staging_;
  std::span<int32_t> ids_host_, row_seq_host_, row_pos_host_, logit_rows_host_, seq_lens_host_,
      table_host_, seq_begin_host_, seq_slot_host_;
  std::span<int64_t> slots_host_, seq_start_host_;
  std::span<float> cos_host_, sin_host_;
  std::vector<int64_t> seq_end_host_;
  // cos / sin of positions 0.. (grown as positions appear, up to max_seq_tokens) of one table.
  const RopeTable* rope_table_of_ = nullptr;
  std::vector<float> rope_cos_all_, rope_sin_all_;
  QueryBatchView host_rows_;

  BackendBuffer ids_, row_seq_, row_pos_, slots_, cos_, sin_, logit_rows_, seq_lens_, table_;

  // Per-sequence row ranges (build_sequences).
  BackendBuffer seq_begin_, seq_slot_, seq_start_;
  SequenceRowsView seq_rows_;
};

}  // namespace e4kv
