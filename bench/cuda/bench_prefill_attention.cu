// Prefill attention benchmark: e4kv paged prefill (tensor cores, causal) over FP16 and E4M3
// (software and native conversion) caches for whole prompts, against the measured tensor-core rate
// of cuBLAS FP16 GEMM (fp32 accumulate) in the same run. Prints a table and writes JSON (argv[1],
// default prefill_attention.json). FLOPs count the causal half: 2 * 2 * heads * d * n(n+1)/2.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/paged_decode_attention.cuh"
#include "backend/cuda/paged_prefill_attention.cuh"
#include "bench_data.cuh"
#include "bench_timing.cuh"

namespace {

using namespace e4kv;
using namespace e4kv::cuda;
using e4kv::bench::fill_cache_bytes;
using e4kv::bench::time_ms;
using e4kv::bench::upload;

struct Shape {
  const char* name;
  int batch;  // sequences, each a whole prompt of `len` tokens
  int n_heads;
  int n_kv_heads;
  int head_dim;
  int len;
};

double cublas_tflops() {
  const int n = 8192;
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 0;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&a, size_t(n) * n * 2));
  E4KV_CUDA_CHECK(cudaMalloc(&b, size_t(n) * n * 2));
  E4KV_CUDA_CHECK(cudaMalloc(&c, size_t(n) * n * 2));
  fill_cache_bytes(static_cast<uint8_t*>(a), size_t(n) * n * 2, 1u, false);
  fill_cache_bytes(static_cast<uint8_t*>(b), size_t(n) * n * 2, 2u, false);
  const float alpha = 1.0f, beta = 0.0f;
  const float ms = time_ms([&] {
    cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16F, n, b, CUDA_R_16F,
                 n, &beta, c, CUDA_R_16F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
  cublasDestroy(handle);
  for (void* p : {a, b, c}) E4KV_CUDA_CHECK(cudaFree(p));
  return 2.0 * n * double(n) * n / (ms * 1e-3) / 1e12;
}

struct Measurement {
  std::string shape;
  std::string kv;
  double ms;
  double tflops;
};

Measurement run(const Shape& s, KvCacheDtype dtype, bool native) {
  constexpr int kBlock = 64;
  const int64_t blocks_per_seq = (s.len + kBlock - 1) / kBlock;
  const int64_t n_blocks = blocks_per_seq * s.batch;
  const KvCacheGeometry geo{n_blocks, kBlock, s.n_kv_heads, s.head_dim, dtype};
  uint8_t* cache = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&cache, geo.total_bytes()));
  fill_cache_bytes(cache, geo.total_bytes(), 12345u, dtype == KvCacheDtype::kE4m3);

  std::mt19937 rng(7);
  std::vector<int32_t> table(n_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const int64_t n_rows = int64_t(s.batch) * s.len;
  std::vector<int32_t> row_seq(n_rows), row_pos(n_rows), seq_lens(s.batch, s.len);
  for (int64_t r = 0; r < n_rows; ++r)
    row_seq[r] = int32_t(r / s.len), row_pos[r] = int32_t(r % s.len);
  std::vector<RouteTile> tiles;
  for (int64_t r = 0; r < n_rows; r += 64) {
    tiles.push_back(RouteTile{r, std::min<int64_t>(64, n_rows - r), row_seq[r]});
  }
  const std::vector<PrefillAttentionItem> items =
      plan_prefill_items(tiles, s.n_heads / s.n_kv_heads);
  int32_t* d_table = upload(table);
  int32_t* d_row_seq = upload(row_seq);
  int32_t* d_row_pos = upload(row_pos);
  int32_t* d_seq_lens = upload(seq_lens);
  PrefillAttentionItem* d_items = upload(items);
  const size_t q_elems = size_t(n_rows) * s.n_heads * s.head_dim;
  uint16_t* d_q = nullptr;
  float* d_out = nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&d_q, q_elems * 2));
  E4KV_CUDA_CHECK(cudaMalloc(&d_out, q_elems * 4));
  fill_cache_bytes(reinterpret_cast<uint8_t*>(d_q), q_elems * 2, 99u, false);

  PagedAttentionParams p;
  p.cache = KvCacheView{cache, geo, 0.01f, 0.01f};
  p.block_table = BlockTableView{d_table, s.batch, blocks_per_seq};
  p.rows.n_rows = n_rows;
  p.rows.row_seq = d_row_seq;
  p.rows.row_pos = d_row_pos;
  p.rows.seq_lens = d_seq_lens;
  p.n_heads = s.n_heads;
  p.q = d_q;
  p.out = d_out;
  const float ms = time_ms([&] {
    const Status st = paged_prefill_attention(p, d_items, int64_t(items.size()), native, nullptr);
    if (!st.ok()) std::fprintf(stderr, "%s\n", st.message().c_str()), std::exit(1);
  });
  for (void* ptr : {(void*)cache, (void*)d_table, (void*)d_row_seq, (void*)d_row_pos,
                    (void*)d_seq_lens, (void*)d_items, (void*)d_q, (void*)d_out}) {
    E4KV_CUDA_CHECK(cudaFree(ptr));
  }
  const double flops =
      4.0 * s.batch * s.n_heads * double(s.head_dim) * (double(s.len) * (s.len + 1) / 2.0);
  const std::string kv = dtype == KvCacheDtype::kF16 ? "fp16"
                         : native                    ? "e4m3-native"
                                                     : "e4m3-soft";
  return Measurement{s.name, kv, ms, flops / (ms * 1e-3) / 1e12};
}

}  // namespace

