// Random paged-attention inputs for the CUDA attention tests, with the CPU reference output: a
// shuffled block pool, Gaussian K/V with outlier channels (FP16, or E4M3 with absmax scales), QSA
// selections (random groups of 4 plus the causal tail, ascending), q and gate.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cuda/cuda_check.h"
#include "core/half.h"
#include "device_buffer.cuh"
#include "e4kv/e4m3.h"
#include "testing/compare.h"

namespace e4kv::cuda {

struct AttentionCase {
  int head_dim;
  int n_kv_heads;
  int group;
  int block_size;
  KvCacheDtype dtype;
  bool qsa;
  bool native;
};

inline std::string describe(const AttentionCase& c) {
  return "d" + std::to_string(c.head_dim) + " kv" + std::to_string(c.n_kv_heads) + " g" +
         std::to_string(c.group) + " bs" + std::to_string(c.block_size) +
         (c.dtype == KvCacheDtype::kF16 ? " f16"
          : c.native                    ? " e4m3-native"
                                        : " e4m3-soft") +
         (c.qsa ? " qsa" : " dense");
}

// Host inputs of one attention call and the CPU reference output. `params` points into this
// object's vectors (do not copy it after calling make()).
struct AttentionData {
  KvCacheGeometry geo;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  std::vector<int32_t> seq_lens;
  int64_t max_blocks = 0;
  std::vector<int32_t> table;
  std::vector<uint8_t> cache_bytes;
  std::vector<int32_t> row_seq;
  std::vector<int32_t> row_pos;
  int64_t sel_width = 0;
  std::vector<int32_t> sel;
  std::vector<int32_t> counts;
  int64_t max_keys = 0;
  std::vector<uint16_t> q;
  std::vector<uint16_t> gate;
  std::vector<float> ref;
  PagedAttentionParams params;

