// QSA indexer caches: the same token stream fed as one prefill, as prefill chunks cut at every
// residue mod 4, as random chunks, token by token, and batched with another sequence gives
// byte-identical compressed rows and raw rings; every row matches a plain double-precision
// computation of DESIGN.md section 4 step 4; a forked sequence continues correctly.
#include "qsa/indexer_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/norm_rope.h"

namespace e4kv {
namespace {

constexpr uint16_t kUnwritten = 0xFFFF;  // a NaN pattern no computed row produces

struct IndexerSetup {
  int64_t index_dim = 32;
  int64_t rotary_dim = 16;
  int64_t ratio = 4;
  int64_t block_size = 16;
  int64_t cap = 4;
  double theta = 1.0e7;
  float eps = 1e-6f;
  std::vector<uint16_t> norm_weight;  // [index_dim]
  std::vector<double> inv_freq;       // [rotary_dim / 2]

  IndexerKeyNormRope norm_rope() const {
    return {norm_weight.data(), eps, rotary_dim, inv_freq.data()};
  }
  int64_t rows_per_block() const { return block_size / ratio; }
};

// Random FP16 raw keys with magnitudes in [2^-8, 8): four of them sum exactly in fp32, so the pool
// stage has no rounding before its final FP16 rounding and the reference below can match it.
std::vector<uint16_t> random_keys(std::mt19937& rng, int64_t n_tokens, int64_t dim) {
  std::vector<uint16_t> keys(static_cast<size_t>(n_tokens * dim));
  for (auto& h : keys) {
    const uint32_t exponent = 15 - 8 + rng() % 11;  // biased FP16 exponent for 2^-8 .. 2^2
    h = uint16_t((rng() & 1 ? 0x8000u : 0u) | (exponent << 10) | (rng() & 0x3FFu));
  }
  return keys;
}

IndexerSetup make_setup(int64_t index_dim, int64_t rotary_dim, int64_t cap, uint32_t seed) {
  IndexerSetup s;
  s.index_dim = index_dim;
  s.rotary_dim = rotary_dim;
  s.cap = cap;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-0.6f, 0.6f);
  for (int64_t j = 0; j < index_dim; ++j) s.norm_weight.push_back(f32_to_f16(dist(rng)));
  s.inv_freq = rope_inv_freq(s.theta, rotary_dim);
  return s;
}

// Caches of one QSA layer shared by the sequences of one run.
struct Caches {
  std::vector<uint16_t> compressed;  // [n_blocks, block_size / ratio, index_dim]
  std::vector<uint16_t> rings;       // [n_rings, cap, index_dim]
  IndexerCompressedView compressed_view;
  IndexerRingView ring_view;