// Usage: e4kv_bench_prefill_attention [OUT.json]
int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "prefill_attention.json";
  if (device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const bool native = decode_attention_native_e4m3_usable(0);
  const double gemm_tflops = cublas_tflops();
  std::printf("cuBLAS FP16 GEMM 8192^3 (fp32 accumulate): %.1f TFLOP/s\n", gemm_tflops);
  const std::vector<Shape> shapes = {
      {"b1_h32_kv8_d128_8k", 1, 32, 8, 128, 8192},
      {"b4_h32_kv8_d128_2k", 4, 32, 8, 128, 2048},
      {"b1_h16_kv2_d256_8k", 1, 16, 2, 256, 8192},
      {"b1_h32_kv32_d64_4k", 1, 32, 32, 64, 4096},
  };
  std::vector<Measurement> results;
  std::printf("%-22s %-12s %10s %9s %7s %9s\n", "shape", "kv", "time ms", "TFLOP/s", "% gemm",
              "vs fp16");
  for (const Shape& s : shapes) {
    double fp16_ms = 0;
    for (int v = 0; v < 3; ++v) {
      if (v == 2 && !native) continue;
      const Measurement m = run(s, v == 0 ? KvCacheDtype::kF16 : KvCacheDtype::kE4m3, v == 2);
      if (v == 0) fp16_ms = m.ms;
      std::printf("%-22s %-12s %10.3f %9.1f %6.1f%% %8.3fx\n", m.shape.c_str(), m.kv.c_str(), m.ms,
                  m.tflops, 100.0 * m.tflops / gemm_tflops, fp16_ms / m.ms);
      results.push_back(m);
    }
  }
  FILE* f = std::fopen(json_path, "w");
  if (f == nullptr) return 1;
  std::fprintf(f, "{\"gemm_tflops\": %.2f, \"results\": [", gemm_tflops);
  for (size_t i = 0; i < results.size(); ++i) {
    const Measurement& m = results[i];
    std::fprintf(f, "%s{\"shape\": \"%s\", \"kv\": \"%s\", \"ms\": %.5f, \"tflops\": %.2f}",
                 i ? ", " : "", m.shape.c_str(), m.kv.c_str(), m.ms, m.tflops);
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return 0;
}
