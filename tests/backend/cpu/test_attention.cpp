// Paged attention (CPU reference): against an independent naive reference in double precision
// (materialised softmax over the gathered tokens of per-sequence arrays, no paging), E4M3 against
// FP16 holding the same numbers, split-K against no split, a seeded sweep over shapes, block sizes,
// GQA groups, dtypes, dense/QSA and mixed batch layouts, and the quality of calibrated E4M3 against
// FP16 on K/V with outlier channels (the figures are printed).
#include "backend/cpu/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "calib/quality_metrics.h"
#include "core/half.h"
#include "e4kv/e4m3.h"
#include "qsa/selection.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

// ---- a paged cache built from per-sequence values ---------------------------------------------

// One layer's cache plus the exact stored values per sequence, for the naive reference.
struct PagedKv {
  KvCacheGeometry geometry;
  std::vector<uint16_t>
      storage;                 // the cache bytes ([n_blocks, 2, block_size, n_kv_heads, head_dim])
  std::vector<int32_t> table;  // [n_seqs, max_blocks]
  std::vector<int32_t> seq_lens;  // [n_seqs]
  int64_t max_blocks = 0;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  // Stored values (decode(code) or the FP16 value, no scale): [seq][kv][t, n_kv_heads, head_dim].
  std::vector<std::array<std::vector<double>, 2>> stored;
  int64_t n_nonzero = 0;    // inputs != 0
  int64_t n_flushed = 0;    // inputs != 0 stored as 0
  int64_t n_subnormal = 0;  // E4M3 codes with a zero exponent field and a nonzero mantissa

  KvCacheView view() { return {storage.data(), geometry, k_scale, v_scale}; }
  BlockTableView block_table() const {
    return {table.data(), int64_t(seq_lens.size()), max_blocks};
  }
  uint8_t* bytes() { return reinterpret_cast<uint8_t*>(storage.data()); }
};

using ValueFn = std::function<float(int64_t seq, int64_t t, int kv, int64_t head, int64_t d)>;

// Physical blocks are shuffled and two spare blocks are left over; every unwritten element holds a
// NaN, so reading a wrong block or a slot past the sequence shows up in the output.
PagedKv make_cache(KvCacheDtype dtype, int64_t block_size, int64_t n_kv_heads, int64_t head_dim,
                   const std::vector<int32_t>& lens, float k_scale, float v_scale,
                   const ValueFn& value, uint32_t layout_seed) {
  PagedKv kv;
  kv.seq_lens = lens;
  kv.k_scale = k_scale;
  kv.v_scale = v_scale;
  for (const int32_t len : lens) {
    kv.max_blocks = std::max<int64_t>(kv.max_blocks, (len + block_size - 1) / block_size);
  }
  int64_t used = 0;
  for (const int32_t len : lens) used += (len + block_size - 1) / block_size;
  kv.geometry = {used + 2, block_size, n_kv_heads, head_dim, dtype};
  const bool e4m3 = dtype == KvCacheDtype::kE4m3;
  kv.storage.assign((kv.geometry.total_bytes() + 1) / 2,
                    e4m3 ? uint16_t(0x7F7F) : uint16_t(0x7E00));
  std::vector<int32_t> physical(static_cast<size_t>(kv.geometry.n_blocks));
  std::iota(physical.begin(), physical.end(), 0);
  std::mt19937 rng(layout_seed);
  std::shuffle(physical.begin(), physical.end(), rng);
  kv.table.assign(lens.size() * size_t(kv.max_blocks), -1);
  size_t next = 0;
  for (size_t s = 0; s < lens.size(); ++s) {
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      kv.table[s * size_t(kv.max_blocks) + size_t(b)] = physical[next++];
    }
  }
  const int64_t row = n_kv_heads * head_dim;
  kv.stored.resize(lens.size());
  for (size_t s = 0; s < lens.size(); ++s) {
    for (int c = 0; c < 2; ++c) {
      const float scale = c == 0 ? k_scale : v_scale;
      std::vector<double>& out = kv.stored[s][size_t(c)];
      out.resize(size_t(lens[s] * row));
      for (int64_t t = 0; t < lens[s]; ++t) {
        const int64_t block = kv.table[s * size_t(kv.max_blocks) + size_t(t / block_size)];
        for (int64_t h = 0; h < n_kv_heads; ++h) {
          const int64_t offset = kv.geometry.elem_offset(block, c, t % block_size, h);
          for (int64_t d = 0; d < head_dim; ++d) {
            const float x = value(int64_t(s), t, c, h, d);
            double v;
            if (e4m3) {
              const uint8_t code = e4m3_encode(x, scale);
              kv.bytes()[offset + d] = code;
              v = e4m3_decode(code);
              kv.n_subnormal += (code & 0x78) == 0 && (code & 0x07) != 0 ? 1 : 0;
            } else {
              const uint16_t h16 = f32_to_f16(x);
              kv.storage[size_t(offset + d)] = h16;
              v = f16_to_f32(h16);
            }
            kv.n_nonzero += x != 0.0f ? 1 : 0;
            kv.n_flushed += x != 0.0f && v == 0.0 ? 1 : 0;
            out[size_t((t * n_kv_heads + h) * head_dim + d)] = v;
          }
        }
      }
    }
  }
  return kv;
}

