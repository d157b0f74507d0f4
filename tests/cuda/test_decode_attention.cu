// CUDA paged decode attention against the CPU reference (backend/cpu/attention.h) on fresh random
// data: head_dim {64,128,256} x GQA {1,4,6,8,12,16} x block {16,64} x FP16/E4M3 (software and
// native decode) x dense/QSA, mixed batches of decode rows and prefill-chunk rows. Outputs are
// poisoned with NaN before each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "core/half.h"
#include "device_buffer.cuh"
#include "e4kv/e4m3.h"
#include "qsa/route_planner.h"

namespace e4kv::cuda {
namespace {

struct Case {
  int head_dim;
  int n_kv_heads;
  int group;
  int block_size;
  KvCacheDtype dtype;
  bool qsa;
  bool native;
};

std::string describe(const Case& c) {
  return "d" + std::to_string(c.head_dim) + " kv" + std::to_string(c.n_kv_heads) + " g" +
         std::to_string(c.group) + " bs" + std::to_string(c.block_size) +
         (c.dtype == KvCacheDtype::kF16 ? " f16"
          : c.native                    ? " e4m3-native"
                                        : " e4m3-soft") +
         (c.qsa ? " qsa" : " dense");
}

struct Result {
  double rel_l2 = 0;
  double max_abs = 0;
  int64_t nan_count = 0;
};

Result run_case(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n_heads = int64_t(c.n_kv_heads) * c.group;
  const std::vector<int32_t> seq_lens{1, 37, 700, 1500};
  const int64_t n_seqs = int64_t(seq_lens.size());
  const int64_t max_len = *std::max_element(seq_lens.begin(), seq_lens.end());
  const int64_t max_blocks = (max_len + c.block_size - 1) / c.block_size;
  const int64_t n_blocks = n_seqs * max_blocks + 3;

  // Block tables over a shuffled pool.
  std::vector<int32_t> pool(n_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<int32_t> table(n_seqs * max_blocks, -1);
  size_t next = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    for (int64_t b = 0; b < (seq_lens[s] + c.block_size - 1) / c.block_size; ++b) {
      table[s * max_blocks + b] = pool[next++];
    }
  }

  // Cache contents: Gaussian with a few outlier channels, as trained models have.
  KvCacheGeometry geo{n_blocks, c.block_size, c.n_kv_heads, c.head_dim, c.dtype};
  const int64_t n_elems = n_blocks * 2 * c.block_size * geo.row_elems();
  std::vector<float> values(n_elems);
  for (int64_t i = 0; i < n_elems; ++i) {
    const int64_t dim = i % c.head_dim;
    const float outlier = (dim % 61 == 7) ? 20.0f : 1.0f;
    values[i] = normal(rng) * outlier;
  }
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  std::vector<uint8_t> cache_bytes(n_elems * geo.elem_bytes());
  if (c.dtype == KvCacheDtype::kF16) {
    auto* h = reinterpret_cast<uint16_t*>(cache_bytes.data());
    for (int64_t i = 0; i < n_elems; ++i) h[i] = f32_to_f16(values[i]);
  } else {
    float k_max = 0;
    float v_max = 0;
    const int64_t half_block = c.block_size * geo.row_elems();
    for (int64_t i = 0; i < n_elems; ++i) {
      const bool is_v = (i / half_block) % 2 == 1;
      (is_v ? v_max : k_max) = std::max(is_v ? v_max : k_max, std::fabs(values[i]));
    }
    k_scale = k_max / 448.0f;
    v_scale = v_max / 448.0f;
    for (int64_t i = 0; i < n_elems; ++i) {
      const bool is_v = (i / half_block) % 2 == 1;
      cache_bytes[i] = e4m3_encode(values[i], is_v ? v_scale : k_scale);
    }
  }

  // Rows: a decode row per sequence, plus a 19-row prefill chunk of sequence 2 and a 5-row
  // chunk of sequence 3 (a mixed batch).
  std::vector<int32_t> row_seq;
  std::vector<int32_t> row_pos;
  for (int64_t s = 0; s < n_seqs; ++s) {
    row_seq.push_back(int32_t(s));
    row_pos.push_back(seq_lens[s] - 1);
  }
  for (int p = 600; p < 619; ++p) row_seq.push_back(2), row_pos.push_back(p);
  for (int p = 1000; p < 1005; ++p) row_seq.push_back(3), row_pos.push_back(p);
  const int64_t n_rows = int64_t(row_seq.size());

  // QSA selections: ascending random subsets (groups of 4 plus the tail) of at most 259 keys.
  const int64_t sel_width = 259;
  std::vector<int32_t> sel(n_rows * sel_width, -1);
  std::vector<int32_t> counts(n_rows, 0);
  int64_t max_keys = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const int32_t pos = row_pos[r];
    std::vector<int32_t> chosen;
    if (pos + 1 <= sel_width) {
      for (int32_t t = 0; t <= pos; ++t) chosen.push_back(t);
    } else {
      const int32_t groups = (pos + 1) / 4;
      std::vector<int32_t> g(groups);
      std::iota(g.begin(), g.end(), 0);
      std::shuffle(g.begin(), g.end(), rng);
      g.resize(64);
      std::sort(g.begin(), g.end());
      for (int32_t x : g) {
        for (int j = 0; j < 4; ++j) chosen.push_back(4 * x + j);
      }
      for (int32_t t = 4 * groups; t <= pos; ++t) chosen.push_back(t);
    }
    counts[r] = int32_t(chosen.size());
    std::copy(chosen.begin(), chosen.end(), sel.begin() + r * sel_width);
    max_keys = std::max<int64_t>(max_keys, c.qsa ? counts[r] : pos + 1);
  }

