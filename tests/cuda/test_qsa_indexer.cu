// CUDA QSA indexer kernels against the CPU reference (qsa/selection.h) on fresh random data:
// index scores bit for bit (the exact kernel), top-k selections (tokens and counts) exactly, and
// the top-k over the tensor-core scores exactly against the CPU top-k over those same scores.
// Shuffled block tables, block sizes 16 and 64, budgets 64 and 2048, query rows at pos % 4 = 0..3
// with visible groups below, at and just above k and up to 20000, duplicated compressed rows (exact
// score ties) and negative dot products (all-zero scores). Outputs are poisoned before each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/qsa_index_scores.cuh"
#include "backend/cuda/qsa_indexer_write.cuh"
#include "backend/cuda/qsa_topk.cuh"
#include "core/half.h"
#include "core/norm_rope.h"
#include "device_buffer.cuh"
#include "qsa/indexer_cache.h"
#include "qsa/selection.h"

namespace e4kv::cuda {
namespace {

constexpr uint32_t kPoisonBits = 0x7FBADBADu;  // a NaN the kernels never produce

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

// Compares selection rows; returns the number of mismatching rows and reports the first few.
int64_t compare_selections(const std::vector<int32_t>& ref_tokens,
                           const std::vector<int32_t>& ref_counts,
                           const std::vector<int32_t>& tokens, const std::vector<int32_t>& counts,
                           int64_t width, const std::vector<int32_t>& row_pos,
                           const std::string& what) {
  int64_t bad_rows = 0;
  for (size_t r = 0; r < ref_counts.size(); ++r) {
    bool same = counts[r] == ref_counts[r];
    int64_t first_bad = -1;
    for (int64_t j = 0; j < width; ++j) {
      if (tokens[r * width + j] != ref_tokens[r * width + j]) {
        same = false;
        first_bad = j;
        break;
      }
    }
    if (!same && ++bad_rows <= 5) {
      ADD_FAILURE() << what << ": row " << r << " (pos " << row_pos[r] << "): count " << counts[r]
                    << " vs " << ref_counts[r] << ", first bad entry " << first_bad
                    << (first_bad >= 0
                            ? " gpu " + std::to_string(tokens[r * width + first_bad]) + " cpu " +
                                  std::to_string(ref_tokens[r * width + first_bad])
                            : std::string());
    }
  }
  return bad_rows;
}

struct Case {
  int64_t block_size;
  int64_t budget;
};

void run_case(const Case& cs, uint32_t seed) {
  const std::string name =
      "bs" + std::to_string(cs.block_size) + " budget" + std::to_string(cs.budget);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.05f, 1.0f);
  constexpr int64_t kRatio = 4;
  constexpr int64_t kIndexDim = 128;
  constexpr int64_t kHeads = 4;
  const int64_t k = qsa_top_k(cs.budget, kRatio);
  const int64_t width = qsa_selection_width(cs.budget, kRatio);