// The FP16 cache of an E4M3 cache's values times `multiply`, with the same block table; the
// conversion must be exact.
PagedKv f16_of_decoded(const PagedKv& e4m3, float multiply, float k_scale, float v_scale) {
  PagedKv kv = e4m3;
  kv.geometry.dtype = KvCacheDtype::kF16;
  kv.k_scale = k_scale;
  kv.v_scale = v_scale;
  const size_t n = e4m3.geometry.total_bytes();
  kv.storage.assign(n, 0);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(e4m3.storage.data());
  for (size_t i = 0; i < n; ++i) {
    const float v = e4m3_decode(codes[i]) * multiply;
    kv.storage[i] = f32_to_f16(v);
    if (!std::isnan(v)) {
      EXPECT_EQ(f16_to_f32(kv.storage[i]), v) << "not exact in FP16";
    }
  }
  for (auto& seq : kv.stored) {
    for (auto& values : seq) {
      for (double& v : values) v *= multiply;
    }
  }
  return kv;
}

// ---- query rows
// ----------------------------------------------------------------------------------

struct Rows {
  std::vector<int32_t> seq;
  std::vector<int32_t> pos;
  std::vector<int32_t> sel_tokens;  // QSA only
  std::vector<int32_t> sel_counts;
  int64_t sel_width = 0;

  void chunk(int32_t s, int32_t first, int32_t n) {
    for (int32_t i = 0; i < n; ++i) {
      seq.push_back(s);
      pos.push_back(first + i);
    }
  }
  int64_t n() const { return int64_t(seq.size()); }
  QueryBatchView view(const PagedKv& kv) const {
    QueryBatchView rows;
    rows.n_rows = n();
    rows.row_seq = seq.data();
    rows.row_pos = pos.data();
    rows.seq_lens = kv.seq_lens.data();
    if (sel_width > 0) {
      rows.sel_tokens = sel_tokens.data();
      rows.sel_counts = sel_counts.data();
      rows.sel_width = sel_width;
    }
    return rows;
  }
};

std::vector<uint16_t> random_f16(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> out(n);
  for (uint16_t& x : out) x = f32_to_f16(dist(rng));
  return out;
}

// QSA selection rows from a random indexer cache paged with the main block table.
void select_rows(const PagedKv& kv, Rows& rows, int64_t budget, std::mt19937& rng) {
  const int64_t index_dim = 16;
  const int64_t n_index_heads = 2;
  std::vector<uint16_t> compressed = random_f16(
      size_t(kv.geometry.n_blocks * (kv.geometry.block_size / 4) * index_dim), 1.0f, rng);
  const IndexerCompressedView view{compressed.data(), kv.geometry.n_blocks, kv.geometry.block_size,
                                   4, index_dim};
  const std::vector<uint16_t> index_q =
      random_f16(size_t(rows.n() * n_index_heads * index_dim), 1.0f, rng);
  rows.sel_width = qsa_selection_width(budget, 4);
  rows.sel_tokens.assign(size_t(rows.n() * rows.sel_width), -1);
  rows.sel_counts.assign(size_t(rows.n()), 0);
  QueryBatchView batch = rows.view(kv);
  batch.sel_tokens = nullptr;
  const Status status = qsa_select({budget, n_index_heads}, view, kv.block_table(), batch,
                                   index_q.data(), rows.sel_tokens.data(), rows.sel_counts.data());
  ASSERT_TRUE(status.ok()) << status.message();
}

// ---- the naive reference
// ---------------------------------------------------------------------------

// Double precision, materialised softmax over the gathered tokens of each row, read from the
// per-sequence value arrays (no paging). [n_rows, n_heads, head_dim]
std::vector<double> naive_attention(const PagedKv& kv, const Rows& rows, int64_t n_heads,
                                    const std::vector<uint16_t>& q,
                                    const std::vector<uint16_t>* gate) {
  const int64_t head_dim = kv.geometry.head_dim;
  const int64_t n_kv_heads = kv.geometry.n_kv_heads;
  const int64_t group = n_heads / n_kv_heads;
  std::vector<double> out(size_t(rows.n() * n_heads * head_dim), 0.0);
  for (int64_t r = 0; r < rows.n(); ++r) {
    std::vector<int64_t> tokens;
    if (rows.sel_width > 0) {
      for (int64_t i = 0; i < rows.sel_counts[size_t(r)]; ++i) {
        tokens.push_back(rows.sel_tokens[size_t(r * rows.sel_width + i)]);
      }
    } else {
      for (int64_t t = 0; t <= rows.pos[size_t(r)]; ++t) tokens.push_back(t);
    }
    const auto& k = kv.stored[size_t(rows.seq[size_t(r)])][0];
    const auto& v = kv.stored[size_t(rows.seq[size_t(r)])][1];
    for (int64_t h = 0; h < n_heads; ++h) {
      const int64_t kvh = h / group;
      const uint16_t* qh = q.data() + (r * n_heads + h) * head_dim;
      std::vector<double> logits;
      for (const int64_t t : tokens) {
        double dot = 0.0;
        for (int64_t d = 0; d < head_dim; ++d) {
          dot += double(f16_to_f32(qh[d])) * k[size_t((t * n_kv_heads + kvh) * head_dim + d)];
        }
        logits.push_back(dot * double(kv.k_scale) / std::sqrt(double(head_dim)));
      }
      if (tokens.empty()) continue;
      const double max_logit = *std::max_element(logits.begin(), logits.end());
      double sum = 0.0;
      for (double& x : logits) sum += (x = std::exp(x - max_logit));
      double* o = out.data() + (r * n_heads + h) * head_dim;
      for (size_t i = 0; i < tokens.size(); ++i) {
        const double p = logits[i] / sum;
        for (int64_t d = 0; d < head_dim; ++d) {
          o[d] += p * v[size_t((tokens[i] * n_kv_heads + kvh) * head_dim + d)];
        }
      }
      for (int64_t d = 0; d < head_dim; ++d) {
        o[d] *= double(kv.v_scale);
        if (gate != nullptr) {
          o[d] /= 1.0 +
                  std::exp(-double(f16_to_f32((*gate)[size_t((r * n_heads + h) * head_dim + d)])));
        }
      }
    }
  }
  return out;
}

