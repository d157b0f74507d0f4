// PLE n-gram ids and table (model/ple_ngram.h): the test vectors of docs/qwen4exp_reference.md
// sections 7.1-7.2, the context rule and the ids against a naive loop written here from the rule
// and against ids computed by scripts/hf_reference_qwen4exp.py's helpers, runs split anywhere equal
// the whole run, the table read from small safetensors files (numeric shard order, F32 / F16 /
// BF16, every error), the int64 hash buffers, and the transformers 5.17 reference checkpoints of
// tests/data/hf_qwen4exp (their stored buffers equal the recomputed ones).
#include "model/ple_ngram.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/half.h"
#include "io/safetensors.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::TempDir;
using testing_support::write_text;

// ---- hash parameters ----------------------------------------------------------------------------

Qwen4ExpConfig default_config() {
  return Qwen4ExpConfig{};  // seed 1234, N = 3, 8 heads per order, base 2e7, rows % 128
}

TEST(PleHashParams, MultipliersMatchTheReferenceVectors) {
  const Qwen4ExpConfig config = default_config();
  const std::vector<std::vector<int64_t>> want = {
      {23703573157769, 20109073645365, 8052911324071},
      {3352040966061, 19752442147475, 10742103100073},
      {35243655749357, 23198521423797, 25737225394503},
  };
  for (int64_t ell = 0; ell < 3; ++ell) {
    const PleHashParams params = ple_hash_params(config, 248320, ell);
    EXPECT_EQ(params.multipliers, want[size_t(ell)]) << "ple index " << ell;
    for (int64_t m : params.multipliers) {
      EXPECT_EQ(m % 2, 1);
      EXPECT_LT(m, std::numeric_limits<int64_t>::max() / 248320);  // token * m < 2^63
    }
  }
}

TEST(PleHashParams, PrimesOffsetsAndRowsMatchTheReferenceVectors) {
  const Qwen4ExpConfig config = default_config();
  const std::vector<std::vector<int64_t>> want_primes = {
      {20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077, 20000081,
       20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171},
      {20000213, 20000221, 20000243, 20000269, 20000287, 20000297, 20000303, 20000311, 20000327,
       20000329, 20000339, 20000353, 20000359, 20000377, 20000389, 20000429},
  };
  const int64_t want_total[] = {320001446, 320005046};
  const int64_t want_rows[] = {320001536, 320005120};
  for (int64_t ell = 0; ell < 2; ++ell) {
    const PleHashParams params = ple_hash_params(config, 248320, ell);
    EXPECT_EQ(params.ngram_size, 3);
    EXPECT_EQ(params.heads_per_ngram, 8);
    EXPECT_EQ(params.n_heads(), 16);
    EXPECT_EQ(params.moduli, want_primes[size_t(ell)]) << "ple index " << ell;
    ASSERT_EQ(params.offsets.size(), 16u);
    int64_t total = 0;
    for (size_t h = 0; h < 16; ++h) {
      EXPECT_EQ(params.offsets[h], total) << "head " << h;
      total += params.moduli[h];
    }
    EXPECT_EQ(total, want_total[ell]);
    EXPECT_EQ(params.n_rows, want_rows[ell]);
    EXPECT_EQ(params.n_rows % 128, 0);
  }
}

// The primes of consecutive PLE layers are consecutive: layer l + 1 starts after layer l's last.
TEST(PleHashParams, LayersUseConsecutiveDistinctPrimes) {
  Qwen4ExpConfig config = default_config();
  config.ngram_vocab_size_base = 2;
  config.heads_per_ngram = 2;  // G = 4
  const std::vector<int64_t> primes = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
  for (int64_t ell = 0; ell < 3; ++ell) {
    const PleHashParams params = ple_hash_params(config, 100, ell);
    EXPECT_EQ(params.moduli,
              std::vector<int64_t>(primes.begin() + ell * 4, primes.begin() + ell * 4 + 4));
  }
  // A base that is itself prime is the first modulus (the search starts at base - 1 + 1).
  config.ngram_vocab_size_base = 211;
  config.ngram_size = 2;
  config.heads_per_ngram = 4;
  config.make_ngram_vocab_size_divisible_by = 64;
  const PleHashParams params = ple_hash_params(config, 256, 0);
  EXPECT_EQ(params.moduli, (std::vector<int64_t>{211, 223, 227, 229}));
  EXPECT_EQ(params.offsets, (std::vector<int64_t>{0, 211, 434, 661}));
  EXPECT_EQ(params.n_rows, 896);
}

