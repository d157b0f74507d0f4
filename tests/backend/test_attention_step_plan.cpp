// The per-step attention plan (plan_attention_step, backend/attention_plan.h) against the planning
// the CUDA attention op did per layer and per call before it was moved into the host half of a
// step (written out again below from the same route planner and decode planner): on random mixed
// batches the step plan has the same prefill items and the same decode launches, and the
// workspace sized at load (decode_workspace_floats_for_limits) holds every run without cutting
// one. With a smaller workspace, runs are cut so that each fits and every decode row is still run
// once, with the plan its own rows call for.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "backend/attention_plan.h"

namespace e4kv {
namespace {

// The rows of one random step: sequences with chunks of random length at consecutive positions,
// chunks of different sequences interleaved in random order (a dense model takes any order).
struct Rows {
  std::vector<int32_t> seq, pos;
  QueryBatchView view() const {
    QueryBatchView v;
    v.n_rows = int64_t(seq.size());
    v.row_seq = seq.data();
    v.row_pos = pos.data();
    return v;
  }
};

Rows random_rows(std::mt19937& rng, int64_t max_rows, int64_t max_len) {
  Rows rows;
  const int n_seqs = std::uniform_int_distribution<int>(1, 8)(rng);
  std::vector<int64_t> next(static_cast<size_t>(n_seqs));
  for (int64_t& p : next) p = std::uniform_int_distribution<int64_t>(0, max_len / 2)(rng);
  while (int64_t(rows.seq.size()) < max_rows) {
    const int s = std::uniform_int_distribution<int>(0, n_seqs - 1)(rng);
    // Mostly decode rows, some short chunks and a few long ones (past a 64-row prefill tile).
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    int64_t n = kind < 6   ? 1
                : kind < 9 ? std::uniform_int_distribution<int64_t>(2, 20)(rng)
                           : std::uniform_int_distribution<int64_t>(60, 140)(rng);
    n = std::min({n, max_rows - int64_t(rows.seq.size()), max_len - next[size_t(s)]});
    if (n <= 0) break;
    for (int64_t i = 0; i < n; ++i) {
      rows.seq.push_back(s);
      rows.pos.push_back(int32_t(next[size_t(s)]++));
    }
  }
  return rows;
}

// What the CUDA op planned per call: routes, prefill tiles cut into items, decode rows sorted and
// cut into runs of consecutive rows, each planned over its longest key list.
AttentionStepPlan per_call_plan(std::span<const AttentionRouteLimits> routes,
                                const AttentionLayerShape& shape, const QueryBatchView& rows,
                                const DecodeDeviceLimits& device) {
  AttentionStepPlan out;
  Result<RoutePlan> plan = plan_attention_routes(routes, shape.route_shape(), rows);
  EXPECT_TRUE(plan.ok()) << plan.message();
  out.routes = *plan;
  std::vector<RouteTile> prefill_tiles, decode_tiles;
  for (const RouteLaunch& launch : plan->launches) {
    auto first = plan->tiles.begin() + launch.first_tile;
    auto& dst = routes[size_t(launch.route)].kernel == AttentionKernel::kPrefillTiles
                    ? prefill_tiles
                    : decode_tiles;
    dst.insert(dst.end(), first, first + launch.n_tiles);
  }
  out.prefill_items = plan_prefill_items(prefill_tiles, shape.n_heads / shape.n_kv_heads);
  std::sort(decode_tiles.begin(), decode_tiles.end(),
            [](const RouteTile& a, const RouteTile& b) { return a.first_row < b.first_row; });
  for (size_t i = 0; i < decode_tiles.size();) {
    size_t j = i + 1;
    while (j < decode_tiles.size() &&
           decode_tiles[j].first_row == decode_tiles[j - 1].first_row + 1) {
      ++j;
    }
    const int64_t first = decode_tiles[i].first_row;
    const int64_t n = int64_t(j - i);
    int64_t max_keys = 1;
    for (int64_t r = first; r < first + n; ++r) {
      max_keys =
          std::max(max_keys, shape.sel_width > 0 ? shape.sel_width : int64_t(rows.row_pos[r]) + 1);
    }
    out.decode_runs.push_back(
        DecodeRowRun{first, n, max_keys,
                     choose_decode_attention_plan(n, shape.n_kv_heads, max_keys,
                                                  device.resident_ctas, device.cluster)});
    i = j;
  }
  return out;
}

void expect_same_runs(const std::vector<DecodeRowRun>& a, const std::vector<DecodeRowRun>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first_row, b[i].first_row) << "run " << i;
    EXPECT_EQ(a[i].n_rows, b[i].n_rows) << "run " << i;
    EXPECT_EQ(a[i].max_keys, b[i].max_keys) << "run " << i;
    EXPECT_EQ(a[i].plan.keys_per_split, b[i].plan.keys_per_split) << "run " << i;
    EXPECT_EQ(a[i].plan.n_splits, b[i].plan.n_splits) << "run " << i;
    EXPECT_EQ(a[i].plan.merge_in_cluster, b[i].plan.merge_in_cluster) << "run " << i;
  }
}