// ---- running the reference under test
// -------------------------------------------------------------

struct Problem {
  PagedKv* kv = nullptr;
  const Rows* rows = nullptr;
  int64_t n_heads = 0;
  const std::vector<uint16_t>* q = nullptr;
  const std::vector<uint16_t>* gate = nullptr;

  PagedAttentionParams params(std::vector<float>& out) const {
    PagedAttentionParams p;
    p.cache = kv->view();
    p.block_table = kv->block_table();
    p.rows = rows->view(*kv);
    p.n_heads = n_heads;
    p.q = q->data();
    p.gate = gate != nullptr ? gate->data() : nullptr;
    out.assign(size_t(rows->n() * n_heads * kv->geometry.head_dim), -999.0f);
    p.out = out.data();
    return p;
  }
};

std::vector<float> run(const Problem& problem) {
  std::vector<float> out;
  const Status status = paged_attention(problem.params(out));
  EXPECT_TRUE(status.ok()) << status.message();
  return out;
}

std::vector<float> run_split(const Problem& problem, int64_t keys_per_split,
                             int64_t extra_splits = 0) {
  std::vector<float> out;
  const PagedAttentionParams p = problem.params(out);
  AttentionPartialsView partials;
  partials.keys_per_split = keys_per_split;
  partials.max_splits = attention_splits_needed(p.rows, keys_per_split) + extra_splits;
  const size_t stats = size_t(p.rows.n_rows * partials.max_splits * p.n_heads);
  std::vector<float> m(stats, 123.0f);
  std::vector<float> l(stats, 123.0f);
  std::vector<float> acc(stats * size_t(p.cache.geometry.head_dim), 123.0f);
  partials.m = m.data();
  partials.l = l.data();
  partials.acc = acc.data();
  Status status = paged_attention_partial(p, partials);
  EXPECT_TRUE(status.ok()) << status.message();
  status = paged_attention_merge(p, partials);
  EXPECT_TRUE(status.ok()) << status.message();
  return out;
}

double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (const double v : x) m = std::max(m, std::fabs(v));
  return m;
}

// Against the naive reference: relative L2 <= 1e-5, and elementwise within 1e-5 * max|ref| + 1e-4
// relative.
void expect_matches_naive(const std::vector<float>& got, const std::vector<double>& ref,
                          const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_LE(test::compare(got, ref, 0.0, 0.0).rel_l2, 1e-5) << what;
  EXPECT_TRUE(test::all_close(got, ref, 1e-5 * max_abs(ref), 1e-4)) << what;
}