// The primality test past 2^32 (where products need 128 bits): the first primes after 2^40 and
// 2^62, and after a Carmichael-rich stretch.
TEST(PleHashParams, PrimesBeyond32Bits) {
  Qwen4ExpConfig config = default_config();
  config.ngram_size = 2;
  config.heads_per_ngram = 1;
  config.make_ngram_vocab_size_divisible_by = 1;
  config.ngram_vocab_size_base = (int64_t(1) << 40) + 1;
  EXPECT_EQ(ple_hash_params(config, 10, 0).moduli, std::vector<int64_t>{1099511627791});
  config.ngram_vocab_size_base = (int64_t(1) << 62) + 1;
  EXPECT_EQ(ple_hash_params(config, 10, 0).moduli, std::vector<int64_t>{4611686018427388039});
  config.ngram_vocab_size_base = 561;  // 561, 1105, 1729 are Carmichael numbers
  EXPECT_EQ(ple_hash_params(config, 10, 0).moduli, std::vector<int64_t>{563});
}

// ---- n-gram ids ---------------------------------------------------------------------------------

// The context of every token of a whole sequence, written from the rule as ple_context does:
// ctx[t][s] = ids[t - s] when t - s >= 0 and no EOS at positions t - s .. t - 1, else eos.
std::vector<std::vector<int64_t>> naive_context(const std::vector<int32_t>& seq, int64_t eos,
                                                int64_t ngram_size) {
  std::vector<std::vector<int64_t>> ctx;
  for (int64_t t = 0; t < int64_t(seq.size()); ++t) {
    std::vector<int64_t> row = {seq[size_t(t)]};
    for (int64_t s = 1; s < ngram_size; ++s) {
      const int64_t src = t - s;
      bool ok = src >= 0;
      for (int64_t j = std::max<int64_t>(src, 0); ok && j < t; ++j) ok = seq[size_t(j)] != eos;
      row.push_back(ok ? seq[size_t(src)] : eos);
    }
    ctx.push_back(row);
  }
  return ctx;
}

// ids[t, h] of a whole sequence from the context, one head at a time.
std::vector<int64_t> naive_ids(const PleHashParams& params, const std::vector<int32_t>& seq,
                               int64_t eos) {
  const auto ctx = naive_context(seq, eos, params.ngram_size);
  std::vector<int64_t> ids;
  for (const auto& row : ctx) {
    for (int64_t h = 0; h < params.n_heads(); ++h) {
      const int64_t order = h / params.heads_per_ngram + 2;
      int64_t mix = 0;
      for (int64_t s = 0; s < order; ++s) mix ^= row[size_t(s)] * params.multipliers[size_t(s)];
      ids.push_back(mix % params.moduli[size_t(h)] + params.offsets[size_t(h)]);
    }
  }
  return ids;
}

std::vector<int64_t> one_shot_ids(const PleHashParams& params, const std::vector<int32_t>& seq,
                                  int64_t eos, std::vector<int32_t>* history_out = nullptr) {
  std::vector<int32_t> history = ple_history_init(params.ngram_size, eos);
  std::vector<int64_t> ids(seq.size() * size_t(params.n_heads()));
  ple_ngram_ids(params, eos, seq, history, ids.data());
  if (history_out != nullptr) *history_out = history;
  return ids;
}

// The reference geometry built from the section 7.1-7.2 constants, not from ple_hash_params.
PleHashParams reference_params_l0() {
  PleHashParams params;
  params.multipliers = {23703573157769, 20109073645365, 8052911324071};
  params.moduli = {20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077,
                   20000081, 20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171};
  int64_t total = 0;
  for (int64_t m : params.moduli) {
    params.offsets.push_back(total);
    total += m;
  }
  params.n_rows = 320001536;
  return params;
}

