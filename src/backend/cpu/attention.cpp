#include "backend/cpu/attention.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "core/half.h"
#include "e4kv/e4m3.h"

namespace e4kv {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keys are gathered and widened in tiles: the dot products of a tile run side by side (each one
// still accumulates in index order, so the numbers are those of one key at a time).
constexpr int64_t kKeyTile = 16;

// The hot loops below are written in fixed-width blocks over non-aliasing pointers so that an -O2
// build (GCC's very-cheap vectoriser, basic-block SLP) vectorises them. Elementwise updates do not
// depend on the order of the elements, and each dot product still accumulates in index order, so
// the numbers are those of the plain loops.
constexpr int64_t kLanes = 8;

// logits[j] = sum over d in index order of q[d] * k_tile[d][j], j = 0..kKeyTile-1.
// q: [head_dim]; k_tile: [head_dim, kKeyTile]; logits: [kKeyTile]
void tile_dots(const float* __restrict__ q, const float* __restrict__ k_tile, int64_t head_dim,
               float* __restrict__ logits) {
  float sums[kKeyTile] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const float qd = q[d];
    const float* k = k_tile + d * kKeyTile;
    for (int64_t j = 0; j < kKeyTile; ++j) {
      const float product = qd * k[j];
      sums[j] += product;
    }
  }
  for (int64_t j = 0; j < kKeyTile; ++j) logits[j] = sums[j];
}

// acc[d] = acc[d] * correction + v[d]
void rescale_add(float* __restrict__ acc, const float* __restrict__ v, float correction,
                 int64_t n) {
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t i = 0; i < kLanes; ++i) {
      const float scaled = acc[d + i] * correction;
      acc[d + i] = scaled + v[d + i];
    }
  }
  for (; d < n; ++d) {
    const float scaled = acc[d] * correction;
    acc[d] = scaled + v[d];
  }
}

// acc[d] += weight * v[d]
void add_weighted(float* __restrict__ acc, const float* __restrict__ v, float weight, int64_t n) {
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t i = 0; i < kLanes; ++i) {
      const float product = weight * v[d + i];
      acc[d + i] += product;
    }
  }
  for (; d < n; ++d) {
    const float product = weight * v[d];
    acc[d] += product;
  }
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int code = 0; code < 256; ++code) t[size_t(code)] = e4m3_decode(uint8_t(code));
    return t;
  }();
  return table;
}

// Reads the stored values (decode(code) or the FP16 value, no scale) of one token row of one KV
// head.
class KvReader {
 public:
  explicit KvReader(const KvCacheView& cache) : cache_(cache), e4m3_(e4m3_table()) {}

  // out[d * stride] = value of (block, kv, slot, kv_head, d), d = 0..head_dim-1.
  void read(int64_t block, int kv, int64_t slot, int64_t kv_head, float* out,
            int64_t stride) const {
    const KvCacheGeometry& g = cache_.geometry;
    const int64_t offset = g.elem_offset(block, kv, slot, kv_head);
    if (g.dtype == KvCacheDtype::kE4m3) {
      const uint8_t* src = static_cast<const uint8_t*>(cache_.data) + offset;
      for (int64_t d = 0; d < g.head_dim; ++d) out[d * stride] = e4m3_[src[d]];
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(cache_.data) + offset;
      for (int64_t d = 0; d < g.head_dim; ++d) out[d * stride] = f16_to_f32(src[d]);
    }
  }

 private:
  const KvCacheView& cache_;
  const std::array<float, 256>& e4m3_;
};

// Key list of one query row.
struct RowKeys {
  int64_t seq = 0;
  int64_t pos = 0;
  int64_t n_keys = 0;
  const int32_t* sel = nullptr;  // [n_keys] selected tokens, or nullptr: tokens 0..pos

  int64_t token(int64_t i) const { return sel != nullptr ? sel[i] : i; }
};

RowKeys row_keys(const QueryBatchView& rows, int64_t row) {
  RowKeys keys;
  keys.seq = rows.row_seq[row];
  keys.pos = rows.row_pos[row];
  keys.n_keys = attention_row_keys(rows, row);
  if (rows.qsa()) keys.sel = rows.sel_tokens + row * rows.sel_width;
  return keys;
}

float softmax_scale(const PagedAttentionParams& p) {
  return p.cache.k_scale / std::sqrt(float(p.cache.geometry.head_dim));
}

