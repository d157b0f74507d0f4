// CUDA paged decode attention against the CPU reference (backend/cpu/attention.h) on fresh random
// data: head_dim {64,128,256} x GQA {1,4,6,8,12,16} x block {16,64} x FP16/E4M3 (software and
// native decode) x dense/QSA x both load paths (registers; async copy on sm_80+), mixed batches of
// decode rows and prefill-chunk rows; and back-to-back launches sharing one workspace. Outputs are
// poisoned with NaN before each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_data.h"
#include "backend/cpu/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "device_buffer.cuh"
#include "qsa/route_planner.h"

namespace e4kv::cuda {
namespace {

using Case = AttentionCase;

// A decode row per sequence, plus a 19-row prefill chunk of sequence 2 and a 5-row chunk of
// sequence 3 (a mixed batch, every row through the decode kernel).
void make_data(const Case& c, uint32_t seed, AttentionData& data) {
  const std::vector<int32_t> seq_lens{1, 37, 700, 1500};
  std::vector<std::pair<int32_t, int32_t>> rows;
  for (int32_t s = 0; s < 4; ++s) rows.emplace_back(s, seq_lens[s] - 1);
  for (int32_t p = 600; p < 619; ++p) rows.emplace_back(2, p);
  for (int32_t p = 1000; p < 1005; ++p) rows.emplace_back(3, p);
  data.make(c, seq_lens, rows, /*selection_width=*/259, seed);
}

Comparison run_case(const Case& c, const DecodeAttentionConfig& config, bool small_plan,
                    uint32_t seed) {
  AttentionData data;
  make_data(c, seed, data);
  const int64_t n_rows = data.params.rows.n_rows;
  const int64_t n_heads = data.params.n_heads;

  DeviceAttentionData device(data);
  const PagedAttentionParams& dev = device.params;

  const Result<int64_t> resident =
      decode_attention_resident_ctas(data.params.cache.geometry, n_heads, config, 0);
  EXPECT_TRUE(resident.ok()) << resident.status().message();
  // Alternate between the planner's split and a small one so many splits are exercised.
  const int64_t max_keys = data.max_keys;
  DecodeAttentionPlan plan =
      plan_decode_attention(n_rows, c.n_kv_heads, max_keys, resident.ok() ? *resident : 1);
  if (small_plan) plan = DecodeAttentionPlan{64, (max_keys + 255) / 256 * 4};
  DeviceBuffer<float> d_ws(
      decode_attention_workspace_floats(n_rows, plan.n_splits, n_heads, c.head_dim));
  E4KV_CUDA_CHECK(cudaMemset(d_ws.ptr, 0xFF, d_ws.n * sizeof(float)));
  DecodeAttentionWorkspace ws;
  ws.m = d_ws.ptr;
  ws.l = ws.m + n_rows * plan.n_splits * n_heads;
  ws.acc = ws.l + n_rows * plan.n_splits * n_heads;
  ws.max_rows = n_rows;
  ws.max_splits = plan.n_splits;
  ws.n_heads = n_heads;
  ws.head_dim = c.head_dim;
  const Status gpu = paged_decode_attention(dev, plan, ws, config, nullptr);
  EXPECT_TRUE(gpu.ok()) << gpu.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  return compare_outputs(device.out.to_host(), data.ref);
}

TEST(DecodeAttentionCuda, MatchesCpuReferenceOverTheSweep) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const bool native = decode_attention_native_e4m3_usable(0);
  std::vector<Case> cases;
  for (int head_dim : {64, 128, 256}) {
    for (int group : {1, 4, 6, 8, 12, 16}) {
      for (int block_size : {16, 64}) {
        for (int variant = 0; variant < 3; ++variant) {
          if (variant == 2 && !native) continue;
          const KvCacheDtype dtype = variant == 0 ? KvCacheDtype::kF16 : KvCacheDtype::kE4m3;
          const bool qsa = (head_dim + group + block_size + variant) % 2 == 0;
          cases.push_back(
              Case{head_dim, group >= 12 ? 1 : 2, group, block_size, dtype, qsa, variant == 2});
        }
      }
    }
  }
  std::vector<DecodeLoadPath> loads{DecodeLoadPath::kRegisters};
  if (compute_capability(0) >= 80) loads.push_back(DecodeLoadPath::kAsyncCopy);
  double worst = 0;
  uint32_t seed = 1;
  size_t index = 0;
  const std::vector<AttentionRouteLimits> routes = cuda_attention_routes();
  for (const Case& c : cases) {
    // The route table the runner plans with claims exactly the shapes tested here.
    EXPECT_TRUE(
        routes[1].supports(AttentionRouteShape{c.head_dim, c.block_size, c.dtype, c.qsa, c.group}))
        << describe(c);
    for (DecodeLoadPath load : loads) {
      const char* path = load == DecodeLoadPath::kAsyncCopy ? " async copy" : " registers";
      const DecodeAttentionConfig config{c.native, load};
      const Comparison r = run_case(c, config, index % 2 == 1, seed++);
      EXPECT_EQ(r.n_nan, 0) << describe(c) << path;
      EXPECT_LE(r.rel_l2, 2e-3) << describe(c) << path << " max abs " << r.max_abs_err;
      worst = std::max(worst, r.rel_l2);
    }
    ++index;
  }
  std::printf("[ info ] %zu cases x %zu load paths (native E4M3 %s), worst relative L2 %.3g\n",
              cases.size(), loads.size(), native ? "included" : "not available", worst);
}

// Three launches queued back to back on one stream, sharing one workspace as the runner's layers
// do (each decode kernel overwrites the partials the merge before it read): data sets A, B, A;
// every output must match its reference.
TEST(DecodeAttentionCuda, BackToBackLaunchesShareTheWorkspace) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const DecodeAttentionConfig config = decode_attention_config(0, false);
  for (const Case& c : {Case{256, 2, 8, 64, KvCacheDtype::kF16, true, false},
                        Case{128, 2, 4, 16, KvCacheDtype::kE4m3, false, false}}) {
    AttentionData host[2];
    make_data(c, 77, host[0]);
    make_data(c, 78, host[1]);
    DeviceAttentionData dev0(host[0]);
    DeviceAttentionData dev1(host[1]);
    DeviceAttentionData dev2(host[0]);
    const int64_t n_rows = host[0].params.rows.n_rows;
    const int64_t n_heads = host[0].params.n_heads;
    const Result<int64_t> resident =
        decode_attention_resident_ctas(host[0].params.cache.geometry, n_heads, config, 0);
    ASSERT_TRUE(resident.ok()) << resident.status().message();
    const DecodeAttentionPlan plan =
        plan_decode_attention(n_rows, c.n_kv_heads, host[0].max_keys, *resident);
    DeviceBuffer<float> d_ws(
        decode_attention_workspace_floats(n_rows, plan.n_splits, n_heads, c.head_dim));
    DecodeAttentionWorkspace ws;
    ws.m = d_ws.ptr;
    ws.l = ws.m + n_rows * plan.n_splits * n_heads;
    ws.acc = ws.l + n_rows * plan.n_splits * n_heads;
    ws.max_rows = n_rows;
    ws.max_splits = plan.n_splits;
    ws.n_heads = n_heads;
    ws.head_dim = c.head_dim;
    for (const DeviceAttentionData* d : {&dev0, &dev1, &dev2}) {
      const Status st = paged_decode_attention(d->params, plan, ws, config, nullptr);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    E4KV_CUDA_CHECK(cudaDeviceSynchronize());
    const Comparison r[3] = {compare_outputs(dev0.out.to_host(), host[0].ref),
                             compare_outputs(dev1.out.to_host(), host[1].ref),
                             compare_outputs(dev2.out.to_host(), host[0].ref)};
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(r[i].n_nan, 0) << describe(c) << " launch " << i;
      EXPECT_LE(r[i].rel_l2, 2e-3)
          << describe(c) << " launch " << i << " max abs " << r[i].max_abs_err;
    }
  }
}