TEST(PleNgramIds, HistoryStartsWithEos) {
  EXPECT_EQ(ple_history_init(3, 2), (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(ple_history_init(5, 7), (std::vector<int32_t>{7, 7, 7, 7}));
  EXPECT_TRUE(ple_history_init(1, 7).empty());
}

// The selftest case of ple_context: [5, 6, 2, 7, 2, 2, 8], eos 2, trigrams.
TEST(PleNgramIds, ContextRuleOfTheSelftest) {
  const std::vector<int32_t> seq = {5, 6, 2, 7, 2, 2, 8};
  const std::vector<std::vector<int64_t>> want = {{5, 2, 2}, {6, 5, 2}, {2, 6, 5}, {7, 2, 2},
                                                  {2, 7, 2}, {2, 2, 2}, {8, 2, 2}};
  EXPECT_EQ(naive_context(seq, 2, 3), want);

  const PleHashParams params = reference_params_l0();
  EXPECT_EQ(one_shot_ids(params, seq, 2), naive_ids(params, seq, 2));
  // Computed with scripts/hf_reference_qwen4exp.py's ple_primes, ple_multipliers and ple_context
  // (rows t = 0, 2 and 6).
  const std::vector<int64_t> ids = one_shot_ids(params, seq, 2);
  const std::vector<int64_t> want_t0 = {
      1550955,   34283473,  50649812,  69562764,  97202548,  119749202, 133569138, 158662441,
      169335313, 185806708, 215023466, 229928562, 248164498, 266400452, 299145988, 302872410};
  const std::vector<int64_t> want_t2 = {
      9931700,   32270835,  53440484,  79078070,  92481767,  116949741, 133651657, 142587523,
      166484259, 181671155, 206056010, 230013134, 257606963, 265200663, 294398781, 300388284};
  const std::vector<int64_t> want_t6 = {
      1405349,   30895476,  55640681,  70284075,  99978585,  109876783, 124724104, 144520580,
      170130235, 181548140, 218202625, 222930030, 258639506, 274348865, 299585485, 305767669};
  EXPECT_EQ(std::vector<int64_t>(ids.begin(), ids.begin() + 16), want_t0);
  EXPECT_EQ(std::vector<int64_t>(ids.begin() + 32, ids.begin() + 48), want_t2);
  EXPECT_EQ(std::vector<int64_t>(ids.begin() + 96, ids.begin() + 112), want_t6);
  for (size_t h = 0; h < ids.size(); ++h) {
    EXPECT_GE(ids[h], 0);
    EXPECT_LT(ids[h], params.n_rows);
  }
}

// 4-grams with 2 heads per order, PLE index 1 (the script's helpers give these ids).
TEST(PleNgramIds, FourGramsMatchTheScript) {
  Qwen4ExpConfig config;
  config.ngram_size = 4;
  config.heads_per_ngram = 2;
  config.ngram_vocab_size_base = 50;
  config.make_ngram_vocab_size_divisible_by = 16;
  config.seed = 42;
  const PleHashParams params = ple_hash_params(config, 100, 1);
  EXPECT_EQ(params.multipliers, (std::vector<int64_t>{17970440801980989, 16022114195190229,
                                                      9578961067233971, 10049565326345757}));
  EXPECT_EQ(params.moduli, (std::vector<int64_t>{79, 83, 89, 97, 101, 103}));
  EXPECT_EQ(params.n_rows, 560);
  const std::vector<int32_t> seq = {9, 3, 4, 3, 5, 3, 3, 6, 7, 8};
  const std::vector<int64_t> want = {69, 139, 176, 299, 397, 451, 73, 88,  195, 294, 443, 517,
                                     60, 104, 215, 334, 382, 493, 72, 99,  190, 283, 409, 548,
                                     40, 97,  225, 340, 426, 457, 12, 95,  178, 294, 445, 508,
                                     25, 158, 201, 303, 384, 525, 53, 158, 195, 258, 377, 476,
                                     34, 100, 162, 286, 383, 494, 31, 142, 214, 312, 411, 511};
  EXPECT_EQ(one_shot_ids(params, seq, 3), want);
  EXPECT_EQ(naive_ids(params, seq, 3), want);
}

std::vector<int32_t> random_tokens(std::mt19937& rng, int64_t n, int32_t vocab, int32_t eos) {
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  std::bernoulli_distribution is_eos(0.2);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(is_eos(rng) ? eos : token(rng));
  return out;
}

// Runs of 1 token at a time, of odd sizes and split at every point equal the whole run, for
// bigrams to 5-grams; the history after each run is the last ngram_size - 1 raw tokens.
TEST(PleNgramIds, RunsSplitAnywhereEqualTheWholeRun) {
  for (const int64_t ngram_size : {2, 3, 4, 5}) {
    Qwen4ExpConfig config;
    config.ngram_size = ngram_size;
    config.heads_per_ngram = 3;
    config.ngram_vocab_size_base = 1000;
    const int32_t vocab = 12;
    const int32_t eos = 4;
    const PleHashParams params = ple_hash_params(config, vocab, 2);
    const int64_t n_heads = params.n_heads();
    std::mt19937 rng(static_cast<uint32_t>(ngram_size));
    const std::vector<int32_t> seq = random_tokens(rng, 41, vocab, eos);
    std::vector<int32_t> full_history;
    const std::vector<int64_t> full = one_shot_ids(params, seq, eos, &full_history);
    EXPECT_EQ(full, naive_ids(params, seq, eos)) << "ngram_size " << ngram_size;
    EXPECT_EQ(full_history, std::vector<int32_t>(seq.end() - (ngram_size - 1), seq.end()));

    std::vector<std::vector<int64_t>> chunkings = {{1}, {3, 1, 5, 7}, {2}, {5}};
    for (int64_t split = 0; split <= int64_t(seq.size()); ++split) {
      chunkings.push_back({split, int64_t(seq.size())});
    }
    for (const std::vector<int64_t>& pattern : chunkings) {
      std::vector<int32_t> history = ple_history_init(ngram_size, eos);
      std::vector<int64_t> ids(full.size(), -1);
      size_t begin = 0;
      for (size_t piece = 0; begin < seq.size(); ++piece) {
        const size_t len = std::min(size_t(pattern[piece % pattern.size()]), seq.size() - begin);
        ple_ngram_ids(params, eos, std::span<const int32_t>(seq.data() + begin, len), history,
                      ids.data() + int64_t(begin) * n_heads);
        // The history is the last ngram_size - 1 tokens seen so far (eos before the start).
        std::vector<int32_t> want_history = ple_history_init(ngram_size, eos);
        want_history.insert(want_history.end(), seq.begin(), seq.begin() + int64_t(begin + len));
        want_history.erase(want_history.begin(), want_history.end() - (ngram_size - 1));
        ASSERT_EQ(history, want_history) << "after token " << begin + len;
        begin += len;
      }
      EXPECT_EQ(ids, full) << "ngram_size " << ngram_size << " pattern[0] " << pattern[0];
    }
  }
}

// An EOS right before a chunk boundary blocks the context of the next chunk's tokens, and the
// current token being EOS does not change its own context.
TEST(PleNgramIds, EosAcrossChunkBoundaries) {
  const PleHashParams params = reference_params_l0();
  const int64_t eos = 2;
  std::vector<int32_t> history = ple_history_init(3, eos);
  std::vector<int64_t> ids(3 * 16);
  const std::vector<int32_t> first = {10, 11, 2};
  ple_ngram_ids(params, eos, first, history, ids.data());
  EXPECT_EQ(history, (std::vector<int32_t>{11, 2}));
  std::vector<int64_t> next(16);
  const std::vector<int32_t> second = {12};
  ple_ngram_ids(params, eos, second, history, next.data());
  // Token 12 after EOS hashes like 12 at sequence start.
  EXPECT_EQ(next, std::vector<int64_t>(one_shot_ids(params, {12}, eos)));
  EXPECT_EQ(history, (std::vector<int32_t>{2, 12}));
  // The EOS token itself hashed with its real context [2, 11, 10].
  const std::vector<int64_t> whole = one_shot_ids(params, {10, 11, 2}, eos);
  EXPECT_EQ(std::vector<int64_t>(ids.begin() + 32, ids.end()),
            std::vector<int64_t>(whole.begin() + 32, whole.end()));
  const auto ctx = naive_context({10, 11, 2}, eos, 3);
  EXPECT_EQ(ctx[2], (std::vector<int64_t>{2, 11, 10}));
  // An empty run changes nothing.
  ple_ngram_ids(params, eos, {}, history, nullptr);
  EXPECT_EQ(history, (std::vector<int32_t>{2, 12}));
}

// Multipliers a checkpoint overrides with large values wrap as torch's int64 products do and are
// reduced with floor-mod (torch.remainder): ids stay inside each head's range.
TEST(PleNgramIds, WrappingProductsUseFloorMod) {
  PleHashParams params;
  params.ngram_size = 2;
  params.heads_per_ngram = 1;
  params.multipliers = {int64_t(1) << 62, 3};
  params.moduli = {1000003};
  params.offsets = {0};
  params.n_rows = 1000064;
  std::vector<int32_t> history = {7};
  int64_t id = -1;
  const std::vector<int32_t> token = {6};
  ple_ngram_ids(params, 0, token, history, &id);
  // 6 * 2^62 wraps to -2^63 (two's complement); XOR with 7 * 3 = 21 gives -2^63 + 21.
  const int64_t mix = std::numeric_limits<int64_t>::min() + 21;
  int64_t want = mix % 1000003;
  if (want < 0) want += 1000003;
  EXPECT_EQ(id, want);
}

// ---- checkpoints --------------------------------------------------------------------------------

constexpr const char* kMinimalConfig =
    R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 16})";

