// PLE (per-layer embeddings) of the Qwen4Exp family, host side: the hashed n-gram row ids of each
// token and the n-gram table read in place from the checkpoint. Spec: docs/qwen4exp_reference.md
// sections 2.5 and 7.1-7.3 (traps 17, 20-22); source: transformers 5.17
// models/qwen4_exp/modeling_qwen4_exp.py M:1034-1160. The PLE block's arithmetic is
// backend/cpu/ple.h.
//
// Per PLE layer l (its position in ple_layer_ids), with G = (ngram_size - 1) * heads_per_ngram
// heads, head h = (n - 2) * heads_per_ngram + j serving n-grams of order n = 2..ngram_size:
//   modulus_h = the (l * G + h + 1)-th prime >= ngram_vocab_size_base; offset_h = sum of the
//     moduli before h; the table has n_rows = sum of moduli rounded up to
//     make_ngram_vocab_size_divisible_by rows of ple_embed_dim / G values
//   multiplier_i = 2 * (splitmix64(seed + 10007 l + 0x9E3779B97F4A7C15 (i + 1)) mod half) + 1,
//     half = max(1, ((2^63 - 1) / vocab_size) / 2), so token * multiplier < 2^63
//   context_s of a token = the token s back in its EOS-delimited segment, else eos (s = 0: itself)
//   mix_n = XOR_{s < n} context_s * multiplier_s;  id_h = (mix_n mod modulus_h) + offset_h
//   embedding = concat_h table[id_h]                              [G * dim] = [ple_embed_dim]
// Arithmetic is torch's int64: products wrap modulo 2^64 and `mod` is floor-mod (torch.remainder),
// which only matters for multipliers a checkpoint overrides with values outside the recomputed
// range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "io/checkpoint.h"
#include "io/model_config.h"

namespace e4kv {

// Geometry and hash constants of one PLE layer's table (reference section 7.1-7.2).
struct PleHashParams {
  int64_t ngram_size = 3;  // largest n-gram order N; orders 2..N
  int64_t heads_per_ngram = 8;
  std::vector<int64_t> multipliers;  // [N], odd
  std::vector<int64_t> moduli;       // [G = (N - 1) * heads_per_ngram] primes
  std::vector<int64_t> offsets;      // [G] offset_h = sum of moduli before h
  int64_t n_rows = 0;  // table rows: sum of moduli rounded up to make_ngram_vocab_size_divisible_by
  int64_t n_heads() const { return (ngram_size - 1) * heads_per_ngram; }
};

// Recomputed from the config as transformers does (M:1041-1113): head h of the PLE layer with
// index ple_index (its position in ple_layers) uses the (ple_index * G + h + 1)-th prime >=
// ngram_vocab_size_base; the multipliers come from splitmix64 of seed + 10007 * ple_index and are
// bounded by vocab_size. Primality is a deterministic Miller-Rabin for int64, so this costs well
// under a millisecond for the real geometry (G = 16, base 2e7). The config must be valid (the
// parser checks it: ngram_size >= 2 when PLE is on, positive sizes); a geometry whose rows
// overflow int64 is an assertion failure.
PleHashParams ple_hash_params(const Qwen4ExpConfig& config, int64_t vocab_size, int64_t ple_index);

// The n-gram table ids of a run of tokens of one sequence.
// history: [ngram_size - 1] the sequence's previous raw tokens, oldest first, ple_history_init at
//   sequence start (eos: HF pads the history with EOS, never BOS or 0, trap 17); updated in place
//   to the last ngram_size - 1 raw tokens of [history | tokens] (a run shorter than the history
//   keeps its older entries).
// ids: [n_tokens, G] int64 rows of the table, heads in order h = 0..G-1.
// Tokens must be in [0, vocab_size) and eos is text_config.eos_token_id (the first of a list,
// trap 22); pads of a padded batch are hashed as eos by the caller. A run split anywhere gives the
// ids of the whole run.
void ple_ngram_ids(const PleHashParams& params, int64_t eos, std::span<const int32_t> tokens,
                   std::span<int32_t> history, int64_t* ids);
std::vector<int32_t> ple_history_init(int64_t ngram_size, int64_t eos);

// How the n-gram tables are held in host memory (--ple-dtype):
//   auto      read in place from the memory-mapped checkpoint, in its dtype (F32, F16 or BF16);
//   fp8_e4m3  converted at load into an owned copy of E4M3 codes with an FP32 scale per row, half
//             the host memory of an F16/BF16 table (plus 4 bytes per row): rows * (dim + 4) bytes.
// The per-row scale follows the table's own granularity: a row is what one hash head of one
// token reads, and rows of different heads and n-gram orders are trained independently, so their
// magnitudes differ; a shared scale would push the small rows into E4M3's subnormals.
enum class PleDtype { kAuto, kE4m3 };
// "auto" or "fp8_e4m3"; other names are an option_error of "ple_dtype".
Result<PleDtype> parse_ple_dtype(std::string_view name);
std::string_view ple_dtype_name(PleDtype dtype);  // "auto" | "fp8_e4m3"

// One row of an E4M3 table: scale = amax / 448 (fp32 division; 1 for a row of zeros) and
// codes[c] = e4m3_encode(row[c], scale) = e4m3_satfinite_rne(fp32(row[c] / scale)), the KV cache's
// codec (include/e4kv/e4m3.h); the decoded value is the fp32 product e4m3_decode(codes[c]) * scale.
// The row must be finite (the caller checks). Returns the scale.
float ple_encode_row_e4m3(std::span<const float> row, uint8_t* codes);

// The error of an E4M3 table against the checkpoint's values, over every value of every row:
// relative L2 = sqrt(sum (decoded - value)^2 / sum value^2).
struct PleTableError {
  double sum_sq_error = 0.0;
  double sum_sq_value = 0.0;
  int64_t n_rows = 0;
  int64_t n_values = 0;

