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
#include <span>
#include <string>
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

// The n-gram table of one PLE layer, read in place from the memory-mapped checkpoint (never copied
// whole: the released one is about 320M rows per layer). On disk it is either one tensor
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
  DType dtype() const { return dtype_; }

  // out[i, :] = row ids[i] converted to fp32 (exact for every dtype). ids: [n], each in
  // [0, n_rows) (the caller checked; asserted here); out: [n, dim].
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