int64_t count_different(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] == b[i] ? 0 : 1;
  return n + int64_t(a.size() != b.size());
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A normal deviate that depends only on (seed, element): Box-Muller over two hashed uniforms.
float hashed_normal(uint32_t seed, int64_t s, int64_t t, int c, int64_t h, int64_t d) {
  uint64_t key = seed;
  for (const int64_t part : {s, t, int64_t(c), h, d})
    key = splitmix64(key * 1000003u + uint64_t(part));
  const double u1 = double((key >> 11) + 1) * 0x1.0p-53;  // (0, 1]
  const double u2 = double(splitmix64(key) >> 11) * 0x1.0p-53;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

ValueFn normal_values(uint32_t seed, float stddev) {
  return [seed, stddev](int64_t s, int64_t t, int c, int64_t h, int64_t d) {
    return stddev * hashed_normal(seed, s, t, c, h, d);
  };
}

// ---- tests
// -----------------------------------------------------------------------------------------

TEST(PagedAttention, DenseMatchesNaiveReference) {
  for (const KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
    const float scale = dtype == KvCacheDtype::kE4m3 ? 0.0171247218f : 1.0f;
    PagedKv kv =
        make_cache(dtype, 16, 2, 64, {37, 70}, scale, scale * 1.5f, normal_values(1, 1.0f), 1);
    Rows rows;
    rows.chunk(1, 60, 10);  // a prefill chunk ending at the last token
    rows.chunk(0, 36, 1);   // a decode row
    rows.chunk(0, 0, 1);    // the first token: one key
    std::mt19937 rng(2);
    const std::vector<uint16_t> q = random_f16(size_t(rows.n() * 8 * 64), 1.0f, rng);
    const std::vector<uint16_t> gate = random_f16(q.size(), 2.0f, rng);
    for (const std::vector<uint16_t>* g :
         {static_cast<const std::vector<uint16_t>*>(nullptr), &gate}) {
      const Problem problem{&kv, &rows, 8, &q, g};
      expect_matches_naive(run(problem), naive_attention(kv, rows, 8, q, g),
                           g != nullptr ? "gated" : "no gate");
    }
  }
}

TEST(PagedAttention, ConsecutiveQueryHeadsShareAKvHead) {
  // 4 query heads over 2 KV heads: heads 0, 1 read KV head 0, heads 2, 3 read KV head 1. With
  // every V of KV head 1 zero, heads 2 and 3 output zero and heads 0 and 1 do not.
  PagedKv kv = make_cache(
      KvCacheDtype::kF16, 16, 2, 64, {20}, 1.0f, 1.0f,
      [](int64_t, int64_t, int c, int64_t h, int64_t d) {
        return c == 1 && h == 1 ? 0.0f : float(d % 7) - 3.0f;
      },
      3);
  Rows rows;
  rows.chunk(0, 19, 1);
  std::mt19937 rng(3);
  const std::vector<uint16_t> q = random_f16(4 * 64, 1.0f, rng);
  const std::vector<float> out = run({&kv, &rows, 4, &q, nullptr});
  for (int64_t h = 0; h < 4; ++h) {
    double norm = 0.0;
    for (int64_t d = 0; d < 64; ++d) norm += std::fabs(out[size_t(h * 64 + d)]);
    if (h < 2) {
      EXPECT_GT(norm, 1.0) << "head " << h;
    } else {
      EXPECT_EQ(norm, 0.0) << "head " << h;
    }
  }
}

TEST(PagedAttention, E4m3EqualsF16HoldingTheDecodedValues) {
  // The E4M3 cache with scales (k_s, v_s) and an FP16 cache holding decode(code) * 2^e with scales
  // (k_s / 2^e, v_s / 2^e) describe the same numbers; when the factors are powers of two every
  // step rounds identically, so the outputs are bit-identical.
  std::mt19937 rng(4);
  for (const int64_t head_dim : {64, 128, 256}) {
    const float k_scale = 0.0625f;
    const float v_scale = 0.125f;
    PagedKv e4m3 = make_cache(KvCacheDtype::kE4m3, 32, 2, head_dim, {90, 33}, k_scale, v_scale,
                              normal_values(5, 2.0f), 5);
    Rows rows;
    rows.chunk(0, 70, 20);
    rows.chunk(1, 32, 1);
    const std::vector<uint16_t> q = random_f16(size_t(rows.n() * 6 * head_dim), 1.0f, rng);
    const std::vector<uint16_t> gate = random_f16(q.size(), 1.0f, rng);
    const std::vector<float> want = run({&e4m3, &rows, 6, &q, &gate});
    // FP16 of decode(code) * scale with scale 1: the contract's FP16 cache.
    PagedKv f16_scaled = f16_of_decoded(e4m3, k_scale, 1.0f, 1.0f);
    // (the V half was also multiplied by k_scale; undo with the V scale ratio)
    f16_scaled.v_scale = v_scale / k_scale;
    EXPECT_EQ(count_different(run({&f16_scaled, &rows, 6, &q, &gate}), want), 0) << head_dim;
    // FP16 of decode(code) with the same (arbitrary) scales as the E4M3 cache.
    PagedKv f16_same = f16_of_decoded(e4m3, 1.0f, k_scale, v_scale);
    EXPECT_EQ(count_different(run({&f16_same, &rows, 6, &q, &gate}), want), 0) << head_dim;
    // And both equal the naive reference to fp32 rounding.
    expect_matches_naive(want, naive_attention(e4m3, rows, 6, q, &gate), "e4m3");
  }
  // A calibrated (non power of two) scale: FP16 with the same scales is still bit-identical, and
  // the output equals the float-valued reference.
  PagedKv e4m3 = make_cache(KvCacheDtype::kE4m3, 64, 1, 128, {150}, 0.0171247218f, 0.0841238871f,
                            normal_values(6, 1.0f), 6);
  Rows rows;
  rows.chunk(0, 100, 50);
  const std::vector<uint16_t> q = random_f16(size_t(rows.n() * 2 * 128), 1.0f, rng);
  const std::vector<float> want = run({&e4m3, &rows, 2, &q, nullptr});
  PagedKv f16_same = f16_of_decoded(e4m3, 1.0f, e4m3.k_scale, e4m3.v_scale);
  EXPECT_EQ(count_different(run({&f16_same, &rows, 2, &q, nullptr}), want), 0);
  expect_matches_naive(want, naive_attention(e4m3, rows, 2, q, nullptr), "calibrated scale");
}

TEST(PagedAttention, SplitKMatchesNoSplit) {
  // Tolerance: |split - no split| <= 2e-6 * max|out| + 2e-5 * |no split| elementwise and relative
  // L2 <= 1e-6 (measured: max error <= 1e-6 * max|out|, relative L2 <= 5e-7; near-zero outputs
  // carry cancellation, hence the absolute term). One split (and extra empty splits) is
  // bit-identical.
  std::mt19937 rng(7);
  for (const KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
    PagedKv kv = make_cache(dtype, 16, 2, 128, {300, 45}, 0.05f, 0.05f, normal_values(8, 3.0f), 8);
    Rows rows;
    rows.chunk(0, 280, 20);
    rows.chunk(1, 44, 1);
    rows.chunk(0, 5, 1);
    const std::vector<uint16_t> q = random_f16(size_t(rows.n() * 8 * 128), 2.0f, rng);
    const std::vector<uint16_t> gate = random_f16(q.size(), 1.0f, rng);
    const Problem problem{&kv, &rows, 8, &q, &gate};
    const std::vector<float> whole = run(problem);
    EXPECT_EQ(count_different(run_split(problem, 1000), whole), 0);
    EXPECT_EQ(count_different(run_split(problem, 1000, 3), whole), 0);
    double scale = 0.0;
    for (const float x : whole) scale = std::max(scale, double(std::fabs(x)));
    for (const int64_t keys_per_split : {1, 3, 16, 17, 64, 100, 299}) {
      const std::vector<float> split = run_split(problem, keys_per_split, keys_per_split % 2);
      EXPECT_TRUE(test::all_close(split, whole, 2e-6 * scale, 2e-5))
          << "keys_per_split " << keys_per_split;
      EXPECT_LE(test::compare(split, whole, 0.0, 0.0).rel_l2, 1e-6);
    }
  }
}

TEST(PagedAttention, QsaSelectionAndEmptySelection) {
  std::mt19937 rng(9);
  PagedKv kv =
      make_cache(KvCacheDtype::kE4m3, 32, 2, 64, {200}, 0.02f, 0.03f, normal_values(10, 2.0f), 10);
  Rows rows;
  rows.chunk(0, 150, 50);
  select_rows(kv, rows, 32, rng);
  const std::vector<uint16_t> q = random_f16(size_t(rows.n() * 4 * 64), 1.0f, rng);
  const Problem problem{&kv, &rows, 4, &q, nullptr};
  const std::vector<double> ref = naive_attention(kv, rows, 4, q, nullptr);
  expect_matches_naive(run(problem), ref, "qsa");
  expect_matches_naive(run_split(problem, 7), ref, "qsa split");
  // An empty selection row attends to nothing: zero output (also through split-K).
  rows.sel_counts[3] = 0;
  std::vector<float> out = run(problem);
  for (int64_t i = 0; i < 4 * 64; ++i) ASSERT_EQ(out[size_t(3 * 4 * 64 + i)], 0.0f);
  out = run_split(problem, 5);
  for (int64_t i = 0; i < 4 * 64; ++i) ASSERT_EQ(out[size_t(3 * 4 * 64 + i)], 0.0f);
}

TEST(PagedAttention, SeedMixedBatchOf49Rows) {
  // The seed's layout: a 46-row catch-up chunk plus three decode rows, QSA over an E4M3 cache,
  // head_dim 256, 2 KV heads, GQA 8 (the seed model's head shape), budget 64.
  std::mt19937 rng(11);
  PagedKv kv = make_cache(KvCacheDtype::kE4m3, 64, 2, 256, {400, 130, 67, 301}, 0.0171247218f,
                          0.0841238871f, normal_values(12, 1.5f), 12);
  Rows rows;
  rows.chunk(0, 400 - 46, 46);
  rows.chunk(1, 129, 1);
  rows.chunk(2, 66, 1);
  rows.chunk(3, 300, 1);
  ASSERT_EQ(rows.n(), 49);
  select_rows(kv, rows, 64, rng);
  const std::vector<uint16_t> q = random_f16(size_t(rows.n() * 16 * 256), 1.0f, rng);
  const std::vector<uint16_t> gate = random_f16(q.size(), 1.0f, rng);
  const Problem problem{&kv, &rows, 16, &q, &gate};
  const std::vector<double> ref = naive_attention(kv, rows, 16, q, &gate);
  expect_matches_naive(run(problem), ref, "49 rows");
  expect_matches_naive(run_split(problem, 16), ref, "49 rows, split-K");
}

TEST(PagedAttention, RandomizedSweepAgainstNaiveReference) {
  // Every (head_dim, block_size, dtype, dense/QSA) combination, GQA groups 1, 2, 4, 6, 8 in turn,
  // 1 or 2 KV heads, 1-3 sequences with prefill chunks and decode rows in one batch, with and
  // without a gate; each case also through split-K with a random split.
  std::mt19937 rng(2026);
  const int64_t groups[] = {1, 2, 4, 6, 8};
  int case_index = 0;
  for (const int64_t head_dim : {64, 128, 256}) {
    for (const int64_t block_size : {16, 32, 64}) {
      for (const KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
        for (const bool qsa : {false, true}) {
          const int64_t group = groups[case_index % 5];
          const int64_t n_kv_heads = 1 + case_index % 2;
          const int64_t n_heads = group * n_kv_heads;
          const uint32_t seed = uint32_t(1000 + case_index);
          ++case_index;
          const int n_seqs = std::uniform_int_distribution<int>(1, 3)(rng);
          std::vector<int32_t> lens;
          for (int s = 0; s < n_seqs; ++s) {
            lens.push_back(
                std::uniform_int_distribution<int32_t>(1, int32_t(2 * block_size + 40))(rng));
          }
          const float scale = dtype == KvCacheDtype::kE4m3 ? 1.0f / 64.0f : 1.0f;
          PagedKv kv = make_cache(dtype, block_size, n_kv_heads, head_dim, lens, scale, scale * 2,
                                  normal_values(seed, 1.0f), seed);
          Rows rows;
          for (int s = 0; s < n_seqs; ++s) {
            // A prefill chunk ending at the sequence's last token, or a decode row.
            const bool decode = std::uniform_int_distribution<int>(0, 1)(rng) == 1;
            const int32_t n = decode ? 1
                                     : std::uniform_int_distribution<int32_t>(
                                           1, std::min(lens[size_t(s)], 12))(rng);
            rows.chunk(s, lens[size_t(s)] - n, n);
          }
          if (qsa)
            select_rows(kv, rows, std::vector<int64_t>{8, 16, 32}[size_t(case_index % 3)], rng);
          const float q_std = std::uniform_real_distribution<float>(0.5f, 3.0f)(rng);
          const std::vector<uint16_t> q =
              random_f16(size_t(rows.n() * n_heads * head_dim), q_std, rng);
          const std::vector<uint16_t> gate = random_f16(q.size(), 1.0f, rng);
          const std::vector<uint16_t>* g = case_index % 3 == 0 ? nullptr : &gate;
          const Problem problem{&kv, &rows, n_heads, &q, g};
          const std::vector<double> ref = naive_attention(kv, rows, n_heads, q, g);
          const std::string what =
              cat("case ", case_index, ": head_dim ", head_dim, ", block ", block_size, ", ",
                  dtype == KvCacheDtype::kE4m3 ? "e4m3" : "f16", ", ", qsa ? "qsa" : "dense",
                  ", GQA ", group, "x", n_kv_heads);
          expect_matches_naive(run(problem), ref, what);
          const int64_t keys_per_split = std::uniform_int_distribution<int64_t>(1, 40)(rng);
          expect_matches_naive(run_split(problem, keys_per_split), ref, what + " split-K");
        }
      }
    }
  }
  EXPECT_EQ(case_index, 36);
}

TEST(PagedAttention, DenseProbabilitiesAndMassRecall) {
  std::mt19937 rng(13);
  PagedKv kv =
      make_cache(KvCacheDtype::kF16, 16, 1, 64, {120}, 1.0f, 1.0f, normal_values(14, 1.0f), 14);
  Rows rows;
  rows.chunk(0, 20, 1);   // dense under budget 32 (pos < budget + 3)
  rows.chunk(0, 119, 1);  // sparse
  select_rows(kv, rows, 32, rng);
  const std::vector<uint16_t> q = random_f16(size_t(rows.n() * 2 * 64), 2.0f, rng);
  std::vector<float> unused;
  const PagedAttentionParams p = Problem{&kv, &rows, 2, &q, nullptr}.params(unused);
  for (int64_t r = 0; r < 2; ++r) {
    const int64_t n_keys = rows.pos[size_t(r)] + 1;
    std::vector<float> probs(size_t(2 * n_keys));
    const Status status = dense_attention_probs(p, r, probs.data());
    ASSERT_TRUE(status.ok()) << status.message();
    for (int64_t h = 0; h < 2; ++h) {
      // Against double-precision probabilities.
      std::vector<double> want(static_cast<size_t>(n_keys));
      for (int64_t t = 0; t < n_keys; ++t) {
        double dot = 0.0;
        for (int64_t d = 0; d < 64; ++d) {
          dot += double(f16_to_f32(q[size_t((r * 2 + h) * 64 + d)])) *
                 kv.stored[0][0][size_t(t * 64 + d)];
        }
        want[size_t(t)] = dot / 8.0;
      }
      const double max_logit = *std::max_element(want.begin(), want.end());
      double sum = 0.0;
      for (double& x : want) sum += (x = std::exp(x - max_logit));
      for (double& x : want) x /= sum;
      const std::vector<float> got(probs.begin() + h * n_keys, probs.begin() + (h + 1) * n_keys);
      EXPECT_TRUE(test::all_close(got, want, 1e-7, 1e-5));
      const std::vector<int32_t> sel(rows.sel_tokens.begin() + r * rows.sel_width,
                                     rows.sel_tokens.begin() + (r + 1) * rows.sel_width);
      const double recall = attention_mass_recall(got, sel);
      if (r == 0) {
        EXPECT_NEAR(recall, 1.0, 1e-6);
      } else {
        EXPECT_GT(recall, 0.0);
        EXPECT_LT(recall, 1.0);
      }
    }
  }
}

TEST(PagedAttention, RejectsBadInput) {
  PagedKv kv =
      make_cache(KvCacheDtype::kF16, 16, 2, 64, {20}, 1.0f, 1.0f, normal_values(15, 1.0f), 15);
  Rows rows;
  rows.chunk(0, 19, 1);
  std::mt19937 rng(15);
  const std::vector<uint16_t> q = random_f16(4 * 64, 1.0f, rng);
  std::vector<float> out;
  auto message = [&](const std::function<void(PagedAttentionParams&)>& edit) {
    PagedAttentionParams p = Problem{&kv, &rows, 4, &q, nullptr}.params(out);
    edit(p);
    const Status status = paged_attention(p);
    return status.ok() ? std::string("ok") : status.message();
  };
  EXPECT_EQ(message([](PagedAttentionParams&) {}), "ok");
  EXPECT_NE(message([](PagedAttentionParams& p) { p.n_heads = 3; }).find("n_heads"),
            std::string::npos);
  EXPECT_NE(message([](PagedAttentionParams& p) { p.cache.k_scale = 0.0f; }).find("scales"),
            std::string::npos);
  EXPECT_NE(message([](PagedAttentionParams& p) { p.cache.v_scale = NAN; }).find("scales"),
            std::string::npos);
  EXPECT_NE(message([](PagedAttentionParams& p) { p.out = nullptr; }).find("null"),
            std::string::npos);
  std::vector<int32_t> bad_pos = {20};  // == seq_len
  EXPECT_NE(message([&](PagedAttentionParams& p) {
              p.rows.row_pos = bad_pos.data();
            }).find("position 20"),
            std::string::npos);
  std::vector<int32_t> bad_seq = {1};
  EXPECT_NE(
      message([&](PagedAttentionParams& p) { p.rows.row_seq = bad_seq.data(); }).find("sequence 1"),
      std::string::npos);
  std::vector<int32_t> bad_table = {0, 99};
  EXPECT_NE(message([&](PagedAttentionParams& p) {
              p.block_table.blocks = bad_table.data();
            }).find("block table entry"),
            std::string::npos);
  std::vector<int32_t> sel = {0, 5, 20, -1};
  std::vector<int32_t> count = {3};
  EXPECT_NE(message([&](PagedAttentionParams& p) {
              p.rows.sel_tokens = sel.data();
              p.rows.sel_counts = count.data();
              p.rows.sel_width = 4;
            }).find("causal range"),
            std::string::npos);
  std::vector<int32_t> big_count = {5};
  EXPECT_NE(message([&](PagedAttentionParams& p) {
              p.rows.sel_tokens = sel.data();
              p.rows.sel_counts = big_count.data();
              p.rows.sel_width = 4;
            }).find("selection count"),
            std::string::npos);
  // Too few splits for the partial buffers.
  PagedAttentionParams p = Problem{&kv, &rows, 4, &q, nullptr}.params(out);
  std::vector<float> m(8), l(8), acc(8 * 64);
  const AttentionPartialsView partials{4, 2, m.data(), l.data(), acc.data()};  // 20 keys need 5
  const Status status = paged_attention_partial(p, partials);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("needs 5 splits"), std::string::npos) << status.message();
}