constexpr const char* kPrefix = "model.layers.0.ple.ple_embedding.";

// A tensor and the bytes it owns.
struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};

// The value of row r, column c of the test tables: multiples of 1/4 in [-31.25, 31.25], exact in
// F32, F16 and BF16.
float table_value(int64_t r, int64_t c) {
  return float((r * 7 + c * 3) % 251 - 125) * 0.25f;
}

// Rows [row_begin, row_begin + rows) of the test table as a tensor of `dtype`.
OwnedTensor table_tensor(const std::string& name, DType dtype, int64_t row_begin, int64_t rows,
                         int64_t dim) {
  OwnedTensor t{name, dtype, {rows, dim}, {}};
  for (int64_t r = row_begin; r < row_begin + rows; ++r) {
    for (int64_t c = 0; c < dim; ++c) {
      const float v = table_value(r, c);
      if (dtype == DType::kF32) {
        const auto* b = reinterpret_cast<const std::byte*>(&v);
        t.data.insert(t.data.end(), b, b + 4);
      } else {
        const uint16_t bits = dtype == DType::kBF16 ? f32_to_bf16(v) : f32_to_f16(v);
        const auto* b = reinterpret_cast<const std::byte*>(&bits);
        t.data.insert(t.data.end(), b, b + 2);
      }
    }
  }
  return t;
}

