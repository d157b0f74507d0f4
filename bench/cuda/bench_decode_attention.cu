// Decode attention benchmark: e4kv paged decode over FP16 and E4M3 (software and native decode)
// caches at the target shapes, plus the device-to-device copy bandwidth as the ceiling. Prints a
// table and writes JSON (argv[1], default decode_attention.json). Times: see time_ms (launches
// from the host, back to back) and graph_us (the same launches replayed from a CUDA graph, so host
// launch overhead is out); bytes are the K and V bytes the launch must read. With "sweep" as
// argv[5], each shape also runs other split counts (1/4 to 2.5x) next to the planner's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "bench_data.cuh"
#include "bench_timing.cuh"

namespace {

using e4kv::bench::copy_bandwidth_tbs;
using e4kv::bench::fill_cache_bytes;
using e4kv::bench::graph_ms;
using e4kv::bench::time_ms;
using e4kv::bench::upload;

using namespace e4kv;
using namespace e4kv::cuda;

struct Shape {
  const char* name;
  int batch;
  int n_heads;
  int n_kv_heads;
  int head_dim;
  int ctx;
  int qsa_budget;  // 0: dense
};

struct Measurement {
  std::string shape;
  std::string kv;
  std::string plan;  // "auto" (the planner's) or "split" (a sweep's split count)
  double ms;
  double graph_ms;
  double bytes;
  double tbs;
  int64_t splits;
  int64_t resident_ctas;
};

// "fp16", "e4m3-soft" or "e4m3-native", with "-reg" for the register load path.
std::string kv_name(KvCacheDtype dtype, const DecodeAttentionConfig& config) {
  std::string name = dtype == KvCacheDtype::kF16 ? "fp16"
                     : config.native_e4m3        ? "e4m3-native"
                                                 : "e4m3-soft";
  if (config.load == DecodeLoadPath::kRegisters) name += "-reg";
  return name;
}

std::vector<Measurement> run(const Shape& s, KvCacheDtype dtype,
                             const DecodeAttentionConfig& config, bool sweep) {
  constexpr int kBlock = 64;
  const int64_t blocks_per_seq = (s.ctx + kBlock - 1) / kBlock;
  const int64_t n_blocks = blocks_per_seq * s.batch;
  const KvCacheGeometry geo{n_blocks, kBlock, s.n_kv_heads, s.head_dim, dtype};
  // Caches smaller than 256 MB are replicated and rotated so that repeated launches read from
  // HBM, not from the 60 MB L2.
  const int n_copies = int(std::max<size_t>(1, (size_t(256) << 20) / geo.total_bytes()));
  std::vector<uint8_t*> caches(n_copies, nullptr);
  for (uint8_t*& cache : caches) {
    E4KV_CUDA_CHECK(cudaMalloc(&cache, geo.total_bytes()));
    fill_cache_bytes(cache, geo.total_bytes(), 12345u, dtype == KvCacheDtype::kE4m3);
  }

  std::mt19937 rng(7);
  std::vector<int32_t> table(n_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<int32_t> row_seq(s.batch), row_pos(s.batch, s.ctx - 1), seq_lens(s.batch, s.ctx);
  std::iota(row_seq.begin(), row_seq.end(), 0);
  const int64_t sel_width = s.qsa_budget > 0 ? s.qsa_budget + 3 : 0;
  std::vector<int32_t> sel(std::max<int64_t>(1, s.batch * sel_width), -1);
  std::vector<int32_t> counts(s.batch, 0);
  int64_t keys = s.ctx;
  if (s.qsa_budget > 0) {
    const int groups = s.ctx / 4;
    for (int r = 0; r < s.batch; ++r) {
      std::vector<int32_t> g(groups);
      std::iota(g.begin(), g.end(), 0);
      std::shuffle(g.begin(), g.end(), rng);
      g.resize(s.qsa_budget / 4);
      std::sort(g.begin(), g.end());
      int n = 0;
      for (int32_t x : g) {
        for (int j = 0; j < 4; ++j) sel[r * sel_width + n++] = 4 * x + j;
      }
      for (int t = 4 * groups; t < s.ctx; ++t) sel[r * sel_width + n++] = t;
      counts[r] = n;
    }
    keys = *std::max_element(counts.begin(), counts.end());
  }
  int32_t* d_table = upload(table);
  int32_t* d_row_seq = upload(row_seq);
  int32_t* d_row_pos = upload(row_pos);
  int32_t* d_seq_lens = upload(seq_lens);
  int32_t* d_sel = upload(sel);
  int32_t* d_counts = upload(counts);
  const size_t q_elems = size_t(s.batch) * s.n_heads * s.head_dim;
  uint16_t* d_q = nullptr;
  float* d_out = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_q, q_elems * 2));
  E4KV_CUDA_CHECK(cudaMalloc(&d_out, q_elems * 4));
  fill_cache_bytes(reinterpret_cast<uint8_t*>(d_q), q_elems * 2, 99u, false);

