#include "model/step_context.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "core/checked.h"
#include "model/workspace.h"

namespace e4kv {

Result<ModelLimits> model_limits(const ModelOptions& options, int64_t max_position_embeddings,
                                 const std::string& config_path) {
  E4KV_RETURN_IF_ERROR(validate_block_size(options.block_size));
  if (options.n_blocks <= 0 || options.n_blocks > std::numeric_limits<int32_t>::max()) {
    return Status::option_error("n_blocks",
                                cat("the KV cache needs 1 to 2^31 - 1 blocks, got ", options.n_blocks));
  }
  ModelLimits limits;
  limits.max_model_len =
      options.max_model_len > 0 ? options.max_model_len : max_position_embeddings;
  if (limits.max_model_len <= 0) {
    return Status::option_error("max_model_len",
                                cat("not given, and ", config_path,
                                    " has no \"max_position_embeddings\"; give it explicitly"));
  }
  if (limits.max_model_len > std::numeric_limits<int32_t>::max()) {
    return Status::option_error("max_model_len", cat(limits.max_model_len,
                                                     " positions do not fit int32 positions"));
  }
  constexpr int64_t kDefaultBatchTokens = 8192;
  constexpr int64_t kDefaultSeqs = 64;
  limits.max_batch_tokens = options.max_batch_tokens > 0
                                ? options.max_batch_tokens
                                : std::min(limits.max_model_len, kDefaultBatchTokens);
  if (limits.max_batch_tokens > std::numeric_limits<int32_t>::max()) {
    return Status::option_error("max_batch_tokens",
                                cat(limits.max_batch_tokens, " rows do not fit int32 row indices"));
  }
  limits.max_seqs = options.max_seqs > 0 ? options.max_seqs
                                         : std::min(kDefaultSeqs, limits.max_batch_tokens);
  if (limits.max_seqs > limits.max_batch_tokens) {
    return Status::option_error("max_seqs", cat(limits.max_seqs, " sequences exceed the ",
                                                limits.max_batch_tokens,
                                                " rows of max_batch_tokens"));
  }
  limits.max_logit_rows = options.max_logit_rows > 0 ? options.max_logit_rows : limits.max_seqs;
  if (limits.max_logit_rows > limits.max_batch_tokens) {
    return Status::option_error("max_logit_rows",
                                cat(limits.max_logit_rows, " exceeds the ",
                                    limits.max_batch_tokens, " rows of max_batch_tokens"));
  }
  // A sequence never holds more blocks than the pool has: the block-table stride and every
  // per-position table follow the pool, not the (possibly huge) max_model_len.
  const std::optional<int64_t> pool_tokens = checked_mul(options.n_blocks, options.block_size);
  limits.max_seq_tokens =
      pool_tokens ? std::min(limits.max_model_len, *pool_tokens) : limits.max_model_len;
  limits.max_blocks_per_seq = blocks_for_tokens(limits.max_seq_tokens, options.block_size);
  return limits;
}

Result<StepContext> StepContext::create(Backend& backend, const ModelLimits& limits,
                                        int64_t rotary_dim) {
  StepContext ctx;
  ctx.backend_ = &backend;
  ctx.limits_ = limits;
  ctx.rotary_dim_ = rotary_dim;
  const size_t rows = size_t(limits.max_batch_tokens);
  const size_t half = size_t(std::max<int64_t>(1, rotary_dim / 2));
  const std::optional<int64_t> table_entries =
      checked_mul(limits.max_seqs, limits.max_blocks_per_seq);
  if (!table_entries) {
    return Status::error(cat(limits.max_seqs, " sequences of ", limits.max_blocks_per_seq,
                             " blocks overflow the block table"));
  }
  const size_t seqs = size_t(limits.max_seqs);
  E4KV_RETURN_IF_ERROR(allocate_buffers(
      backend, {{&ctx.ids_, rows * 4},
                {&ctx.row_seq_, rows * 4},
                {&ctx.row_pos_, rows * 4},
                {&ctx.slots_, rows * 8},
                {&ctx.cos_, rows * half * 4},
                {&ctx.sin_, rows * half * 4},
                {&ctx.logit_rows_, size_t(limits.max_logit_rows) * 4},
                {&ctx.seq_lens_, seqs * 4},
                {&ctx.table_, size_t(*table_entries) * 4},
                {&ctx.seq_begin_, (seqs + 1) * 4},
                {&ctx.seq_slot_, seqs * 4},
                {&ctx.seq_start_, seqs * 8}}));

  // The host staging: one block, each array at a 64-byte boundary.
  size_t staging_bytes = 0;
  auto reserve = [&](size_t bytes) {
    const size_t offset = staging_bytes;
    staging_bytes += (bytes + 63) / 64 * 64;
    return offset;
  };
  const size_t o_ids = reserve(rows * 4), o_row_seq = reserve(rows * 4),
               o_row_pos = reserve(rows * 4), o_slots = reserve(rows * 8),
               o_cos = reserve(rows * half * 4), o_sin = reserve(rows * half * 4),
               o_logit_rows = reserve(size_t(limits.max_logit_rows) * 4),
               o_seq_lens = reserve(seqs * 4), o_table = reserve(size_t(*table_entries) * 4),
               o_seq_begin = reserve((seqs + 1) * 4), o_seq_slot = reserve(seqs * 4),
               o_seq_start = reserve(seqs * 8);
  E4KV_ASSIGN_OR_RETURN(ctx.staging_, backend.allocate_host(staging_bytes));
  std::byte* base = ctx.staging_.as<std::byte>();
  auto carve = [&]<class T>(std::span<T>& span, size_t offset, size_t count) {
    span = std::span<T>(reinterpret_cast<T*>(base + offset), count);
  };
  carve(ctx.ids_host_, o_ids, rows);
  carve(ctx.row_seq_host_, o_row_seq, rows);
  carve(ctx.row_pos_host_, o_row_pos, rows);
  carve(ctx.slots_host_, o_slots, rows);
  carve(ctx.cos_host_, o_cos, rows * half);
  carve(ctx.sin_host_, o_sin, rows * half);
  carve(ctx.logit_rows_host_, o_logit_rows, size_t(limits.max_logit_rows));
  carve(ctx.seq_lens_host_, o_seq_lens, seqs);
  carve(ctx.table_host_, o_table, size_t(*table_entries));
  carve(ctx.seq_begin_host_, o_seq_begin, seqs + 1);
  carve(ctx.seq_slot_host_, o_seq_slot, seqs);
  carve(ctx.seq_start_host_, o_seq_start, seqs);
  ctx.seq_end_host_.resize(seqs);
  return ctx;
}

Status StepContext::build(const ForwardBatch& batch, const RopeTable* rope, int64_t vocab_size,
                          int64_t block_size, int64_t n_blocks) {
  size_t n = batch.token_ids.size();  // padding added below
  if (n == 0) return Status::error("forward: the batch has no rows");
  if (batch.row_seq.size() != n || batch.row_pos.size() != n) {
    return Status::error(cat("forward: ", n, " token ids but ", batch.row_seq.size(),
                             " row sequences and ", batch.row_pos.size(), " row positions"));
  }
  // Padding rows (ForwardBatch::pad_to): one per padding sequence, after the batch's own.
  const size_t pad = batch.pad_to > int64_t(n) ? size_t(batch.pad_to) - n : 0;
  if (pad > 0 && (batch.seqs.size() != n || batch.logit_rows.size() != n)) {
    return Status::error(cat("forward: padding to ", batch.pad_to,
                             " rows needs a batch of decode rows (one per sequence, each a logit "
                             "row); this one has ",
                             n, " rows, ", batch.seqs.size(), " sequences and ",
                             batch.logit_rows.size(), " logit rows"));
  }
  if (int64_t(n + pad) > limits_.max_batch_tokens) {
    return Status::option_error("max_batch_tokens",
                                cat("the batch has ", n + pad,
                                    " rows; the model was loaded for at most ",
                                    limits_.max_batch_tokens, " per forward"));
  }
  if (batch.seqs.empty()) return Status::error("forward: the batch has no sequences");
  if (int64_t(batch.seqs.size() + pad) > limits_.max_seqs) {
    return Status::option_error("max_seqs", cat("the batch has ", batch.seqs.size() + pad,
                                                " sequences; the model was loaded for at most ",
                                                limits_.max_seqs, " per forward"));
  }
  if (int64_t(batch.logit_rows.size() + pad) > limits_.max_logit_rows) {
    return Status::option_error("max_logit_rows",
                                cat("the batch asks for the logits of ",
                                    batch.logit_rows.size() + pad,
                                    " rows; the model was loaded for at most ",
                                    limits_.max_logit_rows, " per forward"));
  }
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const BlockTable* table = batch.seqs[s];
    if (table == nullptr) return Status::error(cat("forward: sequence ", s, " has no block table"));
    if (table->n_tokens > static_cast<int64_t>(table->blocks.size()) * block_size) {
      return Status::error(cat("forward: sequence ", s, " holds ", table->n_tokens, " tokens in ",
                               table->blocks.size(), " blocks of ", block_size));
    }
    if (table->n_tokens > limits_.max_model_len) {
      return Status::error(cat("forward: sequence ", s, " has ", table->n_tokens,
                               " tokens, more than the max model length ", limits_.max_model_len));
    }
    if (int64_t(table->blocks.size()) > limits_.max_blocks_per_seq) {
      return Status::error(cat("forward: sequence ", s, " has ", table->blocks.size(),
                               " blocks, more than the ", limits_.max_blocks_per_seq,
                               " a sequence may hold"));
    }
    for (int32_t block : table->blocks) {
      if (block < 0 || block >= n_blocks) {
        return Status::error(cat("forward: sequence ", s, " names block ", block, " outside [0, ",
                                 n_blocks, ")"));
      }
    }
  }
  for (size_t r = 0; r < n; ++r) {
    const int32_t id = batch.token_ids[r];
    if (id < 0 || id >= vocab_size) {
      return Status::error(cat("token id ", id, " (row ", r, ") is outside the vocabulary [0, ",
                               vocab_size, ")"));
    }
    const int32_t seq = batch.row_seq[r];
    if (seq < 0 || static_cast<size_t>(seq) >= batch.seqs.size()) {
      return Status::error(
          cat("forward: row ", r, " names sequence ", seq, " of ", batch.seqs.size()));
    }
    const int32_t pos = batch.row_pos[r];
    if (pos < 0 || pos >= batch.seqs[size_t(seq)]->n_tokens) {
      return Status::error(cat("forward: row ", r, " has position ", pos, " outside sequence ", seq,
                               "'s ", batch.seqs[size_t(seq)]->n_tokens, " tokens"));
    }
  }
  for (int32_t row : batch.logit_rows) {
    if (row < 0 || static_cast<size_t>(row) >= n) {
      return Status::error(cat("forward: logit row ", row, " outside the ", n, " rows"));
    }
  }
  if (pad > 0) {
    for (size_t r = 0; r < n; ++r) {
      if (batch.row_seq[r] != int32_t(r) || batch.logit_rows[r] != int32_t(r)) {
        return Status::error(cat("forward: padding needs row r to be sequence r's and logit row r; "
                                 "row ", r, " is not"));
      }
    }
  }