// Scratch of one (row, KV head) pass.
struct Workspace {
  std::vector<float> q;       // [group, head_dim]
  std::vector<float> k_tile;  // [head_dim, kKeyTile] (transposed: a tile's dot products vectorise)
  std::vector<float> v_tile;  // [kKeyTile, head_dim]
  std::vector<float> logits;  // [kKeyTile]

  Workspace(int64_t group, int64_t head_dim)
      : q(size_t(group * head_dim)),
        k_tile(size_t(head_dim * kKeyTile)),
        v_tile(size_t(kKeyTile * head_dim)),
        logits(size_t(kKeyTile)) {}
};

// Widens the query rows of the `group` heads sharing kv_head into ws.q.
void load_q(const PagedAttentionParams& p, int64_t row, int64_t kv_head, int64_t group,
            Workspace& ws) {
  const int64_t head_dim = p.cache.geometry.head_dim;
  const uint16_t* src = p.q + (row * p.n_heads + kv_head * group) * head_dim;
  for (int64_t i = 0; i < group * head_dim; ++i) ws.q[size_t(i)] = f16_to_f32(src[i]);
}

// FP32 online softmax over key-list entries [key_begin, key_end) of one row for the `group` query
// heads of kv_head. m, l: [group]; acc: [group, head_dim]; the caller initialises them (-inf, 0,
// 0).
void attend_range(const PagedAttentionParams& p, const KvReader& reader, const RowKeys& keys,
                  int64_t kv_head, int64_t group, int64_t key_begin, int64_t key_end, Workspace& ws,
                  float* m, float* l, float* acc) {
  const KvCacheGeometry& g = p.cache.geometry;
  const int64_t head_dim = g.head_dim;
  const float scale = softmax_scale(p);
  for (int64_t tile_begin = key_begin; tile_begin < key_end; tile_begin += kKeyTile) {
    const int64_t n = std::min(kKeyTile, key_end - tile_begin);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t token = keys.token(tile_begin + j);
      const int64_t block = p.block_table.block(keys.seq, token / g.block_size);
      const int64_t slot = token % g.block_size;
      reader.read(block, 0, slot, kv_head, ws.k_tile.data() + j, kKeyTile);
      reader.read(block, 1, slot, kv_head, ws.v_tile.data() + j * head_dim, 1);
    }
    for (int64_t h = 0; h < group; ++h) {
      const float* q = ws.q.data() + h * head_dim;
      float* logits = ws.logits.data();
      tile_dots(q, ws.k_tile.data(), head_dim, logits);
      float* acc_h = acc + h * head_dim;
      for (int64_t j = 0; j < n; ++j) {
        const float logit = logits[j] * scale;
        const float* v = ws.v_tile.data() + j * head_dim;
        if (logit > m[h]) {
          // The max grows: rescale what was summed so far (exp(-inf) = 0 for the first key).
          const float correction = std::exp(m[h] - logit);
          m[h] = logit;
          l[h] = l[h] * correction + 1.0f;
          rescale_add(acc_h, v, correction, head_dim);
        } else {
          const float weight = std::exp(logit - m[h]);
          l[h] += weight;
          add_weighted(acc_h, v, weight, head_dim);
        }
      }
    }
  }
}

// out[d] = acc[d] * v_scale / l, then * sigmoid(gate[d]); zero when no key was attended (l == 0).
void write_output(const PagedAttentionParams& p, int64_t row, int64_t head, const float* acc,
                  float l) {
  const int64_t head_dim = p.cache.geometry.head_dim;
  const int64_t offset = (row * p.n_heads + head) * head_dim;
  float* out = p.out + offset;
  if (!(l > 0.0f)) {
    std::fill(out, out + head_dim, 0.0f);
    return;
  }
  for (int64_t d = 0; d < head_dim; ++d) out[d] = acc[d] * p.cache.v_scale / l;
  if (p.gate != nullptr) {
    const uint16_t* gate = p.gate + offset;
    for (int64_t d = 0; d < head_dim; ++d) {
      const float sigmoid = 1.0f / (1.0f + std::exp(-f16_to_f32(gate[d])));
      out[d] *= sigmoid;
    }
  }
}