OwnedTensor i64_tensor(const std::string& name, const std::vector<int64_t>& values) {
  OwnedTensor t{name, DType::kI64, {int64_t(values.size())}, {}};
  const auto* b = reinterpret_cast<const std::byte*>(values.data());
  t.data.assign(b, b + values.size() * 8);
  return t;
}

// A checkpoint directory `name` under `root` holding config.json and `tensors`.
fs::path write_checkpoint(const fs::path& root, const std::string& name,
                          const std::vector<OwnedTensor>& tensors) {
  const fs::path dir = root / name;
  fs::create_directories(dir);
  write_text(dir / "config.json", kMinimalConfig);
  std::vector<SafetensorsWriteTensor> views;
  for (const OwnedTensor& t : tensors) views.push_back({t.name, t.dtype, t.shape, t.data});
  const Status status = write_safetensors(dir / "model.safetensors", views);
  EXPECT_TRUE(status.ok()) << status.message();
  return dir;
}

std::string shard_name(int64_t k) {
  return std::string(kPrefix) + "ngram_embedding.shard_" + std::to_string(k) + ".weight";
}

// Rows of shard k in the 12-shard tables: 1, 2, 3, 1, 2, 3, ... (uneven, so a lexical order
// shard_0, shard_1, shard_10, shard_11, shard_2 ... would misplace rows).
int64_t shard_rows(int64_t k) {
  return 1 + k % 3;
}

std::vector<OwnedTensor> sharded_table(DType dtype, int64_t n_shards, int64_t dim,
                                       int64_t* total_rows) {
  std::vector<OwnedTensor> tensors;
  int64_t begin = 0;
  for (int64_t k = 0; k < n_shards; ++k) {
    tensors.push_back(table_tensor(shard_name(k), dtype, begin, shard_rows(k), dim));
    begin += shard_rows(k);
  }
  std::reverse(tensors.begin(), tensors.end());  // file order is not the row order
  *total_rows = begin;
  return tensors;
}

void expect_gathers_the_table(const PleTable& table) {
  std::vector<int64_t> ids;
  for (int64_t r = table.n_rows() - 1; r >= 0; --r) ids.push_back(r);
  ids.push_back(0);
  ids.push_back(table.n_rows() - 1);
  std::vector<float> out(ids.size() * size_t(table.dim()), -1000.0f);
  table.gather(ids.data(), int64_t(ids.size()), out.data());
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t c = 0; c < table.dim(); ++c) {
      ASSERT_EQ(out[i * size_t(table.dim()) + size_t(c)], table_value(ids[i], c))
          << "row " << ids[i] << " column " << c;
    }
  }
}

TEST(PleTable, TwelveShardsInNumericOrder) {
  TempDir tmp;
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    int64_t rows = 0;
    const fs::path dir = write_checkpoint(tmp.path(), std::string(dtype_name(dtype)),
                                          sharded_table(dtype, 12, 6, &rows));
    Result<Checkpoint> ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    Result<PleTable> table = PleTable::open(*ckpt, kPrefix, rows, 6);
    ASSERT_TRUE(table.ok()) << table.message();
    EXPECT_EQ(table->n_rows(), rows);
    EXPECT_EQ(table->dim(), 6);
    EXPECT_EQ(table->dtype(), dtype);
    std::vector<std::string> want_names;
    for (int64_t k = 0; k < 12; ++k) want_names.push_back(shard_name(k));
    EXPECT_EQ(table->used_names(), want_names);
    expect_gathers_the_table(*table);
  }
}

TEST(PleTable, OneTensor) {
  TempDir tmp;
  const std::string name = std::string(kPrefix) + "ngram_embedding.weight";
  const fs::path dir =
      write_checkpoint(tmp.path(), "one", {table_tensor(name, DType::kBF16, 0, 64, 4)});
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<PleTable> table = PleTable::open(*ckpt, kPrefix, 64, 4);
  ASSERT_TRUE(table.ok()) << table.message();
  EXPECT_EQ(table->used_names(), std::vector<std::string>{name});
  expect_gathers_the_table(*table);
  // Another layer's prefix finds nothing.
  Result<PleTable> other = PleTable::open(*ckpt, "model.layers.1.ple.ple_embedding.", 64, 4);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.message().find("model.layers.1.ple.ple_embedding.ngram_embedding.weight is "
                                 "missing"),
            std::string::npos)
      << other.message();
}

