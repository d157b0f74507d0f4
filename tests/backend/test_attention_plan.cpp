// The launch plans of the CUDA attention and top-k kernels (backend/attention_plan.h), tested in
// the CPU suite: prefill items cover every tile row once, in order, within the CTA's slot budget;
// the top-k workspace is asked for only where two phases shrink the rows and kAuto picks the
// documented method; decode splits cover every key and fill whole waves of resident CTAs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/attention_plan.h"

namespace e4kv {
namespace {

TEST(PrefillPlanning, ItemsCoverEveryTileRowOnceWithinTheSlotBudget) {
  const std::vector<RouteTile> tiles{{0, 64, 0}, {64, 3, 0}, {67, 37, 1}, {104, 1, 2}};
  for (int64_t group : {1, 4, 6, 8, 16}) {
    const int64_t per_item = prefill_rows_per_item(group);
    EXPECT_EQ(per_item, 64 / group);
    const std::vector<PrefillAttentionItem> items = plan_prefill_items(tiles, group);
    int64_t next_row = 0;
    for (const PrefillAttentionItem& item : items) {
      EXPECT_EQ(item.first_row, next_row) << "group " << group;
      EXPECT_GE(item.n_rows, 1);
      EXPECT_LE(item.n_rows, per_item);
      EXPECT_LE(item.n_rows * group, 64);
      next_row += item.n_rows;
    }
    EXPECT_EQ(next_row, 105) << "group " << group;
    // No item spans two tiles (tiles are one sequence each).
    for (const PrefillAttentionItem& item : items) {
      bool inside = false;
      for (const RouteTile& t : tiles) {
        inside |=
            item.first_row >= t.first_row && item.first_row + item.n_rows <= t.first_row + t.n_rows;
      }
      EXPECT_TRUE(inside) << "group " << group << " item at row " << item.first_row;
    }
  }
  EXPECT_TRUE(plan_prefill_items(tiles, 0).empty());
  EXPECT_TRUE(plan_prefill_items(tiles, 65).empty());
  EXPECT_EQ(prefill_rows_per_item(64), 1);
}

TEST(DecodePlanning, SplitsCoverEveryKeyAndFillWholeWaves) {
  struct Case {
    int64_t rows, kv_heads, keys, resident;
  };
  for (const Case& c : {Case{32, 8, 8192, 396}, Case{8, 8, 32768, 396}, Case{4, 2, 131072, 396},
                        Case{64, 2, 8192, 264}, Case{1, 2, 20480, 396}, Case{4, 2, 2051, 396},
                        Case{3, 1, 1, 396}, Case{7, 5, 999, 1}}) {
    const DecodeAttentionPlan plan = plan_decode_attention(c.rows, c.kv_heads, c.keys, c.resident);
    const std::string what = "rows " + std::to_string(c.rows) + " keys " + std::to_string(c.keys);
    EXPECT_EQ(plan.n_splits % 4, 0) << what;
    EXPECT_EQ(plan.keys_per_split % 8, 0) << what;
    EXPECT_GE(plan.keys_per_split * plan.n_splits, c.keys) << what;
    // Waves x (keys per split + 64) + 1.25 per CTA of a row and KV head is never far above what
    // any other split count gives (brute force here).
    auto cost = [&](int64_t splits, int64_t kps) {
      const int64_t n = c.rows * c.kv_heads * splits / 4;
      return double((n + c.resident - 1) / c.resident) * double(kps + 64) + 1.25 * (splits / 4);
    };
    for (int64_t s = 4; s <= 4096; s += 4) {
      if ((c.keys + s - 1) / s < 16 && s > 4) break;  // the planner keeps 16+ keys per split
      const int64_t kps = ((c.keys + s - 1) / s + 7) / 8 * 8;
      EXPECT_LE(cost(plan.n_splits, plan.keys_per_split), 1.02 * cost(s, kps))
          << what << " beaten by " << s << " splits";
    }
  }
  // 8 x 32K at 396 resident CTAs: one wave (the old SM-count rule launched 576 CTAs, 1.45 waves).
  const DecodeAttentionPlan p = plan_decode_attention(8, 8, 32768, 396);
  EXPECT_LE(8 * 8 * p.n_splits / 4, 396);
  EXPECT_GE(8 * 8 * p.n_splits / 4, 396 * 9 / 10);
  // Short launches: the per-CTA cost picks 16 CTAs of 4 x 32 keys per row and KV head for the QSA
  // benchmark (4 rows, 2 KV heads, 2048 keys; 32 CTAs of 4 x 16 before, measured slower on the
  // H200), 17 for 2051 keys, and 54 for one 20K sequence (128 before).
  EXPECT_EQ(plan_decode_attention(4, 2, 2048, 264).n_splits, 64);
  EXPECT_EQ(plan_decode_attention(4, 2, 2051, 264).n_splits, 68);
  EXPECT_EQ(plan_decode_attention(1, 2, 20480, 264).n_splits, 216);
}

TEST(DecodeAttentionPlanning, ClusterMergePlan) {
  // 64 splits; a QSA selection of budget + tail keeps budget / 64 keys per split (the last split
  // takes the tail), other lengths round up to a multiple of 8 that covers every key.
  struct Expect {
    int64_t keys, keys_per_split;
  };
  for (const Expect& e : {Expect{2051, 32}, Expect{2048, 32}, Expect{2040, 32}, Expect{1500, 24},
                          Expect{259, 8}, Expect{1, 8}, Expect{4096, 64}, Expect{4103, 64}}) {
    const DecodeAttentionPlan p = plan_decode_attention_cluster(e.keys, 64);
    EXPECT_TRUE(p.merge_in_cluster) << e.keys;
    EXPECT_EQ(p.n_splits, 64) << e.keys;
    EXPECT_EQ(p.keys_per_split, e.keys_per_split) << e.keys;
    // The last split takes every key past the first 63 splits: at most a tile more than them.
    EXPECT_LE(e.keys - 63 * p.keys_per_split, p.keys_per_split + 8) << e.keys;
  }
  // The cluster merge where one wave of clusters holds every row and KV head and the keys are
  // short; the split merged by a second kernel otherwise.
  // 128 splits (clusters of 16 CTAs): 16 keys each, the last 19.
  EXPECT_EQ(plan_decode_attention_cluster(2051, 128).keys_per_split, 16);
  const DecodeClusterMerge merge{16, 64};
  EXPECT_TRUE(choose_decode_attention_plan(4, 2, 2051, 264, merge).merge_in_cluster);
  EXPECT_EQ(choose_decode_attention_plan(4, 2, 2051, 264, merge).n_splits, 64);
  EXPECT_FALSE(choose_decode_attention_plan(16, 2, 2051, 264, merge).merge_in_cluster);
  EXPECT_FALSE(
      choose_decode_attention_plan(4, 2, 2051, 264, DecodeClusterMerge{}).merge_in_cluster);
  EXPECT_FALSE(choose_decode_attention_plan(1, 2, 20480, 264, merge).merge_in_cluster);
  EXPECT_EQ(choose_decode_attention_plan(1, 2, 20480, 264, merge).n_splits, 216);
}

TEST(QsaTopKPlanning, WorkspaceOnlyWhereTwoPhasesShrinkTheRows) {
  // 128K context, budget 2048, ratio 4: 32768 groups -> 8 chunks x 512 candidates.
  EXPECT_EQ(qsa_top_k_workspace_bytes(4, 32768, 2048, 4), size_t(4 * 8 * 512 * 8));
  // One chunk still shrinks 4096 groups to 512 candidates.
  EXPECT_EQ(qsa_top_k_workspace_bytes(4, 4096, 2048, 4), size_t(4 * 1 * 512 * 8));
  // Where chunks * k >= the groups, two phases gain nothing: no workspace.
  EXPECT_EQ(qsa_top_k_workspace_bytes(4, 512, 2048, 4), 0u);
  EXPECT_EQ(qsa_top_k_workspace_bytes(4, 8192, 16384, 4), 0u);  // 2 chunks x 4096
  // Bad sizes ask for nothing (the launcher reports them).
  EXPECT_EQ(qsa_top_k_workspace_bytes(0, 32768, 2048, 4), 0u);
  EXPECT_EQ(qsa_top_k_workspace_bytes(4, 32768, 2, 4), 0u);
  // 65536 chunks would exceed the grid's y dimension: no two-phase workspace.
  EXPECT_EQ(qsa_top_k_workspace_bytes(1, 65536 * kQsaTopKChunkGroups, 2048, 4), 0u);
  EXPECT_GT(qsa_top_k_workspace_bytes(1, 65535 * kQsaTopKChunkGroups, 2048, 4), 0u);
}

TEST(QsaTopKPlanning, AutoPicksTheClusterThenTheFilterThenTwoPhasesThenTheScan) {
  const int64_t fits = kQsaTopKFilteredMaxGroups;
  const int64_t longer = kQsaTopKFilteredMaxGroups + 1;
  EXPECT_EQ(choose_qsa_top_k_method(4, fits, true, false), QsaTopKMethod::kCluster);
  EXPECT_EQ(choose_qsa_top_k_method(4, fits, false, true), QsaTopKMethod::kFiltered);
  EXPECT_EQ(choose_qsa_top_k_method(kQsaTopKClusterMaxRows, 512, true, false),
            QsaTopKMethod::kFiltered);
  EXPECT_EQ(choose_qsa_top_k_method(4, longer, true, true), QsaTopKMethod::kTwoPhase);
  EXPECT_EQ(choose_qsa_top_k_method(4, longer, true, false), QsaTopKMethod::kScan);
  // 512K tokens at ratio 4 is the filter's limit.
  EXPECT_EQ(kQsaTopKFilteredMaxGroups * 4, int64_t(512) * 1024);
}

}  // namespace
}  // namespace e4kv
