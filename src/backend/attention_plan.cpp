#include "backend/attention_plan.h"

#include <algorithm>

namespace e4kv {
namespace {

// The decode planner's costs, in keys (fitted on the H200; bench/notes/paged_decode_attention.md).
// A split's fixed work: loading Q and filling the load pipeline.
constexpr int64_t kDecodeSplitCostKeys = 64;
// Each CTA of a row and KV head writes a partial result the merge reads back one after another,
// and more CTAs share the SMs. Without this term the planner chose 32 CTAs per row and KV head for
// QSA 4 x 2048 keys where 16 are fastest, and 128 for one 20K sequence where 47-64 are.
constexpr double kDecodeCtaCostKeys = 1.25;
// The fewest keys the planner gives a split.
constexpr int64_t kDecodeMinSplitKeys = 16;

}  // namespace

DecodeAttentionPlan plan_decode_attention(int64_t n_rows, int64_t n_kv_heads, int64_t max_keys,
                                          int64_t resident_ctas) {
  // Every split count is costed as waves x (keys per split + the fixed cost per split) + the cost
  // per CTA: a launch of C CTAs with R resident at once takes ceil(C / R) rounds, each as long as
  // one split. The cheapest wins; among those within 2% of it, the fewest splits.
  const int64_t items = std::max<int64_t>(1, n_rows * n_kv_heads);
  const int64_t slots = std::max<int64_t>(1, resident_ctas);
  const int64_t keys = std::max<int64_t>(1, max_keys);
  const int64_t most =
      std::max<int64_t>(kDecodeWarpsPerCta, (keys + kDecodeMinSplitKeys - 1) / kDecodeMinSplitKeys);
  auto keys_per_split = [&](int64_t splits) {
    const int64_t k = (keys + splits - 1) / splits;
    return (k + kDecodeTileTokens - 1) / kDecodeTileTokens * kDecodeTileTokens;
  };
  auto cost = [&](int64_t splits) {
    const int64_t ctas = items * splits / kDecodeWarpsPerCta;
    return double((ctas + slots - 1) / slots) *
               double(keys_per_split(splits) + kDecodeSplitCostKeys) +
           kDecodeCtaCostKeys * double(splits / kDecodeWarpsPerCta);
  };
  double best = cost(kDecodeWarpsPerCta);
  for (int64_t s = 2 * kDecodeWarpsPerCta; s < most + kDecodeWarpsPerCta; s += kDecodeWarpsPerCta) {
    best = std::min(best, cost(s));
  }
  int64_t splits = kDecodeWarpsPerCta;
  while (cost(splits) > best * 1.02) splits += kDecodeWarpsPerCta;
  return DecodeAttentionPlan{keys_per_split(splits), splits};
}

DecodeAttentionPlan plan_decode_attention_cluster(int64_t max_keys, int64_t n_splits) {
  const int64_t splits = std::max<int64_t>(1, n_splits);
  const int64_t keys = std::max<int64_t>(1, max_keys);
  const int64_t floor8 = keys / splits / kDecodeTileTokens * kDecodeTileTokens;
  const int64_t ceil8 = ((keys + splits - 1) / splits + kDecodeTileTokens - 1) / kDecodeTileTokens *
                        kDecodeTileTokens;
  // The last split's keys with the floor: within a tile of the others'.
  const bool floor_fits = floor8 > 0 && keys - (splits - 1) * floor8 <= floor8 + kDecodeTileTokens;
  DecodeAttentionPlan plan{floor_fits ? floor8 : ceil8, splits};
  plan.merge_in_cluster = true;
  return plan;
}

DecodeAttentionPlan choose_decode_attention_plan(int64_t n_rows, int64_t n_kv_heads,
                                                 int64_t max_keys, int64_t resident_ctas,
                                                 const DecodeClusterMerge& cluster) {
  if (cluster.splits > 0 && max_keys <= kDecodeClusterMaxKeys &&
      n_rows * n_kv_heads <= cluster.clusters) {
    return plan_decode_attention_cluster(max_keys, cluster.splits);
  }
  return plan_decode_attention(n_rows, n_kv_heads, max_keys, resident_ctas);
}

size_t decode_attention_workspace_floats(int64_t max_rows, int64_t max_splits, int64_t n_heads,
                                         int64_t head_dim) {
  return size_t(max_rows * max_splits * n_heads * (head_dim + 2));
}

int64_t prefill_rows_per_item(int64_t gqa_group) {
  return gqa_group <= 0 || gqa_group > kPrefillQuerySlots ? 0 : kPrefillQuerySlots / gqa_group;
}

std::vector<PrefillAttentionItem> plan_prefill_items(std::span<const RouteTile> tiles,
                                                     int64_t gqa_group) {
  const int64_t per_item = prefill_rows_per_item(gqa_group);
  std::vector<PrefillAttentionItem> items;
  if (per_item <= 0) return items;
  for (const RouteTile& tile : tiles) {
    for (int64_t r = 0; r < tile.n_rows; r += per_item) {
      items.push_back(
          PrefillAttentionItem{static_cast<int32_t>(tile.first_row + r),
                               static_cast<int32_t>(std::min(per_item, tile.n_rows - r))});
    }
  }
  return items;
}

namespace {

size_t decode_run_floats(const AttentionLayerShape& shape, int64_t n_rows,
                         const DecodeAttentionPlan& plan) {
  return plan.merge_in_cluster ? 0
                               : decode_attention_workspace_floats(n_rows, plan.n_splits,
                                                                   shape.n_heads, shape.head_dim);
}

}  // namespace

Result<AttentionStepPlan> plan_attention_step(std::span<const AttentionRouteLimits> routes,
                                              const AttentionLayerShape& shape,
                                              const QueryBatchView& rows,
                                              const DecodeDeviceLimits& device) {
  if (shape.n_kv_heads <= 0 || shape.n_heads % shape.n_kv_heads != 0) {
    return Status::error(cat("attention: ", shape.n_heads, " query heads are not a multiple of ",
                             shape.n_kv_heads, " KV heads"));
  }
  AttentionStepPlan step;
  E4KV_ASSIGN_OR_RETURN(step.routes, plan_attention_routes(routes, shape.route_shape(), rows));
  std::vector<RouteTile> prefill_tiles;
  std::vector<RouteTile> decode_tiles;
  for (const RouteLaunch& launch : step.routes.launches) {
    auto first = step.routes.tiles.begin() + launch.first_tile;
    auto& dst = routes[size_t(launch.route)].kernel == AttentionKernel::kPrefillTiles
                    ? prefill_tiles
                    : decode_tiles;
    dst.insert(dst.end(), first, first + launch.n_tiles);
  }
  step.prefill_items = plan_prefill_items(prefill_tiles, shape.gqa_group());

  // Decode: runs of consecutive rows (the kernel takes a contiguous row range).
  std::sort(decode_tiles.begin(), decode_tiles.end(),
            [](const RouteTile& a, const RouteTile& b) { return a.first_row < b.first_row; });
  auto row_keys = [&](int64_t r) {
    return shape.qsa() ? shape.sel_width : int64_t(rows.row_pos[r]) + 1;
  };
  auto plan_run = [&](int64_t first, int64_t n) {
    DecodeRowRun run{first, n, 1, {}};
    for (int64_t r = first; r < first + n; ++r) run.max_keys = std::max(run.max_keys, row_keys(r));
    run.plan = choose_decode_attention_plan(n, shape.n_kv_heads, run.max_keys, device.resident_ctas,
                                            device.cluster);
    return run;
  };
  for (size_t i = 0; i < decode_tiles.size();) {
    size_t j = i + 1;
    while (j < decode_tiles.size() &&
           decode_tiles[j].first_row == decode_tiles[j - 1].first_row + 1) {
      ++j;
    }
    int64_t first = decode_tiles[i].first_row;
    const int64_t end = first + int64_t(j - i);
    while (first < end) {
      // The longest prefix of the rest whose partials fit the reserved workspace.
      int64_t n = end - first;
      DecodeRowRun run = plan_run(first, n);
      while (decode_run_floats(shape, n, run.plan) > device.workspace_floats && n > 1) {
        n = (n + 1) / 2;
        run = plan_run(first, n);
      }
      if (decode_run_floats(shape, n, run.plan) > device.workspace_floats) {
        return Status::error(cat("attention: the decode workspace of ", device.workspace_floats,
                                 " floats does not hold one row of ", run.max_keys,
                                 " keys; it is sized at load for the model's limits"));
      }
      step.decode_runs.push_back(run);
      first += n;
    }
    i = j;
  }
  return step;
}

size_t decode_workspace_floats_for_limits(const AttentionLayerShape& shape, int64_t max_rows,
                                          int64_t max_keys, const DecodeDeviceLimits& device) {
  size_t most = 0;
  for (int64_t n = 1; n <= max_rows; ++n) {
    const DecodeAttentionPlan plan = choose_decode_attention_plan(
        n, shape.n_kv_heads, max_keys, device.resident_ctas, device.cluster);
    most = std::max(most, decode_run_floats(shape, n, plan));
  }
  return most;
}

size_t qsa_top_k_workspace_bytes(int64_t n_rows, int64_t max_groups, int64_t budget,
                                 int64_t ratio) {
  if (ratio < 1 || budget < ratio || max_groups <= 0 || n_rows <= 0) return 0;
  const int64_t k = budget / ratio;
  const int64_t n_chunks = (max_groups + kQsaTopKChunkGroups - 1) / kQsaTopKChunkGroups;
  if (n_chunks * k >= max_groups || n_chunks > 65535) return 0;  // no shrink, or too many chunks
  return size_t(n_rows * n_chunks * k) * (sizeof(uint32_t) + sizeof(int32_t));
}

QsaTopKMethod choose_qsa_top_k_method(int64_t n_rows, int64_t max_groups, bool cluster_available,
                                      bool has_workspace) {
  const bool filter_fits = max_groups <= kQsaTopKFilteredMaxGroups;
  if (filter_fits && n_rows < kQsaTopKClusterMaxRows && cluster_available) {
    return QsaTopKMethod::kCluster;
  }
  if (filter_fits) return QsaTopKMethod::kFiltered;
  return has_workspace ? QsaTopKMethod::kTwoPhase : QsaTopKMethod::kScan;
}

}  // namespace e4kv