// ---- quality of calibrated E4M3 against FP16
// ------------------------------------------------------

// Default policy of DESIGN.md section 6: the smallest fp32 s with fl(absmax / s) <= 448.
float calibrated_scale(float absmax) {
  float s = absmax / kE4m3Max;
  while (absmax / s > kE4m3Max) s = std::nextafter(s, INFINITY);
  while (absmax / std::nextafter(s, 0.0f) <= kE4m3Max) s = std::nextafter(s, 0.0f);
  return s;
}

// K/V with the structure of a trained model's: K has a few fixed outlier channels (4 per head,
// 20-50x the rest), V has none (keys carry channel outliers, values do not: KIVI, Liu et al. 2024).
// The FP16 value is what the cache write sees.
struct Structured {
  int64_t head_dim = 128;
  int64_t n_kv_heads = 2;
  float base = 1.0f;
  std::vector<float> k_gain;  // [n_kv_heads * head_dim]

  Structured(float base_std, uint32_t seed) : base(base_std) {
    std::mt19937 rng(seed);
    k_gain.assign(size_t(n_kv_heads * head_dim), 1.0f);
    std::uniform_int_distribution<int64_t> channel(0, head_dim - 1);
    std::uniform_real_distribution<float> gain(20.0f, 50.0f);
    for (int64_t h = 0; h < n_kv_heads; ++h) {
      for (int i = 0; i < 4; ++i) k_gain[size_t(h * head_dim + channel(rng))] = gain(rng);
    }
  }
  float value(int64_t s, int64_t t, int c, int64_t h, int64_t d) const {
    const float x = base * hashed_normal(77, s, t, c, h, d);
    const float g = c == 0 ? k_gain[size_t(h * head_dim + d)] : 1.0f;
    return f16_to_f32(f32_to_f16(x * g));
  }
  float absmax(int c, int64_t len) const {
    float m = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
      for (int64_t h = 0; h < n_kv_heads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) m = std::max(m, std::fabs(value(0, t, c, h, d)));
      }
    }
    return m;
  }
};

