// Cache write benchmark: FP16 K/V rows into the paged cache as FP16 or E4M3, with and without fused
// statistics, for batches of 1 to 65536 tokens over shuffled slots, plus the device-to-device copy
// bandwidth as the ceiling. E4M3 runs on the hardware encoder (where
// cache_write_hardware_encode_usable) and on the software one, each measured in the same run and
// then shown side by side. Prints tables and writes JSON (argv[1], default cache_write.json).
// Bytes moved = FP16 K and V read + cache bytes written; times: see time_ms.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cache_write.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "bench_data.cuh"
#include "bench_timing.cuh"

namespace {

using e4kv::bench::copy_bandwidth_tbs;
using e4kv::bench::fill_f16;
using e4kv::bench::time_ms;

using namespace e4kv;
using namespace e4kv::cuda;

struct Shape {
  const char* name;
  int n_kv_heads;
  int head_dim;
};

struct Measurement {
  std::string shape;
  std::string kv;
  std::string encode;  // "hw" or "sw" for E4M3, "-" for FP16
  bool stats;
  int64_t tokens;
  double ms;
  double bytes;
  double tbs;
};

Measurement run(const Shape& s, int64_t tokens, KvCacheDtype dtype, CacheWriteEncode encode,
                bool stats, CacheWriteStatsBuffer& stats_buffer) {
  constexpr int kBlock = 64;
  const int64_t row = int64_t(s.n_kv_heads) * s.head_dim;
  const int64_t n_blocks = (tokens + kBlock - 1) / kBlock;
  const KvCacheGeometry geo{n_blocks, kBlock, s.n_kv_heads, s.head_dim, dtype};
  const size_t kv_bytes = size_t(tokens * row) * 2;  // one of K, V
  const size_t copy_bytes = 2 * kv_bytes + geo.total_bytes();
  // Inputs and caches smaller than 256 MB are replicated and rotated so that repeated launches
  // move data through HBM, not the 60 MB L2.
  const int n_copies = int(std::clamp<size_t>((size_t(256) << 20) / copy_bytes, 1, 256));
  uint16_t* k = nullptr;
  uint16_t* v = nullptr;
  uint8_t* cache = nullptr;
  int64_t* slots = nullptr;
  unsigned long long* non_finite = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&k, kv_bytes * n_copies));
  E4KV_CUDA_CHECK(cudaMalloc(&v, kv_bytes * n_copies));
  E4KV_CUDA_CHECK(cudaMalloc(&cache, geo.total_bytes() * n_copies));
  E4KV_CUDA_CHECK(cudaMalloc(&slots, size_t(tokens) * sizeof(int64_t)));
  E4KV_CUDA_CHECK(cudaMalloc(&non_finite, 2 * sizeof(unsigned long long)));
  E4KV_CUDA_CHECK(cudaMemset(non_finite, 0, 2 * sizeof(unsigned long long)));
  // Finite FP16 values of modest magnitude (exponents 2^-5 .. 2^0), both signs.
  fill_f16(k, kv_bytes / 2 * n_copies, 12345u, 10u, 6u);
  fill_f16(v, kv_bytes / 2 * n_copies, 777u, 10u, 6u);
  E4KV_CUDA_CHECK(cudaMemset(cache, 0, geo.total_bytes() * n_copies));

  // Decode-like scatter: a shuffled permutation of the cache's slots.
  std::mt19937 rng(7);
  std::vector<int64_t> host_slots(size_t(n_blocks * kBlock));
  std::iota(host_slots.begin(), host_slots.end(), 0);
  std::shuffle(host_slots.begin(), host_slots.end(), rng);
  E4KV_CUDA_CHECK(cudaMemcpy(slots, host_slots.data(), size_t(tokens) * sizeof(int64_t),
                             cudaMemcpyHostToDevice));

  const CacheWriteStatsView view = stats_buffer.view();
  int next_copy = 0;
  const float ms = time_ms([&] {
    const KvCacheView c{cache + geo.total_bytes() * next_copy, geo, 0.01f, 0.02f};
    const size_t offset = kv_bytes / 2 * next_copy;
    next_copy = (next_copy + 1) % n_copies;
    const Status st = cache_write(c, k + offset, v + offset, slots, tokens, non_finite,
                                  stats ? &view : nullptr, nullptr, encode);
    if (!st.ok()) std::fprintf(stderr, "%s\n", st.message().c_str()), std::exit(1);
  });
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  for (void* ptr : {(void*)k, (void*)v, (void*)cache, (void*)slots, (void*)non_finite}) {
    E4KV_CUDA_CHECK(cudaFree(ptr));
  }
  const double bytes = double(tokens) * double(row) * 2.0 * (2.0 + double(geo.elem_bytes()));
  const bool hardware = encode == CacheWriteEncode::kAuto && cache_write_hardware_encode_usable(0);
  return Measurement{s.name,
                     dtype == KvCacheDtype::kF16 ? "fp16" : "e4m3",
                     dtype == KvCacheDtype::kF16 ? "-" : (hardware ? "hw" : "sw"),
                     stats,
                     tokens,
                     ms,
                     bytes,
                     bytes / (ms * 1e-3) / 1e12};
}

}  // namespace