Status check_rows(const PagedAttentionParams& p) {
  const KvCacheGeometry& g = p.cache.geometry;
  const QueryBatchView& rows = p.rows;
  for (int64_t r = 0; r < rows.n_rows; ++r) {
    const int64_t seq = rows.row_seq[r];
    const int64_t pos = rows.row_pos[r];
    if (seq < 0 || seq >= p.block_table.n_seqs) {
      return Status::error(cat("attention: row ", r, ": sequence ", seq,
                               " outside the block table (", p.block_table.n_seqs, " rows)"));
    }
    const int64_t seq_len = rows.seq_lens[seq];
    if (pos < 0 || pos >= seq_len) {
      return Status::error(cat("attention: row ", r, ": position ", pos,
                               " outside the sequence's cached tokens [0, ", seq_len, ")"));
    }
    const int64_t last_block = pos / g.block_size;
    if (last_block >= p.block_table.max_blocks_per_seq) {
      return Status::error(cat("attention: row ", r, ": position ", pos, " needs ", last_block + 1,
                               " blocks, the block table holds ",
                               p.block_table.max_blocks_per_seq));
    }
    for (int64_t b = 0; b <= last_block; ++b) {
      const int64_t block = p.block_table.block(seq, b);
      if (block < 0 || block >= g.n_blocks) {
        return Status::error(cat("attention: row ", r, ": block table entry (", seq, ", ", b,
                                 ") = ", block, " outside [0, ", g.n_blocks, ")"));
      }
    }
    if (!rows.qsa()) continue;
    const int64_t count = rows.sel_counts[r];
    if (count < 0 || count > rows.sel_width) {
      return Status::error(cat("attention: row ", r, ": selection count ", count, " outside [0, ",
                               rows.sel_width, "]"));
    }
    const int32_t* sel = rows.sel_tokens + r * rows.sel_width;
    for (int64_t i = 0; i < count; ++i) {
      if (sel[i] < 0 || sel[i] > pos) {
        return Status::error(cat("attention: row ", r, ": selected token ", sel[i], " at entry ", i,
                                 " is not in the causal range [0, ", pos, "]"));
      }
    }
  }
  return ok_status();
}

}  // namespace

int64_t attention_row_keys(const QueryBatchView& rows, int64_t row) {
  return rows.qsa() ? int64_t(rows.sel_counts[row]) : int64_t(rows.row_pos[row]) + 1;
}

int64_t attention_splits_needed(const QueryBatchView& rows, int64_t keys_per_split) {
  E4KV_ASSERT(keys_per_split > 0, "keys_per_split must be positive");
  int64_t splits = 1;
  for (int64_t r = 0; r < rows.n_rows; ++r) {
    const int64_t n_keys = attention_row_keys(rows, r);
    splits = std::max(splits, (n_keys + keys_per_split - 1) / keys_per_split);
  }
  return splits;
}

Status validate_paged_attention(const PagedAttentionParams& p, bool need_out) {
  const KvCacheGeometry& g = p.cache.geometry;
  if (g.n_blocks < 1 || g.block_size < 1 || g.n_kv_heads < 1 || g.head_dim < 1) {
    return Status::error(cat("attention: bad cache geometry (n_blocks ", g.n_blocks,
                             ", block_size ", g.block_size, ", n_kv_heads ", g.n_kv_heads,
                             ", head_dim ", g.head_dim, "): all must be >= 1"));
  }
  if (p.n_heads < 1 || p.n_heads % g.n_kv_heads != 0) {
    return Status::error(cat("attention: n_heads ", p.n_heads,
                             " must be a positive multiple of n_kv_heads ", g.n_kv_heads));
  }
  for (const float scale : {p.cache.k_scale, p.cache.v_scale}) {
    if (!std::isfinite(scale) || !(scale > 0.0f)) {
      return Status::error(cat("attention: K/V scales (", p.cache.k_scale, ", ", p.cache.v_scale,
                               ") must be finite and > 0"));
    }
  }
  if (p.rows.n_rows < 0) return Status::error(cat("attention: n_rows ", p.rows.n_rows, " < 0"));
  if (p.rows.n_rows == 0) return ok_status();
  if (p.cache.data == nullptr || p.block_table.blocks == nullptr || p.q == nullptr ||
      p.rows.row_seq == nullptr || p.rows.row_pos == nullptr || p.rows.seq_lens == nullptr ||
      (need_out && p.out == nullptr)) {
    return Status::error(
        "attention: a required pointer (cache data, block table, q, row_seq, "
        "row_pos, seq_lens or out) is null");
  }
  if (p.rows.qsa() && (p.rows.sel_counts == nullptr || p.rows.sel_width < 1)) {
    return Status::error(
        cat("attention: QSA selection rows need sel_counts and sel_width >= 1 "
            "(sel_width ",
            p.rows.sel_width, ")"));
  }
  return check_rows(p);
}

