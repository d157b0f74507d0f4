// CUDA QSA index scores (backend/cuda/qsa_index_scores.cuh) against the CPU reference
// qsa_index_scores (qsa/selection.h) on fresh random data, both kernels: the tensor-core default
// within a bound on fp32 summation error (relative to the sum of the products' magnitudes, which
// is computed here in double), the exact FFMA kernel bit for bit; run maxima bit for bit against
// the kernel's own scores. Over n_index_heads x index_dim x
// block size, shuffled block tables, rows of very different lengths (0 visible groups, part of a
// tile, exactly one tile, many tiles), enough virtual tiles that each warp walks several and its
// range starts and ends inside rows, unreadable blocks (entry -1, entry past n_blocks, logical
// block past the table's width: score 0), FP16 subnormals and large values, skip_visible_at_most
// and a max_groups that cuts the longest rows short. Every output is poisoned first; entries at or
// past a row's visible count, and whole skipped rows, must stay untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/qsa_index_scores.cuh"
#include "backend/cuda/qsa_topk.cuh"
#include "core/half.h"
#include "device_buffer.cuh"
#include "qsa/selection.h"

namespace e4kv::cuda {
namespace {

constexpr uint32_t kPoisonBits = 0x7FBADBADu;  // a NaN the kernel never produces
constexpr int64_t kRatio = 4;

struct ScoresCase {
  int64_t n_heads;
  int64_t index_dim;
  int64_t block_size;
  uint32_t seed;
  int64_t skip_visible_at_most = 0;
  int64_t max_groups_cut = 0;  // max_groups = longest visible - this
  int64_t n_short_rows = 120;  // cheap rows that multiply the virtual tiles
  bool exact = false;          // QsaIndexScoresArgs::exact
};

// Tensor-core scores: |gpu - cpu| <= kSumTolerance * sum over heads and dims of |q * k| /
// sqrt(index_dim). Any fp32 summation order of n exact products errs by at most about n * 2^-24
// of that sum; 2^-16 leaves room for the tensor core's truncating accumulation while a wrong
// dimension or head pairing errs by the size of the score itself.
constexpr double kSumTolerance = 1.0 / 65536.0;

// A random FP16 value: mostly N(0, 1), sometimes a subnormal, sometimes large.
uint16_t random_half(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 99);
  const int k = kind(rng);
  if (k < 2) return uint16_t((rng() & 0x8000u) | (1u + rng() % 0x3FFu));  // subnormal
  if (k < 4) return f32_to_f16(normal(rng) * 300.0f);
  if (k < 5) return f32_to_f16(0.0f);
  return f32_to_f16(normal(rng));
}

void run_scores_case(const ScoresCase& cs) {
  const std::string name =
      "heads " + std::to_string(cs.n_heads) + " dim " + std::to_string(cs.index_dim) + " bs " +
      std::to_string(cs.block_size) + " skip " + std::to_string(cs.skip_visible_at_most) + " cut " +
      std::to_string(cs.max_groups_cut) + (cs.exact ? " exact" : " tensor cores");
  std::mt19937 rng(cs.seed);
  const int64_t dim = cs.index_dim;
  const int64_t heads = cs.n_heads;
  const int64_t bs = cs.block_size;
  const int64_t rows_per_block = bs / kRatio;

  // Sequences (tokens). Sequence 0 is longer than the block table is wide: its last groups have
  // no logical block. Sequence 4 maps only its first blocks (the rest of its row is -1).
  const std::vector<int32_t> seq_lens{9001, 4099, 1027, 3, 2400, 259};
  const int64_t n_seqs = int64_t(seq_lens.size());
  const int64_t max_blocks = (8000 + bs - 1) / bs;     // width of the block table
  const int64_t narrow_blocks = (1500 + bs - 1) / bs;  // blocks sequence 4 maps
  int64_t n_blocks = 3;
  for (int64_t s = 0; s < n_seqs; ++s) {
    n_blocks += std::min(max_blocks, (seq_lens[size_t(s)] + bs - 1) / bs);
  }
  std::vector<int32_t> pool(static_cast<size_t>(n_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<int32_t> table(size_t(n_seqs * max_blocks), -1);
  size_t next = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    int64_t blocks = std::min(max_blocks, (seq_lens[size_t(s)] + bs - 1) / bs);
    if (s == 4) blocks = narrow_blocks;
    for (int64_t b = 0; b < blocks; ++b) table[size_t(s * max_blocks + b)] = pool[next++];
  }
  // Unreadable blocks inside visible ranges: -1 and past n_blocks.
  table[size_t(1 * max_blocks + 2)] = -1;
  table[size_t(0 * max_blocks + 5)] = int32_t(n_blocks + 7);
  table[size_t(0 * max_blocks + max_blocks - 2)] = -3;

  std::vector<uint16_t> compressed(size_t(n_blocks * rows_per_block * dim));
  for (auto& x : compressed) x = random_half(rng);

  // Rows: long rows at several positions, rows with 0..few visible groups, rows at tile edges,
  // then many short rows (cheap on the CPU, but each adds a row of virtual tiles).
  std::vector<int32_t> row_seq;
  std::vector<int32_t> row_pos;
  auto add = [&](int64_t s, int64_t pos) {
    if (pos >= 0 && pos < seq_lens[size_t(s)]) {
      row_seq.push_back(int32_t(s));
      row_pos.push_back(int32_t(pos));
    }
  };
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t len = seq_lens[size_t(s)];
    for (int64_t pos :
         {len - 1, len - 2, len / 2, len / 3 + 1, int64_t(0), int64_t(2), int64_t(3),
          int64_t(4 * 64 - 1), int64_t(4 * 64 + 3), int64_t(4 * 65 - 1), int64_t(4 * 127 + 1)}) {
      add(s, pos);
    }
  }
  std::uniform_int_distribution<int> short_seq(0, int(n_seqs) - 1);
  std::uniform_int_distribution<int> short_pos(0, 4 * 150);
  for (int64_t i = 0; i < cs.n_short_rows; ++i) add(short_seq(rng), short_pos(rng));
  std::shuffle(row_pos.begin(), row_pos.end(), rng);  // rows need not be sorted by length...
  for (size_t r = 0; r < row_pos.size(); ++r) {       // ...but must stay inside their sequence
    row_pos[r] = std::min<int32_t>(row_pos[r], seq_lens[size_t(row_seq[r])] - 1);
  }
  const int64_t n_rows = int64_t(row_seq.size());

  std::vector<uint16_t> index_q(size_t(n_rows * heads * dim));
  for (auto& x : index_q) x = random_half(rng);

  std::vector<int64_t> visible(static_cast<size_t>(n_rows));
  int64_t longest = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    visible[size_t(r)] =
        qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(row_seq[size_t(r)])], kRatio);
    longest = std::max(longest, visible[size_t(r)]);
  }
  const int64_t max_groups = longest - cs.max_groups_cut;
  ASSERT_GT(max_groups, 0);

  // CPU reference: unreadable entries are pointed at block 0 for the reference (which needs a
  // readable row), and those groups expect exactly 0.
  std::vector<int32_t> cpu_table = table;
  for (auto& b : cpu_table) {
    if (b < 0 || b >= n_blocks) b = 0;
  }
  int64_t cpu_max_blocks = max_blocks;  // room for sequence 0's unmapped groups
  for (int32_t len : seq_lens) cpu_max_blocks = std::max(cpu_max_blocks, (len + bs - 1) / bs);
  std::vector<int32_t> wide_table(size_t(n_seqs * cpu_max_blocks), 0);
  for (int64_t s = 0; s < n_seqs; ++s) {
    std::copy_n(cpu_table.begin() + s * max_blocks, max_blocks,
                wide_table.begin() + s * cpu_max_blocks);
  }
  const IndexerCompressedView host_cv{compressed.data(), n_blocks, bs, kRatio, dim};
  const BlockTableView host_table{wide_table.data(), n_seqs, cpu_max_blocks};
  std::vector<float> expected(size_t(n_rows * max_groups), 0.0f);
  std::vector<char> written(size_t(n_rows * max_groups), 0);
  int64_t scored_rows = 0;
  int64_t zero_groups = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t vis = std::min(visible[size_t(r)], max_groups);
    if (vis <= cs.skip_visible_at_most || vis == 0) continue;
    ++scored_rows;
    const int64_t s = row_seq[size_t(r)];
    float* out = expected.data() + r * max_groups;
    qsa_index_scores(index_q.data() + r * heads * dim, heads, host_cv, host_table, s, vis, out);
    for (int64_t c = 0; c < vis; ++c) {
      written[size_t(r * max_groups + c)] = 1;
      const int64_t logical = c * kRatio / bs;
      const int64_t block = logical < max_blocks ? table[size_t(s * max_blocks + logical)] : -1;
      if (block < 0 || block >= n_blocks) {
        out[c] = 0.0f;
        ++zero_groups;
      }
    }
  }
  EXPECT_GT(zero_groups, 0) << name;
  // Sum of the products' magnitudes of every scored group (0 for unreadable ones).
  std::vector<double> magnitude(expected.size(), 0.0);
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t vis = std::min(visible[size_t(r)], max_groups);
    if (vis <= cs.skip_visible_at_most) continue;
    const int64_t s = row_seq[size_t(r)];
    for (int64_t c = 0; c < vis; ++c) {
      const int64_t logical = c * kRatio / bs;
      const int64_t block = logical < max_blocks ? table[size_t(s * max_blocks + logical)] : -1;
      if (block < 0 || block >= n_blocks) continue;
      const uint16_t* k = compressed.data() + (block * rows_per_block + c % rows_per_block) * dim;
      double sum = 0.0;
      for (int64_t h = 0; h < heads; ++h) {
        const uint16_t* q = index_q.data() + (r * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          sum += std::fabs(double(f16_to_f32(q[d])) * double(f16_to_f32(k[d])));
        }
      }
      magnitude[size_t(r * max_groups + c)] = sum / std::sqrt(double(dim));
    }
  }

  // GPU.
  DeviceBuffer<uint16_t> d_compressed(compressed);
  DeviceBuffer<int32_t> d_table(table);
  DeviceBuffer<int32_t> d_row_seq(row_seq);
  DeviceBuffer<int32_t> d_row_pos(row_pos);
  DeviceBuffer<int32_t> d_seq_lens(seq_lens);
  DeviceBuffer<uint16_t> d_q(index_q);
  DeviceBuffer<float> d_scores(expected.size());
  std::vector<uint32_t> poison(expected.size(), kPoisonBits);
  E4KV_CUDA_CHECK(
      cudaMemcpy(d_scores.ptr, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice));
  QsaIndexScoresArgs sa;
  sa.compressed = IndexerCompressedView{d_compressed.ptr, n_blocks, bs, kRatio, dim};
  sa.block_table = BlockTableView{d_table.ptr, n_seqs, max_blocks};
  sa.rows.n_rows = n_rows;
  sa.rows.row_seq = d_row_seq.ptr;
  sa.rows.row_pos = d_row_pos.ptr;
  sa.rows.seq_lens = d_seq_lens.ptr;
  sa.index_q = d_q.ptr;
  sa.n_index_heads = heads;
  sa.max_groups = max_groups;
  sa.skip_visible_at_most = cs.skip_visible_at_most;
  sa.scores = d_scores.ptr;
  sa.exact = cs.exact;
  // Run maxima with a stride wider than needed (entries past the row's runs must stay poisoned).
  const int64_t run_stride = (max_groups + kQsaRunGroups - 1) / kQsaRunGroups + 3;
  DeviceBuffer<float> d_maxima(size_t(n_rows * run_stride));
  std::vector<uint32_t> maxima_poison(size_t(n_rows * run_stride), kPoisonBits);
  E4KV_CUDA_CHECK(cudaMemcpy(d_maxima.ptr, maxima_poison.data(), maxima_poison.size() * 4,
                             cudaMemcpyHostToDevice));
  sa.run_maxima = d_maxima.ptr;
  sa.run_stride = run_stride;
  const Status st = qsa_index_scores(sa, nullptr);
  ASSERT_TRUE(st.ok()) << name << ": " << st.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> scores = d_scores.to_host();
  const std::vector<float> maxima = d_maxima.to_host();

  // Run maxima: the largest of the kernel's own scores of each run that holds a scored group, bit
  // for bit (the scores themselves are checked against the CPU below).
  int64_t bad_maxima = 0;
  int64_t compared_maxima = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t j = 0; j < run_stride; ++j) {
      float want = -INFINITY;
      bool any = false;
      for (int64_t c = j * kQsaRunGroups; c < (j + 1) * kQsaRunGroups && c < max_groups; ++c) {
        if (!written[size_t(r * max_groups + c)]) continue;
        want = any ? std::max(want, scores[size_t(r * max_groups + c)])
                   : scores[size_t(r * max_groups + c)];
        any = true;
      }
      uint32_t got;
      std::memcpy(&got, &maxima[size_t(r * run_stride + j)], 4);
      uint32_t want_bits = kPoisonBits;
      if (any) std::memcpy(&want_bits, &want, 4);
      compared_maxima += any ? 1 : 0;
      if (got != want_bits && ++bad_maxima <= 5) {
        ADD_FAILURE() << name << ": row " << r << " run " << j << ": gpu bits 0x" << std::hex << got
                      << ", expected 0x" << want_bits << std::dec
                      << (any ? "" : " (poison: no scored group in the run)");
      }
    }
  }
  EXPECT_EQ(bad_maxima, 0) << name << ": " << compared_maxima << " run maxima compared";
  EXPECT_GT(compared_maxima, 0) << name;

  int64_t bad = 0;
  int64_t touched = 0;
  int64_t compared = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t c = 0; c < max_groups; ++c) {
      const size_t i = size_t(r * max_groups + c);
      uint32_t got;
      std::memcpy(&got, &scores[i], 4);
      if (!written[i]) {
        if (got != kPoisonBits && ++touched <= 5) {
          ADD_FAILURE() << name << ": row " << r << " (visible " << visible[size_t(r)] << ") group "
                        << c << " written past the row's scored groups";
        }
        continue;
      }
      ++compared;
      uint32_t want;
      std::memcpy(&want, &expected[i], 4);
      const double error = std::fabs(double(scores[i]) - double(expected[i]));
      const bool close = std::isfinite(scores[i]) && error <= kSumTolerance * magnitude[i];
      if ((cs.exact ? got != want : !close) && ++bad <= 5) {
        ADD_FAILURE() << name << ": row " << r << " (seq " << row_seq[size_t(r)] << ", visible "
                      << visible[size_t(r)] << ") group " << c << ": gpu " << scores[i] << " (0x"
                      << std::hex << got << ") cpu " << expected[i] << " (0x" << want << std::dec
                      << "), error bound " << kSumTolerance * magnitude[i];
      }
    }
  }
  EXPECT_EQ(bad, 0) << name << ": " << compared << " scores compared";
  EXPECT_EQ(touched, 0) << name;
  EXPECT_GT(scored_rows, 10) << name;
}