  PleTableError& operator+=(const PleTableError& other) {
    sum_sq_error += other.sum_sq_error;
    sum_sq_value += other.sum_sq_value;
    n_rows += other.n_rows;
    n_values += other.n_values;
    return *this;
  }
  double rel_l2() const;  // 0 for a table of zeros
};

// A table converted to E4M3 (owned, host memory).
struct PleE4m3Rows {
  std::unique_ptr<uint8_t[]> codes;  // [n_rows, dim] E4M3
  std::unique_ptr<float[]> scales;   // [n_rows] fp32
  PleTableError error;
};

// The E4M3 tables converted so far, by tensor prefix, so that models loaded from one checkpoint
// in one process (the provisional and the real model of --gpu-memory-utilization, the modes of
// `e4kv compare`) convert and hold each table once. Only for tables of the same checkpoint.
class PleE4m3Cache {
 public:
  std::shared_ptr<const PleE4m3Rows> find(const std::string& prefix) const {
    const auto it = tables_.find(prefix);
    return it == tables_.end() ? nullptr : it->second;
  }
  void add(const std::string& prefix, std::shared_ptr<const PleE4m3Rows> rows) {
    tables_[prefix] = std::move(rows);
  }

 private:
  std::map<std::string, std::shared_ptr<const PleE4m3Rows>> tables_;
};

// The n-gram table of one PLE layer, read in place from the memory-mapped checkpoint (never copied
// whole: the released one is about 320M rows per layer), or converted once to E4M3 (to_e4m3). On disk it is either one tensor
// `<prefix>ngram_embedding.weight` [n_rows, dim] or row shards
// `<prefix>ngram_embedding.shard_{k}.weight` [rows_k, dim], k = 0, 1, ... concatenated in numeric
// order (shard_2 before shard_11, trap 20; torch.chunk may have made fewer than
// split_ngram_parts). dtype F32, F16 or BF16. The Checkpoint must outlive the table.
class PleTable {
 public:
  PleTable() = default;  // an empty table (0 rows)

