#include "qsa/route_planner.h"

#include <algorithm>

namespace e4kv {

namespace {

bool contains(const std::vector<int64_t>& values, int64_t value) {
  return std::find(values.begin(), values.end(), value) != values.end();
}

std::string describe(const AttentionRouteShape& shape) {
  return cat("head_dim ", shape.head_dim, ", block_size ", shape.block_size, ", ",
             shape.dtype == KvCacheDtype::kE4m3 ? "E4M3" : "FP16", " cache, ",
             shape.qsa ? "QSA" : "dense", ", GQA group ", shape.gqa_group);
}

// Largest tile the route can take from `remaining` rows of a chunk, or 0.
int64_t take_rows(const AttentionRouteLimits& route, int64_t remaining) {
  int64_t t = std::min(remaining, route.max_rows_per_tile);
  t -= t % route.tile_row_multiple;
  return t >= std::max<int64_t>(1, route.min_rows_per_tile) ? t : 0;
}

bool tile_fits(const AttentionRouteLimits& route, int64_t n_rows) {
  return n_rows >= std::max<int64_t>(1, route.min_rows_per_tile) &&
         n_rows <= route.max_rows_per_tile && n_rows % route.tile_row_multiple == 0;
}

Status check_rows_view(const QueryBatchView& rows) {
  if (rows.n_rows < 0) return Status::error(cat("route planner: n_rows ", rows.n_rows, " < 0"));
  if (rows.n_rows > 0 && (rows.row_seq == nullptr || rows.row_pos == nullptr)) {
    return Status::error("route planner: row_seq and row_pos must not be null");
  }
  return ok_status();
}

}  // namespace

bool AttentionRouteLimits::supports(const AttentionRouteShape& shape) const {
  const bool dtype_ok = shape.dtype == KvCacheDtype::kE4m3 ? e4m3 : f16;
  const bool mode_ok = shape.qsa ? qsa : dense;
  return dtype_ok && mode_ok && contains(head_dims, shape.head_dim) &&
         contains(block_sizes, shape.block_size) && contains(gqa_groups, shape.gqa_group);
}

Status validate_route_table(std::span<const AttentionRouteLimits> routes) {
  if (routes.empty()) return Status::error("route table is empty");
  for (size_t i = 0; i < routes.size(); ++i) {
    const AttentionRouteLimits& r = routes[i];
    const std::string who = cat("route ", i, " '", r.name, "'");
    if (r.name.empty()) return Status::error(cat("route ", i, " has no name"));
    if (r.max_rows_per_launch < 1 || r.max_tiles_per_launch < 1 || r.max_rows_per_tile < 1 ||
        r.tile_row_multiple < 1 || r.min_rows_per_tile < 0) {
      return Status::error(cat(who,
                               ": max_rows_per_launch, max_tiles_per_launch, max_rows_per_tile "
                               "and tile_row_multiple must be >= 1, min_rows_per_tile >= 0"));
    }
    if (r.max_rows_per_tile > r.max_rows_per_launch) {
      return Status::error(cat(who, ": max_rows_per_tile ", r.max_rows_per_tile,
                               " exceeds max_rows_per_launch ", r.max_rows_per_launch));
    }
    if (r.kernel == AttentionKernel::kDecodeRows && r.max_rows_per_tile != 1) {
      return Status::error(cat(who,
                               ": a decode-rows route takes tiles of one row (max_rows_per_tile ",
                               r.max_rows_per_tile, ")"));
    }
    if (take_rows(r, r.max_rows_per_tile) == 0) {
      return Status::error(cat(who, ": no tile size satisfies min_rows_per_tile ",
                               r.min_rows_per_tile, ", max_rows_per_tile ", r.max_rows_per_tile,
                               " and tile_row_multiple ", r.tile_row_multiple));
    }
  }
  return ok_status();
}

Result<RoutePlan> plan_attention_routes(std::span<const AttentionRouteLimits> routes,
                                        const AttentionRouteShape& shape,
                                        const QueryBatchView& rows) {
  E4KV_RETURN_IF_ERROR(validate_route_table(routes));
  E4KV_RETURN_IF_ERROR(check_rows_view(rows));
  std::vector<int32_t> eligible;
  bool single_row_route = false;
  for (size_t i = 0; i < routes.size(); ++i) {
    if (!routes[i].supports(shape)) continue;
    eligible.push_back(int32_t(i));
    single_row_route |= take_rows(routes[i], 1) == 1;
  }
  if (eligible.empty()) {
    return Status::error(cat("route planner: no attention route supports ", describe(shape)));
  }
  if (!single_row_route) {
    return Status::error(cat("route planner: no route supporting ", describe(shape),
                             " takes single rows, so some layouts could not be planned"));
  }

  // Cut every chunk into tiles, per route.
  std::vector<std::vector<RouteTile>> tiles_by_route(routes.size());
  int64_t chunk_begin = 0;
  while (chunk_begin < rows.n_rows) {
    int64_t chunk_end = chunk_begin + 1;
    while (chunk_end < rows.n_rows && rows.row_seq[chunk_end] == rows.row_seq[chunk_end - 1] &&
           int64_t(rows.row_pos[chunk_end]) == int64_t(rows.row_pos[chunk_end - 1]) + 1) {
      ++chunk_end;
    }
    for (int64_t row = chunk_begin; row < chunk_end;) {
      int64_t taken = 0;
      for (const int32_t route : eligible) {
        taken = take_rows(routes[size_t(route)], chunk_end - row);
        if (taken > 0) {
          tiles_by_route[size_t(route)].push_back({row, taken, rows.row_seq[chunk_begin]});
          break;
        }
      }
      E4KV_ASSERT(taken > 0, "the single-row route must take any remaining row");
      row += taken;
    }
    chunk_begin = chunk_end;
  }

  // Pack each route's tiles into launches, in row order.
  RoutePlan plan;
  for (size_t route = 0; route < routes.size(); ++route) {
    const AttentionRouteLimits& limits = routes[route];
    for (const RouteTile& tile : tiles_by_route[route]) {
      RouteLaunch* launch = plan.launches.empty() ? nullptr : &plan.launches.back();
      if (launch == nullptr || launch->route != int32_t(route) ||
          launch->n_rows + tile.n_rows > limits.max_rows_per_launch ||
          launch->n_tiles + 1 > limits.max_tiles_per_launch) {
        plan.launches.push_back({int32_t(route), int64_t(plan.tiles.size()), 0, 0});
        launch = &plan.launches.back();
      }
      plan.tiles.push_back(tile);
      launch->n_tiles += 1;
      launch->n_rows += tile.n_rows;
    }
  }
  return plan;
}

Status check_route_plan(std::span<const AttentionRouteLimits> routes,
                        const AttentionRouteShape& shape, const QueryBatchView& rows,
                        const RoutePlan& plan) {
  E4KV_RETURN_IF_ERROR(validate_route_table(routes));
  E4KV_RETURN_IF_ERROR(check_rows_view(rows));
  const int64_t n_tiles = int64_t(plan.tiles.size());
  std::vector<int> tile_uses(size_t(n_tiles), 0);
  std::vector<int> row_uses(size_t(rows.n_rows), 0);
  for (size_t li = 0; li < plan.launches.size(); ++li) {
    const RouteLaunch& launch = plan.launches[li];
    if (launch.route < 0 || size_t(launch.route) >= routes.size()) {
      return Status::error(cat("launch ", li, ": route ", launch.route, " not in the table"));
    }
    const AttentionRouteLimits& limits = routes[size_t(launch.route)];
    if (!limits.supports(shape)) {
      return Status::error(
          cat("launch ", li, ": route '", limits.name, "' does not support ", describe(shape)));
    }
    if (launch.n_tiles < 1 || launch.n_tiles > limits.max_tiles_per_launch ||
        launch.first_tile < 0 || launch.first_tile + launch.n_tiles > n_tiles) {
      return Status::error(cat("launch ", li, ": tiles [", launch.first_tile, ", +", launch.n_tiles,
                               ") invalid for route '", limits.name, "' (max ",
                               limits.max_tiles_per_launch, ", plan has ", n_tiles, ")"));
    }
    int64_t launch_rows = 0;
    for (int64_t ti = launch.first_tile; ti < launch.first_tile + launch.n_tiles; ++ti) {
      const RouteTile& tile = plan.tiles[size_t(ti)];
      ++tile_uses[size_t(ti)];
      if (!tile_fits(limits, tile.n_rows)) {
        return Status::error(
            cat("tile ", ti, ": ", tile.n_rows, " rows outside the limits of '", limits.name, "'"));
      }
      if (tile.first_row < 0 || tile.first_row + tile.n_rows > rows.n_rows) {
        return Status::error(cat("tile ", ti, ": rows outside the batch"));
      }
      for (int64_t r = tile.first_row; r < tile.first_row + tile.n_rows; ++r) {
        ++row_uses[size_t(r)];
        if (rows.row_seq[r] != tile.seq) {
          return Status::error(cat("tile ", ti, ": row ", r, " belongs to sequence ",
                                   rows.row_seq[r], ", not ", tile.seq));
        }
        if (r > tile.first_row && int64_t(rows.row_pos[r]) != int64_t(rows.row_pos[r - 1]) + 1) {
          return Status::error(
              cat("tile ", ti, ": row ", r, " does not follow the previous position"));
        }
      }
      launch_rows += tile.n_rows;
    }
    if (launch_rows != launch.n_rows || launch_rows > limits.max_rows_per_launch) {
      return Status::error(cat("launch ", li, ": ", launch_rows, " rows (declared ", launch.n_rows,
                               ") against max_rows_per_launch ", limits.max_rows_per_launch));
    }
  }
  for (int64_t ti = 0; ti < n_tiles; ++ti) {
    if (tile_uses[size_t(ti)] != 1) {
      return Status::error(cat("tile ", ti, " is in ", tile_uses[size_t(ti)], " launches"));
    }
  }
  for (int64_t r = 0; r < rows.n_rows; ++r) {
    if (row_uses[size_t(r)] != 1) {
      return Status::error(cat("row ", r, " is in ", row_uses[size_t(r)], " tiles"));
    }
  }
  return ok_status();
}

std::vector<AttentionRouteLimits> reference_attention_routes() {
  AttentionRouteLimits common;
  common.head_dims = {64, 128, 256};
  common.block_sizes = {16, 32, 64};
  common.gqa_groups = {1, 2, 4, 6, 8, 16};
  common.f16 = true;
  common.e4m3 = true;
  common.dense = true;
  common.qsa = true;

  AttentionRouteLimits prefill_64 = common;
  prefill_64.name = "prefill_64";
  prefill_64.kernel = AttentionKernel::kPrefillTiles;
  prefill_64.min_rows_per_tile = 33;
  prefill_64.max_rows_per_tile = 64;
  prefill_64.max_rows_per_launch = 8192;
  prefill_64.max_tiles_per_launch = 1024;

  AttentionRouteLimits prefill_16 = common;
  prefill_16.name = "prefill_16";
  prefill_16.kernel = AttentionKernel::kPrefillTiles;
  prefill_16.min_rows_per_tile = 2;
  prefill_16.max_rows_per_tile = 16;
  prefill_16.max_rows_per_launch = 8192;
  prefill_16.max_tiles_per_launch = 1024;

  AttentionRouteLimits decode = common;
  decode.name = "decode";
  decode.min_rows_per_tile = 1;
  decode.max_rows_per_tile = 1;
  decode.max_rows_per_launch = 16;
  decode.max_tiles_per_launch = 16;

  return {prefill_64, prefill_16, decode};
}

std::vector<AttentionRouteLimits> cuda_attention_routes() {
  // backend/cuda/paged_prefill_attention: runs of 2..64 rows of one sequence share each K/V tile
  // (the launcher cuts a tile into CTA items of 64 / group rows); head_dim 64/128/256, GQA group
  // <= 16, block_size a multiple of 8, FP16 and E4M3, dense and QSA. No workspace, so no row bound
  // beyond the grid.
  AttentionRouteLimits prefill;
  prefill.name = "cuda_prefill";
  prefill.kernel = AttentionKernel::kPrefillTiles;
  prefill.min_rows_per_tile = 2;
  prefill.max_rows_per_tile = 64;
  prefill.max_rows_per_launch = 1 << 24;
  prefill.max_tiles_per_launch = 1 << 24;
  // backend/cuda/paged_decode_attention: one query row per warp task, so every row is its own tile;
  // the same shapes. Rows per launch are bounded by the workspace the runner allocates
  // (DecodeAttentionWorkspace::max_rows), not by the grid.
  AttentionRouteLimits decode;
  decode.name = "cuda_decode";
  decode.min_rows_per_tile = 1;
  decode.max_rows_per_tile = 1;
  decode.max_rows_per_launch = 65536;
  decode.max_tiles_per_launch = 65536;
  for (AttentionRouteLimits* route : {&prefill, &decode}) {
    route->head_dims = {64, 128, 256};
    route->block_sizes = {8, 16, 32, 64, 128, 256};
    for (int64_t g = 1; g <= 16; ++g) route->gqa_groups.push_back(g);
    route->f16 = true;
    route->e4m3 = true;
    route->dense = true;
    route->qsa = true;
  }
  return {prefill, decode};
}

}  // namespace e4kv