  PagedAttentionParams p;
  p.cache = KvCacheView{caches[0], geo, 0.01f, 0.01f};
  p.block_table = BlockTableView{d_table, s.batch, blocks_per_seq};
  p.rows.n_rows = s.batch;
  p.rows.row_seq = d_row_seq;
  p.rows.row_pos = d_row_pos;
  p.rows.seq_lens = d_seq_lens;
  if (s.qsa_budget > 0) {
    p.rows.sel_tokens = d_sel;
    p.rows.sel_counts = d_counts;
    p.rows.sel_width = sel_width;
  }
  p.n_heads = s.n_heads;
  p.q = d_q;
  p.out = d_out;

  const Result<int64_t> resident = decode_attention_resident_ctas(geo, s.n_heads, config, 0);
  if (!resident.ok())
    std::fprintf(stderr, "%s\n", resident.status().message().c_str()), std::exit(1);
  const DecodeAttentionPlan plan = plan_decode_attention(s.batch, s.n_kv_heads, keys, *resident);
  struct Variant {
    std::string name;
    DecodeAttentionPlan plan;
  };
  std::vector<Variant> plans{{"auto", plan}};
  if (sweep) {
    std::vector<int64_t> done{plan.n_splits};
    for (double f : {0.25, 0.5, 0.75, 0.94, 1.06, 1.28, 1.5, 2.0, 2.56}) {
      const int64_t splits = std::max<int64_t>(4, std::llround(double(plan.n_splits) * f / 4) * 4);
      if (std::find(done.begin(), done.end(), splits) != done.end()) continue;
      done.push_back(splits);
      const int64_t kps = ((keys + splits - 1) / splits + 7) / 8 * 8;
      plans.push_back({"split", DecodeAttentionPlan{kps, splits}});
    }
  }
  int64_t max_splits = 0;
  for (const Variant& v : plans) max_splits = std::max(max_splits, v.plan.n_splits);
  float* d_ws = nullptr;
  const size_t ws_floats =
      decode_attention_workspace_floats(s.batch, max_splits, s.n_heads, s.head_dim);
  E4KV_CUDA_CHECK(cudaMalloc(&d_ws, ws_floats * 4));
  DecodeAttentionWorkspace ws{d_ws,
                              d_ws + s.batch * max_splits * s.n_heads,
                              d_ws + 2 * s.batch * max_splits * s.n_heads,
                              s.batch,
                              max_splits,
                              s.n_heads,
                              s.head_dim};
  const double bytes =
      double(s.batch) * double(keys) * s.n_kv_heads * s.head_dim * 2.0 * double(geo.elem_bytes());
  std::vector<Measurement> out;
  for (const Variant& v : plans) {
    int next_copy = 0;
    auto launch = [&](cudaStream_t stream) {
      p.cache.data = caches[next_copy];
      next_copy = (next_copy + 1) % n_copies;
      const Status st = paged_decode_attention(p, v.plan, ws, config, stream);
      if (!st.ok()) std::fprintf(stderr, "%s\n", st.message().c_str()), std::exit(1);
    };
    const float ms = time_ms([&] { launch(nullptr); });
    const float gms = graph_ms([&](cudaStream_t stream, int) { launch(stream); }, 20);
    out.push_back(Measurement{s.name, kv_name(dtype, config), v.name, ms, gms, bytes,
                              bytes / (ms * 1e-3) / 1e12, v.plan.n_splits, *resident});
  }
  for (uint8_t* cache : caches) E4KV_CUDA_CHECK(cudaFree(cache));
  for (void* ptr : {(void*)d_table, (void*)d_row_seq, (void*)d_row_pos, (void*)d_seq_lens,
                    (void*)d_sel, (void*)d_counts, (void*)d_q, (void*)d_out, (void*)d_ws}) {
    E4KV_CUDA_CHECK(cudaFree(ptr));
  }
  return out;
}

}  // namespace