  // ---- the metadata, on the host ----
  const size_t n_real_seqs = batch.seqs.size();
  n_padding_ = int64_t(pad);
  n_rows_ = int64_t(n + pad);
  n_seqs_ = int64_t(n_real_seqs + pad);
  n_logits_ = int64_t(batch.logit_rows.size() + pad);
  for (size_t r = 0; r < n; ++r) {
    ids_host_[r] = batch.token_ids[r];
    row_seq_host_[r] = batch.row_seq[r];
    row_pos_host_[r] = batch.row_pos[r];
  }
  for (size_t i = 0; i < batch.logit_rows.size(); ++i) logit_rows_host_[i] = batch.logit_rows[i];
  for (size_t r = 0; r < n; ++r) {
    slots_host_[r] = slot_for_position(*batch.seqs[size_t(row_seq_host_[r])], row_pos_host_[r],
                                       block_size);
  }
  // The block table at the fixed stride, unused entries -1.
  const int64_t stride = limits_.max_blocks_per_seq;
  std::fill_n(table_host_.begin(), size_t(n_seqs_ * stride), -1);
  for (size_t s = 0; s < n_real_seqs; ++s) {
    const BlockTable& seq = *batch.seqs[s];
    seq_lens_host_[s] = static_cast<int32_t>(seq.n_tokens);
    std::copy(seq.blocks.begin(), seq.blocks.end(), table_host_.begin() + int64_t(s) * stride);
  }
  // Padding: token 0 at position 0 of a one-token sequence in the scratch block (n_blocks, the
  // block after the pool), every padding row writing the same cache slot.
  for (size_t i = 0; i < pad; ++i) {
    const size_t r = n + i, s = n_real_seqs + i;
    ids_host_[r] = 0;
    row_seq_host_[r] = int32_t(s);
    row_pos_host_[r] = 0;
    slots_host_[r] = n_blocks * block_size;
    logit_rows_host_[batch.logit_rows.size() + i] = int32_t(r);
    seq_lens_host_[s] = 1;
    table_host_[s * size_t(stride)] = int32_t(n_blocks);
  }
  const size_t half = size_t(rotary_dim_ / 2);
  if (rope != nullptr && half > 0) {
    // The rows come from a table of every position seen so far, computed once (cos and sin in
    // double per entry cost about 1 us a row at rotary width 128: a third of a millisecond per
    // step at 256 decode rows when computed per step).
    if (rope_table_of_ != rope) {
      rope_table_of_ = rope;
      rope_cos_all_.clear();
      rope_sin_all_.clear();
    }
    int64_t need = 1;
    for (const int32_t p : batch.row_pos) need = std::max<int64_t>(need, int64_t(p) + 1);
    const int64_t have = int64_t(rope_cos_all_.size() / half);
    if (need > have) {
      const int64_t grow = std::max(need, std::min(2 * have, limits_.max_seq_tokens));
      std::vector<int32_t> positions(size_t(grow - have));
      for (size_t i = 0; i < positions.size(); ++i) positions[i] = int32_t(have + int64_t(i));
      rope_cos_all_.resize(size_t(grow) * half);
      rope_sin_all_.resize(size_t(grow) * half);
      rope_cos_sin_rows(*rope, positions, rope_cos_all_.data() + size_t(have) * half,
                        rope_sin_all_.data() + size_t(have) * half);
    }
    for (size_t r = 0; r < n + pad; ++r) {
      const float* cos_row = rope_cos_all_.data() + size_t(row_pos_host_[r]) * half;
      const float* sin_row = rope_sin_all_.data() + size_t(row_pos_host_[r]) * half;
      std::copy_n(cos_row, half, cos_host_.data() + r * half);
      std::copy_n(sin_row, half, sin_host_.data() + r * half);
    }
  }
  host_rows_ = QueryBatchView{};
  host_rows_.n_rows = n_rows_;
  host_rows_.row_seq = row_seq_host_.data();
  host_rows_.row_pos = row_pos_host_.data();
  host_rows_.seq_lens = seq_lens_host_.data();
  E4KV_RETURN_IF_ERROR(backend_->plan_attention(host_rows_));

