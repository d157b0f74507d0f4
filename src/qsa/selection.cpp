#include "qsa/selection.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "core/half.h"

namespace e4kv {

namespace {

Status validate_select(const QsaSelectionConfig& config, const IndexerCompressedView& compressed,
                       const BlockTableView& block_table, const QueryBatchView& rows,
                       const uint16_t* index_q, const int32_t* sel_tokens,
                       const int32_t* sel_counts) {
  if (compressed.ratio < 1 || compressed.block_size < 1 || compressed.index_dim < 1 ||
      compressed.n_blocks < 1 || compressed.block_size % compressed.ratio != 0) {
    return Status::error(cat("qsa_select: bad indexer geometry (n_blocks ", compressed.n_blocks,
                             ", block_size ", compressed.block_size, ", ratio ", compressed.ratio,
                             ", index_dim ", compressed.index_dim,
                             "): all must be >= 1 and block_size a multiple of ratio"));
  }
  if (config.budget < compressed.ratio) {
    return Status::error(cat("qsa_select: budget ", config.budget, " is below the group size ",
                             compressed.ratio, ": it would select no group"));
  }
  if (config.n_index_heads < 1) {
    return Status::error(cat("qsa_select: n_index_heads ", config.n_index_heads, " must be >= 1"));
  }
  if (rows.n_rows < 0) return Status::error(cat("qsa_select: n_rows ", rows.n_rows, " < 0"));
  if (rows.n_rows == 0) return ok_status();
  if (compressed.data == nullptr || index_q == nullptr || sel_tokens == nullptr ||
      sel_counts == nullptr || rows.row_seq == nullptr || rows.row_pos == nullptr ||
      rows.seq_lens == nullptr || block_table.blocks == nullptr) {
    return Status::error(
        "qsa_select: a required pointer (indexer data, index_q, row_seq, "
        "row_pos, seq_lens, block table or an output) is null");
  }
  for (int64_t r = 0; r < rows.n_rows; ++r) {
    const int64_t seq = rows.row_seq[r];
    const int64_t pos = rows.row_pos[r];
    if (seq < 0 || seq >= block_table.n_seqs) {
      return Status::error(cat("qsa_select: row ", r, ": sequence ", seq,
                               " outside the block table (", block_table.n_seqs, " rows)"));
    }
    const int64_t seq_len = rows.seq_lens[seq];
    if (pos < 0 || pos >= seq_len) {
      return Status::error(cat("qsa_select: row ", r, ": position ", pos,
                               " outside the sequence's cached tokens [0, ", seq_len, ")"));
    }
    const int64_t visible = qsa_visible_groups(pos, seq_len, compressed.ratio);
    if (visible <= qsa_top_k(config.budget, compressed.ratio)) continue;  // no score is read
    const int64_t last_block = (visible * compressed.ratio - 1) / compressed.block_size;
    if (last_block >= block_table.max_blocks_per_seq) {
      return Status::error(cat("qsa_select: row ", r, ": ", visible, " groups need ",
                               last_block + 1, " blocks, the block table holds ",
                               block_table.max_blocks_per_seq));
    }
    for (int64_t b = 0; b <= last_block; ++b) {
      const int64_t block = block_table.block(seq, b);
      if (block < 0 || block >= compressed.n_blocks) {
        return Status::error(cat("qsa_select: row ", r, ": block table entry (", seq, ", ", b,
                                 ") = ", block, " outside [0, ", compressed.n_blocks, ")"));
      }
    }
  }
  return ok_status();
}

}  // namespace

void qsa_index_scores(const uint16_t* index_q, int64_t n_index_heads,
                      const IndexerCompressedView& compressed, const BlockTableView& block_table,
                      int64_t seq, int64_t n_groups, float* scores) {
  const int64_t index_dim = compressed.index_dim;
  // Widen the query once: [n_index_heads, index_dim].
  std::vector<float> q(static_cast<size_t>(n_index_heads * index_dim));
  for (size_t i = 0; i < q.size(); ++i) q[i] = f16_to_f32(index_q[i]);
  std::vector<float> khat(static_cast<size_t>(index_dim));
  const float sqrt_index_dim = std::sqrt(float(index_dim));
  for (int64_t c = 0; c < n_groups; ++c) {
    const uint16_t* row = compressed.row(block_table, seq, c);
    for (int64_t d = 0; d < index_dim; ++d) khat[size_t(d)] = f16_to_f32(row[d]);
    float sum = 0.0f;
    for (int64_t h = 0; h < n_index_heads; ++h) {
      const float* qh = q.data() + h * index_dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < index_dim; ++d) {
        const float product = qh[d] * khat[size_t(d)];
        dot += product;
      }
      sum += std::fmax(dot, 0.0f);
    }
    scores[c] = sum / sqrt_index_dim;
  }
}