// The cluster merge (sm_90+; the split's partials combined through distributed shared memory, no
// merge kernel) against the CPU reference: head_dim 128/256 x GQA {1,4,8} x FP16/E4M3 x
// dense/QSA, on the sweep's mixed batch and on QSA selections of budget + tail (2048 + 3 keys,
// where the last split takes the tail), gate applied.
TEST(DecodeAttentionCuda, ClusterMergeMatchesCpuReference) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (compute_capability(0) < 90) GTEST_SKIP() << "the cluster merge needs sm_90+";
  const bool native = decode_attention_native_e4m3_usable(0);
  double worst = 0;
  int runs = 0;
  uint32_t seed = 500;
  for (int head_dim : {128, 256}) {
    for (int group : {1, 4, 8}) {
      for (int variant = 0; variant < 3; ++variant) {
        if (variant == 2 && !native) continue;
        for (bool qsa : {false, true}) {
          const KvCacheDtype dtype = variant == 0 ? KvCacheDtype::kF16 : KvCacheDtype::kE4m3;
          const Case c{head_dim, 2,   group,       (group + variant) % 2 == 0 ? 64 : 16,
                       dtype,    qsa, variant == 2};
          const DecodeAttentionConfig config{c.native, DecodeLoadPath::kAsyncCopy};
          for (int set = 0; set < 2; ++set) {
            AttentionData data;
            if (set == 0) {
              make_data(c, seed++, data);
            } else {
              // Rows of 2051 (pos + 1 = 3 mod 4), 2048 and 2051 (all keys, pos + 1 <= width) keys.
              data.make(c, {5000, 3000}, {{0, 4998}, {1, 2999}, {1, 2050}, {0, 100}},
                        /*selection_width=*/2051, seed++);
            }
            const Result<DecodeClusterMerge> merge =
                decode_attention_cluster_merge(data.params.cache.geometry, c.group * 2, config, 0);
            ASSERT_TRUE(merge.ok()) << merge.status().message();
            ASSERT_GT(merge->clusters, 0) << describe(c);
            DeviceAttentionData device(data);
            const DecodeAttentionPlan plan =
                plan_decode_attention_cluster(data.max_keys, merge->splits);
            const Status st = paged_decode_attention(device.params, plan,
                                                     DecodeAttentionWorkspace{}, config, nullptr);
            ASSERT_TRUE(st.ok()) << st.message();
            E4KV_CUDA_CHECK(cudaDeviceSynchronize());
            const Comparison r = compare_outputs(device.out.to_host(), data.ref);
            EXPECT_EQ(r.n_nan, 0) << describe(c) << " set " << set;
            EXPECT_LE(r.rel_l2, 2e-3)
                << describe(c) << " set " << set << " max abs " << r.max_abs_err;
            worst = std::max(worst, r.rel_l2);
            ++runs;
          }
        }
      }
    }
  }
  std::printf("[ info ] cluster merge: %d runs, worst relative L2 %.3g\n", runs, worst);
}

}  // namespace
}  // namespace e4kv::cuda