  std::vector<uint16_t> q(n_rows * n_heads * c.head_dim);
  std::vector<uint16_t> gate(q.size());
  for (auto& x : q) x = f32_to_f16(normal(rng) * 0.5f);
  for (auto& x : gate) x = f32_to_f16(normal(rng));

  // CPU reference.
  std::vector<float> ref(q.size());
  PagedAttentionParams host;
  host.cache = KvCacheView{cache_bytes.data(), geo, k_scale, v_scale};
  host.block_table = BlockTableView{table.data(), n_seqs, max_blocks};
  host.rows.n_rows = n_rows;
  host.rows.row_seq = row_seq.data();
  host.rows.row_pos = row_pos.data();
  host.rows.seq_lens = seq_lens.data();
  if (c.qsa) {
    host.rows.sel_tokens = sel.data();
    host.rows.sel_counts = counts.data();
    host.rows.sel_width = sel_width;
  }
  host.n_heads = n_heads;
  host.q = q.data();
  host.gate = gate.data();
  host.out = ref.data();
  const Status cpu = paged_attention(host);
  EXPECT_TRUE(cpu.ok()) << cpu.message();

  // GPU.
  DeviceBuffer<uint8_t> d_cache(cache_bytes);
  DeviceBuffer<int32_t> d_table(table);
  DeviceBuffer<int32_t> d_row_seq(row_seq);
  DeviceBuffer<int32_t> d_row_pos(row_pos);
  DeviceBuffer<int32_t> d_seq_lens(seq_lens);
  DeviceBuffer<int32_t> d_sel(sel);
  DeviceBuffer<int32_t> d_counts(counts);
  DeviceBuffer<uint16_t> d_q(q);
  DeviceBuffer<uint16_t> d_gate(gate);
  DeviceBuffer<float> d_out(ref.size());
  E4KV_CUDA_CHECK(cudaMemset(d_out.ptr, 0xFF, ref.size() * sizeof(float)));  // NaN poison

  PagedAttentionParams dev = host;
  dev.cache.data = d_cache.ptr;
  dev.block_table.blocks = d_table.ptr;
  dev.rows.row_seq = d_row_seq.ptr;
  dev.rows.row_pos = d_row_pos.ptr;
  dev.rows.seq_lens = d_seq_lens.ptr;
  if (c.qsa) {
    dev.rows.sel_tokens = d_sel.ptr;
    dev.rows.sel_counts = d_counts.ptr;
  }
  dev.q = d_q.ptr;
  dev.gate = d_gate.ptr;
  dev.out = d_out.ptr;

  int n_sms = 0;
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
  // Alternate between the planner's split and a small one so many splits are exercised.
  DecodeAttentionPlan plan = plan_decode_attention(n_rows, c.n_kv_heads, max_keys, n_sms);
  if (seed % 2 == 1) plan = DecodeAttentionPlan{64, (max_keys + 255) / 256 * 4};
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
  const Status gpu = paged_decode_attention(dev, plan, ws, c.native, nullptr);
  EXPECT_TRUE(gpu.ok()) << gpu.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> out = d_out.to_host();

  Result result;
  double diff2 = 0;
  double ref2 = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(out[i])) {
      ++result.nan_count;
      continue;
    }
    const double d = double(out[i]) - double(ref[i]);
    diff2 += d * d;
    ref2 += double(ref[i]) * ref[i];
    result.max_abs = std::max(result.max_abs, std::fabs(d));
  }
  result.rel_l2 = std::sqrt(diff2 / std::max(ref2, 1e-30));
  return result;
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
  double worst = 0;
  uint32_t seed = 1;
  const std::vector<AttentionRouteLimits> routes = cuda_attention_routes();
  for (const Case& c : cases) {
    // The route table the runner plans with claims exactly the shapes tested here.
    EXPECT_TRUE(
        routes[0].supports(AttentionRouteShape{c.head_dim, c.block_size, c.dtype, c.qsa, c.group}))
        << describe(c);
    const Result r = run_case(c, seed++);
    EXPECT_EQ(r.nan_count, 0) << describe(c);
    EXPECT_LE(r.rel_l2, 2e-3) << describe(c) << " max abs " << r.max_abs;
    worst = std::max(worst, r.rel_l2);
  }
  std::printf("[ info ] %zu cases (native E4M3 %s), worst relative L2 %.3g\n", cases.size(),
              native ? "included" : "not available", worst);
}

}  // namespace
}  // namespace e4kv::cuda