  // Sequences: 0 long (20000 groups), 1 short (visible around k), 2 exact ties (rows repeat a few
  // patterns), 3 mostly negative dot products (scores 0), 4 around k for the other budget.
  const std::vector<int32_t> seq_lens{80003, int32_t(4 * k + 13), 4002, 2001, 283};
  const int64_t n_seqs = int64_t(seq_lens.size());
  const int64_t rows_per_block = cs.block_size / kRatio;
  int64_t max_blocks = 0;
  for (int32_t len : seq_lens)
    max_blocks = std::max(max_blocks, (len + cs.block_size - 1) / cs.block_size);
  int64_t n_blocks = 5;
  for (int32_t len : seq_lens) n_blocks += (len + cs.block_size - 1) / cs.block_size;
  std::vector<int32_t> pool(static_cast<size_t>(n_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<int32_t> table(size_t(n_seqs * max_blocks), -1);
  size_t next = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    for (int64_t b = 0; b < (seq_lens[s] + cs.block_size - 1) / cs.block_size; ++b) {
      table[size_t(s * max_blocks + b)] = pool[next++];
    }
  }

  // Compressed rows: random everywhere, then per-sequence structure.
  std::vector<uint16_t> compressed(size_t(n_blocks * rows_per_block * kIndexDim));
  for (auto& x : compressed) x = f32_to_f16(normal(rng));
  IndexerCompressedView host_cv{compressed.data(), n_blocks, cs.block_size, kRatio, kIndexDim};
  const BlockTableView host_table{table.data(), n_seqs, max_blocks};
  std::vector<std::vector<uint16_t>> patterns(5, std::vector<uint16_t>(kIndexDim));
  for (auto& pattern : patterns) {
    for (auto& x : pattern) x = f32_to_f16(normal(rng));
  }
  for (int64_t c = 0; c < seq_lens[2] / kRatio; ++c) {
    if (c % 3 == 0) continue;  // unique rows between the repeated ones
    std::copy(patterns[size_t(c % 5)].begin(), patterns[size_t(c % 5)].end(),
              host_cv.row(host_table, 2, c));
  }
  for (int64_t c = 0; c < seq_lens[3] / kRatio; ++c) {
    uint16_t* row = host_cv.row(host_table, 3, c);
    const bool positive = c % 53 == 7;  // about 9 of 500 groups score above 0
    for (int64_t d = 0; d < kIndexDim; ++d) {
      row[d] = f32_to_f16(positive ? uniform(rng) : -uniform(rng));
    }
  }

  // Rows: every pos % 4 per sequence, visible = k - 1, k, k + 1 where the sequence allows.
  std::vector<int32_t> row_seq;
  std::vector<int32_t> row_pos;
  auto add = [&](int32_t s, int64_t pos) {
    if (pos >= 0 && pos < seq_lens[size_t(s)])
      row_seq.push_back(s), row_pos.push_back(int32_t(pos));
  };
  for (int32_t s = 0; s < int32_t(n_seqs); ++s) {
    const int64_t len = seq_lens[size_t(s)];
    for (int64_t pos : {len - 1, len - 2, len - 3, len - 4, len / 2, len / 3}) add(s, pos);
    for (int64_t pos : {int64_t(0), int64_t(1), int64_t(2), int64_t(3), int64_t(4)}) add(s, pos);
    for (int64_t visible : {k - 1, k, k + 1}) {
      for (int64_t m = 0; m < kRatio; ++m) add(s, visible * kRatio - 1 + m);
    }
  }
  const int64_t n_rows = int64_t(row_seq.size());
  std::vector<uint16_t> index_q(size_t(n_rows * kHeads * kIndexDim));
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t i = 0; i < kHeads * kIndexDim; ++i) {
      // Sequence 3: positive queries, so its negative rows give negative dot products.
      const float v = row_seq[size_t(r)] == 3 ? uniform(rng) : normal(rng);
      index_q[size_t(r * kHeads * kIndexDim + i)] = f32_to_f16(v);
    }
  }
  int64_t max_groups = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    max_groups = std::max(
        max_groups,
        qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(row_seq[size_t(r)])], kRatio));
  }
  max_groups += 3;  // entries past visible must stay untouched

  // CPU reference: scores of every row, and the selection.
  std::vector<float> ref_scores(size_t(n_rows * max_groups), 0.0f);
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t visible =
        qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(row_seq[size_t(r)])], kRatio);
    e4kv::qsa_index_scores(index_q.data() + r * kHeads * kIndexDim, kHeads, host_cv, host_table,
                           row_seq[size_t(r)], visible, ref_scores.data() + r * max_groups);
  }
  std::vector<int32_t> ref_tokens(size_t(n_rows * width), 12345);
  std::vector<int32_t> ref_counts(size_t(n_rows), 12345);
  QueryBatchView host_rows;
  host_rows.n_rows = n_rows;
  host_rows.row_seq = row_seq.data();
  host_rows.row_pos = row_pos.data();
  host_rows.seq_lens = seq_lens.data();
  QsaSelectionConfig config;
  config.budget = cs.budget;
  config.n_index_heads = kHeads;
  const Status cpu = qsa_select(config, host_cv, host_table, host_rows, index_q.data(),
                                ref_tokens.data(), ref_counts.data());
  ASSERT_TRUE(cpu.ok()) << cpu.message();

  // GPU.
  DeviceBuffer<uint16_t> d_compressed(compressed);
  DeviceBuffer<int32_t> d_table(table);
  DeviceBuffer<int32_t> d_row_seq(row_seq);
  DeviceBuffer<int32_t> d_row_pos(row_pos);
  DeviceBuffer<int32_t> d_seq_lens(seq_lens);
  DeviceBuffer<uint16_t> d_q(index_q);
  DeviceBuffer<float> d_scores(ref_scores.size());
  DeviceBuffer<float> d_scores_skip(ref_scores.size());
  DeviceBuffer<int32_t> d_tokens(ref_tokens.size());
  DeviceBuffer<int32_t> d_counts(ref_counts.size());
  std::vector<uint32_t> poison(ref_scores.size(), kPoisonBits);
  E4KV_CUDA_CHECK(
      cudaMemcpy(d_scores.ptr, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice));
  E4KV_CUDA_CHECK(
      cudaMemcpy(d_scores_skip.ptr, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice));

  QsaIndexScoresArgs sa;
  sa.compressed = host_cv;
  sa.compressed.data = d_compressed.ptr;
  sa.block_table = BlockTableView{d_table.ptr, n_seqs, max_blocks};
  sa.rows = host_rows;
  sa.rows.row_seq = d_row_seq.ptr;
  sa.rows.row_pos = d_row_pos.ptr;
  sa.rows.seq_lens = d_seq_lens.ptr;
  sa.index_q = d_q.ptr;
  sa.n_index_heads = kHeads;
  sa.max_groups = max_groups;
  sa.scores = d_scores.ptr;
  sa.exact = true;  // bit-identical scores, so the selections can be compared with the CPU's
  const Status scored = qsa_index_scores(sa, nullptr);
  ASSERT_TRUE(scored.ok()) << scored.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> scores = d_scores.to_host();

  int64_t bad_scores = 0;
  int64_t untouched_bad = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t visible =
        qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(row_seq[size_t(r)])], kRatio);
    for (int64_t c = 0; c < max_groups; ++c) {
      const size_t i = size_t(r * max_groups + c);
      if (c >= visible) {
        untouched_bad += bits_of(scores[i]) != kPoisonBits ? 1 : 0;
      } else if (bits_of(scores[i]) != bits_of(ref_scores[i]) && ++bad_scores <= 5) {
        ADD_FAILURE() << name << ": score row " << r << " group " << c << ": gpu " << scores[i]
                      << " cpu " << ref_scores[i];
      }
    }
  }
  EXPECT_EQ(bad_scores, 0) << name;
  EXPECT_EQ(untouched_bad, 0) << name << ": scores written past a row's visible groups";

  // Top-k on the GPU scores: with every row scored, and with dense rows skipped; each through
  // every method (scan, two phases with chunk candidates, filtered).
  DeviceBuffer<uint8_t> d_topk_ws(
      std::max<size_t>(1, qsa_top_k_workspace_bytes(n_rows, max_groups, cs.budget, kRatio)));
  const QsaTopKMethod methods[4] = {QsaTopKMethod::kScan, QsaTopKMethod::kTwoPhase,
                                    QsaTopKMethod::kFiltered, QsaTopKMethod::kCluster};
  const char* method_names[4] = {"", " two-phase", " filtered", " cluster"};
  const int n_variants = qsa_top_k_cluster_available() ? 8 : 6;
  for (int variant = 0; variant < n_variants; ++variant) {
    if (variant == 1) {  // variant 3 reuses these scores
      sa.scores = d_scores_skip.ptr;
      sa.skip_visible_at_most = k;
      const Status rescored = qsa_index_scores(sa, nullptr);
      ASSERT_TRUE(rescored.ok()) << rescored.message();
    }
    E4KV_CUDA_CHECK(cudaMemset(d_tokens.ptr, 0x7F, d_tokens.n * sizeof(int32_t)));
    E4KV_CUDA_CHECK(cudaMemset(d_counts.ptr, 0x7F, d_counts.n * sizeof(int32_t)));
    QsaTopKArgs ta;
    ta.rows = sa.rows;
    ta.ratio = kRatio;
    ta.budget = cs.budget;
    ta.scores = variant % 2 == 0 ? d_scores.ptr : d_scores_skip.ptr;
    ta.max_groups = max_groups;
    ta.sel_tokens = d_tokens.ptr;
    ta.sel_counts = d_counts.ptr;
    ta.workspace = d_topk_ws.ptr;
    ta.method = methods[variant / 2];
    const Status selected = qsa_top_k_select(ta, nullptr);
    ASSERT_TRUE(selected.ok()) << selected.message();
    E4KV_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(compare_selections(ref_tokens, ref_counts, d_tokens.to_host(), d_counts.to_host(),
                                 width, row_pos,
                                 name + (variant % 2 == 0 ? "" : " skip-dense") +
                                     method_names[variant / 2]),
              0);
  }

  // Scores then top-k back to back on one stream, nothing between the launches, as a model's
  // decode step enqueues them: the scores are poisoned before, so a top-k that ran ahead of the
  // score kernel (the programmatic launch of launch.cuh lets it start early on sm_90; it must wait
  // at entry) would select from NaN poison. Returns false when a launch was refused.
  auto score_and_select = [&](bool exact) {
    E4KV_CUDA_CHECK(
        cudaMemcpy(d_scores.ptr, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice));
    E4KV_CUDA_CHECK(cudaMemset(d_tokens.ptr, 0x7F, d_tokens.n * sizeof(int32_t)));
    E4KV_CUDA_CHECK(cudaMemset(d_counts.ptr, 0x7F, d_counts.n * sizeof(int32_t)));
    sa.scores = d_scores.ptr;
    sa.skip_visible_at_most = 0;
    sa.exact = exact;
    QsaTopKArgs ta;
    ta.rows = sa.rows;
    ta.ratio = kRatio;
    ta.budget = cs.budget;
    ta.scores = d_scores.ptr;
    ta.max_groups = max_groups;
    ta.sel_tokens = d_tokens.ptr;
    ta.sel_counts = d_counts.ptr;
    ta.workspace = d_topk_ws.ptr;
    const Status rescored = qsa_index_scores(sa, nullptr);
    EXPECT_TRUE(rescored.ok()) << rescored.message();
    const Status selected = qsa_top_k_select(ta, nullptr);
    EXPECT_TRUE(selected.ok()) << selected.message();
    E4KV_CUDA_CHECK(cudaDeviceSynchronize());
    return rescored.ok() && selected.ok();
  };
  ASSERT_TRUE(score_and_select(true));
  EXPECT_EQ(compare_selections(ref_tokens, ref_counts, d_tokens.to_host(), d_counts.to_host(),
                               width, row_pos, name + " chained"),
            0);

  // The default tensor-core scores (within summation error of the CPU's, test_qsa_scores.cu),
  // then the top-k: exactly the CPU top-k and expansion over those same scores.
  {
    ASSERT_TRUE(score_and_select(false));
    const std::vector<float> tc_scores = d_scores.to_host();
    std::vector<int32_t> tc_tokens(size_t(n_rows * width), 12345);
    std::vector<int32_t> tc_counts(size_t(n_rows), 12345);
    std::vector<int32_t> groups(static_cast<size_t>(k));
    int64_t differing_rows = 0;
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t visible =
          qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(row_seq[size_t(r)])], kRatio);
      const int64_t n = qsa_top_k_groups(
          std::span<const float>(tc_scores.data() + r * max_groups, size_t(visible)), k,
          groups.data());
      tc_counts[size_t(r)] = int32_t(qsa_expand_tokens(
          std::span<const int32_t>(groups.data(), size_t(n)), row_pos[size_t(r)], kRatio,
          std::span<int32_t>(tc_tokens.data() + r * width, size_t(width))));
      differing_rows +=
          std::equal(tc_tokens.begin() + r * width, tc_tokens.begin() + (r + 1) * width,
                     ref_tokens.begin() + r * width)
              ? 0
              : 1;
    }
    EXPECT_EQ(compare_selections(tc_tokens, tc_counts, d_tokens.to_host(), d_counts.to_host(),
                                 width, row_pos, name + " tensor-core scores"),
              0);
    std::printf(
        "[ info ] %s: tensor-core scores select other tokens than the exact ones in %lld of "
        "%lld rows\n",
        name.c_str(), (long long)differing_rows, (long long)n_rows);
  }

  // The test covers what it claims: ties at the threshold, an all-zero threshold, long rows.
  int64_t rows_above_k = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    rows_above_k +=
        qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(row_seq[size_t(r)])], kRatio) > k;
  }
  EXPECT_GE(rows_above_k, 8) << name;
  std::printf("[ info ] %s: %lld rows (%lld above k = %lld), max_groups %lld\n", name.c_str(),
              (long long)n_rows, (long long)rows_above_k, (long long)k, (long long)max_groups);
}

