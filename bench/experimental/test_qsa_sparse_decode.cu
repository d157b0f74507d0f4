// The QSA sparse decode kernel (selection and attention in one cluster, sm_90+) against the CPU
// reference: the selection against qsa_top_k_groups + qsa_expand_tokens on the same scores (the
// count and the token set; the order is the kernel's own on its fast path), the output against
// the CPU attention over that selection. head_dim 128/256 x GQA 1/4/8 x FP16/E4M3 (software and
// native decode), budgets 64 and 2048, with and without run maxima, over rows whose scores take
// each path: distinct scores (candidates in shared memory), a few equal at the threshold (ties
// ranked by group), heavy ties and all-zero rows (the selection emitted and read back), rows with
// at most k groups, the largest scores at either end of the row. Outputs are poisoned with NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "attention_data.h"
#include "backend/cpu/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "device_buffer.cuh"
#include "experimental/qsa_sparse_decode.cuh"
#include "qsa/selection.h"

namespace e4kv::cuda {
namespace {

constexpr int64_t kRatio = 4;

// Scores of one row's visible groups, by kind.
void fill_scores(int kind, std::mt19937& rng, std::span<float> row) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> small(0, 6);
  for (size_t c = 0; c < row.size(); ++c) {
    float& s = row[c];
    switch (kind) {
      case 0:  // distinct
        s = std::fabs(normal(rng)) * 3.0f;
        break;
      case 1:  // a few equal at the threshold: steps of 1/16
        s = std::round(std::fabs(normal(rng)) * 16.0f) / 16.0f;
        break;
      case 2:  // heavy ties
        s = float(small(rng));
        break;
      case 3:  // all zero
        s = 0.0f;
        break;
      case 4:  // the largest at the end
        s = float(c) * 0.5f;
        break;
      default:  // the largest bunched at the start
        s = c < 700 ? 100.0f + normal(rng) : std::fabs(normal(rng));
        break;
    }
  }
}

struct Outcome {
  Comparison output;
  int64_t bad_rows = 0;
};

Outcome run_case(const AttentionCase& c, int64_t budget, bool with_maxima, uint32_t seed) {
  const int64_t width = qsa_selection_width(budget, kRatio);
  const int64_t k = qsa_top_k(budget, kRatio);
  // (sequence, position) and the kind of scores: distinct over 5000 groups; heavy ties (178 equal
  // at T, some left out); a few equal at T over 525 groups just above k = 512 (ascending at budget
  // 64); 175 groups (at most k at budget 2048); all zero over 4750 groups (more candidates than
  // shared memory holds) and over 1000 groups (more equal to T than one comparison pass ranks).
  const std::vector<int32_t> lens{20001, 5003, 2101, 701};
  const std::vector<std::pair<int32_t, int32_t>> rows{{0, 20000}, {1, 5002},  {2, 2100},
                                                      {3, 700},   {0, 19000}, {1, 4001}};
  const std::vector<int> kinds{0, 2, budget == 64 ? 4 : 1, 5, 3, 3};
  AttentionData data;
  data.make(c, lens, rows, width, seed);
  const int64_t n_rows = int64_t(rows.size());

  int64_t max_groups = 0;
  for (const auto& [s, p] : rows) {
    max_groups = std::max(max_groups, qsa_visible_groups(p, lens[size_t(s)], kRatio));
  }
  std::mt19937 rng(seed * 7u + 1u);
  std::vector<float> scores(size_t(n_rows * max_groups), -1.0f);
  const int64_t run_stride = (max_groups + kQsaRunGroups - 1) / kQsaRunGroups;
  std::vector<float> maxima(size_t(n_rows * run_stride), 0.0f);
  std::vector<int32_t> groups(static_cast<size_t>(k));
  for (int64_t r = 0; r < n_rows; ++r) {
    const auto [s, pos] = rows[size_t(r)];
    const int64_t visible = qsa_visible_groups(pos, lens[size_t(s)], kRatio);
    std::span<float> row(scores.data() + r * max_groups, size_t(visible));
    fill_scores(kinds[size_t(r)], rng, row);
    for (int64_t g = 0; g < visible; ++g) {
      float& m = maxima[size_t(r * run_stride + g / kQsaRunGroups)];
      m = g % kQsaRunGroups == 0 ? row[size_t(g)] : std::max(m, row[size_t(g)]);
    }
    // The reference selection replaces the fixture's random one, then its attention.
    const int64_t n_groups = qsa_top_k_groups(row, k, groups.data());
    std::fill(data.sel.begin() + r * width, data.sel.begin() + (r + 1) * width, -1);
    data.counts[size_t(r)] = int32_t(
        qsa_expand_tokens(std::span<const int32_t>(groups.data(), size_t(n_groups)), pos, kRatio,
                          std::span<int32_t>(data.sel.data() + r * width, size_t(width))));
  }
  data.params.out = data.ref.data();
  const Status cpu = paged_attention(data.params);
  EXPECT_TRUE(cpu.ok()) << cpu.message();

  DeviceAttentionData device(data);
  DeviceBuffer<float> d_scores(scores);
  DeviceBuffer<float> d_maxima(maxima);
  DeviceBuffer<int32_t> d_tokens(size_t(n_rows * width));
  DeviceBuffer<int32_t> d_counts(static_cast<size_t>(n_rows));
  E4KV_CUDA_CHECK(cudaMemset(d_tokens.ptr, 0x7F, d_tokens.n * sizeof(int32_t)));
  E4KV_CUDA_CHECK(cudaMemset(d_counts.ptr, 0x7F, d_counts.n * sizeof(int32_t)));
  QsaSparseDecodeArgs args;
  args.select.rows = device.params.rows;
  args.select.ratio = kRatio;
  args.select.budget = budget;
  args.select.scores = d_scores.ptr;
  args.select.max_groups = max_groups;
  args.select.run_maxima = with_maxima ? d_maxima.ptr : nullptr;
  args.select.run_stride = with_maxima ? run_stride : 0;
  args.select.sel_tokens = d_tokens.ptr;
  args.select.sel_counts = d_counts.ptr;
  args.attention = device.params;
  args.attention.rows.sel_tokens = nullptr;
  args.attention.rows.sel_counts = nullptr;

  const DecodeAttentionConfig config{c.native, DecodeLoadPath::kAsyncCopy};
  const Result<DecodeClusterMerge> clusters =
      qsa_sparse_decode_clusters(data.params.cache.geometry, data.params.n_heads, config, 0);
  EXPECT_TRUE(clusters.ok()) << clusters.status().message();
  Outcome result;
  if (!clusters.ok()) return result;
  const DecodeAttentionPlan plan =
      plan_qsa_sparse_decode(n_rows, c.n_kv_heads, max_groups, budget, kRatio, *clusters);
  EXPECT_GT(plan.n_splits, 0) << describe(c) << ": " << clusters->clusters << " clusters";
  if (plan.n_splits == 0) return result;
  const Status st = qsa_sparse_decode(args, plan, config, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  result.output = compare_outputs(device.out.to_host(), data.ref);

  // The selection: the reference's count and set, -1 padding.
  const std::vector<int32_t> tokens = d_tokens.to_host();
  const std::vector<int32_t> counts = d_counts.to_host();
  for (int64_t r = 0; r < n_rows; ++r) {
    const int32_t n = data.counts[size_t(r)];
    std::vector<int32_t> want(data.sel.begin() + r * width, data.sel.begin() + r * width + n);
    std::vector<int32_t> got(tokens.begin() + r * width, tokens.begin() + r * width + n);
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    const bool padded =
        std::all_of(tokens.begin() + r * width + n, tokens.begin() + (r + 1) * width,
                    [](int32_t t) { return t == -1; });
    if (counts[size_t(r)] != n || got != want || !padded) {
      ++result.bad_rows;
      ADD_FAILURE() << describe(c) << " budget " << budget << " row " << r << " (kind "
                    << kinds[size_t(r)] << "): count " << counts[size_t(r)] << " vs " << n
                    << (got != want ? ", other tokens" : "") << (padded ? "" : ", bad padding");
    }
  }
  return result;
}

TEST(QsaSparseDecodeCuda, MatchesCpuReference) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (compute_capability(0) < 90) GTEST_SKIP() << "the sparse decode kernel needs sm_90+";
  const bool native = decode_attention_native_e4m3_usable(0);
  double worst = 0;
  int runs = 0;
  uint32_t seed = 900;
  for (int head_dim : {128, 256}) {
    for (int group : {1, 4, 8}) {
      for (int variant = 0; variant < 3; ++variant) {
        if (variant == 2 && !native) continue;
        const KvCacheDtype dtype = variant == 0 ? KvCacheDtype::kF16 : KvCacheDtype::kE4m3;
        const AttentionCase c{head_dim, 2,    group,       (group + variant) % 2 == 0 ? 64 : 16,
                              dtype,    true, variant == 2};
        for (int64_t budget : {64, 2048}) {
          const bool with_maxima = (runs % 2) == 0;
          const Outcome o = run_case(c, budget, with_maxima, seed++);
          EXPECT_EQ(o.output.n_nan, 0) << describe(c) << " budget " << budget;
          EXPECT_LE(o.output.rel_l2, 2e-3)
              << describe(c) << " budget " << budget << " max abs " << o.output.max_abs_err;
          EXPECT_EQ(o.bad_rows, 0);
          worst = std::max(worst, o.output.rel_l2);
          ++runs;
        }
      }
    }
  }
  std::printf("[ info ] sparse decode: %d runs, worst relative L2 %.3g\n", runs, worst);
}

// Two runs that between them take every path of the kernel (the sweep's rows), small enough for
// compute-sanitizer (scripts/gpu_run.sh runs it there instead of the sweep).
TEST(QsaSparseDecodeCuda, EveryPathOnceForTheSanitizer) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (compute_capability(0) < 90) GTEST_SKIP() << "the sparse decode kernel needs sm_90+";
  const bool native = decode_attention_native_e4m3_usable(0);
  const AttentionCase cases[2] = {
      {256, 2, 8, 64, KvCacheDtype::kE4m3, true, native},
      {128, 2, 4, 16, KvCacheDtype::kF16, true, false}};
  const int64_t budgets[2] = {2048, 64};
  for (int i = 0; i < 2; ++i) {
    const Outcome o = run_case(cases[i], budgets[i], i == 0, 4242u + uint32_t(i));
    EXPECT_EQ(o.output.n_nan, 0) << describe(cases[i]);
    EXPECT_LE(o.output.rel_l2, 2e-3) << describe(cases[i]) << " max abs " << o.output.max_abs_err;
    EXPECT_EQ(o.bad_rows, 0);
  }
}