// An F32 shard placed after odd-sized BF16 data sits at an offset that is not a multiple of 4.
TEST(PleTable, UnalignedF32Data) {
  TempDir tmp;
  OwnedTensor odd{"model.other", DType::kBF16, {1}, std::vector<std::byte>(2)};
  int64_t rows = 0;
  std::vector<OwnedTensor> tensors = {odd};
  for (OwnedTensor& t : sharded_table(DType::kF32, 3, 5, &rows)) tensors.push_back(std::move(t));
  const fs::path dir = write_checkpoint(tmp.path(), "unaligned", tensors);
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<PleTable> table = PleTable::open(*ckpt, kPrefix, rows, 5);
  ASSERT_TRUE(table.ok()) << table.message();
  expect_gathers_the_table(*table);
}

// Opens `tensors` as a table of `rows` x `dim` and expects an error containing every `parts`.
void expect_open_error(const fs::path& root, const std::string& name,
                       const std::vector<OwnedTensor>& tensors, int64_t rows, int64_t dim,
                       const std::vector<std::string>& parts) {
  SCOPED_TRACE(name);
  const fs::path dir = write_checkpoint(root, name, tensors);
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<PleTable> table = PleTable::open(*ckpt, kPrefix, rows, dim);
  ASSERT_FALSE(table.ok());
  EXPECT_NE(table.message().find(dir.string()), std::string::npos) << table.message();
  for (const std::string& part : parts) {
    EXPECT_NE(table.message().find(part), std::string::npos)
        << "missing \"" << part << "\" in: " << table.message();
  }
}

TEST(PleTable, Errors) {
  TempDir tmp;
  const fs::path& root = tmp.path();
  const std::string single = std::string(kPrefix) + "ngram_embedding.weight";
  int64_t rows = 0;

  expect_open_error(root, "absent",
                    {table_tensor("model.embed_tokens.weight", DType::kF32, 0, 4, 4)}, 4, 4,
                    {single + " is missing", "shard_{k}.weight"});

  // shard_0, shard_2: shard_1 is named.
  expect_open_error(root, "gap",
                    {table_tensor(shard_name(0), DType::kF32, 0, 2, 4),
                     table_tensor(shard_name(2), DType::kF32, 2, 2, 4)},
                    4, 4, {shard_name(1) + " is missing", "found " + shard_name(2)});
  // No shard_0 at all.
  expect_open_error(root, "no_first", {table_tensor(shard_name(1), DType::kF32, 0, 2, 4)}, 2, 4,
                    {shard_name(0) + " is missing"});

  std::vector<OwnedTensor> width = sharded_table(DType::kF32, 3, 4, &rows);
  width.front() = table_tensor(shard_name(2), DType::kF32, 0, shard_rows(2), 5);  // file order
  expect_open_error(root, "width_mismatch", width, rows, 4,
                    {"shards disagree", shard_name(2), "[3, 5]", shard_name(0), "[1, 4]"});

  std::vector<OwnedTensor> dtypes = sharded_table(DType::kF32, 3, 4, &rows);
  dtypes.front() = table_tensor(shard_name(2), DType::kBF16, 0, shard_rows(2), 4);
  expect_open_error(root, "dtype_mismatch", dtypes, rows, 4, {"shards disagree", "BF16", "F32"});

  expect_open_error(root, "total", sharded_table(DType::kF32, 12, 4, &rows), 100, 4,
                    {"has 24 rows", "implies 100", "make_ngram_vocab_size_divisible_by"});
  expect_open_error(root, "dim", sharded_table(DType::kF32, 2, 4, &rows), 3, 8,
                    {"rows of 4 values", "implies 8", "ple_embed_dim"});

  OwnedTensor ints = i64_tensor(single, {1, 2, 3, 4});
  ints.shape = {2, 2};
  expect_open_error(root, "int_table", {ints}, 2, 2, {single, "dtype I64", "F32, F16 or BF16"});
  {
    OwnedTensor flat = table_tensor(single, DType::kF32, 0, 1, 4);
    flat.shape = {4};
    expect_open_error(root, "flat", {flat}, 4, 1, {single, "[4]", "2-D"});
  }
  expect_open_error(root, "both",
                    {table_tensor(single, DType::kF32, 0, 2, 4),
                     table_tensor(shard_name(0), DType::kF32, 0, 2, 4)},
                    2, 4, {"stored twice"});
  const std::string leading_zero = std::string(kPrefix) + "ngram_embedding.shard_01.weight";
  expect_open_error(root, "leading_zero",
                    {table_tensor(shard_name(0), DType::kF32, 0, 2, 4),
                     table_tensor(leading_zero, DType::kF32, 2, 2, 4)},
                    4, 4, {leading_zero, "plain decimal"});
}