TEST(QsaIndexerCuda, ScoresAndSelectionMatchCpuReference) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 11;
  for (int64_t block_size : {16, 64}) {
    for (int64_t budget : {64, 2048}) run_case(Case{block_size, budget}, seed++);
  }
}

// Top-k alone on crafted scores (heavy ties, +-0, negatives, infinities, long rows that need
// several chunks and stop early) against qsa_top_k_groups + qsa_expand_tokens.
TEST(QsaIndexerCuda, TopKMatchesCpuOnCraftedScores) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  constexpr int64_t kRatio = 4;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t budget : {4, 64, 2048}) {
    const int64_t k = qsa_top_k(budget, kRatio);
    const int64_t width = qsa_selection_width(budget, kRatio);
    // 131071 (+1 for some kinds): the longest row the filtered method takes.
    const std::vector<int32_t> visible_list{
        0, 1, int32_t(k - 1), int32_t(k), int32_t(k + 1), 1000, 1025, 20000, 70001, 131071};
    const int64_t n_kinds = 8;
    std::vector<int32_t> row_seq;
    std::vector<int32_t> row_pos;
    std::vector<int32_t> seq_lens;
    std::vector<int32_t> kinds;
    for (int32_t visible : visible_list) {
      if (visible < 0) continue;
      for (int32_t kind = 0; kind < n_kinds; ++kind) {
        const int32_t pos = int32_t(visible * kRatio + (kind % 4));
        row_seq.push_back(int32_t(seq_lens.size()));
        row_pos.push_back(pos);
        seq_lens.push_back(pos + 1 + kind);
        kinds.push_back(kind);
      }
    }
    const int64_t n_rows = int64_t(row_seq.size());
    int64_t max_groups = 0;
    for (int64_t r = 0; r < n_rows; ++r) {
      max_groups =
          std::max(max_groups, qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(r)], kRatio));
    }
    std::vector<float> scores(size_t(n_rows * max_groups), 0.0f);
    std::uniform_int_distribution<int> small(0, 6);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t r = 0; r < n_rows; ++r) {
      for (int64_t c = 0; c < max_groups; ++c) {
        float& s = scores[size_t(r * max_groups + c)];
        switch (kinds[size_t(r)]) {
          case 0:
            s = normal(rng);
            break;  // negatives too
          case 1:
            s = float(small(rng));  // heavy ties
            break;
          case 2:
            s = (c % 2 == 0) ? 0.0f : -0.0f;
            break;  // all zero, both signs
          case 3:
            s = c % 97 == 5 ? inf : std::fabs(normal(rng));
            break;
          case 4:
            s = c % 211 == 3 ? 1.0f + float(c % 3) : 0.0f;
            break;  // few positives
          case 5:
            s = float(c % 13) * 0.25f;
            break;  // periodic ties
          case 6:
            s = float(c) * 0.5f;
            break;  // ascending: the largest scores at the end of the row
          default:
            s = c < 3000 ? 100.0f + normal(rng) : normal(rng);
            break;  // the largest scores bunched at the start
        }
      }
    }
    std::vector<int32_t> ref_tokens(size_t(n_rows * width));
    std::vector<int32_t> ref_counts(static_cast<size_t>(n_rows));
    std::vector<int32_t> groups(static_cast<size_t>(k));
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t visible = qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(r)], kRatio);
      const int64_t n_groups =
          qsa_top_k_groups(std::span<const float>(scores.data() + r * max_groups, size_t(visible)),
                           k, groups.data());
      ref_counts[size_t(r)] = int32_t(qsa_expand_tokens(
          std::span<const int32_t>(groups.data(), size_t(n_groups)), row_pos[size_t(r)], kRatio,
          std::span<int32_t>(ref_tokens.data() + r * width, size_t(width))));
    }

    // The largest score of each run of kQsaRunGroups groups, as the filtered method may be given.
    const int64_t run_stride = (max_groups + kQsaRunGroups - 1) / kQsaRunGroups;
    std::vector<float> run_maxima(size_t(n_rows * run_stride), 0.0f);
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t visible = qsa_visible_groups(row_pos[size_t(r)], seq_lens[size_t(r)], kRatio);
      for (int64_t c = 0; c < visible; ++c) {
        float& m = run_maxima[size_t(r * run_stride + c / kQsaRunGroups)];
        const float s = scores[size_t(r * max_groups + c)];
        m = c % kQsaRunGroups == 0 ? s : std::max(m, s);
      }
    }

    DeviceBuffer<int32_t> d_row_seq(row_seq);
    DeviceBuffer<int32_t> d_row_pos(row_pos);
    DeviceBuffer<int32_t> d_seq_lens(seq_lens);
    DeviceBuffer<float> d_scores(scores);
    DeviceBuffer<float> d_run_maxima(run_maxima);
    DeviceBuffer<int32_t> d_tokens(ref_tokens.size());
    DeviceBuffer<int32_t> d_counts(ref_counts.size());
    E4KV_CUDA_CHECK(cudaMemset(d_tokens.ptr, 0x7F, d_tokens.n * sizeof(int32_t)));
    E4KV_CUDA_CHECK(cudaMemset(d_counts.ptr, 0x7F, d_counts.n * sizeof(int32_t)));
    QsaTopKArgs ta;
    ta.rows.n_rows = n_rows;
    ta.rows.row_seq = d_row_seq.ptr;
    ta.rows.row_pos = d_row_pos.ptr;
    ta.rows.seq_lens = d_seq_lens.ptr;
    ta.ratio = kRatio;
    ta.budget = budget;
    ta.scores = d_scores.ptr;
    ta.max_groups = max_groups;
    ta.sel_tokens = d_tokens.ptr;
    ta.sel_counts = d_counts.ptr;
    const size_t ws_bytes = qsa_top_k_workspace_bytes(n_rows, max_groups, budget, kRatio);
    DeviceBuffer<uint8_t> d_ws(std::max<size_t>(1, ws_bytes));
    // Every method: scan, two phases (chunk candidates; where the rows are long enough for them
    // it runs them), filtered, cluster (sm_90+ only).
    // The filtered and cluster methods run with and without run maxima.
    const QsaTopKMethod methods[6] = {QsaTopKMethod::kScan,     QsaTopKMethod::kTwoPhase,
                                      QsaTopKMethod::kFiltered, QsaTopKMethod::kFiltered,
                                      QsaTopKMethod::kCluster,  QsaTopKMethod::kCluster};
    const char* method_names[6] = {"",         " two-phase", " filtered", " filtered with run maxima",
                                   " cluster", " cluster with run maxima"};
    const int n_methods = qsa_top_k_cluster_available() ? 6 : 4;
    for (int m = 0; m < n_methods; ++m) {
      E4KV_CUDA_CHECK(cudaMemset(d_tokens.ptr, 0x7F, d_tokens.n * sizeof(int32_t)));
      E4KV_CUDA_CHECK(cudaMemset(d_counts.ptr, 0x7F, d_counts.n * sizeof(int32_t)));
      ta.workspace = d_ws.ptr;
      ta.method = methods[m];
      ta.run_maxima = m == 3 || m == 5 ? d_run_maxima.ptr : nullptr;
      ta.run_stride = m == 3 || m == 5 ? run_stride : 0;
      const Status st = qsa_top_k_select(ta, nullptr);
      ASSERT_TRUE(st.ok()) << st.message();
      E4KV_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(compare_selections(ref_tokens, ref_counts, d_tokens.to_host(), d_counts.to_host(),
                                   width, row_pos,
                                   "crafted budget " + std::to_string(budget) +
                                       method_names[m]),
                0);
    }
  }
}