// Heads {1, 3, 4, 8} x index_dim {8, 64, 128, 136, 256} x block size {16, 64}, seeds from `seed`.
void run_every_shape(bool exact, uint32_t seed) {
  for (int64_t heads : {1, 3, 4, 8}) {
    for (int64_t dim : {8, 64, 128, 136, 256}) {
      for (int64_t bs : {16, 64}) {
        ScoresCase cs{heads, dim, bs, seed++};
        cs.exact = exact;
        run_scores_case(cs);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

TEST(QsaScoresCuda, TensorCoresMatchCpuReferenceWithinSummationError) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  run_every_shape(false, 100);
}

TEST(QsaScoresCuda, ExactKernelMatchesCpuReferenceBitForBit) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  run_every_shape(true, 300);
}

// Every head-count instance of both kernels, skip_visible_at_most and a max_groups that cuts rows
// short.
TEST(QsaScoresCuda, SkipAndCutRowsAndEveryHeadCount) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 500;
  for (bool exact : {false, true}) {
    for (int64_t heads = 1; heads <= 8; ++heads) {
      for (ScoresCase cs : {ScoresCase{heads, 128, 64, seed++, 100, 0},
                            ScoresCase{heads, 40, 16, seed++, 0, 300}}) {
        cs.exact = exact;
        run_scores_case(cs);
      }
      if (HasFailure()) return;
    }
    // Many rows: for the exact kernel's persistent warps, several tiles per warp and warp ranges
    // that cross many rows.
    for (ScoresCase cs : {ScoresCase{4, 128, 64, seed++, 0, 0, 3000},
                          ScoresCase{8, 256, 16, seed++, 37, 11, 2000}}) {
      cs.exact = exact;
      run_scores_case(cs);
    }
  }
}

// Shape and pointer validation happens on the host, before any device access: runs without a GPU.
TEST(QsaScoresCuda, RejectsBadShapesAndPointers) {
  alignas(16) static uint16_t dummy[64];
  alignas(16) static int32_t ints[4];
  alignas(16) static float out[4];
  QsaIndexScoresArgs sa;
  sa.compressed = IndexerCompressedView{dummy, 1, 64, 4, 8};
  sa.block_table = BlockTableView{ints, 1, 1};
  sa.rows.n_rows = 1;
  sa.rows.row_seq = ints;
  sa.rows.row_pos = ints;
  sa.rows.seq_lens = ints;
  sa.index_q = dummy + 1;  // 2-byte aligned: rejected before any launch
  sa.n_index_heads = 1;
  sa.max_groups = 4;
  sa.scores = out;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());
  sa.index_q = dummy;
  sa.n_index_heads = 0;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());
  sa.n_index_heads = 1;
  sa.compressed.index_dim = 264;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());
  sa.compressed.index_dim = 8;
  sa.max_groups = -1;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());
  sa.max_groups = 4 * kQsaRunGroups + 1;  // needs 5 run maxima per row
  sa.run_maxima = out;
  sa.run_stride = 4;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());
  sa.run_maxima = nullptr;
  sa.run_stride = 0;
  sa.max_groups = 0;
  EXPECT_TRUE(qsa_index_scores(sa, nullptr).ok());  // nothing to do
}

}  // namespace
}  // namespace e4kv::cuda