struct QualityRun {
  OutputError error;
  double flushed = 0.0;    // fraction of nonzero inputs stored as zero
  double subnormal = 0.0;  // fraction of elements stored as E4M3 subnormals
};

// Attention of 24 rows (a 16-row chunk and 8 decode-like rows) over a 1024-token sequence, GQA 8,
// through an E4M3 cache with the given scales, against the FP16 cache of the same values.
QualityRun quality(const Structured& data, float q_std, float k_scale, float v_scale) {
  const int64_t len = 1024;
  const ValueFn value = [&](int64_t s, int64_t t, int c, int64_t h, int64_t d) {
    return data.value(s, t, c, h, d);
  };
  PagedKv f16 = make_cache(KvCacheDtype::kF16, 64, data.n_kv_heads, data.head_dim, {len}, 1.0f,
                           1.0f, value, 1);
  PagedKv e4m3 = make_cache(KvCacheDtype::kE4m3, 64, data.n_kv_heads, data.head_dim, {len}, k_scale,
                            v_scale, value, 1);
  Rows rows;
  rows.chunk(0, len - 16, 16);
  for (int32_t i = 0; i < 8; ++i) rows.chunk(0, 100 + 111 * i, 1);
  std::mt19937 rng(21);
  const int64_t n_heads = 8 * data.n_kv_heads;
  const std::vector<uint16_t> q =
      random_f16(size_t(rows.n() * n_heads * data.head_dim), q_std, rng);
  const std::vector<uint16_t> gate = random_f16(q.size(), 1.0f, rng);
  const std::vector<float> want = run({&f16, &rows, n_heads, &q, &gate});
  const std::vector<float> got = run({&e4m3, &rows, n_heads, &q, &gate});
  QualityRun result;
  result.error = output_error(got, want);
  result.flushed = double(e4m3.n_flushed) / double(e4m3.n_nonzero);
  result.subnormal = double(e4m3.n_subnormal) / double(2 * len * data.n_kv_heads * data.head_dim);
  return result;
}