  // rows: (sequence, position) pairs in batch order; positions < seq_lens[sequence].
  void make(const AttentionCase& c, const std::vector<int32_t>& lens,
            const std::vector<std::pair<int32_t, int32_t>>& rows, int64_t selection_width,
            uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t n_heads = int64_t(c.n_kv_heads) * c.group;
    seq_lens = lens;
    const int64_t n_seqs = int64_t(seq_lens.size());
    const int64_t max_len = *std::max_element(seq_lens.begin(), seq_lens.end());
    max_blocks = (max_len + c.block_size - 1) / c.block_size;
    const int64_t n_blocks = n_seqs * max_blocks + 3;

    std::vector<int32_t> pool(n_blocks);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    table.assign(n_seqs * max_blocks, -1);
    size_t next = 0;
    for (int64_t s = 0; s < n_seqs; ++s) {
      for (int64_t b = 0; b < (seq_lens[s] + c.block_size - 1) / c.block_size; ++b) {
        table[s * max_blocks + b] = pool[next++];
      }
    }

    // Gaussian with a few outlier channels, as trained models have.
    geo = KvCacheGeometry{n_blocks, c.block_size, c.n_kv_heads, c.head_dim, c.dtype};
    const int64_t n_elems = n_blocks * 2 * c.block_size * geo.row_elems();
    std::vector<float> values(n_elems);
    for (int64_t i = 0; i < n_elems; ++i) {
      const float outlier = (i % c.head_dim) % 61 == 7 ? 20.0f : 1.0f;
      values[i] = normal(rng) * outlier;
    }
    cache_bytes.assign(n_elems * geo.elem_bytes(), 0);
    if (c.dtype == KvCacheDtype::kF16) {
      auto* h = reinterpret_cast<uint16_t*>(cache_bytes.data());
      for (int64_t i = 0; i < n_elems; ++i) h[i] = f32_to_f16(values[i]);
    } else {
      float k_max = 0;
      float v_max = 0;
      const int64_t half_block = c.block_size * geo.row_elems();
      for (int64_t i = 0; i < n_elems; ++i) {
        float& m = (i / half_block) % 2 == 1 ? v_max : k_max;
        m = std::max(m, std::fabs(values[i]));
      }
      k_scale = k_max / 448.0f;
      v_scale = v_max / 448.0f;
      for (int64_t i = 0; i < n_elems; ++i) {
        const bool is_v = (i / half_block) % 2 == 1;
        cache_bytes[i] = e4m3_encode(values[i], is_v ? v_scale : k_scale);
      }
    }

    row_seq.clear();
    row_pos.clear();
    for (const auto& [s, p] : rows) row_seq.push_back(s), row_pos.push_back(p);
    const int64_t n_rows = int64_t(rows.size());

    // Selections: all keys when they fit, else random groups of 4 plus the causal tail.
    sel_width = selection_width;
    sel.assign(n_rows * sel_width, -1);
    counts.assign(n_rows, 0);
    max_keys = 0;
    const int64_t n_groups_chosen = (sel_width - 3) / 4;
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
        g.resize(std::min<int64_t>(groups, n_groups_chosen));
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

    q.resize(n_rows * n_heads * c.head_dim);
    gate.resize(q.size());
    for (auto& x : q) x = f32_to_f16(normal(rng) * 0.5f);
    for (auto& x : gate) x = f32_to_f16(normal(rng));

    ref.assign(q.size(), 0.0f);
    params = PagedAttentionParams{};
    params.cache = KvCacheView{cache_bytes.data(), geo, k_scale, v_scale};
    params.block_table = BlockTableView{table.data(), n_seqs, max_blocks};
    params.rows.n_rows = n_rows;
    params.rows.row_seq = row_seq.data();
    params.rows.row_pos = row_pos.data();
    params.rows.seq_lens = seq_lens.data();
    if (c.qsa) {
      params.rows.sel_tokens = sel.data();
      params.rows.sel_counts = counts.data();
      params.rows.sel_width = sel_width;
    }
    params.n_heads = n_heads;
    params.q = q.data();
    params.gate = gate.data();
    params.out = ref.data();
    const Status cpu = paged_attention(params);
    if (!cpu.ok()) throw std::runtime_error(cpu.message());
  }
};

// The same inputs on the device, and `params` pointing at them (out: poisoned with NaN).
struct DeviceAttentionData {
  DeviceBuffer<uint8_t> cache;
  DeviceBuffer<int32_t> table, row_seq, row_pos, seq_lens, sel, counts;
  DeviceBuffer<uint16_t> q, gate;
  DeviceBuffer<float> out;
  PagedAttentionParams params;

  explicit DeviceAttentionData(const AttentionData& host)
      : cache(host.cache_bytes),
        table(host.table),
        row_seq(host.row_seq),
        row_pos(host.row_pos),
        seq_lens(host.seq_lens),
        sel(host.sel),
        counts(host.counts),
        q(host.q),
        gate(host.gate),
        out(host.ref.size()),
        params(host.params) {
    E4KV_CUDA_CHECK(cudaMemset(out.ptr, 0xFF, out.n * sizeof(float)));  // NaN poison
    params.cache.data = cache.ptr;
    params.block_table.blocks = table.ptr;
    params.rows.row_seq = row_seq.ptr;
    params.rows.row_pos = row_pos.ptr;
    params.rows.seq_lens = seq_lens.ptr;
    if (host.params.rows.qsa()) {
      params.rows.sel_tokens = sel.ptr;
      params.rows.sel_counts = counts.ptr;
    }
    params.q = q.ptr;
    params.gate = gate.ptr;
    params.out = out.ptr;
  }
};

// The shared comparator (testing/compare.h) with no tolerance: the tests bound its relative L2
// and NaN count and print its largest absolute error.
using Comparison = test::CompareReport;

inline Comparison compare_outputs(const std::vector<float>& out, const std::vector<float>& ref) {
  return test::compare(out, ref, 0.0, 0.0);
}

}  // namespace e4kv::cuda