// Bad arguments get an error that names them; nothing is launched.
TEST(QsaSparseDecodeCuda, RejectsWhatItDoesNotRun) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const AttentionCase c{128, 2, 4, 16, KvCacheDtype::kF16, true, false};
  const DecodeAttentionConfig config = decode_attention_config(0, false);
  QsaSparseDecodeArgs args;
  args.select.rows.n_rows = 1;
  args.select.budget = 8192;  // width 8195 > kDecodeClusterMaxKeys
  args.attention.rows.n_rows = 1;
  args.attention.cache.geometry = KvCacheGeometry{4, 16, 2, 128, KvCacheDtype::kF16};
  args.attention.n_heads = 8;
  const Status wide = qsa_sparse_decode(args, DecodeAttentionPlan{}, config, nullptr);
  EXPECT_FALSE(wide.ok());
  EXPECT_NE(wide.message().find("selection width"), std::string::npos) << wide.message();
  // A plan that is not the sparse decode's.
  args.select.budget = 2048;
  args.select.max_groups = 100;
  AttentionData data;
  data.make(c, {900}, {{0, 899}}, 2051, 3);
  DeviceAttentionData device(data);
  DeviceBuffer<float> d_scores(std::vector<float>(100, 1.0f));
  DeviceBuffer<int32_t> d_tokens(2051);
  DeviceBuffer<int32_t> d_counts(1);
  args.select.rows = device.params.rows;
  args.select.scores = d_scores.ptr;
  args.select.sel_tokens = d_tokens.ptr;
  args.select.sel_counts = d_counts.ptr;
  args.attention = device.params;
  const Status bad_plan = qsa_sparse_decode(args, DecodeAttentionPlan{64, 32}, config, nullptr);
  EXPECT_FALSE(bad_plan.ok());
  EXPECT_NE(bad_plan.message().find("plan"), std::string::npos) << bad_plan.message();
  // Longer rows than the kernel selects over: the planner declines.
  const DecodeAttentionPlan none = plan_qsa_sparse_decode(1, 2, kQsaSparseDecodeMaxGroups + 1, 2048,
                                                          kRatio, DecodeClusterMerge{16, 64});
  EXPECT_EQ(none.n_splits, 0);
  const DecodeAttentionPlan fits = plan_qsa_sparse_decode(8, 2, kQsaSparseDecodeMaxGroups, 2048,
                                                          kRatio, DecodeClusterMerge{16, 64});
  EXPECT_EQ(fits.n_splits, 64);
  EXPECT_TRUE(fits.merge_in_cluster);
  EXPECT_EQ(plan_qsa_sparse_decode(9, 2, 100, 2048, kRatio, DecodeClusterMerge{16, 64}).n_splits,
            0);  // 18 clusters, 16 fit
}

}  // namespace
}  // namespace e4kv::cuda