Status paged_attention(const PagedAttentionParams& p) {
  E4KV_RETURN_IF_ERROR(validate_paged_attention(p, /*need_out=*/true));
  const int64_t head_dim = p.cache.geometry.head_dim;
  const int64_t group = p.n_heads / p.cache.geometry.n_kv_heads;
  const KvReader reader(p.cache);
  Workspace ws(group, head_dim);
  std::vector<float> m(static_cast<size_t>(group));
  std::vector<float> l(static_cast<size_t>(group));
  std::vector<float> acc(static_cast<size_t>(group * head_dim));
  for (int64_t r = 0; r < p.rows.n_rows; ++r) {
    const RowKeys keys = row_keys(p.rows, r);
    for (int64_t kv_head = 0; kv_head < p.cache.geometry.n_kv_heads; ++kv_head) {
      load_q(p, r, kv_head, group, ws);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      attend_range(p, reader, keys, kv_head, group, 0, keys.n_keys, ws, m.data(), l.data(),
                   acc.data());
      for (int64_t h = 0; h < group; ++h) {
        write_output(p, r, kv_head * group + h, acc.data() + h * head_dim, l[size_t(h)]);
      }
    }
  }
  return ok_status();
}

namespace {

Status validate_partial_buffers(const PagedAttentionParams& p,
                                const AttentionPartialsView& partials) {
  if (partials.keys_per_split < 1 || partials.max_splits < 1) {
    return Status::error(
        cat("attention: split-K needs keys_per_split >= 1 and max_splits >= 1 (got ",
            partials.keys_per_split, ", ", partials.max_splits, ")"));
  }
  if (p.rows.n_rows > 0 &&
      (partials.m == nullptr || partials.l == nullptr || partials.acc == nullptr)) {
    return Status::error("attention: split-K partial buffers m, l, acc must not be null");
  }
  return ok_status();
}

}  // namespace

Status paged_attention_partial(const PagedAttentionParams& p,
                               const AttentionPartialsView& partials) {
  E4KV_RETURN_IF_ERROR(validate_paged_attention(p, /*need_out=*/false));
  E4KV_RETURN_IF_ERROR(validate_partial_buffers(p, partials));
  const int64_t needed = attention_splits_needed(p.rows, partials.keys_per_split);
  if (needed > partials.max_splits) {
    return Status::error(cat("attention: a row needs ", needed, " splits of ",
                             partials.keys_per_split, " keys, the partial buffers hold ",
                             partials.max_splits));
  }
  const int64_t head_dim = p.cache.geometry.head_dim;
  const int64_t group = p.n_heads / p.cache.geometry.n_kv_heads;
  const KvReader reader(p.cache);
  Workspace ws(group, head_dim);
  for (int64_t r = 0; r < p.rows.n_rows; ++r) {
    const RowKeys keys = row_keys(p.rows, r);
    for (int64_t s = 0; s < partials.max_splits; ++s) {
      const int64_t key_begin = std::min(keys.n_keys, s * partials.keys_per_split);
      const int64_t key_end = std::min(keys.n_keys, key_begin + partials.keys_per_split);
      const int64_t stat_base = (r * partials.max_splits + s) * p.n_heads;
      float* m = partials.m + stat_base;
      float* l = partials.l + stat_base;
      float* acc = partials.acc + stat_base * head_dim;
      std::fill(m, m + p.n_heads, kNegInf);
      std::fill(l, l + p.n_heads, 0.0f);
      std::fill(acc, acc + p.n_heads * head_dim, 0.0f);
      if (key_begin == key_end) continue;  // an empty split
      for (int64_t kv_head = 0; kv_head < p.cache.geometry.n_kv_heads; ++kv_head) {
        load_q(p, r, kv_head, group, ws);
        const int64_t h0 = kv_head * group;
        attend_range(p, reader, keys, kv_head, group, key_begin, key_end, ws, m + h0, l + h0,
                     acc + h0 * head_dim);
      }
    }
  }
  return ok_status();
}