void print(const char* label, const QualityRun& r) {
  std::printf(
      "  %-34s cosine %.6f  rel L2 %.6f  RMSE %.3g  flushed-to-zero %.4f%%  subnormal %.4f%%\n",
      label, r.error.cosine, r.error.rel_l2, r.error.rmse, 100.0 * r.flushed, 100.0 * r.subnormal);
}

// q ~ N(0, 0.15 / base): logits with a standard deviation of about 1, mostly through K's outlier
// channels. The output error (about 7% relative L2 on this synthetic data; V's rounding alone gives
// about 2.5%) is dominated by K's rounding: with 3 mantissa bits an outlier-channel key is off by
// ~2.7% RMS, which moves the logits by a few hundredths, most on the large-|k| tokens that carry
// the attention weight; it grows with the spread of the logits (q ~ N(0, 0.05) gives about 2%).
constexpr float kQStdTimesBase = 0.15f;

TEST(AttentionQuality, CalibratedE4m3AgainstF16OnOutlierChannels) {
  // Unit-magnitude K/V (|x| ~ 1, K outlier channels to ~200).
  const Structured data(1.0f, 31);
  const float k_scale = calibrated_scale(data.absmax(0, 1024));
  const float v_scale = calibrated_scale(data.absmax(1, 1024));
  const QualityRun calibrated = quality(data, kQStdTimesBase, k_scale, v_scale);
  const QualityRun unit = quality(data, kQStdTimesBase, 1.0f, 1.0f);
  std::printf(
      "E4M3 vs FP16 attention output (24 rows x 16 heads, GQA 8, 1024 tokens), |x| ~ 1, "
      "K with 20-50x outlier channels (k_scale %.6g, v_scale %.6g):\n",
      k_scale, v_scale);
  print("calibrated (absmax / 448)", calibrated);
  print("unit scale 1.0", unit);
  EXPECT_GT(calibrated.error.cosine, 0.995);
  EXPECT_LT(calibrated.error.rel_l2, 0.1);
  EXPECT_LT(calibrated.flushed, 1e-3);
}

