#include "model/step_context.h"

#include <algorithm>
#include <limits>

#include "core/checked.h"

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
  limits.max_blocks_per_seq = blocks_for_tokens(limits.max_model_len, options.block_size);
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
  struct Need {
    BackendBuffer* buffer;
    size_t bytes;
  };
  for (const Need& need : {Need{&ctx.ids_, rows * 4}, Need{&ctx.row_seq_, rows * 4},
                           Need{&ctx.row_pos_, rows * 4}, Need{&ctx.slots_, rows * 8},
                           Need{&ctx.cos_, rows * half * 4}, Need{&ctx.sin_, rows * half * 4},
                           Need{&ctx.logit_rows_, size_t(limits.max_logit_rows) * 4},
                           Need{&ctx.seq_lens_, size_t(limits.max_seqs) * 4},
                           Need{&ctx.table_, size_t(*table_entries) * 4}}) {
    E4KV_ASSIGN_OR_RETURN(*need.buffer, backend.allocate(std::max<size_t>(64, need.bytes)));
  }
  return ctx;
}

Status StepContext::build(const ForwardBatch& batch, const RopeTable* rope, int64_t vocab_size,
                          int64_t block_size, int64_t n_blocks) {
  const size_t n = batch.token_ids.size();
  if (n == 0) return Status::error("forward: the batch has no rows");
  if (batch.row_seq.size() != n || batch.row_pos.size() != n) {
    return Status::error(cat("forward: ", n, " token ids but ", batch.row_seq.size(),
                             " row sequences and ", batch.row_pos.size(), " row positions"));
  }
  if (int64_t(n) > limits_.max_batch_tokens) {
    return Status::option_error("max_batch_tokens",
                                cat("the batch has ", n, " rows; the model was loaded for at most ",
                                    limits_.max_batch_tokens, " per forward"));
  }
  if (batch.seqs.empty()) return Status::error("forward: the batch has no sequences");
  if (int64_t(batch.seqs.size()) > limits_.max_seqs) {
    return Status::option_error("max_seqs", cat("the batch has ", batch.seqs.size(),
                                                " sequences; the model was loaded for at most ",
                                                limits_.max_seqs, " per forward"));
  }
  if (int64_t(batch.logit_rows.size()) > limits_.max_logit_rows) {
    return Status::option_error("max_logit_rows",
                                cat("the batch asks for the logits of ", batch.logit_rows.size(),
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
                               " its max model length needs"));
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

  // ---- the metadata, on the host ----
  n_rows_ = int64_t(n);
  n_seqs_ = int64_t(batch.seqs.size());
  n_logits_ = int64_t(batch.logit_rows.size());
  row_seq_host_.assign(batch.row_seq.begin(), batch.row_seq.end());
  row_pos_host_.assign(batch.row_pos.begin(), batch.row_pos.end());
  slots_host_.resize(n);
  for (size_t r = 0; r < n; ++r) {
    slots_host_[r] = slot_for_position(*batch.seqs[size_t(row_seq_host_[r])], row_pos_host_[r],
                                       block_size);
  }
  seq_lens_host_.resize(size_t(n_seqs_));
  max_blocks_ = 1;
  for (int64_t s = 0; s < n_seqs_; ++s) {
    seq_lens_host_[size_t(s)] = static_cast<int32_t>(batch.seqs[size_t(s)]->n_tokens);
    max_blocks_ = std::max<int64_t>(max_blocks_, int64_t(batch.seqs[size_t(s)]->blocks.size()));
  }
  table_host_.assign(size_t(n_seqs_ * max_blocks_), -1);
  for (int64_t s = 0; s < n_seqs_; ++s) {
    const std::vector<int32_t>& blocks = batch.seqs[size_t(s)]->blocks;
    std::copy(blocks.begin(), blocks.end(), table_host_.begin() + s * max_blocks_);
  }
  const size_t half = size_t(rotary_dim_ / 2);
  if (rope != nullptr && half > 0) {
    cos_host_.resize(n * half);
    sin_host_.resize(n * half);
    rope_cos_sin_rows(*rope, batch.row_pos, cos_host_.data(), sin_host_.data());
  }
  host_rows_ = QueryBatchView{};
  host_rows_.n_rows = n_rows_;
  host_rows_.row_seq = row_seq_host_.data();
  host_rows_.row_pos = row_pos_host_.data();
  host_rows_.seq_lens = seq_lens_host_.data();

  // ---- and on the device ----
  Backend& b = *backend_;
  b.copy_from_host(ids_.data(), batch.token_ids.data(), n * 4);
  b.copy_from_host(row_seq_.data(), row_seq_host_.data(), n * 4);
  b.copy_from_host(row_pos_.data(), row_pos_host_.data(), n * 4);
  b.copy_from_host(slots_.data(), slots_host_.data(), n * 8);
  if (rope != nullptr && half > 0) {
    b.copy_from_host(cos_.data(), cos_host_.data(), cos_host_.size() * 4);
    b.copy_from_host(sin_.data(), sin_host_.data(), sin_host_.size() * 4);
  }
  if (n_logits_ > 0) {
    b.copy_from_host(logit_rows_.data(), batch.logit_rows.data(), size_t(n_logits_) * 4);
  }
  b.copy_from_host(seq_lens_.data(), seq_lens_host_.data(), size_t(n_seqs_) * 4);
  b.copy_from_host(table_.data(), table_host_.data(), table_host_.size() * 4);
  return ok_status();
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
  return BlockTableView{table_.as<int32_t>(), n_seqs_, max_blocks_};
}

}  // namespace e4kv