Status paged_attention_merge(const PagedAttentionParams& p, const AttentionPartialsView& partials) {
  // The merge reads neither the cache data, the block table nor the key lists.
  const KvCacheGeometry& g = p.cache.geometry;
  if (g.head_dim < 1 || g.n_kv_heads < 1 || p.n_heads < 1 || p.n_heads % g.n_kv_heads != 0) {
    return Status::error(cat("attention merge: bad shape (head_dim ", g.head_dim, ", n_heads ",
                             p.n_heads, ", n_kv_heads ", g.n_kv_heads, ")"));
  }
  if (!std::isfinite(p.cache.v_scale) || !(p.cache.v_scale > 0.0f)) {
    return Status::error(
        cat("attention merge: v_scale ", p.cache.v_scale, " must be finite and > 0"));
  }
  if (p.rows.n_rows < 0)
    return Status::error(cat("attention merge: n_rows ", p.rows.n_rows, " < 0"));
  if (p.rows.n_rows > 0 && p.out == nullptr) return Status::error("attention merge: out is null");
  E4KV_RETURN_IF_ERROR(validate_partial_buffers(p, partials));
  const int64_t head_dim = p.cache.geometry.head_dim;
  std::vector<float> acc(static_cast<size_t>(head_dim));
  for (int64_t r = 0; r < p.rows.n_rows; ++r) {
    for (int64_t h = 0; h < p.n_heads; ++h) {
      float max_m = kNegInf;
      for (int64_t s = 0; s < partials.max_splits; ++s) {
        const int64_t i = (r * partials.max_splits + s) * p.n_heads + h;
        if (partials.l[i] > 0.0f) max_m = std::max(max_m, partials.m[i]);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float l = 0.0f;
      for (int64_t s = 0; s < partials.max_splits; ++s) {
        const int64_t i = (r * partials.max_splits + s) * p.n_heads + h;
        if (!(partials.l[i] > 0.0f)) continue;  // empty split
        const float weight = std::exp(partials.m[i] - max_m);
        l += partials.l[i] * weight;
        const float* split_acc = partials.acc + i * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          const float product = split_acc[d] * weight;
          acc[size_t(d)] += product;
        }
      }
      write_output(p, r, h, acc.data(), l);
    }
  }
  return ok_status();
}

Status dense_attention_probs(const PagedAttentionParams& params, int64_t row, float* probs) {
  PagedAttentionParams p = params;
  p.rows.sel_tokens = nullptr;
  p.rows.sel_counts = nullptr;
  p.rows.sel_width = 0;
  E4KV_RETURN_IF_ERROR(validate_paged_attention(p, /*need_out=*/false));
  if (row < 0 || row >= p.rows.n_rows) {
    return Status::error(
        cat("attention probabilities: row ", row, " outside [0, ", p.rows.n_rows, ")"));
  }
  if (probs == nullptr) return Status::error("attention probabilities: probs is null");
  const KvCacheGeometry& g = p.cache.geometry;
  const int64_t head_dim = g.head_dim;
  const int64_t group = p.n_heads / g.n_kv_heads;
  const RowKeys keys = row_keys(p.rows, row);
  const KvReader reader(p.cache);
  const float scale = softmax_scale(p);
  Workspace ws(group, head_dim);
  std::vector<float> k(static_cast<size_t>(head_dim));
  for (int64_t kv_head = 0; kv_head < g.n_kv_heads; ++kv_head) {
    load_q(p, row, kv_head, group, ws);
    for (int64_t t = 0; t < keys.n_keys; ++t) {
      reader.read(p.block_table.block(keys.seq, t / g.block_size), 0, t % g.block_size, kv_head,
                  k.data(), 1);
      for (int64_t h = 0; h < group; ++h) {
        const float* q = ws.q.data() + h * head_dim;
        float dot = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) {
          const float product = q[d] * k[size_t(d)];
          dot += product;
        }
        probs[(kv_head * group + h) * keys.n_keys + t] = dot * scale;
      }
    }
  }
  for (int64_t h = 0; h < p.n_heads; ++h) {
    float* ph = probs + h * keys.n_keys;
    const float max_logit = *std::max_element(ph, ph + keys.n_keys);
    float sum = 0.0f;
    for (int64_t t = 0; t < keys.n_keys; ++t) {
      ph[t] = std::exp(ph[t] - max_logit);
      sum += ph[t];
    }
    for (int64_t t = 0; t < keys.n_keys; ++t) ph[t] /= sum;
  }
  return ok_status();
}

}  // namespace e4kv