TEST(AttentionQuality, UnitScaleUnderflowsSmallValues) {
  // Small-magnitude K/V (|x| ~ 1e-3..1e-2, K outlier channels to ~0.5): at scale 1.0 a large share
  // of the values falls below half of E4M3's smallest subnormal 2^-9 (flushed to zero) or into the
  // subnormal range below 2^-6 (at most 3 significant bits, fewer below), as the seed describes;
  // calibrated scales move them into the normal range.
  const Structured data(3e-3f, 32);
  const float k_scale = calibrated_scale(data.absmax(0, 1024));
  const float v_scale = calibrated_scale(data.absmax(1, 1024));
  const float q_std = kQStdTimesBase / 3e-3f;  // the same logits as at unit magnitude
  const QualityRun calibrated = quality(data, q_std, k_scale, v_scale);
  const QualityRun unit = quality(data, q_std, 1.0f, 1.0f);
  std::printf(
      "E4M3 vs FP16 attention output (24 rows x 16 heads, GQA 8, 1024 tokens), "
      "|x| ~ 1e-3..1e-2, K with 20-50x outlier channels (k_scale %.6g, v_scale %.6g):\n",
      k_scale, v_scale);
  print("calibrated (absmax / 448)", calibrated);
  print("unit scale 1.0 (negative control)", unit);
  EXPECT_GT(unit.flushed, 0.1);  // a tenth of the nonzero values or more vanish at scale 1.0
  EXPECT_GT(unit.subnormal, 0.3);
  EXPECT_LT(calibrated.flushed, 1e-3);
  EXPECT_GT(calibrated.error.cosine, 0.995);
  EXPECT_LT(calibrated.error.rel_l2, 0.1);
  EXPECT_LT(calibrated.error.rel_l2 * 2.0, unit.error.rel_l2);
  EXPECT_GT(calibrated.error.cosine, unit.error.cosine);
}

}  // namespace
}  // namespace e4kv
