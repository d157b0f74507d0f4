// The mixed-batch route planner: assigns the query rows of one attention call (prefill chunks and
// decode rows together) to kernel routes, each described by its limits, so that no launch exceeds
// what its kernel supports. Pure host code, no CUDA: the CUDA attention issue fills the route table
// with the kernels' real limits; tests call the planner without a GPU.
//
// Terms:
//   chunk   a maximal run of consecutive batch rows of one sequence at consecutive positions (a
//           prefill chunk, or a single decode row);
//   tile    consecutive rows of one chunk that one route handles together (they share the
//   sequence's
//           K/V tiles; a decode route takes tiles of one row);
//   launch  one kernel launch of one route: a list of tiles.
//
// Policy (deterministic): each chunk is cut from its first row on. At each step the first route of
// the table (table order = preference) that supports the batch's shape and can take a tile from
// the remaining r rows takes the largest tile it can:
//   t = min(r, max_rows_per_tile) rounded down to a multiple of tile_row_multiple,
//   accepted when t >= max(1, min_rows_per_tile).
// Tiles of each route are then packed, in row order, into launches of at most max_rows_per_launch
// rows and max_tiles_per_launch tiles. Launches are ordered by route (table order), then by row.
// A table that supports the shape must contain a single-row route (min_rows_per_tile <= 1,
// tile_row_multiple == 1), so every layout is covered; the planner checks this.
//
// The seed's 49-row batch (one 46-row catch-up chunk plus three decode rows) with the
// reference table below: prefill_64 takes the chunk as one 46-row tile, decode takes the three
// single rows in one launch.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "kv/kv_cache_view.h"

namespace e4kv {

// What one attention call looks like, as far as route support goes.
struct AttentionRouteShape {
  int64_t head_dim = 0;
  int64_t block_size = 0;
  KvCacheDtype dtype = KvCacheDtype::kF16;
  bool qsa = false;       // selection rows (true) or dense causal attention (false)
  int64_t gqa_group = 1;  // query heads per KV head
};

// The kernel a route launches: single query rows (split-K decode) or tiles of rows of one
// sequence that share each K/V tile (prefill / chunked attention).
enum class AttentionKernel { kDecodeRows, kPrefillTiles };

// Limits of one kernel route. A default-constructed route supports nothing.
struct AttentionRouteLimits {
  std::string name;  // for messages and logs; the launcher dispatches on `kernel`
  AttentionKernel kernel = AttentionKernel::kDecodeRows;
  int64_t max_rows_per_launch = 0;   // query rows in one launch (grid / workspace bound), >= 1
  int64_t max_tiles_per_launch = 0;  // tiles in one launch, >= 1
  int64_t min_rows_per_tile = 1;     // smallest tile the route accepts
  int64_t max_rows_per_tile = 1;     // 1 for a decode route; 16 or 64 for prefill tiles
  int64_t tile_row_multiple = 1;     // a tile's rows must be a multiple of this
  std::vector<int64_t> head_dims;    // supported head_dim values
  std::vector<int64_t> block_sizes;  // supported cache block sizes
  std::vector<int64_t> gqa_groups;   // supported query heads per KV head
  bool f16 = false;                  // FP16 cache supported
  bool e4m3 = false;                 // E4M3 cache supported
  bool dense = false;                // dense causal attention supported
  bool qsa = false;                  // attention over selection rows supported

  bool supports(const AttentionRouteShape& shape) const;
};

// Rows [first_row, first_row + n_rows) of the batch: one sequence, consecutive positions.
struct RouteTile {
  int64_t first_row = 0;
  int64_t n_rows = 0;
  int32_t seq = 0;
};

// Tiles [first_tile, first_tile + n_tiles) of the plan, all for route `route` (table index).
struct RouteLaunch {
  int32_t route = 0;
  int64_t first_tile = 0;
  int64_t n_tiles = 0;
  int64_t n_rows = 0;
};

struct RoutePlan {
  std::vector<RouteTile> tiles;  // grouped by launch
  std::vector<RouteLaunch> launches;
};

// Checks the table itself: names, positive limits, max_rows_per_tile <= max_rows_per_launch, ...
Status validate_route_table(std::span<const AttentionRouteLimits> routes);

// Plans the rows of a batch. row_seq, row_pos: [n_rows] as in QueryBatchView (other fields unused).
// Errors: a bad table, no route for the shape, no single-row route for the shape, bad rows.
Result<RoutePlan> plan_attention_routes(std::span<const AttentionRouteLimits> routes,
                                        const AttentionRouteShape& shape,
                                        const QueryBatchView& rows);

// Independent check of a plan: every row in exactly one tile, tiles are runs of one sequence at
// consecutive positions, launches cover the tiles once, every tile and launch within its route's
// limits, every route used supports the shape. For tests and for the CUDA launcher's debug builds.
Status check_route_plan(std::span<const AttentionRouteLimits> routes,
                        const AttentionRouteShape& shape, const QueryBatchView& rows,
                        const RoutePlan& plan);

// A reference table for the planner's own tests: prefill tiles of 64 rows (chunks of 33+ rows), of
// 16 rows (2+), and single decode rows, at most 16 per launch, as the seed's XQA tail route. The
// engine plans with cuda_attention_routes() (below) on the GPU.
std::vector<AttentionRouteLimits> reference_attention_routes();

// The routes of the CUDA kernels, in preference order: "cuda_prefill" (paged_prefill_attention.cuh)
// takes runs of 2..64 rows of one sequence, "cuda_decode" (paged_decode_attention.cuh) every
// remaining row, one per tile. Their limits are the kernels'.
std::vector<AttentionRouteLimits> cuda_attention_routes();

}  // namespace e4kv