  // prefix: e.g. "model.layers.0.ple.ple_embedding.". Errors (each naming the checkpoint and the
  // tensor): no table in either form, both forms, a shard name whose index is not a plain decimal
  // number, a missing shard (a gap in k), a dtype other than F32 / F16 / BF16, a tensor that is
  // not 2-D, shards that differ in dtype or width, width != expected_dim (ple_embed_dim / G),
  // total rows != expected_rows (PleHashParams::n_rows).
  static Result<PleTable> open(const Checkpoint& ckpt, const std::string& prefix,
                               int64_t expected_rows, int64_t expected_dim);

  int64_t n_rows() const { return n_rows_; }
  int64_t dim() const { return dim_; }
  DType dtype() const { return dtype_; }  // the checkpoint's
  bool is_e4m3() const { return e4m3_ != nullptr; }

  // Converts the table to E4M3 (ple_encode_row_e4m3 per row, on every hardware thread); later
  // gathers read the copy, never the mapping again. With a cache: a table it holds under `prefix`
  // is reused, a new one is added. Errors (naming the checkpoint, the tensor and the row): a
  // non-finite value. On error the table is unchanged.
  Status to_e4m3(const Checkpoint& ckpt, const std::string& prefix, PleE4m3Cache* cache);
  // The E4M3 copy's error against the checkpoint's values; zeros before to_e4m3.
  PleTableError e4m3_error() const { return e4m3_ ? e4m3_->error : PleTableError{}; }
  // The E4M3 copy, [n_rows, dim] codes and [n_rows] scales; empty before to_e4m3.
  std::span<const uint8_t> e4m3_codes() const;
  std::span<const float> e4m3_scales() const;
  // Host memory the table holds itself: the E4M3 copy's codes and scales, or 0 (read in place).
  int64_t owned_bytes() const;
  // The table's bytes in the checkpoint.
  int64_t checkpoint_bytes() const { return n_rows_ * dim_ * int64_t(dtype_size(dtype_)); }

  // out[i, :] = row ids[i] converted to fp32 (exact for every dtype; for an E4M3 copy,
  // e4m3_decode(code) * scale). ids: [n], each in [0, n_rows) (the caller checked; asserted
  // here); out: [n, dim].
  void gather(const int64_t* ids, int64_t n, float* out) const;

  // The tensor names the table is made of (shards in numeric order), for the weight loader's
  // check that every tensor was used.
  const std::vector<std::string>& used_names() const { return used_names_; }

 private:
  struct Shard {
    int64_t row_begin = 0;  // first row of the whole table held by this shard
    int64_t n_rows = 0;
    const std::byte* data = nullptr;  // [n_rows, dim] of dtype_, in the checkpoint's mapping
  };

  int64_t n_rows_ = 0;
  int64_t dim_ = 0;
  DType dtype_ = DType::kF32;
  std::vector<Shard> shards_;          // in row order
  std::vector<int64_t> shard_begins_;  // shards_[i].row_begin, for the binary search of a row
  std::vector<std::string> used_names_;
  std::shared_ptr<const PleE4m3Rows> e4m3_;  // null: read from the mapping
  // Row `id` of the checkpoint's table (its shard's bytes, dtype_).
  const std::byte* mapped_row(int64_t id) const;
};

// The int64 buffers a checkpoint may carry for one PLE layer (persistent nn.Buffers, M:1106-1110):
// `<prefix>layer_multipliers` [N], `<prefix>ngram_heads_vocab_sizes` [G] and
// `<prefix>ngram_heads_offsets` [G], dtype I64. Each one present replaces the recomputed value in
// `params`, as in transformers (trap 21); absent ones leave it unchanged. The resulting moduli
// and offsets are checked: moduli > 0, offset_0 = 0 and offset_h = offset_{h-1} +
// modulus_{h-1}, sum of moduli <= params.n_rows (the table's rows, so every id is a row). Errors
// name the checkpoint, the tensor and what is wrong; on error `params` is unchanged. Returns the
// names it read (empty when none is present).
Result<std::vector<std::string>> ple_read_hash_buffers(const Checkpoint& ckpt,
                                                       const std::string& prefix,
                                                       PleHashParams& params);

}  // namespace e4kv