// Compressed rows and rings after a batch that continues earlier history (groups straddling the
// batch start read the ring), starts new sequences (ring cleared) or completes no group, against
// indexer_cache_write from the same state: every FP16 bit identical.
TEST(QsaIndexerCuda, IndexerWriteMatchesCpuReference) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int64_t kRatio = 4;
  constexpr int64_t kDim = 128;
  constexpr int64_t kRotary = 64;
  for (int64_t cap : {4, 8}) {
    for (int64_t block_size : {16, 64}) {
      // (history tokens, batch tokens) per sequence.
      const std::vector<std::pair<int64_t, int64_t>> seqs{{0, 37},  {10, 1}, {13, 3}, {7, 1},
                                                          {5, 200}, {0, 2},  {22, 0}, {9, 11}};
      const int64_t n_seqs = int64_t(seqs.size());
      int64_t max_blocks = 0;
      for (auto [h, n] : seqs) max_blocks = std::max(max_blocks, (h + n) / block_size + 1);
      const int64_t n_blocks = n_seqs * max_blocks + 2;
      std::vector<int32_t> pool(static_cast<size_t>(n_blocks));
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);
      std::vector<int32_t> table(pool.begin(), pool.begin() + n_seqs * max_blocks);
      std::vector<uint16_t> compressed(size_t(n_blocks * (block_size / kRatio) * kDim));
      for (auto& x : compressed) x = f32_to_f16(normal(rng));
      std::vector<uint16_t> rings(size_t((n_seqs + 1) * cap * kDim));
      for (auto& x : rings) x = f32_to_f16(normal(rng));
      std::vector<uint16_t> weight(static_cast<size_t>(kDim));
      for (auto& x : weight) x = f32_to_f16(0.2f * normal(rng));
      const std::vector<double> inv_freq = rope_inv_freq(1e7, kRotary);
      IndexerCompressedView cv{compressed.data(), n_blocks, block_size, kRatio, kDim};
      IndexerRingView rv{rings.data(), n_seqs + 1, cap, kDim};
      IndexerKeyNormRope nr{weight.data(), 1e-6f, kRotary, inv_freq.data()};
      std::vector<int32_t> ring_index(static_cast<size_t>(n_seqs));
      std::iota(ring_index.begin(), ring_index.end(), 1);
      std::shuffle(ring_index.begin(), ring_index.end(), rng);

      // Raw keys with an outlier channel; history first (CPU only), then the tested batch.
      auto make_batch = [&](bool history, std::vector<uint16_t>& keys,
                            std::vector<int32_t>& offsets, std::vector<int64_t>& starts) {
        offsets.assign(1, 0);
        starts.clear();
        for (auto [h, n] : seqs) {
          const int64_t count = history ? h : n;
          for (int64_t t = 0; t < count * kDim; ++t) {
            keys.push_back(f32_to_f16(normal(rng) * (t % kDim == 5 ? 30.0f : 1.0f)));
          }
          offsets.push_back(offsets.back() + int32_t(count));
          starts.push_back(history ? 0 : h);
        }
      };
      std::vector<uint16_t> keys;
      std::vector<int32_t> offsets;
      std::vector<int64_t> starts;
      make_batch(true, keys, offsets, starts);
      IndexerWriteBatch batch{keys.data(),   offsets.data(),
                              starts.data(), ring_index.data(),
                              n_seqs,        BlockTableView{table.data(), n_seqs, max_blocks}};
      indexer_cache_write(cv, rv, batch, nr);
      keys.clear();
      make_batch(false, keys, offsets, starts);
      batch.index_k = keys.data();

      // GPU from the post-history state.
      DeviceBuffer<uint16_t> d_compressed(compressed);
      DeviceBuffer<uint16_t> d_rings(rings);
      DeviceBuffer<uint16_t> d_keys(keys);
      DeviceBuffer<int32_t> d_offsets(offsets);
      DeviceBuffer<int64_t> d_starts(starts);
      DeviceBuffer<int32_t> d_ring_index(ring_index);
      DeviceBuffer<int32_t> d_table(table);
      DeviceBuffer<uint16_t> d_weight(weight);
      int64_t max_pos = 1;
      int64_t max_tokens = 0;
      for (auto [h, n] : seqs)
        max_pos = std::max(max_pos, h + n), max_tokens = std::max(max_tokens, n);
      std::vector<float> rope_table(size_t(max_pos * kRotary));
      for (int64_t p = 0; p < max_pos; ++p) {
        rope_cos_sin(p, inv_freq.data(), kRotary / 2, rope_table.data() + p * kRotary,
                     rope_table.data() + p * kRotary + kRotary / 2);
      }
      DeviceBuffer<float> d_rope(rope_table);

      indexer_cache_write(cv, rv, batch, nr);  // the reference, in place on the host copies

      QsaIndexerWriteArgs wa;
      wa.compressed = cv;
      wa.compressed.data = d_compressed.ptr;
      wa.rings = rv;
      wa.rings.data = d_rings.ptr;
      wa.batch = batch;
      wa.batch.index_k = d_keys.ptr;
      wa.batch.token_offsets = d_offsets.ptr;
      wa.batch.start_pos = d_starts.ptr;
      wa.batch.ring_index = d_ring_index.ptr;
      wa.batch.block_tables.blocks = d_table.ptr;
      wa.norm_weight = d_weight.ptr;
      wa.eps = nr.eps;
      wa.rotary_dim = kRotary;
      wa.rope_table = d_rope.ptr;
      wa.n_rope_positions = max_pos;
      wa.max_tokens_per_seq = max_tokens;
      const Status st = qsa_indexer_write(wa, nullptr);
      ASSERT_TRUE(st.ok()) << st.message();
      E4KV_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint16_t> gpu_compressed = d_compressed.to_host();
      const std::vector<uint16_t> gpu_rings = d_rings.to_host();
      int64_t bad = 0;
      for (size_t i = 0; i < compressed.size(); ++i) {
        if (gpu_compressed[i] != compressed[i] && ++bad <= 5) {
          ADD_FAILURE() << "cap " << cap << " bs " << block_size << ": compressed element " << i
                        << " (row " << i / kDim << ", dim " << i % kDim << "): gpu "
                        << f16_to_f32(gpu_compressed[i]) << " cpu " << f16_to_f32(compressed[i]);
        }
      }
      for (size_t i = 0; i < rings.size(); ++i) {
        if (gpu_rings[i] != rings[i] && ++bad <= 10) {
          ADD_FAILURE() << "cap " << cap << " bs " << block_size << ": ring element " << i;
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

// Shape validation happens on the host, before any device access: runs without a GPU.
TEST(QsaIndexerCuda, LaunchersRejectBadShapes) {
  QsaIndexScoresArgs sa;
  sa.rows.n_rows = 1;
  sa.max_groups = 10;
  sa.compressed.n_blocks = 1;
  sa.n_index_heads = 9;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());
  sa.n_index_heads = 4;
  sa.compressed.index_dim = 100;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());
  sa.compressed.index_dim = 128;
  sa.compressed.block_size = 18;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());
  sa.compressed.block_size = 64;
  EXPECT_FALSE(qsa_index_scores(sa, nullptr).ok());  // null pointers
  sa.rows.n_rows = 0;
  EXPECT_TRUE(qsa_index_scores(sa, nullptr).ok());  // nothing to do

  QsaTopKArgs ta;
  ta.rows.n_rows = 1;
  ta.budget = 3;
  EXPECT_FALSE(qsa_top_k_select(ta, nullptr).ok());  // budget below one group
  ta.budget = 2048;
  EXPECT_FALSE(qsa_top_k_select(ta, nullptr).ok());  // null pointers
  ta.rows.n_rows = 0;
  EXPECT_TRUE(qsa_top_k_select(ta, nullptr).ok());
  // A method that cannot take the shape is refused before any launch (the host pointers below are
  // never dereferenced).
  int32_t host_int = 0;
  float host_score = 0.0f;
  ta.rows.n_rows = 1;
  ta.rows.row_seq = ta.rows.row_pos = ta.rows.seq_lens = &host_int;
  ta.sel_tokens = ta.sel_counts = &host_int;
  ta.scores = &host_score;
  ta.max_groups = kQsaTopKFilteredMaxGroups + 1;
  ta.method = QsaTopKMethod::kFiltered;
  EXPECT_FALSE(qsa_top_k_select(ta, nullptr).ok());  // rows beyond the filtered limit
  ta.method = QsaTopKMethod::kCluster;
  EXPECT_FALSE(qsa_top_k_select(ta, nullptr).ok());  // the same limit
  ta.method = QsaTopKMethod::kTwoPhase;
  EXPECT_FALSE(qsa_top_k_select(ta, nullptr).ok());  // no workspace
}

}  // namespace
}  // namespace e4kv::cuda