  // ---- and on the device ----
  Backend& b = *backend_;
  n += pad;
  b.copy_from_host(ids_.data(), ids_host_.data(), n * 4);
  b.copy_from_host(row_seq_.data(), row_seq_host_.data(), n * 4);
  b.copy_from_host(row_pos_.data(), row_pos_host_.data(), n * 4);
  b.copy_from_host(slots_.data(), slots_host_.data(), n * 8);
  if (rope != nullptr && half > 0) {
    b.copy_from_host(cos_.data(), cos_host_.data(), n * half * 4);
    b.copy_from_host(sin_.data(), sin_host_.data(), n * half * 4);
  }
  if (n_logits_ > 0) {
    b.copy_from_host(logit_rows_.data(), logit_rows_host_.data(), size_t(n_logits_) * 4);
  }
  b.copy_from_host(seq_lens_.data(), seq_lens_host_.data(), size_t(n_seqs_) * 4);
  b.copy_from_host(table_.data(), table_host_.data(), size_t(n_seqs_ * stride) * 4);
  return ok_status();
}

Status StepContext::build_sequences(const ForwardBatch& batch, const SequenceSlots& slots) {
  const size_t n_seqs = batch.seqs.size();  // without the padding sequences
  const int64_t n_real_rows = n_rows_ - n_padding_;
  if (batch.seq_slots.size() != n_seqs) {
    return Status::error(cat("forward: ", n_seqs, " sequences but ", batch.seq_slots.size(),
                             " state slots; this model keeps per-sequence state: give each "
                             "sequence the slot Model::allocate_sequence returned"));
  }
  std::fill_n(seq_begin_host_.begin(), size_t(n_seqs_) + 1, -1);
  for (size_t s = 0; s < n_seqs; ++s) seq_slot_host_[s] = batch.seq_slots[s];
  std::fill_n(seq_start_host_.begin(), n_seqs, 0);
  std::fill_n(seq_end_host_.begin(), n_seqs, 0);
  for (size_t s = 0; s < n_seqs; ++s) {
    const int32_t slot = seq_slot_host_[s];
    if (!slots.valid(slot)) {
      return Status::error(
          cat("forward: sequence ", s, " names state slot ", slot, ", which is not allocated"));
    }
    if (slots.poisoned(slot)) {
      return Status::error(cat("forward: sequence ", s, " (state slot ", slot,
                               ") was in a forward that failed; its state is undefined: free it "
                               "and start the sequence again"));
    }
    for (size_t t = 0; t < s; ++t) {
      if (seq_slot_host_[t] == slot) {
        return Status::error(cat("forward: sequences ", t, " and ", s, " share state slot ", slot));
      }
    }
  }
  // Rows of each sequence: one contiguous run at consecutive positions from the tokens seen.
  for (int64_t r = 0; r < n_real_rows; ++r) {
    const size_t s = size_t(row_seq_host_[size_t(r)]);
    const int32_t pos = row_pos_host_[size_t(r)];
    if (seq_begin_host_[s] < 0) {
      seq_begin_host_[s] = int32_t(r);
      seq_start_host_[s] = pos;
      const int64_t seen = slots.tokens(seq_slot_host_[s]);
      if (pos != seen) {
        return Status::error(cat("forward: sequence ", s, " starts at position ", pos,
                                 " but its state has seen ", seen,
                                 " tokens; a recurrent model takes every position once, in order"));
      }
    } else if (row_seq_host_[size_t(r - 1)] != int32_t(s) ||
               row_pos_host_[size_t(r - 1)] + 1 != pos) {
      return Status::error(cat("forward: row ", r, " (sequence ", s, ", position ", pos,
                               ") does not follow the sequence's previous row; the rows of a "
                               "sequence must be contiguous at consecutive positions"));
    }
    seq_end_host_[s] = pos + 1;
  }
  // Row ranges in sequence order (a sequence without rows gets an empty range).
  int32_t next = 0;
  int64_t max_seq_rows = 0;
  int64_t max_end_pos = 0;
  for (size_t s = 0; s < n_seqs; ++s) {
    if (seq_begin_host_[s] < 0) {
      seq_begin_host_[s] = next;
      seq_start_host_[s] = slots.tokens(seq_slot_host_[s]);
      seq_end_host_[s] = seq_start_host_[s];
    } else if (seq_begin_host_[s] != next) {
      return Status::error(cat("forward: the rows of sequence ", s,
                               " come after those of a later sequence; order the rows by "
                               "sequence"));
    }
    next += int32_t(seq_end_host_[s] - seq_start_host_[s]);
    max_seq_rows = std::max(max_seq_rows, seq_end_host_[s] - seq_start_host_[s]);
    max_end_pos = std::max(max_end_pos, seq_end_host_[s]);
  }
  // Padding sequences: one row each at position 0, all in the scratch state slot (the slot after
  // the pool's), which every step sees as new (commit_sequences leaves it alone).
  for (size_t s = n_seqs; s < size_t(n_seqs_); ++s) {
    seq_begin_host_[s] = next;
    seq_slot_host_[s] = int32_t(slots.capacity());
    seq_start_host_[s] = 0;
    seq_end_host_[s] = 1;
    next += 1;
    max_seq_rows = std::max<int64_t>(max_seq_rows, 1);
    max_end_pos = std::max<int64_t>(max_end_pos, 1);
  }
  const size_t total_seqs = size_t(n_seqs_);
  seq_begin_host_[total_seqs] = next;
  Backend& b = *backend_;
  b.copy_from_host(seq_begin_.data(), seq_begin_host_.data(), (total_seqs + 1) * 4);
  b.copy_from_host(seq_slot_.data(), seq_slot_host_.data(), total_seqs * 4);
  b.copy_from_host(seq_start_.data(), seq_start_host_.data(), total_seqs * 8);
  seq_rows_ = SequenceRowsView{};
  seq_rows_.n_seqs = int64_t(total_seqs);
  seq_rows_.row_begin = seq_begin_.as<int32_t>();
  seq_rows_.state_slot = seq_slot_.as<int32_t>();
  seq_rows_.start_pos = seq_start_.as<int64_t>();
  seq_rows_.first_row = seq_begin_host_[0];
  seq_rows_.end_row = next;
  seq_rows_.max_seq_rows = max_seq_rows;
  seq_rows_.max_end_pos = max_end_pos;
  return ok_status();
}

void StepContext::commit_sequences(SequenceSlots& slots) const {
  for (size_t s = 0; s < size_t(seq_rows_.n_seqs - n_padding_); ++s) {
    slots.set_tokens(seq_slot_host_[s], seq_end_host_[s]);
  }
}

QueryBatchView StepContext::rows() const {
  QueryBatchView rows;
  rows.n_rows = n_rows_;
  rows.row_seq = row_seq_.as<int32_t>();
  rows.row_pos = row_pos_.as<int32_t>();
  rows.seq_lens = seq_lens_.as<int32_t>();
  return rows;
}

BlockTableView StepContext::block_table() const {
  return BlockTableView{table_.as<int32_t>(), n_seqs_, limits_.max_blocks_per_seq};
}

}  // namespace e4kv