int64_t qsa_top_k_groups(std::span<const float> scores, int64_t k, int32_t* groups,
                         std::vector<float>* scratch) {
  E4KV_ASSERT(k >= 0, "top-k with negative k");
  const int64_t n = int64_t(scores.size());
  if (n <= k) {
    for (int64_t c = 0; c < n; ++c) groups[c] = int32_t(c);
    return n;
  }
  if (k == 0) return 0;
  // The k-th largest score: the threshold T.
  std::vector<float> local;
  std::vector<float>& sorted = scratch != nullptr ? *scratch : local;
  sorted.assign(scores.begin(), scores.end());
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
  const float threshold = sorted[size_t(k - 1)];
  // Fewer than k groups lie strictly above T; the lowest-index groups equal to T fill the rest.
  int64_t above = 0;
  for (const float s : scores) above += s > threshold ? 1 : 0;
  E4KV_ASSERT(above < k, "more than k-1 scores above the k-th score");
  int64_t ties_left = k - above;
  int64_t count = 0;
  for (int64_t c = 0; c < n; ++c) {
    const float s = scores[size_t(c)];
    if (s > threshold || (s == threshold && ties_left > 0)) {
      if (s == threshold) --ties_left;
      groups[count++] = int32_t(c);
    }
  }
  E4KV_ASSERT(count == k, "top-k emitted a wrong number of groups");
  return count;
}

int64_t qsa_expand_tokens(std::span<const int32_t> groups, int64_t pos, int64_t ratio,
                          std::span<int32_t> tokens) {
  const int64_t tail_begin = ratio * ((pos + 1) / ratio);
  const int64_t count = int64_t(groups.size()) * ratio + (pos + 1 - tail_begin);
  E4KV_ASSERT(count <= int64_t(tokens.size()), "selection row too narrow for its tokens");
  int64_t n = 0;
  for (const int32_t c : groups) {
    for (int64_t i = 0; i < ratio; ++i) tokens[size_t(n++)] = int32_t(int64_t(c) * ratio + i);
  }
  for (int64_t t = tail_begin; t <= pos; ++t) tokens[size_t(n++)] = int32_t(t);
  std::fill(tokens.begin() + n, tokens.end(), -1);
  return n;
}

Status qsa_select(const QsaSelectionConfig& config, const IndexerCompressedView& compressed,
                  const BlockTableView& block_table, const QueryBatchView& rows,
                  const uint16_t* index_q, int32_t* sel_tokens, int32_t* sel_counts) {
  E4KV_RETURN_IF_ERROR(
      validate_select(config, compressed, block_table, rows, index_q, sel_tokens, sel_counts));
  const int64_t ratio = compressed.ratio;
  const int64_t k = qsa_top_k(config.budget, ratio);
  const int64_t width = qsa_selection_width(config.budget, ratio);
  const int64_t q_row_elems = config.n_index_heads * compressed.index_dim;
  std::vector<float> scores;
  std::vector<float> scratch;
  std::vector<int32_t> groups(static_cast<size_t>(k));
  for (int64_t r = 0; r < rows.n_rows; ++r) {
    const int64_t seq = rows.row_seq[r];
    const int64_t pos = rows.row_pos[r];
    const int64_t visible = qsa_visible_groups(pos, rows.seq_lens[seq], ratio);
    int64_t n_groups;
    if (visible <= k) {
      // Short context: every visible group, no score needed (exactly dense when seq_len > pos).
      for (int64_t c = 0; c < visible; ++c) groups[size_t(c)] = int32_t(c);
      n_groups = visible;
    } else {
      scores.resize(size_t(visible));
      qsa_index_scores(index_q + r * q_row_elems, config.n_index_heads, compressed, block_table,
                       seq, visible, scores.data());
      n_groups = qsa_top_k_groups(scores, k, groups.data(), &scratch);
    }
    sel_counts[r] = int32_t(
        qsa_expand_tokens(std::span<const int32_t>(groups.data(), size_t(n_groups)), pos, ratio,
                          std::span<int32_t>(sel_tokens + r * width, size_t(width))));
  }
  return ok_status();
}

}  // namespace e4kv