// ---- hash buffers -------------------------------------------------------------------------------

PleHashParams small_params() {
  Qwen4ExpConfig config;
  config.ngram_size = 3;
  config.heads_per_ngram = 2;
  config.ngram_vocab_size_base = 101;
  config.make_ngram_vocab_size_divisible_by = 64;
  return ple_hash_params(config, 256, 0);  // moduli 101, 103, 107, 109; 448 rows
}

TEST(PleHashBuffers, AbsentLeavesParamsUnchanged) {
  TempDir tmp;
  const fs::path dir = write_checkpoint(tmp.path(), "none", {i64_tensor("model.other", {1})});
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  PleHashParams params = small_params();
  const PleHashParams before = params;
  Result<std::vector<std::string>> used = ple_read_hash_buffers(*ckpt, kPrefix, params);
  ASSERT_TRUE(used.ok()) << used.message();
  EXPECT_TRUE(used->empty());
  EXPECT_EQ(params.multipliers, before.multipliers);
  EXPECT_EQ(params.moduli, before.moduli);
  EXPECT_EQ(params.offsets, before.offsets);
}

TEST(PleHashBuffers, PresentBuffersWin) {
  TempDir tmp;
  const std::string p = kPrefix;
  const fs::path dir =
      write_checkpoint(tmp.path(), "all",
                       {i64_tensor(p + "layer_multipliers", {3, 5, 7}),
                        i64_tensor(p + "ngram_heads_vocab_sizes", {11, 13, 17, 19}),
                        i64_tensor(p + "ngram_heads_offsets", {0, 11, 24, 41})});
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  PleHashParams params = small_params();
  Result<std::vector<std::string>> used = ple_read_hash_buffers(*ckpt, kPrefix, params);
  ASSERT_TRUE(used.ok()) << used.message();
  EXPECT_EQ(*used, (std::vector<std::string>{p + "layer_multipliers", p + "ngram_heads_vocab_sizes",
                                             p + "ngram_heads_offsets"}));
  EXPECT_EQ(params.multipliers, (std::vector<int64_t>{3, 5, 7}));
  EXPECT_EQ(params.moduli, (std::vector<int64_t>{11, 13, 17, 19}));
  EXPECT_EQ(params.offsets, (std::vector<int64_t>{0, 11, 24, 41}));
  EXPECT_EQ(params.n_rows, 448);  // the table's geometry stays config.json's

  // Only the multipliers: the moduli and offsets stay recomputed.
  const fs::path dir2 =
      write_checkpoint(tmp.path(), "mult", {i64_tensor(p + "layer_multipliers", {3, 5, 7})});
  Result<Checkpoint> ckpt2 = Checkpoint::open(dir2);
  ASSERT_TRUE(ckpt2.ok()) << ckpt2.message();
  PleHashParams params2 = small_params();
  Result<std::vector<std::string>> used2 = ple_read_hash_buffers(*ckpt2, kPrefix, params2);
  ASSERT_TRUE(used2.ok()) << used2.message();
  EXPECT_EQ(*used2, std::vector<std::string>{p + "layer_multipliers"});
  EXPECT_EQ(params2.multipliers, (std::vector<int64_t>{3, 5, 7}));
  EXPECT_EQ(params2.moduli, small_params().moduli);
}