  Caches(const IndexerSetup& s, int64_t n_blocks, int64_t n_rings) {
    compressed.assign(static_cast<size_t>(n_blocks * s.rows_per_block() * s.index_dim), kUnwritten);
    rings.assign(static_cast<size_t>(n_rings * s.cap * s.index_dim), 0x7777);  // stale garbage
    compressed_view = {compressed.data(), n_blocks, s.block_size, s.ratio, s.index_dim};
    ring_view = {rings.data(), n_rings, s.cap, s.index_dim};
  }
  std::vector<uint16_t> ring(int64_t r) const {
    const auto begin = rings.begin() + r * ring_view.cap * ring_view.index_dim;
    return std::vector<uint16_t>(begin, begin + ring_view.cap * ring_view.index_dim);
  }
};

// One sequence's part of a batch step.
struct Chunk {
  const std::vector<uint16_t>* keys;  // the sequence's whole stream [n_tokens, index_dim]
  int64_t start;
  int64_t n;
  int32_t ring;
  const BlockTable* table;
};

void write_step(const IndexerSetup& s, Caches& caches, const std::vector<Chunk>& chunks) {
  std::vector<uint16_t> index_k;  // [n_tokens, index_dim]
  std::vector<int32_t> offsets = {0};
  std::vector<int64_t> starts;
  std::vector<int32_t> rings;
  std::vector<const BlockTable*> tables;
  for (const Chunk& c : chunks) {
    index_k.insert(index_k.end(), c.keys->begin() + c.start * s.index_dim,
                   c.keys->begin() + (c.start + c.n) * s.index_dim);
    offsets.push_back(offsets.back() + static_cast<int32_t>(c.n));
    starts.push_back(c.start);
    rings.push_back(c.ring);
    tables.push_back(c.table);
  }
  // The tables padded with -1 to the longest, as a step's block table is.
  int64_t max_blocks = 0;
  for (const BlockTable* table : tables) {
    max_blocks = std::max(max_blocks, static_cast<int64_t>(table->blocks.size()));
  }
  std::vector<int32_t> padded(tables.size() * static_cast<size_t>(max_blocks), -1);
  for (size_t i = 0; i < tables.size(); ++i) {
    std::copy(tables[i]->blocks.begin(), tables[i]->blocks.end(),
              padded.begin() + static_cast<ptrdiff_t>(i) * max_blocks);
  }
  IndexerWriteBatch batch;
  batch.index_k = index_k.data();
  batch.token_offsets = offsets.data();
  batch.start_pos = starts.data();
  batch.ring_index = rings.data();
  batch.n_seqs = static_cast<int64_t>(chunks.size());
  batch.block_tables = {padded.data(), static_cast<int64_t>(tables.size()), max_blocks};
  indexer_cache_write(caches.compressed_view, caches.ring_view, batch, s.norm_rope());
}

// Feeds one sequence's stream in chunks of the given lengths (ring 0).
Caches feed(const IndexerSetup& s, const std::vector<uint16_t>& keys, const BlockTable& table,
            int64_t n_blocks, const std::vector<int64_t>& lengths) {
  Caches caches(s, n_blocks, 1);
  int64_t start = 0;
  for (int64_t n : lengths) {
    write_step(s, caches, {{&keys, start, n, 0, &table}});
    start += n;
  }
  EXPECT_EQ(start * s.index_dim, static_cast<int64_t>(keys.size()));
  return caches;
}

// The rows of groups 0 .. n_groups-1 read through the block table by hand (not through the code
// under test): group c in logical block c * ratio / block_size, row c % (block_size / ratio).
std::vector<uint16_t> gather_rows(const IndexerSetup& s, const Caches& caches,
                                  const BlockTable& table, int64_t n_groups) {
  std::vector<uint16_t> rows;
  for (int64_t c = 0; c < n_groups; ++c) {
    const int64_t block = table.blocks[static_cast<size_t>(c * s.ratio / s.block_size)];
    const int64_t row = c % s.rows_per_block();
    const auto begin = caches.compressed.begin() + (block * s.rows_per_block() + row) * s.index_dim;
    rows.insert(rows.end(), begin, begin + s.index_dim);
  }
  return rows;
}

// What the ring must hold after positions 0..n_tokens-1: slot j = key of the largest p with
// p % cap == j, zeros when there is none.
std::vector<uint16_t> expected_ring(const IndexerSetup& s, const std::vector<uint16_t>& keys,
                                    int64_t n_tokens) {
  std::vector<uint16_t> ring(static_cast<size_t>(s.cap * s.index_dim), 0);
  for (int64_t p = std::max<int64_t>(0, n_tokens - s.cap); p < n_tokens; ++p) {
    std::copy_n(keys.begin() + p * s.index_dim, s.index_dim,
                ring.begin() + (p % s.cap) * s.index_dim);
  }
  return ring;
}

uint16_t f16_from_double(double x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

double ulp16(double x) {
  int exponent = 0;
  std::frexp(std::fabs(x), &exponent);
  return std::ldexp(1.0, std::max(exponent - 11, -24));
}

// Row of group c written plainly in double: mean of the 4 keys, RMSNorm with (1 + w), NeoX RoPE
// at position 4c with exact cos/sin; rounded to FP16 at the same three points as the contract.
// Returns the FP16 row and, per element, the magnitude |a| + |b| of the pair it came from.
void reference_row(const IndexerSetup& s, const std::vector<uint16_t>& keys, int64_t c,
                   std::vector<uint16_t>& row, std::vector<double>& pair_magnitude) {
  const int64_t dim = s.index_dim;
  std::vector<double> pooled(static_cast<size_t>(dim));
  for (int64_t j = 0; j < dim; ++j) {
    double sum = 0.0;
    for (int64_t p = c * s.ratio; p < (c + 1) * s.ratio; ++p) {
      sum += f16_to_f32(keys[static_cast<size_t>(p * dim + j)]);
    }
    pooled[size_t(j)] = f16_to_f32(f16_from_double(sum / double(s.ratio)));
  }
  double sum_squares = 0.0;
  for (double x : pooled) sum_squares += x * x;
  const double inv_rms = 1.0 / std::sqrt(sum_squares / double(dim) + double(s.eps));
  std::vector<double> normed(static_cast<size_t>(dim));
  for (int64_t j = 0; j < dim; ++j) {
    const double w = f16_to_f32(s.norm_weight[size_t(j)]);
    normed[size_t(j)] = f16_to_f32(f16_from_double(pooled[size_t(j)] * inv_rms * (1.0 + w)));
  }
  row.assign(static_cast<size_t>(dim), 0);
  pair_magnitude.assign(static_cast<size_t>(dim), 0.0);
  const int64_t half = s.rotary_dim / 2;
  const double pos = double(c * s.ratio);
  for (int64_t i = 0; i < half; ++i) {
    const double angle = pos * std::pow(s.theta, -double(2 * i) / double(s.rotary_dim));
    const double a = normed[size_t(i)];
    const double b = normed[size_t(i + half)];
    row[size_t(i)] = f16_from_double(a * std::cos(angle) - b * std::sin(angle));
    row[size_t(i + half)] = f16_from_double(b * std::cos(angle) + a * std::sin(angle));
    pair_magnitude[size_t(i)] = pair_magnitude[size_t(i + half)] = std::fabs(a) + std::fabs(b);
  }
  for (int64_t j = s.rotary_dim; j < dim; ++j) {
    row[size_t(j)] = f16_from_double(normed[size_t(j)]);
    pair_magnitude[size_t(j)] = std::fabs(normed[size_t(j)]);
  }
}

// A table over a scrambled set of physical blocks, so logical and physical order differ.
BlockTable scrambled_table(int64_t n_tokens, int64_t block_size, int64_t n_blocks, uint32_t seed) {
  std::vector<int32_t> physical(static_cast<size_t>(n_blocks));
  for (int32_t b = 0; b < n_blocks; ++b) physical[size_t(b)] = b;
  std::mt19937 rng(seed);
  std::shuffle(physical.begin(), physical.end(), rng);
  BlockTable table;
  table.n_tokens = n_tokens;
  table.blocks.assign(physical.begin(), physical.begin() + blocks_for_tokens(n_tokens, block_size));
  return table;
}

struct IndexerCase {
  int64_t index_dim;
  int64_t rotary_dim;
  int64_t cap;
  int64_t n_tokens;
};

class IndexerCacheTest : public ::testing::TestWithParam<IndexerCase> {};

TEST_P(IndexerCacheTest, EveryWayOfCuttingTheStreamGivesIdenticalCaches) {
  const IndexerCase p = GetParam();
  const IndexerSetup s = make_setup(p.index_dim, p.rotary_dim, p.cap, 3);
  std::mt19937 rng(static_cast<uint32_t>(p.n_tokens * 7 + p.index_dim));
  const std::vector<uint16_t> keys = random_keys(rng, p.n_tokens, s.index_dim);
  const int64_t n_blocks = blocks_for_tokens(p.n_tokens, s.block_size) + 3;
  const BlockTable table = scrambled_table(p.n_tokens, s.block_size, n_blocks, 99);
  const int64_t n_groups = p.n_tokens / s.ratio;

  // (a) one prefill.
  const Caches prefill = feed(s, keys, table, n_blocks, {p.n_tokens});

  std::vector<std::pair<std::string, std::vector<int64_t>>> cuts;
  // (b) chunks whose boundaries all sit at one residue mod 4: [0, r), then multiples of 4.
  for (int64_t residue = 0; residue < 4; ++residue) {
    std::vector<int64_t> lengths;
    int64_t at = 0;
    if (residue > 0) {
      lengths.push_back(residue);
      at = residue;
    }
    while (at < p.n_tokens) {
      const int64_t n = std::min<int64_t>(4 * (1 + int64_t(rng() % 5)), p.n_tokens - at);
      lengths.push_back(n);
      at += n;
    }
    cuts.push_back({"boundaries at residue " + std::to_string(residue), lengths});
  }
  {  // random chunk lengths 1..13
    std::vector<int64_t> lengths;
    for (int64_t at = 0; at < p.n_tokens;) {
      const int64_t n = std::min<int64_t>(1 + int64_t(rng() % 13), p.n_tokens - at);
      lengths.push_back(n);
      at += n;
    }
    cuts.push_back({"random chunks", lengths});
  }
  // (c) token-by-token decode after a one-token prefill.
  cuts.push_back({"token by token", std::vector<int64_t>(static_cast<size_t>(p.n_tokens), 1)});

  for (const auto& [name, lengths] : cuts) {
    const Caches other = feed(s, keys, table, n_blocks, lengths);
    EXPECT_EQ(other.compressed, prefill.compressed) << name;
    EXPECT_EQ(other.rings, prefill.rings) << name;
  }

  // The ring holds the last keys by slot p % cap.
  EXPECT_EQ(prefill.ring(0), expected_ring(s, keys, p.n_tokens));

  // Exactly the complete groups were written, each at its own row.
  const std::vector<uint16_t> rows = gather_rows(s, prefill, table, n_groups);
  const int64_t written = std::count_if(prefill.compressed.begin(), prefill.compressed.end(),
                                        [](uint16_t h) { return h != kUnwritten; });
  EXPECT_EQ(written, n_groups * s.index_dim);
  EXPECT_EQ(std::count(rows.begin(), rows.end(), kUnwritten), 0);

  // Each row against the plain double computation. Tolerance: the pool stage is exact here (the
  // keys sum exactly in fp32), but the norm and RoPE stages run in fp32 where the reference runs in
  // double, so an intermediate that sits next to an FP16 rounding boundary may round the other way
  // (one FP16 ulp of the normed value), and the RoPE output may round the other way too. Both
  // together bound the difference by 2 FP16 ulps at the magnitude |a| + |b| of the rotated pair.
  int64_t exact = 0;
  double worst_ulps = 0.0;
  std::vector<uint16_t> want;
  std::vector<double> magnitude;
  for (int64_t c = 0; c < n_groups; ++c) {
    reference_row(s, keys, c, want, magnitude);
    for (int64_t j = 0; j < s.index_dim; ++j) {
      const uint16_t got = rows[size_t(c * s.index_dim + j)];
      const double diff = std::fabs(double(f16_to_f32(got)) - double(f16_to_f32(want[size_t(j)])));
      const double ulps = diff / ulp16(magnitude[size_t(j)]);
      worst_ulps = std::max(worst_ulps, ulps);
      ASSERT_LE(ulps, 2.0) << "group " << c << " dim " << j;
      exact += got == want[size_t(j)] ? 1 : 0;
    }
  }
  const int64_t total = n_groups * s.index_dim;
  EXPECT_GE(double(exact), 0.99 * double(total));
  std::printf(
      "[ indexer ] dim %lld cap %lld: %lld of %lld row elements equal the double reference "
      "exactly, worst %.2f ulp of the pair\n",
      static_cast<long long>(s.index_dim), static_cast<long long>(s.cap),
      static_cast<long long>(exact), static_cast<long long>(total), worst_ulps);
}

TEST_P(IndexerCacheTest, BatchedSequencesMatchTheirSoloRuns) {
  const IndexerCase p = GetParam();
  const IndexerSetup s = make_setup(p.index_dim, p.rotary_dim, p.cap, 4);
  std::mt19937 rng(21);
  const int64_t n_a = p.n_tokens;
  const int64_t n_b = p.n_tokens / 2 + 5;
  const std::vector<uint16_t> keys_a = random_keys(rng, n_a, s.index_dim);
  const std::vector<uint16_t> keys_b = random_keys(rng, n_b, s.index_dim);
  // Both sequences' blocks interleave in one physical pool.
  const int64_t blocks_a = blocks_for_tokens(n_a, s.block_size);
  const int64_t blocks_b = blocks_for_tokens(n_b, s.block_size);
  const int64_t n_blocks = blocks_a + blocks_b;
  const BlockTable all = scrambled_table(n_blocks * s.block_size, s.block_size, n_blocks, 5);
  BlockTable table_a;
  BlockTable table_b;
  for (int64_t i = 0; i < n_blocks; ++i) {
    BlockTable& t = (i % 2 == 0 && int64_t(table_a.blocks.size()) < blocks_a) ||
                            int64_t(table_b.blocks.size()) == blocks_b
                        ? table_a
                        : table_b;
    t.blocks.push_back(all.blocks[size_t(i)]);
  }
  table_a.n_tokens = n_a;
  table_b.n_tokens = n_b;

  Caches batched(s, n_blocks, 3);
  int64_t at_a = 0;
  int64_t at_b = 0;
  while (at_a < n_a || at_b < n_b) {
    const int64_t step_a = std::min<int64_t>(int64_t(rng() % 7), n_a - at_a);
    const int64_t step_b = std::min<int64_t>(int64_t(rng() % 5), n_b - at_b);
    // Sequence B sits first in the batch and uses ring 2; A uses ring 0; a zero-token entry is
    // fine.
    write_step(s, batched,
               {{&keys_b, at_b, step_b, 2, &table_b}, {&keys_a, at_a, step_a, 0, &table_a}});
    at_a += step_a;
    at_b += step_b;
  }
  const Caches solo_a = feed(s, keys_a, table_a, n_blocks, {n_a});
  const Caches solo_b = feed(s, keys_b, table_b, n_blocks, {n_b});
  EXPECT_EQ(gather_rows(s, batched, table_a, n_a / 4), gather_rows(s, solo_a, table_a, n_a / 4));
  EXPECT_EQ(gather_rows(s, batched, table_b, n_b / 4), gather_rows(s, solo_b, table_b, n_b / 4));
  EXPECT_EQ(batched.ring(0), solo_a.ring(0));
  EXPECT_EQ(batched.ring(2), solo_b.ring(0));
  EXPECT_EQ(batched.ring(1),
            std::vector<uint16_t>(size_t(s.cap * s.index_dim), 0x7777));  // untouched
}

TEST_P(IndexerCacheTest, ForkedSequenceContinuesLikeAFreshOne) {
  const IndexerCase p = GetParam();
  const IndexerSetup s = make_setup(p.index_dim, p.rotary_dim, p.cap, 6);
  std::mt19937 rng(8);
  const int64_t prefix = 10;  // 2 complete groups, 2 keys in the ring, a partly filled block
  const int64_t more_a = 7;
  const int64_t more_b = 29;
  const std::vector<uint16_t> shared = random_keys(rng, prefix, s.index_dim);
  std::vector<uint16_t> keys_a = shared;
  std::vector<uint16_t> keys_b = shared;
  const std::vector<uint16_t> tail_a = random_keys(rng, more_a, s.index_dim);
  const std::vector<uint16_t> tail_b = random_keys(rng, more_b, s.index_dim);
  keys_a.insert(keys_a.end(), tail_a.begin(), tail_a.end());
  keys_b.insert(keys_b.end(), tail_b.begin(), tail_b.end());

  const int64_t n_blocks = 8;
  BlockAllocator allocator(n_blocks, s.block_size);
  Caches caches(s, n_blocks, 2);
  BlockTable table_a;
  allocator.append(table_a, prefix);
  write_step(s, caches, {{&keys_a, 0, prefix, 0, &table_a}});
  BlockTable table_b = allocator.fork(table_a);
  indexer_ring_copy(caches.ring_view, 0, 1);

  // A appends into the shared partial block first: it must get its own copy of it.
  std::vector<BlockCopy> copies = allocator.append(table_a, more_a);
  ASSERT_EQ(copies.size(), 1u);
  indexer_copy_blocks(caches.compressed_view, copies.data(), int64_t(copies.size()));
  copies = allocator.append(table_b, more_b);
  EXPECT_TRUE(copies.empty());
  write_step(s, caches,
             {{&keys_a, prefix, more_a, 0, &table_a}, {&keys_b, prefix, more_b, 1, &table_b}});

  const Caches fresh_a = feed(s, keys_a, table_a, n_blocks, {prefix + more_a});
  const Caches fresh_b = feed(s, keys_b, table_b, n_blocks, {prefix + more_b});
  const int64_t groups_a = (prefix + more_a) / 4;
  const int64_t groups_b = (prefix + more_b) / 4;
  EXPECT_EQ(gather_rows(s, caches, table_a, groups_a), gather_rows(s, fresh_a, table_a, groups_a));
  EXPECT_EQ(gather_rows(s, caches, table_b, groups_b), gather_rows(s, fresh_b, table_b, groups_b));
  EXPECT_EQ(caches.ring(0), fresh_a.ring(0));
  EXPECT_EQ(caches.ring(1), fresh_b.ring(0));
}

INSTANTIATE_TEST_SUITE_P(Shapes, IndexerCacheTest,
                         ::testing::Values(IndexerCase{32, 16, 4, 203},   // small, many groups
                                           IndexerCase{32, 16, 8, 130},   // speculative ring
                                           IndexerCase{128, 64, 4, 611},  // the seed's shape
                                           IndexerCase{128, 128, 4, 66}),
                         [](const ::testing::TestParamInfo<IndexerCase>& param_info) {
                           return "dim" + std::to_string(param_info.param.index_dim) + "_rot" +
                                  std::to_string(param_info.param.rotary_dim) + "_cap" +
                                  std::to_string(param_info.param.cap) + "_n" +
                                  std::to_string(param_info.param.n_tokens);
                         });

TEST(IndexerCache, CompressedRowAccessorFollowsTheBlockTable) {
  std::vector<uint16_t> data(5 * 4 * 8);  // [5 blocks, 16 / 4 rows, 8 dims]
  for (size_t i = 0; i < data.size(); ++i) data[i] = uint16_t(i);
  const IndexerCompressedView view{data.data(), 5, 16, 4, 8};
  const std::vector<int32_t> table = {3, 0, 4};  // one sequence
  const BlockTableView tables{table.data(), 1, 3};
  // Group 5: logical block 5 * 4 / 16 = 1 -> physical 0, row 5 % 4 = 1 -> element (0 * 4 + 1) * 8.
  EXPECT_EQ(indexer_compressed_row(view, tables, 0, 5), data.data() + 8);
  // Group 9: logical block 2 -> physical 4, row 1 -> element (4 * 4 + 1) * 8 = 136.
  EXPECT_EQ(indexer_compressed_row(view, tables, 0, 9), data.data() + 136);
  EXPECT_EQ(indexer_compressed_row(view, tables, 0, 0), data.data() + 3 * 4 * 8);
}

}  // namespace
}  // namespace e4kv