// Usage: e4kv_bench_decode_attention [OUT.json [SHAPE_FILTER [KV_FILTER [LOADS [sweep]]]]]
// (filters are substrings; LOADS: "best" for the device's load path only, default both).
int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "decode_attention.json";
  const std::string shape_filter = argc > 2 ? argv[2] : "";
  const std::string kv_filter = argc > 3 ? argv[3] : "";
  const bool best_load_only = argc > 4 && std::string(argv[4]) == "best";
  const bool sweep = argc > 5 && std::string(argv[5]) == "sweep";
  if (device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const DecodeAttentionConfig best = decode_attention_config(0, false);
  const double copy_tbs = copy_bandwidth_tbs();
  std::printf("device copy bandwidth (read+write): %.3f TB/s\n", copy_tbs);

  const std::vector<Shape> shapes = {
      {"b32_h32_kv8_d128_8k", 32, 32, 8, 128, 8192, 0},
      {"b8_h32_kv8_d128_32k", 8, 32, 8, 128, 32768, 0},
      {"b4_h16_kv2_d256_128k", 4, 16, 2, 256, 131072, 0},
      {"b64_h24_kv2_d256_8k", 64, 24, 2, 256, 8192, 0},
      {"b1_h16_kv2_d256_20k", 1, 16, 2, 256, 20480, 0},
      {"qsa_b4_h16_kv2_d256_128k_budget2048", 4, 16, 2, 256, 131072, 2048},
  };
  std::vector<Measurement> results;
  std::printf("%-38s %-16s %-6s %9s %9s %9s %8s %8s %7s %9s\n", "shape", "kv", "plan", "time_us",
              "graph_us", "MB_read", "TB/s", "vs_copy", "splits", "resident");
  for (const Shape& s : shapes) {
    if (std::string(s.name).find(shape_filter) == std::string::npos) continue;
    // The device's best configuration, and the register load path where that is async (the
    // path sm_75 runs), FP16 and software E4M3 first.
    std::vector<DecodeLoadPath> loads{best.load};
    if (best.load != DecodeLoadPath::kRegisters && !best_load_only) {
      loads.push_back(DecodeLoadPath::kRegisters);
    }
    std::vector<std::pair<KvCacheDtype, DecodeAttentionConfig>> kinds;
    for (DecodeLoadPath load : loads) {
      kinds.push_back({KvCacheDtype::kF16, {false, load}});
      kinds.push_back({KvCacheDtype::kE4m3, {false, load}});
      if (best.native_e4m3) kinds.push_back({KvCacheDtype::kE4m3, {true, load}});
    }
    for (const auto& [dtype, config] : kinds) {
      if (kv_name(dtype, config).find(kv_filter) == std::string::npos) continue;
      for (const Measurement& m : run(s, dtype, config, sweep)) {
        std::printf("%-38s %-16s %-6s %9.1f %9.1f %9.1f %8.3f %7.1f%% %7lld %9lld\n",
                    m.shape.c_str(), m.kv.c_str(), m.plan.c_str(), m.ms * 1e3, m.graph_ms * 1e3,
                    m.bytes / 1e6, m.tbs, 100.0 * m.tbs / copy_tbs, (long long)m.splits,
                    (long long)m.resident_ctas);
        results.push_back(m);
      }
    }
  }
  FILE* f = std::fopen(json_path, "w");
  if (f == nullptr) return 1;
  std::fprintf(f, "{\"copy_tbs\": %.4f, \"results\": [\n", copy_tbs);
  for (size_t i = 0; i < results.size(); ++i) {
    const Measurement& m = results[i];
    std::fprintf(f,
                 "  {\"shape\": \"%s\", \"kv\": \"%s\", \"plan\": \"%s\", \"ms\": %.5f, "
                 "\"graph_ms\": %.5f, \"bytes\": %.0f, \"tbs\": %.4f, \"splits\": %lld, "
                 "\"resident_ctas\": %lld}%s\n",
                 m.shape.c_str(), m.kv.c_str(), m.plan.c_str(), m.ms, m.graph_ms, m.bytes, m.tbs,
                 (long long)m.splits, (long long)m.resident_ctas,
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return 0;
}