TEST(PleHashBuffers, BadBuffersAreErrorsNamingTheTensor) {
  TempDir tmp;
  const std::string p = kPrefix;
  struct Case {
    std::string name;
    std::vector<OwnedTensor> tensors;
    std::vector<std::string> parts;
  };
  OwnedTensor float_mult = table_tensor(p + "layer_multipliers", DType::kF32, 0, 1, 3);
  float_mult.shape = {3};
  OwnedTensor matrix = i64_tensor(p + "ngram_heads_vocab_sizes", {101, 103, 107, 109});
  matrix.shape = {2, 2};
  std::vector<Case> cases = {
      {"dtype", {float_mult}, {p + "layer_multipliers", "dtype F32", "I64"}},
      {"length", {i64_tensor(p + "layer_multipliers", {3, 5})}, {"shape [2]", "implies [3]"}},
      {"matrix", {matrix}, {p + "ngram_heads_vocab_sizes", "[2, 2]", "implies [4]"}},
      {"zero_modulus",
       {i64_tensor(p + "ngram_heads_vocab_sizes", {101, 0, 107, 109}),
        i64_tensor(p + "ngram_heads_offsets", {0, 101, 101, 208})},
       {p + "ngram_heads_vocab_sizes", "head 1 has modulus 0"}},
      {"offsets",
       {i64_tensor(p + "ngram_heads_offsets", {0, 101, 205, 311})},
       {p + "ngram_heads_offsets", "running sums", "head 2 should start at 204"}},
      {"offsets_first",
       {i64_tensor(p + "ngram_heads_offsets", {1, 102, 205, 312})},
       {p + "ngram_heads_offsets", "head 0 should start at 0"}},
      // New moduli without offsets: the recomputed offsets no longer fit.
      {"moduli_without_offsets",
       {i64_tensor(p + "ngram_heads_vocab_sizes", {11, 13, 17, 19})},
       {p + "ngram_heads_vocab_sizes", "recomputed from config.json", "running sums"}},
      {"too_many_rows",
       {i64_tensor(p + "ngram_heads_vocab_sizes", {101, 103, 107, 200}),
        i64_tensor(p + "ngram_heads_offsets", {0, 101, 204, 311})},
       {p + "ngram_heads_vocab_sizes", "more rows than the table's 448"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = write_checkpoint(tmp.path(), c.name, c.tensors);
    Result<Checkpoint> ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    PleHashParams params = small_params();
    Result<std::vector<std::string>> used = ple_read_hash_buffers(*ckpt, kPrefix, params);
    ASSERT_FALSE(used.ok());
    EXPECT_NE(used.message().find(dir.string()), std::string::npos) << used.message();
    for (const std::string& part : c.parts) {
      EXPECT_NE(used.message().find(part), std::string::npos)
          << "missing \"" << part << "\" in: " << used.message();
    }
    EXPECT_EQ(params.moduli, small_params().moduli);  // unchanged on error
    EXPECT_EQ(params.multipliers, small_params().multipliers);
  }
}

// ---- the transformers 5.17 reference checkpoints ------------------------------------------------

// Every PLE layer of tests/data/hf_qwen4exp: the int64 buffers transformers saved equal
// ple_hash_params recomputed from the parsed config.json, and the sharded table opens with the
// geometry it implies.
TEST(PleReferenceCheckpoints, StoredBuffersEqualTheRecomputedOnes) {
  const fs::path root = fs::path(E4KV_SOURCE_DIR) / "tests/data/hf_qwen4exp";
  int64_t ple_layers = 0;
  for (const auto& entry : fs::directory_iterator(root)) {
    if (!fs::exists(entry.path() / "model.safetensors")) continue;
    SCOPED_TRACE(entry.path().string());
    Result<Checkpoint> ckpt = Checkpoint::open(entry.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    const ModelConfig& config = ckpt->config();
    ASSERT_TRUE(config.qwen4exp.has_value());
    const Qwen4ExpConfig& q = *config.qwen4exp;
    const std::string text_prefix = config.nested_text_config ? "model.language_model." : "model.";
    for (size_t ell = 0; ell < q.ple_layers.size(); ++ell) {
      const std::string prefix =
          text_prefix + "layers." + std::to_string(q.ple_layers[ell]) + ".ple.ple_embedding.";
      SCOPED_TRACE(prefix);
      const PleHashParams recomputed = ple_hash_params(q, config.vocab_size, int64_t(ell));
      PleHashParams stored = recomputed;
      stored.multipliers.assign(stored.multipliers.size(), -1);
      stored.moduli.assign(stored.moduli.size(), 1);
      stored.offsets.clear();
      for (size_t h = 0; h < stored.moduli.size(); ++h) stored.offsets.push_back(int64_t(h));
      Result<std::vector<std::string>> used = ple_read_hash_buffers(*ckpt, prefix, stored);
      ASSERT_TRUE(used.ok()) << used.message();
      ASSERT_EQ(used->size(), 3u) << "the reference checkpoints carry all three buffers";
      EXPECT_EQ(stored.multipliers, recomputed.multipliers);
      EXPECT_EQ(stored.moduli, recomputed.moduli);
      EXPECT_EQ(stored.offsets, recomputed.offsets);

      Result<PleTable> table =
          PleTable::open(*ckpt, prefix, recomputed.n_rows, q.ple_embed_dim / recomputed.n_heads());
      ASSERT_TRUE(table.ok()) << table.message();
      EXPECT_GE(table->used_names().size(), 2u);  // saved as shards
      ++ple_layers;
    }
  }
  EXPECT_GE(ple_layers, 7);  // 1 + 1 + 2 + 3 PLE layers in the four cases with PLE
}

}  // namespace
}  // namespace e4kv