// Usage: e4kv_bench_cache_write [OUT.json [SHAPE_FILTER [KV_FILTER]]] (filters are substrings).
int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "cache_write.json";
  const std::string shape_filter = argc > 2 ? argv[2] : "";
  const std::string kv_filter = argc > 3 ? argv[3] : "";
  if (device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const double copy_tbs = copy_bandwidth_tbs();
  std::printf("device copy bandwidth (read+write): %.3f TB/s\n", copy_tbs);
  const bool hardware = cache_write_hardware_encode_usable(0);
  std::printf("E4M3 hardware encode: %s\n",
              hardware ? "yes" : "no (sm < 89, E4KV_FORCE_SOFTWARE_E4M3, or no sm_89+ code)");

  const std::vector<Shape> shapes = {{"kv8_d128", 8, 128}, {"kv2_d256", 2, 256}};
  // E4M3: the automatic choice (hardware where usable), then the software encoder if that differs.
  std::vector<CacheWriteEncode> e4m3_encodes = {CacheWriteEncode::kAuto};
  if (hardware) e4m3_encodes.push_back(CacheWriteEncode::kSoftware);
  CacheWriteStatsBuffer stats_buffer;
  std::vector<Measurement> results;
  std::printf("%-10s %-5s %-6s %-6s %7s %10s %10s %9s %8s\n", "shape", "kv", "encode", "stats",
              "tokens", "time_us", "MB_moved", "TB/s", "vs_copy");
  for (const Shape& s : shapes) {
    if (std::string(s.name).find(shape_filter) == std::string::npos) continue;
    for (KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
      const std::string kv = dtype == KvCacheDtype::kF16 ? "fp16" : "e4m3";
      if (kv.find(kv_filter) == std::string::npos) continue;
      const std::vector<CacheWriteEncode> encodes =
          dtype == KvCacheDtype::kF16 ? std::vector<CacheWriteEncode>{CacheWriteEncode::kAuto}
                                      : e4m3_encodes;
      for (bool stats : {false, true}) {
        for (int64_t tokens : {1, 64, 4096, 65536}) {
          for (const CacheWriteEncode encode : encodes) {
            const Measurement m = run(s, tokens, dtype, encode, stats, stats_buffer);
            std::printf("%-10s %-5s %-6s %-6s %7lld %10.2f %10.2f %9.3f %7.1f%%\n", m.shape.c_str(),
                        m.kv.c_str(), m.encode.c_str(), m.stats ? "yes" : "no",
                        static_cast<long long>(m.tokens), m.ms * 1e3, m.bytes / 1e6, m.tbs,
                        100.0 * m.tbs / copy_tbs);
            results.push_back(m);
          }
        }
      }
    }
  }

  // E4M3, hardware against software encode (measured just above, one after the other).
  if (hardware) {
    std::printf("\nE4M3 encode, hardware vs software (vs_copy: of %.3f TB/s)\n", copy_tbs);
    std::printf("%-10s %-6s %7s | %9s %8s %8s | %9s %8s %8s | %8s\n", "shape", "stats", "tokens",
                "hw_us", "hw_TB/s", "hw_copy", "sw_us", "sw_TB/s", "sw_copy", "sw/hw");
    for (size_t i = 0; i + 1 < results.size(); ++i) {
      const Measurement& hw = results[i];
      const Measurement& sw = results[i + 1];
      if (hw.encode != "hw" || sw.encode != "sw") continue;
      std::printf("%-10s %-6s %7lld | %9.2f %8.3f %7.1f%% | %9.2f %8.3f %7.1f%% | %7.2fx\n",
                  hw.shape.c_str(), hw.stats ? "yes" : "no", static_cast<long long>(hw.tokens),
                  hw.ms * 1e3, hw.tbs, 100.0 * hw.tbs / copy_tbs, sw.ms * 1e3, sw.tbs,
                  100.0 * sw.tbs / copy_tbs, sw.ms / hw.ms);
    }
  }
  FILE* f = std::fopen(json_path, "w");
  if (f == nullptr) return 1;
  std::fprintf(f, "{\"copy_tbs\": %.4f, \"hardware_encode\": %s, \"results\": [\n", copy_tbs,
               hardware ? "true" : "false");
  for (size_t i = 0; i < results.size(); ++i) {
    const Measurement& m = results[i];
    std::fprintf(f,
                 "  {\"shape\": \"%s\", \"kv\": \"%s\", \"encode\": \"%s\", \"stats\": %s, "
                 "\"tokens\": %lld, \"ms\": %.5f, \"bytes\": %.0f, \"tbs\": %.4f, \"vs_copy\": "
                 "%.4f}%s\n",
                 m.shape.c_str(), m.kv.c_str(), m.encode.c_str(), m.stats ? "true" : "false",
                 static_cast<long long>(m.tokens), m.ms, m.bytes, m.tbs, m.tbs / copy_tbs,
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return 0;
}
