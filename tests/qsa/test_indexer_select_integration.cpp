// The indexer cache writer and the QSA selection agree on where compressed rows live: rows written
// by indexer_cache_write through a shuffled block table are found by qsa_select, and the selection
// equals a brute force computed here from rows located by the contract's own arithmetic (DESIGN.md
// section 3: group c in logical block c * ratio / block_size, row (c * ratio % block_size) /
// ratio).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/half.h"
#include "core/norm_rope.h"
#include "qsa/indexer_cache.h"
#include "qsa/selection.h"

namespace e4kv {
namespace {

TEST(QsaIndexerSelect, SelectionReadsTheRowsTheWriterWrote) {
  constexpr int64_t kDim = 32, kRatio = 4, kBlockSize = 16, kHeads = 4, kTokens = 203;
  constexpr int64_t kBudget = 32, kPoolBlocks = 24;
  const int64_t n_logical = (kTokens + kBlockSize - 1) / kBlockSize;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  std::vector<int32_t> table(kPoolBlocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  table.resize(n_logical);
  const BlockTableView block_table{table.data(), 1, n_logical};

  std::vector<uint16_t> compressed_data(kPoolBlocks * (kBlockSize / kRatio) * kDim, 0x7E00);  // NaN
  const IndexerCompressedView compressed{compressed_data.data(), kPoolBlocks, kBlockSize, kRatio,
                                         kDim};
  std::vector<uint16_t> ring_data(kRatio * kDim, 0);
  const IndexerRingView rings{ring_data.data(), 1, kRatio, kDim};

  std::vector<uint16_t> raw(kTokens * kDim);
  for (auto& x : raw) x = f32_to_f16(normal(rng));
  std::vector<uint16_t> norm_weight(kDim);
  for (auto& w : norm_weight) w = f32_to_f16(0.1f * normal(rng));
  const std::vector<double> inv_freq = rope_inv_freq(1e6, 16);
  const IndexerKeyNormRope norm_rope{norm_weight.data(), 1e-6f, 16, inv_freq.data()};

  const std::vector<int32_t> offsets{0, int32_t(kTokens)};
  const std::vector<int64_t> start{0};
  const std::vector<int32_t> ring_index{0};
  indexer_cache_write(compressed, rings,
                      IndexerWriteBatch{raw.data(), offsets.data(), start.data(), ring_index.data(),
                                        1, block_table},
                      norm_rope);

  const std::vector<int32_t> positions{202, 200, 131, 63, 36, 34};
  const int64_t n_rows = int64_t(positions.size());
  const int64_t width = kBudget + kRatio - 1;
  std::vector<int32_t> row_seq(n_rows, 0);
  const std::vector<int32_t> seq_lens{int32_t(kTokens)};
  std::vector<uint16_t> index_q(n_rows * kHeads * kDim);
  for (auto& x : index_q) x = f32_to_f16(normal(rng));
  std::vector<int32_t> sel(n_rows * width, 7777);
  std::vector<int32_t> counts(n_rows, -5);
  QueryBatchView rows;
  rows.n_rows = n_rows;
  rows.row_seq = row_seq.data();
  rows.row_pos = positions.data();
  rows.seq_lens = seq_lens.data();
  ASSERT_TRUE(qsa_select(QsaSelectionConfig{kBudget, kHeads}, compressed, block_table, rows,
                         index_q.data(), sel.data(), counts.data())
                  .ok());

  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t pos = positions[r];
    const int64_t visible = (pos + 1) / kRatio;
    std::vector<std::pair<double, int64_t>> scored;  // (-score, group): sorts best first
    for (int64_t c = 0; c < visible; ++c) {
      const int64_t token = c * kRatio;
      const int64_t block = table[token / kBlockSize];
      const uint16_t* row = compressed_data.data() +
                            (block * (kBlockSize / kRatio) + (token % kBlockSize) / kRatio) * kDim;
      double score = 0;
      for (int64_t h = 0; h < kHeads; ++h) {
        double dot = 0;
        for (int64_t d = 0; d < kDim; ++d) {
          const float k = f16_to_f32(row[d]);
          ASSERT_FALSE(std::isnan(k)) << "group " << c << " was never written";
          dot += double(f16_to_f32(index_q[(r * kHeads + h) * kDim + d])) * k;
        }
        score += std::max(dot, 0.0);
      }
      scored.push_back({-score / std::sqrt(double(kDim)), c});
    }
    std::sort(scored.begin(), scored.end());
    const int64_t k = std::min<int64_t>(kBudget / kRatio, visible);
    std::vector<int64_t> groups;
    for (int64_t i = 0; i < k; ++i) groups.push_back(scored[i].second);
    std::sort(groups.begin(), groups.end());
    std::vector<int32_t> want;
    for (int64_t c : groups) {
      for (int64_t t = 0; t < kRatio; ++t) want.push_back(int32_t(c * kRatio + t));
    }
    for (int64_t t = visible * kRatio; t <= pos; ++t) want.push_back(int32_t(t));
    ASSERT_EQ(counts[r], int32_t(want.size())) << "pos " << pos;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_EQ(sel[r * width + i], want[i]) << "pos " << pos;
    for (int64_t i = int64_t(want.size()); i < width; ++i) EXPECT_EQ(sel[r * width + i], -1);
  }
}

}  // namespace
}  // namespace e4kv
