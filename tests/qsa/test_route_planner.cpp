// The mixed-batch route planner: the seed's 49-row batch, exhaustive small layouts under tight
// limits, random large layouts, and the checks that reject bad tables and bad plans. Every plan is
// verified twice: by check_route_plan and by an independent count in this file.
#include "qsa/route_planner.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <vector>

namespace e4kv {
namespace {

struct Batch {
  std::vector<int32_t> row_seq;
  std::vector<int32_t> row_pos;

  void add_chunk(int32_t seq, int32_t first_pos, int32_t n) {
    for (int32_t i = 0; i < n; ++i) {
      row_seq.push_back(seq);
      row_pos.push_back(first_pos + i);
    }
  }
  QueryBatchView view() const {
    QueryBatchView rows;
    rows.n_rows = int64_t(row_seq.size());
    rows.row_seq = row_seq.data();
    rows.row_pos = row_pos.data();
    return rows;
  }
};

const AttentionRouteShape kSeedShape = {256, 64, KvCacheDtype::kE4m3, /*qsa=*/true, 8};

// Independent of check_route_plan: rows covered once, tile and launch limits, tile contents.
void expect_valid(const std::vector<AttentionRouteLimits>& routes, const AttentionRouteShape& shape,
                  const Batch& batch, const RoutePlan& plan) {
  const Status checked = check_route_plan(routes, shape, batch.view(), plan);
  ASSERT_TRUE(checked.ok()) << checked.message();
  std::vector<int> covered(batch.row_seq.size(), 0);
  int64_t tiles_seen = 0;
  for (const RouteLaunch& launch : plan.launches) {
    const AttentionRouteLimits& r = routes[size_t(launch.route)];
    ASSERT_TRUE(r.supports(shape));
    ASSERT_EQ(launch.first_tile, tiles_seen);  // launches list the tiles in order
    ASSERT_GE(launch.n_tiles, 1);
    ASSERT_LE(launch.n_tiles, r.max_tiles_per_launch);
    ASSERT_LE(launch.n_rows, r.max_rows_per_launch);
    int64_t rows = 0;
    for (int64_t t = launch.first_tile; t < launch.first_tile + launch.n_tiles; ++t) {
      const RouteTile& tile = plan.tiles[size_t(t)];
      ASSERT_GE(tile.n_rows, std::max<int64_t>(1, r.min_rows_per_tile));
      ASSERT_LE(tile.n_rows, r.max_rows_per_tile);
      ASSERT_EQ(tile.n_rows % r.tile_row_multiple, 0);
      for (int64_t i = tile.first_row; i < tile.first_row + tile.n_rows; ++i) {
        ++covered[size_t(i)];
        ASSERT_EQ(batch.row_seq[size_t(i)], tile.seq);
        ASSERT_EQ(batch.row_pos[size_t(i)],
                  batch.row_pos[size_t(tile.first_row)] + (i - tile.first_row));
      }
      rows += tile.n_rows;
    }
    ASSERT_EQ(rows, launch.n_rows);
    tiles_seen += launch.n_tiles;
  }
  ASSERT_EQ(tiles_seen, int64_t(plan.tiles.size()));
  for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << "row " << i;
}

RoutePlan plan_ok(const std::vector<AttentionRouteLimits>& routes, const AttentionRouteShape& shape,
                  const Batch& batch) {
  Result<RoutePlan> plan = plan_attention_routes(routes, shape, batch.view());
  EXPECT_TRUE(plan.ok()) << plan.message();
  if (!plan.ok()) return {};
  expect_valid(routes, shape, batch, *plan);
  return std::move(plan).value();
}

TEST(RoutePlanner, SeedBatchOf46RowChunkAndThreeDecodeRows) {
  // The seed's layout: one 46-row catch-up chunk at 64K context plus three decode rows.
  Batch batch;
  batch.add_chunk(0, 65536 - 46, 46);
  batch.add_chunk(1, 40000, 1);
  batch.add_chunk(2, 51234, 1);
  batch.add_chunk(3, 70000, 1);
  const std::vector<AttentionRouteLimits> routes = reference_attention_routes();
  const RoutePlan plan = plan_ok(routes, kSeedShape, batch);
  ASSERT_EQ(plan.launches.size(), 2u);
  EXPECT_EQ(routes[size_t(plan.launches[0].route)].name, "prefill_64");
  EXPECT_EQ(plan.launches[0].n_rows, 46);
  EXPECT_EQ(plan.launches[0].n_tiles, 1);
  EXPECT_EQ(routes[size_t(plan.launches[1].route)].name, "decode");
  EXPECT_EQ(plan.launches[1].n_rows, 3);
  EXPECT_EQ(plan.launches[1].n_tiles, 3);
}

TEST(RoutePlanner, SeedBatchWhenOnlyTheDecodeRouteTakesE4m3) {
  // A table whose prefill kernels lack E4M3: all 49 rows go to the decode route, 16 per launch.
  Batch batch;
  batch.add_chunk(0, 100, 46);
  batch.add_chunk(1, 7, 1);
  batch.add_chunk(2, 8, 1);
  batch.add_chunk(3, 9, 1);
  std::vector<AttentionRouteLimits> routes = reference_attention_routes();
  routes[0].e4m3 = false;
  routes[1].e4m3 = false;
  const RoutePlan plan = plan_ok(routes, kSeedShape, batch);
  ASSERT_EQ(plan.launches.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(routes[size_t(plan.launches[i].route)].name, "decode");
  EXPECT_EQ(plan.launches[0].n_rows, 16);
  EXPECT_EQ(plan.launches[3].n_rows, 1);
}

TEST(RoutePlanner, ChunksAreCutIntoTilesByPreference) {
  Batch batch;
  batch.add_chunk(0, 0, 100);  // 64 + 36 (prefill_64)
  batch.add_chunk(1, 0, 70);   // 64 (prefill_64) + 6 (prefill_16)
  batch.add_chunk(2, 0, 17);   // 16 (prefill_16) + 1 (decode)
  const std::vector<AttentionRouteLimits> routes = reference_attention_routes();
  const RoutePlan plan = plan_ok(routes, kSeedShape, batch);
  std::vector<std::pair<std::string, int64_t>> tiles;
  for (const RouteLaunch& launch : plan.launches) {
    for (int64_t t = launch.first_tile; t < launch.first_tile + launch.n_tiles; ++t) {
      tiles.emplace_back(routes[size_t(launch.route)].name, plan.tiles[size_t(t)].n_rows);
    }
  }
  const std::vector<std::pair<std::string, int64_t>> want = {{"prefill_64", 64}, {"prefill_64", 36},
                                                             {"prefill_64", 64}, {"prefill_16", 6},
                                                             {"prefill_16", 16}, {"decode", 1}};
  EXPECT_EQ(tiles, want);
}

TEST(RoutePlanner, ChunkBoundariesFollowSequenceAndPosition) {
  // Same sequence twice in a row with a position gap, and rows of two sequences interleaved:
  // every row is its own chunk unless sequence and position both continue.
  Batch batch;
  batch.add_chunk(0, 0, 5);
  batch.add_chunk(0, 10, 5);  // gap: a new chunk
  batch.add_chunk(1, 0, 1);
  batch.add_chunk(2, 0, 1);
  batch.add_chunk(1, 1, 1);  // sequence 1 again, not adjacent
  const std::vector<AttentionRouteLimits> routes = reference_attention_routes();
  const RoutePlan plan = plan_ok(routes, kSeedShape, batch);
  ASSERT_EQ(plan.tiles.size(), 5u);
  EXPECT_EQ(plan.tiles[0].n_rows, 5);
  EXPECT_EQ(plan.tiles[1].n_rows, 5);
  EXPECT_EQ(plan.tiles[1].first_row, 5);
}

TEST(RoutePlanner, EmptyBatch) {
  Batch batch;
  const RoutePlan plan = plan_ok(reference_attention_routes(), kSeedShape, batch);
  EXPECT_TRUE(plan.launches.empty());
  EXPECT_TRUE(plan.tiles.empty());
}

// Tight tables that exercise every limit on small layouts.
std::vector<std::vector<AttentionRouteLimits>> small_tables() {
  AttentionRouteLimits base;
  base.head_dims = {128};
  base.block_sizes = {64};
  base.gqa_groups = {4};
  base.f16 = base.e4m3 = base.dense = base.qsa = true;

  AttentionRouteLimits wide = base;  // tiles of 4..6 rows, even only, 2 tiles / 10 rows per launch
  wide.name = "wide";
  wide.kernel = AttentionKernel::kPrefillTiles;
  wide.min_rows_per_tile = 4;
  wide.max_rows_per_tile = 6;
  wide.tile_row_multiple = 2;
  wide.max_rows_per_launch = 10;
  wide.max_tiles_per_launch = 2;
  AttentionRouteLimits pair = base;  // tiles of exactly 2 rows, 3 tiles per launch
  pair.name = "pair";
  pair.kernel = AttentionKernel::kPrefillTiles;
  pair.min_rows_per_tile = 2;
  pair.max_rows_per_tile = 2;
  pair.max_rows_per_launch = 6;
  pair.max_tiles_per_launch = 3;
  AttentionRouteLimits single = base;  // decode rows, 3 per launch
  single.name = "single";
  single.max_rows_per_tile = 1;
  single.max_rows_per_launch = 3;
  single.max_tiles_per_launch = 3;
  AttentionRouteLimits unsupported = wide;  // never eligible: wrong head_dim
  unsupported.name = "other_head_dim";
  unsupported.head_dims = {64};
  unsupported.min_rows_per_tile = 1;
  unsupported.max_rows_per_tile = 8;
  unsupported.max_rows_per_launch = 100;
  unsupported.tile_row_multiple = 1;
  return {
      {wide, pair, single}, {unsupported, pair, single}, {single}, {single, wide}, {wide, single}};
}

const AttentionRouteShape kSmallShape = {128, 64, KvCacheDtype::kF16, false, 4};

TEST(RoutePlanner, ExhaustiveSmallLayouts) {
  // Every composition of n <= 10 rows into chunks, in three variants: (0) chunk i is sequence
  // i % 3; (1) pairs of adjacent chunks share a sequence with a position gap between them, so they
  // stay separate chunks; (2) one sequence at continuing positions, so everything merges into one
  // chunk. Each layout is planned with every small table.
  const auto tables = small_tables();
  int64_t layouts = 0;
  for (int n = 0; n <= 10; ++n) {
    const int n_compositions = n == 0 ? 1 : 1 << (n - 1);
    for (int mask = 0; mask < n_compositions; ++mask) {
      for (int variant = 0; variant < 3; ++variant) {
        Batch batch;
        int32_t chunk = 0;
        int32_t pos = 0;
        for (int i = 0; i < n; ++i) {
          if (i > 0 && (mask >> (i - 1)) & 1) {
            ++chunk;
            pos += variant == 2 ? 0 : 5;
          }
          const int32_t seq = variant == 0 ? chunk % 3 : variant == 1 ? (chunk / 2) % 2 : 0;
          batch.add_chunk(seq, pos++, 1);
        }
        for (const auto& table : tables) {
          plan_ok(table, kSmallShape, batch);
          ++layouts;
          if (HasFailure()) FAIL() << "n " << n << " mask " << mask << " variant " << variant;
        }
      }
    }
  }
  EXPECT_EQ(layouts, 3 * 5 * 1024);  // 1 + sum over n = 1..10 of 2^(n-1) = 1024 compositions
}

TEST(RoutePlanner, RandomLargeLayouts) {
  std::mt19937 rng(3);
  const auto tables = small_tables();
  const std::vector<AttentionRouteLimits> reference = reference_attention_routes();
  for (int trial = 0; trial < 60; ++trial) {
    Batch batch;
    const int n_chunks = std::uniform_int_distribution<int>(1, 300)(rng);
    for (int c = 0; c < n_chunks; ++c) {
      const bool decode = std::uniform_int_distribution<int>(0, 2)(rng) > 0;
      const int32_t len = decode ? 1 : std::uniform_int_distribution<int32_t>(1, 3000)(rng);
      batch.add_chunk(std::uniform_int_distribution<int32_t>(0, 50)(rng),
                      std::uniform_int_distribution<int32_t>(0, 100000)(rng), len);
    }
    plan_ok(tables[size_t(trial) % tables.size()], kSmallShape, batch);
    plan_ok(reference, kSeedShape, batch);
    if (HasFailure()) FAIL() << "trial " << trial;
  }
}

TEST(RoutePlanner, RejectsShapesWithoutARoute) {
  Batch batch;
  batch.add_chunk(0, 0, 3);
  const std::vector<AttentionRouteLimits> routes = reference_attention_routes();
  AttentionRouteShape shape = kSeedShape;
  shape.head_dim = 96;
  Result<RoutePlan> plan = plan_attention_routes(routes, shape, batch.view());
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.message().find("head_dim 96"), std::string::npos) << plan.message();
  // Supported by prefill routes only: some layouts (a single decode row) could not be planned.
  std::vector<AttentionRouteLimits> no_decode(routes.begin(), routes.begin() + 2);
  plan = plan_attention_routes(no_decode, kSeedShape, batch.view());
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.message().find("single rows"), std::string::npos) << plan.message();
}

TEST(RoutePlanner, RejectsBadTables) {
  std::vector<AttentionRouteLimits> routes = reference_attention_routes();
  EXPECT_TRUE(validate_route_table(routes).ok());
  EXPECT_FALSE(validate_route_table({}).ok());
  auto broken = [&](const std::function<void(AttentionRouteLimits&)>& edit) {
    std::vector<AttentionRouteLimits> table = routes;
    edit(table[1]);
    return !validate_route_table(table).ok();
  };
  EXPECT_TRUE(broken([](AttentionRouteLimits& r) { r.name.clear(); }));
  EXPECT_TRUE(broken([](AttentionRouteLimits& r) { r.max_rows_per_launch = 0; }));
  EXPECT_TRUE(broken([](AttentionRouteLimits& r) { r.max_tiles_per_launch = 0; }));
  EXPECT_TRUE(broken([](AttentionRouteLimits& r) { r.max_rows_per_tile = 20000; }));
  EXPECT_TRUE(broken([](AttentionRouteLimits& r) { r.tile_row_multiple = 0; }));
  // min 17 > max 16: no tile size at all.
  EXPECT_TRUE(broken([](AttentionRouteLimits& r) { r.min_rows_per_tile = 17; }));
  // multiple 32 > max 16: no tile size at all.
  EXPECT_TRUE(broken([](AttentionRouteLimits& r) { r.tile_row_multiple = 32; }));
  // A 16-row tile route marked as the single-row decode kernel.
  EXPECT_TRUE(broken([](AttentionRouteLimits& r) { r.kernel = AttentionKernel::kDecodeRows; }));
}

TEST(RoutePlanner, RouteTablesNameTheirKernels) {
  for (const auto& table : {reference_attention_routes(), cuda_attention_routes()}) {
    for (const AttentionRouteLimits& r : table) {
      EXPECT_EQ(r.kernel == AttentionKernel::kPrefillTiles, r.max_rows_per_tile > 1) << r.name;
    }
  }
}

TEST(RoutePlanner, CheckCatchesBrokenPlans) {
  Batch batch;
  batch.add_chunk(0, 0, 46);
  batch.add_chunk(1, 9, 1);
  batch.add_chunk(2, 9, 1);
  const std::vector<AttentionRouteLimits> routes = reference_attention_routes();
  const RoutePlan good = plan_ok(routes, kSeedShape, batch);
  auto rejected = [&](const std::function<void(RoutePlan&)>& edit) {
    RoutePlan plan = good;
    edit(plan);
    return !check_route_plan(routes, kSeedShape, batch.view(), plan).ok();
  };
  EXPECT_TRUE(rejected([](RoutePlan& p) { p.launches.pop_back(); }));  // rows missing
  EXPECT_TRUE(rejected([](RoutePlan& p) { p.launches.push_back(p.launches.back()); }));  // twice
  EXPECT_TRUE(rejected([](RoutePlan& p) { p.launches[0].route = 2; }));   // decode: 46 rows
  EXPECT_TRUE(rejected([](RoutePlan& p) { p.launches[0].route = 7; }));   // no such route
  EXPECT_TRUE(rejected([](RoutePlan& p) { p.tiles[0].seq = 1; }));        // wrong sequence
  EXPECT_TRUE(rejected([](RoutePlan& p) { p.launches[1].n_rows = 5; }));  // wrong row count
  EXPECT_TRUE(rejected([](RoutePlan& p) {                                 // tile spans 2 seqs
    p.tiles[0].n_rows = 47;
    p.tiles[1].first_row = 47;
    p.tiles[1].n_rows = 1;
    p.launches[0].n_rows = 47;
  }));
}

}  // namespace
}  // namespace e4kv

