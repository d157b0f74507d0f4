// QSA selection: hand-built cases for every rule of DESIGN.md section 4 (steps 5-7) and randomized
// cases against a brute-force selection (full sort in (score desc, index asc) order).
#include "qsa/selection.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/half.h"

namespace e4kv {
namespace {

std::vector<int32_t> top_k(const std::vector<float>& scores, int64_t k) {
  std::vector<int32_t> groups(std::min<size_t>(size_t(k), scores.size()));
  const int64_t n = qsa_top_k_groups(scores, k, groups.data());
  EXPECT_EQ(n, int64_t(groups.size()));
  return groups;
}

// Brute force: order all groups by (score desc, index asc), keep the first k, emit ascending.
std::vector<int32_t> brute_top_k(const std::vector<float>& scores, int64_t k) {
  std::vector<int32_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (scores[size_t(a)] != scores[size_t(b)]) return scores[size_t(a)] > scores[size_t(b)];
    return a < b;
  });
  order.resize(std::min<size_t>(order.size(), size_t(k)));
  std::sort(order.begin(), order.end());
  return order;
}

TEST(QsaTopK, TiesAtTheKthScoreTakeTheLowestIndices) {
  // Sorted: 3 (g1), 2 (g2, g3, g4), 1 (g0), 0 (g5).
  const std::vector<float> scores = {1, 3, 2, 2, 2, 0};
  EXPECT_EQ(top_k(scores, 1), (std::vector<int32_t>{1}));
  EXPECT_EQ(top_k(scores, 2), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(top_k(scores, 3), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(top_k(scores, 4), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(top_k(scores, 5), (std::vector<int32_t>{0, 1, 2, 3, 4}));
}

TEST(QsaTopK, TieOfEveryGroupAtTheKthScore) {
  const std::vector<float> scores = {7, 7, 7, 7, 7};
  EXPECT_EQ(top_k(scores, 2), (std::vector<int32_t>{0, 1}));
  // +0 and -0 compare equal: a tie, broken by index.
  const std::vector<float> zeros = {0.0f, -0.0f, 0.0f, -0.0f};
  EXPECT_EQ(top_k(zeros, 3), (std::vector<int32_t>{0, 1, 2}));
}

TEST(QsaTopK, AllZeroScoresKeepTheFirstKGroups) {
  const std::vector<float> scores(10, 0.0f);
  EXPECT_EQ(top_k(scores, 3), (std::vector<int32_t>{0, 1, 2}));
}

TEST(QsaTopK, EmitsGroupsInIncreasingIndex) {
  const std::vector<float> scores = {5, 1, 9, 7};
  EXPECT_EQ(top_k(scores, 2), (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(top_k(scores, 3), (std::vector<int32_t>{0, 2, 3}));
}

TEST(QsaTopK, VisibleExactlyKAndKPlusOne) {
  // Exactly k visible: everything, whatever the scores.
  EXPECT_EQ(top_k({0, 4, 1}, 3), (std::vector<int32_t>{0, 1, 2}));
  // k + 1 visible: the lowest score drops out; among equal lowest, the highest index drops out.
  EXPECT_EQ(top_k({3, 0, 4, 1}, 3), (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(top_k({1, 1, 1, 1}, 3), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(top_k({}, 3), (std::vector<int32_t>{}));
}

TEST(QsaTopK, InfiniteScores) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(top_k({inf, 1, inf, inf}, 2), (std::vector<int32_t>{0, 2}));
}

TEST(QsaTopK, RandomScoresMatchBruteForce) {
  std::mt19937 rng(7);
  std::vector<float> scratch;
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t n = std::uniform_int_distribution<int64_t>(0, 200)(rng);
    const int64_t k = std::uniform_int_distribution<int64_t>(0, 220)(rng);
    // Few distinct values (many ties) in half of the trials, continuous values in the other.
    const bool ties = trial % 2 == 0;
    std::uniform_int_distribution<int> level(0, 5);
    std::uniform_real_distribution<float> real(0.0f, 10.0f);
    std::vector<float> scores(static_cast<size_t>(n));
    for (float& s : scores) s = ties ? float(level(rng)) * 0.25f : real(rng);
    std::vector<int32_t> got(size_t(std::min(n, k)));
    ASSERT_EQ(qsa_top_k_groups(scores, k, got.data(), &scratch), int64_t(got.size()));
    ASSERT_EQ(got, brute_top_k(scores, k)) << "trial " << trial << " n " << n << " k " << k;
  }
}

std::vector<int32_t> expand(const std::vector<int32_t>& groups, int64_t pos, int64_t width,
                            int64_t* count) {
  std::vector<int32_t> tokens(static_cast<size_t>(width), 12345);
  *count = qsa_expand_tokens(groups, pos, 4, tokens);
  return tokens;
}

TEST(QsaExpand, CausalTailForEveryPositionModFour) {
  const std::vector<int32_t> groups = {0, 5};
  const int64_t width = 8 + 3;  // budget 8, ratio 4
  int64_t count = 0;
  // pos = 40 (≡ 0 mod 4): tail 40.
  EXPECT_EQ(expand(groups, 40, width, &count),
            (std::vector<int32_t>{0, 1, 2, 3, 20, 21, 22, 23, 40, -1, -1}));
  EXPECT_EQ(count, 9);
  // pos = 41: tail 40, 41.
  EXPECT_EQ(expand(groups, 41, width, &count),
            (std::vector<int32_t>{0, 1, 2, 3, 20, 21, 22, 23, 40, 41, -1}));
  EXPECT_EQ(count, 10);
  // pos = 42: tail 40..42, the full width.
  EXPECT_EQ(expand(groups, 42, width, &count),
            (std::vector<int32_t>{0, 1, 2, 3, 20, 21, 22, 23, 40, 41, 42}));
  EXPECT_EQ(count, 11);
  // pos = 43 (≡ 3): group 10 (40..43) is complete, no tail.
  EXPECT_EQ(expand(groups, 43, width, &count),
            (std::vector<int32_t>{0, 1, 2, 3, 20, 21, 22, 23, -1, -1, -1}));
  EXPECT_EQ(count, 8);
}

TEST(QsaExpand, NoGroups) {
  int64_t count = 0;
  EXPECT_EQ(expand({}, 2, 5, &count), (std::vector<int32_t>{0, 1, 2, -1, -1}));
  EXPECT_EQ(count, 3);
  EXPECT_EQ(expand({}, 3, 5, &count), (std::vector<int32_t>{-1, -1, -1, -1, -1}));
  EXPECT_EQ(count, 0);
}

TEST(QsaVisible, CompleteGroupsOnly) {
  EXPECT_EQ(qsa_visible_groups(0, 100, 4), 0);
  EXPECT_EQ(qsa_visible_groups(2, 100, 4), 0);
  EXPECT_EQ(qsa_visible_groups(3, 100, 4), 1);
  EXPECT_EQ(qsa_visible_groups(4, 100, 4), 1);
  EXPECT_EQ(qsa_visible_groups(7, 100, 4), 2);
  EXPECT_EQ(qsa_visible_groups(99, 100, 4), 25);
  EXPECT_EQ(qsa_visible_groups(50, 9, 4), 2);  // bounded by the written groups
  EXPECT_EQ(qsa_selection_width(2048, 4), 2051);
  EXPECT_EQ(qsa_top_k(2048, 4), 512);
}

// A small indexer cache filled by hand: one sequence per block-table row, physical blocks shuffled.
struct IndexerFixture {
  static constexpr int64_t kBlockSize = 16;
  static constexpr int64_t kRatio = 4;
  int64_t index_dim = 8;
  int64_t n_index_heads = 2;
  int64_t max_blocks = 0;
  std::vector<uint16_t> data;  // [n_blocks, block_size / ratio, index_dim]
  std::vector<int32_t> table;  // [n_seqs, max_blocks]
  std::vector<int32_t> seq_lens;
  IndexerCompressedView view;
  BlockTableView block_table;

  IndexerFixture(const std::vector<int32_t>& lens, int64_t dim, int64_t heads, uint32_t seed)
      : index_dim(dim), n_index_heads(heads), seq_lens(lens) {
    for (const int32_t len : lens) max_blocks = std::max<int64_t>(max_blocks, (len + 15) / 16);
    const int64_t n_blocks = int64_t(lens.size()) * max_blocks + 1;
    std::vector<int32_t> physical(static_cast<size_t>(n_blocks));
    std::iota(physical.begin(), physical.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(physical.begin(), physical.end(), rng);
    table.assign(lens.size() * size_t(max_blocks), -1);
    size_t next = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      for (int64_t b = 0; b < (lens[s] + 15) / 16; ++b)
        table[s * size_t(max_blocks) + size_t(b)] = physical[next++];
    }
    data.assign(size_t(n_blocks * (kBlockSize / kRatio) * index_dim), f32_to_f16(1000.0f));
    view = {data.data(), n_blocks, kBlockSize, kRatio, index_dim};
    block_table = {table.data(), int64_t(lens.size()), max_blocks};
  }

  // Row of group c of sequence s (computed independently of the view's helper).
  uint16_t* row(int64_t s, int64_t c) {
    const int64_t logical_block = c * kRatio / kBlockSize;
    const int64_t physical = table[size_t(s * max_blocks + logical_block)];
    const int64_t slot = c % (kBlockSize / kRatio);
    return data.data() + (physical * (kBlockSize / kRatio) + slot) * index_dim;
  }
};

struct Selection {
  std::vector<int32_t> tokens;
  std::vector<int32_t> counts;
  int64_t width = 0;

  std::vector<int32_t> row(int64_t r) const {
    return {tokens.begin() + r * width, tokens.begin() + (r + 1) * width};
  }
};

Selection select(IndexerFixture& f, int64_t budget, const std::vector<int32_t>& row_seq,
                 const std::vector<int32_t>& row_pos, const std::vector<uint16_t>& index_q,
                 Status* status_out = nullptr) {
  Selection sel;
  sel.width = qsa_selection_width(budget, f.kRatio);
  sel.tokens.assign(row_seq.size() * size_t(sel.width), 777);
  sel.counts.assign(row_seq.size(), -5);
  QueryBatchView rows;
  rows.n_rows = int64_t(row_seq.size());
  rows.row_seq = row_seq.data();
  rows.row_pos = row_pos.data();
  rows.seq_lens = f.seq_lens.data();
  const Status status = qsa_select({budget, f.n_index_heads}, f.view, f.block_table, rows,
                                   index_q.data(), sel.tokens.data(), sel.counts.data());
  if (status_out != nullptr) {
    *status_out = status;
  } else {
    EXPECT_TRUE(status.ok()) << status.message();
  }
  return sel;
}

std::vector<int32_t> padded(std::vector<int32_t> tokens, int64_t width) {
  tokens.resize(size_t(width), -1);
  return tokens;
}

std::vector<int32_t> range(int32_t first, int32_t last) {  // first..last inclusive
  std::vector<int32_t> v;
  for (int32_t t = first; t <= last; ++t) v.push_back(t);
  return v;
}

// Scores s[c] = max(value_c, 0) / sqrt(8): khat_c = value_c * e_0, index_q head 0 = e_0, head 1 =
// 0.
void set_group_values(IndexerFixture& f, int64_t seq, const std::vector<float>& values,
                      std::vector<uint16_t>* index_q, int64_t n_rows) {
  for (size_t c = 0; c < values.size(); ++c) {
    uint16_t* r = f.row(seq, int64_t(c));
    std::fill(r, r + f.index_dim, f32_to_f16(0.0f));
    r[0] = f32_to_f16(values[c]);
  }
  index_q->assign(size_t(n_rows * f.n_index_heads * f.index_dim), f32_to_f16(0.0f));
  for (int64_t i = 0; i < n_rows; ++i)
    (*index_q)[size_t(i * f.n_index_heads * f.index_dim)] = f32_to_f16(1.0f);
}

TEST(QsaSelect, ShortContextsSelectEverything) {
  // budget 8 (k = 2 groups): positions up to budget + 2 = 10 are exactly dense.
  IndexerFixture f({40}, 8, 2, 1);
  std::vector<uint16_t> index_q;
  set_group_values(f, 0, std::vector<float>(10, 1.0f), &index_q, 11);
  std::vector<int32_t> row_seq(11, 0);
  std::vector<int32_t> row_pos = range(0, 10);
  const Selection sel = select(f, 8, row_seq, row_pos, index_q);
  for (int32_t pos = 0; pos <= 10; ++pos) {
    EXPECT_EQ(sel.counts[size_t(pos)], pos + 1) << "pos " << pos;
    EXPECT_EQ(sel.row(pos), padded(range(0, pos), sel.width)) << "pos " << pos;
  }
}

TEST(QsaSelect, VisibleExactlyKThenKPlusOne) {
  IndexerFixture f({40}, 8, 2, 2);
  std::vector<uint16_t> index_q;
  // Group scores 3, 1, 2 (then unused groups).
  set_group_values(f, 0, {3, 1, 2, 5, 5, 5}, &index_q, 2);
  // pos 10: visible 2 = k (dense, 0..10); pos 11: visible 3 = k + 1, group 1 (lowest) drops.
  const Selection sel = select(f, 8, {0, 0}, {10, 11}, index_q);
  EXPECT_EQ(sel.row(0), padded(range(0, 10), sel.width));
  EXPECT_EQ(sel.row(1), padded({0, 1, 2, 3, 8, 9, 10, 11}, sel.width));
  EXPECT_EQ(sel.counts, (std::vector<int32_t>{11, 8}));
}

TEST(QsaSelect, TiesAndRectifiedScores) {
  IndexerFixture f({64}, 8, 2, 3);
  std::vector<uint16_t> index_q;
  // Negative dot products rectify to 0: groups 0, 2, 5 tie at 0; group 3 and 4 tie at 2.
  set_group_values(f, 0, {-1, 4, -3, 2, 2, 0, 1, 1, 9, 9}, &index_q, 3);
  // pos 27: 7 groups visible (0..6), k = 3 (budget 12): 4 (g1) > 2 (g3, g4) -> {1, 3, 4}; tail
  // none. pos 29: same groups, tail 28, 29. pos 22: 5 groups (0..4): {1, 3, 4}; tail 20..22.
  const Selection sel = select(f, 12, {0, 0, 0}, {27, 29, 22}, index_q);
  EXPECT_EQ(sel.row(0), padded({4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19}, sel.width));
  EXPECT_EQ(sel.row(1), padded({4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29}, sel.width));
  EXPECT_EQ(sel.row(2),
            padded({4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22}, sel.width));
  EXPECT_EQ(sel.counts, (std::vector<int32_t>{12, 14, 15}));
  // k = 2: above the k-th score (2) only group 1; of the tied groups 3 and 4 the lower one.
  const Selection sel2 = select(f, 8, {0}, {27}, index_q);
  EXPECT_EQ(sel2.row(0), padded({4, 5, 6, 7, 12, 13, 14, 15}, sel2.width));
}

TEST(QsaSelect, AllZeroScoresKeepTheFirstGroups) {
  IndexerFixture f({64}, 8, 2, 4);
  std::vector<uint16_t> index_q;
  set_group_values(f, 0, std::vector<float>(16, -2.0f), &index_q, 1);
  const Selection sel = select(f, 8, {0}, {62}, index_q);
  EXPECT_EQ(sel.row(0), padded({0, 1, 2, 3, 4, 5, 6, 7, 60, 61, 62}, sel.width));
}

TEST(QsaSelect, EveryHeadContributesAndEachRowHasItsOwnSelection) {
  // Two sequences in one batch, rows interleaved. Head 1 looks at dim 1; head 0 at dim 0.
  IndexerFixture f({48, 48}, 8, 2, 5);
  for (int64_t s = 0; s < 2; ++s) {
    for (int64_t c = 0; c < 12; ++c) {
      uint16_t* r = f.row(s, c);
      std::fill(r, r + f.index_dim, f32_to_f16(0.0f));
      r[0] = f32_to_f16(s == 0 ? float(c) : float(12 - c));  // seq 0 rises, seq 1 falls
      r[1] = f32_to_f16(c == 5 ? 100.0f : 0.0f);             // head 1 favours group 5
    }
  }
  std::vector<uint16_t> index_q(size_t(3 * 2 * 8), f32_to_f16(0.0f));
  for (int64_t i = 0; i < 3; ++i) {
    index_q[size_t(i * 16 + 0)] = f32_to_f16(1.0f);      // head 0, dim 0
    index_q[size_t(i * 16 + 8 + 1)] = f32_to_f16(1.0f);  // head 1, dim 1
  }
  // k = 2. Row 0: seq 0 pos 47: scores c (+100 at 5) -> {5, 11}. Row 1: seq 1 pos 47: 12 - c (+100
  // at 5) -> {0, 5}. Row 2: seq 0 pos 30: visible 7 -> {5, 6}, tail 28..30.
  const Selection sel = select(f, 8, {0, 1, 0}, {47, 47, 30}, index_q);
  EXPECT_EQ(sel.row(0), padded({20, 21, 22, 23, 44, 45, 46, 47}, sel.width));
  EXPECT_EQ(sel.row(1), padded({0, 1, 2, 3, 20, 21, 22, 23}, sel.width));
  EXPECT_EQ(sel.row(2), padded({20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30}, sel.width));
}

TEST(QsaSelect, RejectsBadInput) {
  IndexerFixture f({20}, 8, 2, 6);
  std::vector<uint16_t> index_q(16, 0);
  Status status;
  select(f, 2, {0}, {5}, index_q, &status);  // budget below the group size
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("budget"), std::string::npos) << status.message();
  select(f, 8, {0}, {20}, index_q, &status);  // pos == seq_len: its K is not in the cache
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("position 20"), std::string::npos) << status.message();
  select(f, 8, {1}, {5}, index_q, &status);  // no such sequence
  EXPECT_FALSE(status.ok());
  f.table[0] = 99;  // a block id outside the cache, read only when scores are needed
  select(f, 4, {0}, {3}, index_q, &status);
  EXPECT_TRUE(status.ok()) << status.message();
  select(f, 4, {0}, {19}, index_q, &status);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("block table entry"), std::string::npos) << status.message();
}

// Brute-force selection of one row from the FP16 data, scores by the same fp32 contract.
std::vector<int32_t> brute_select(IndexerFixture& f, const uint16_t* q, int64_t seq, int64_t pos,
                                  int64_t budget) {
  const int64_t visible = std::min((pos + 1) / 4, int64_t(f.seq_lens[size_t(seq)]) / 4);
  std::vector<float> scores(static_cast<size_t>(visible));
  for (int64_t c = 0; c < visible; ++c) {
    const uint16_t* k = f.row(seq, c);
    float sum = 0.0f;
    for (int64_t h = 0; h < f.n_index_heads; ++h) {
      float dot = 0.0f;
      for (int64_t d = 0; d < f.index_dim; ++d) {
        const float product = f16_to_f32(q[h * f.index_dim + d]) * f16_to_f32(k[d]);
        dot += product;
      }
      sum += dot > 0.0f ? dot : 0.0f;
    }
    scores[size_t(c)] = sum / std::sqrt(float(f.index_dim));
  }
  std::vector<int32_t> tokens;
  for (const int32_t c : brute_top_k(scores, budget / 4)) {
    for (int32_t i = 0; i < 4; ++i) tokens.push_back(4 * c + i);
  }
  for (int64_t t = 4 * ((pos + 1) / 4); t <= pos; ++t) tokens.push_back(int32_t(t));
  return padded(tokens, budget + 3);
}

TEST(QsaSelect, RandomBatchesMatchBruteForce) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t n_seqs = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    std::vector<int32_t> lens;
    for (int64_t s = 0; s < n_seqs; ++s)
      lens.push_back(std::uniform_int_distribution<int32_t>(1, 300)(rng));
    const int64_t dim = trial % 3 == 0 ? 16 : 8;
    const int64_t heads = 1 + trial % 4;
    IndexerFixture f(lens, dim, heads, uint32_t(trial));
    // Small integers (exact products and sums, many ties) or continuous values.
    const bool ties = trial % 2 == 0;
    std::uniform_int_distribution<int> small(-2, 2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto value = [&] { return f32_to_f16(ties ? float(small(rng)) : normal(rng)); };
    for (uint16_t& x : f.data) x = value();
    const int64_t budget = std::vector<int64_t>{4, 8, 16, 64, 128}[size_t(trial % 5)];
    std::vector<int32_t> row_seq;
    std::vector<int32_t> row_pos;
    for (int64_t s = 0; s < n_seqs; ++s) {
      // A chunk ending at the last token plus a few random rows.
      const int32_t len = lens[size_t(s)];
      const int32_t chunk = std::uniform_int_distribution<int32_t>(1, std::min(len, 40))(rng);
      for (int32_t p = len - chunk; p < len; ++p) {
        row_seq.push_back(int32_t(s));
        row_pos.push_back(p);
      }
      for (int i = 0; i < 3; ++i) {
        row_seq.push_back(int32_t(s));
        row_pos.push_back(std::uniform_int_distribution<int32_t>(0, len - 1)(rng));
      }
    }
    std::vector<uint16_t> index_q(row_seq.size() * size_t(heads * dim));
    for (uint16_t& x : index_q) x = value();
    const Selection sel = select(f, budget, row_seq, row_pos, index_q);
    for (size_t r = 0; r < row_seq.size(); ++r) {
      const std::vector<int32_t> want =
          brute_select(f, index_q.data() + r * size_t(heads * dim), row_seq[r], row_pos[r], budget);
      ASSERT_EQ(sel.row(int64_t(r)), want) << "trial " << trial << " row " << r;
      const int64_t valid =
          std::count_if(want.begin(), want.end(), [](int32_t t) { return t >= 0; });
      ASSERT_EQ(sel.counts[r], valid);
    }
  }
}

}  // namespace
}  // namespace e4kv