std::vector<AttentionLayerShape> shapes() {
  std::vector<AttentionLayerShape> out;
  for (int64_t group : {1, 4, 8}) {
    for (int64_t sel_width : {int64_t(0), int64_t(2048 + 3)}) {
      AttentionLayerShape s;
      s.head_dim = 128;
      s.block_size = 64;
      s.dtype = sel_width > 0 ? KvCacheDtype::kE4m3 : KvCacheDtype::kF16;
      s.n_kv_heads = 2;
      s.n_heads = 2 * group;
      s.sel_width = sel_width;
      out.push_back(s);
    }
  }
  return out;
}

TEST(AttentionStepPlan, EqualsThePerCallPlanOnRandomBatches) {
  std::mt19937 rng(7);
  const std::vector<AttentionRouteLimits> routes = cuda_attention_routes();
  constexpr int64_t kMaxRows = 256;
  constexpr int64_t kMaxLen = 6000;
  for (const DecodeClusterMerge cluster : {DecodeClusterMerge{}, DecodeClusterMerge{132, 16}}) {
    for (const AttentionLayerShape& shape : shapes()) {
      DecodeDeviceLimits device;
      device.resident_ctas = 132 * 4;
      device.cluster = cluster;
      device.workspace_floats = decode_workspace_floats_for_limits(
          shape, kMaxRows, shape.qsa() ? shape.sel_width : kMaxLen, device);
      for (int trial = 0; trial < 40; ++trial) {
        const Rows rows =
            random_rows(rng, std::uniform_int_distribution<int64_t>(1, kMaxRows)(rng), kMaxLen);
        SCOPED_TRACE(testing::Message() << "group " << shape.gqa_group() << " sel_width "
                                        << shape.sel_width << " clusters " << cluster.clusters
                                        << " trial " << trial << " rows " << rows.seq.size());
        Result<AttentionStepPlan> step = plan_attention_step(routes, shape, rows.view(), device);
        ASSERT_TRUE(step.ok()) << step.message();
        const AttentionStepPlan old = per_call_plan(routes, shape, rows.view(), device);
        ASSERT_EQ(step->prefill_items.size(), old.prefill_items.size());
        for (size_t i = 0; i < old.prefill_items.size(); ++i) {
          EXPECT_EQ(step->prefill_items[i].first_row, old.prefill_items[i].first_row);
          EXPECT_EQ(step->prefill_items[i].n_rows, old.prefill_items[i].n_rows);
        }
        expect_same_runs(step->decode_runs, old.decode_runs);
        EXPECT_EQ(step->routes.tiles.size(), old.routes.tiles.size());
      }
    }
  }
}

TEST(AttentionStepPlan, RunsAreCutToFitASmallerWorkspace) {
  std::mt19937 rng(11);
  const std::vector<AttentionRouteLimits> routes = cuda_attention_routes();
  AttentionLayerShape shape = shapes()[2];  // group 4, dense
  DecodeDeviceLimits device;
  device.resident_ctas = 132 * 4;
  // One row of 6000 keys fits; long runs do not.
  device.workspace_floats = decode_workspace_floats_for_limits(shape, 1, 6000, device) + 1;
  int cut = 0;
  for (int trial = 0; trial < 30; ++trial) {
    const Rows rows = random_rows(rng, 200, 6000);
    Result<AttentionStepPlan> step = plan_attention_step(routes, shape, rows.view(), device);
    ASSERT_TRUE(step.ok()) << step.message();
    const AttentionStepPlan old = per_call_plan(routes, shape, rows.view(), device);
    // The decode rows of the uncut plan, each exactly once, in row order.
    std::vector<int64_t> want, got;
    for (const DecodeRowRun& run : old.decode_runs) {
      for (int64_t r = run.first_row; r < run.first_row + run.n_rows; ++r) want.push_back(r);
    }
    for (const DecodeRowRun& run : step->decode_runs) {
      const size_t need = run.plan.merge_in_cluster
                              ? 0
                              : decode_attention_workspace_floats(run.n_rows, run.plan.n_splits,
                                                                  shape.n_heads, shape.head_dim);
      EXPECT_LE(need, device.workspace_floats);
      int64_t max_keys = 1;
      for (int64_t r = run.first_row; r < run.first_row + run.n_rows; ++r) {
        got.push_back(r);
        max_keys = std::max<int64_t>(max_keys, rows.pos[size_t(r)] + 1);
      }
      EXPECT_EQ(run.max_keys, max_keys);
      const DecodeAttentionPlan plan = choose_decode_attention_plan(
          run.n_rows, shape.n_kv_heads, max_keys, device.resident_ctas, device.cluster);
      EXPECT_EQ(run.plan.n_splits, plan.n_splits);
      EXPECT_EQ(run.plan.keys_per_split, plan.keys_per_split);
    }
    EXPECT_EQ(got, want);
    cut += step->decode_runs.size() > old.decode_runs.size() ? 1 : 0;
  }
  EXPECT_GT(cut, 0) << "no run needed cutting: the test does not test it";
  // A workspace that holds no row is an error naming the workspace.
  device.workspace_floats = 1;
  const Rows rows = random_rows(rng, 10, 6000);
  Result<AttentionStepPlan> step = plan_attention_step(routes, shape, rows.view(), device);
  if (!step.ok()) {
    EXPECT_NE(step.message().find("decode workspace"), std::string::npos) << step.message();
  } else {
    EXPECT_TRUE(step->decode_runs.empty());
  }
}

}  // namespace
}  // namespace e4kv