namespace e4kv {
namespace {

// The CUDA table: every shape the decode kernel takes is planned, the seed's 49-row batch included,
// and random mixed layouts stay inside the limits.
TEST(RoutePlannerCuda, EveryKernelShapeAndLayoutIsPlanned) {
  const std::vector<AttentionRouteLimits> routes = cuda_attention_routes();
  ASSERT_TRUE(validate_route_table(routes).ok());
  std::mt19937 rng(5);
  for (int64_t head_dim : {64, 128, 256}) {
    for (int64_t group : {1, 4, 6, 8, 12, 16}) {
      for (int64_t block_size : {16, 64}) {
        for (KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
          for (bool qsa : {false, true}) {
            const AttentionRouteShape shape{head_dim, block_size, dtype, qsa, group};
            ASSERT_TRUE(routes[0].supports(shape));
            ASSERT_TRUE(routes[1].supports(shape));
            // 46-row catch-up chunk plus three decode rows, then a random layout.
            std::vector<int32_t> row_seq;
            std::vector<int32_t> row_pos;
            for (int32_t p = 1000; p < 1046; ++p) row_seq.push_back(0), row_pos.push_back(p);
            for (int32_t s = 1; s <= 3; ++s) row_seq.push_back(s), row_pos.push_back(5000 + s);
            const int n_random = int(rng() % 40);
            for (int i = 0; i < n_random; ++i) {
              row_seq.push_back(4 + i);
              row_pos.push_back(int32_t(rng() % 100000));
            }
            QueryBatchView rows;
            rows.n_rows = int64_t(row_seq.size());
            rows.row_seq = row_seq.data();
            rows.row_pos = row_pos.data();
            const Result<RoutePlan> plan = plan_attention_routes(routes, shape, rows);
            ASSERT_TRUE(plan.ok()) << plan.message();
            const Status checked = check_route_plan(routes, shape, rows, *plan);
            EXPECT_TRUE(checked.ok()) << checked.message();
            // The 46-row chunk goes to the prefill route (one tile), every single row to decode.
            ASSERT_GE(plan->launches.size(), 2u);
            EXPECT_EQ(routes[plan->launches[0].route].name, "cuda_prefill");
            EXPECT_EQ(plan->launches[0].n_rows, 46);
            EXPECT_EQ(int64_t(plan->tiles.size()), rows.n_rows - 45);
          }
        }
      }
    }
  }
  // Outside the kernel's limits: no route.
  const AttentionRouteShape too_wide{96, 64, KvCacheDtype::kF16, false, 8};
  std::vector<int32_t> seq{0};
  std::vector<int32_t> pos{3};
  QueryBatchView one;
  one.n_rows = 1;
  one.row_seq = seq.data();
  one.row_pos = pos.data();
  EXPECT_FALSE(plan_attention_routes(routes, too_wide, one).ok());
}

}  // namespace
}  // namespace e4kv
