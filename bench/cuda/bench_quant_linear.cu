// Quantized linear benchmark: e4kv's W4A16 (AWQ, group 128, zero points) linear against cuBLAS
// FP16 (cublasGemmEx, fp32 accumulation, as the CUDA backend's dense linear) on the Llama-3-8B
// projection shapes (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336) at 1, 4,
// 16, 64 and 256 rows; NVFP4 and FP8-block (128x128 blocks) at 1 and 16 rows. Weights are
// replicated and rotated so that every launch reads them from HBM, not L2. Prints a table and
// writes JSON (argv[1], default quant_linear.json). Bytes = weight planes + x + y; times: see
// time_ms (bench_timing.cuh). The speedup column is cuBLAS FP16 time / quantized time at the same
// shape and rows (the decode target for 4-bit weights is about 4x at 1 row). From 4 rows also
// the CUDA backend's long-input path: the weight dequantized to FP16 in 32 MB slices of rows,
// each followed by a cuBLAS GEMM (cuda_backend.cu, kQuantDequantMinRows). AWQ W4 (groups 128 and
// 32) also runs quant_w4_mma.cuh's kernel in every CTA tile: the "ms" column is then the register
// kernels (QuantLinearPath::kRegisters), "mma" the tile quant_linear picks, "best tile" the
// fastest of them.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/quant_linear.cuh"
#include "backend/cuda/quant_w4_mma.cuh"
#include "bench_data.cuh"
#include "bench_timing.cuh"
#include "quant/linear_view.h"

namespace {

using e4kv::bench::copy_bandwidth_tbs;
using e4kv::bench::fill_cache_bytes;
using e4kv::bench::fill_f16;
using e4kv::bench::time_ms;

using namespace e4kv;

#define BENCH_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                           \
    const cublasStatus_t bench_status_ = (expr);                                                 \
    if (bench_status_ != CUBLAS_STATUS_SUCCESS) {                                                \
      std::fprintf(stderr, "%s:%d: cuBLAS status %d\n", __FILE__, __LINE__, int(bench_status_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

struct Shape {
  const char* name;
  int64_t out;
  int64_t in;
};

struct Measurement {
  std::string format;
  std::string shape;
  int64_t out;
  int64_t in;
  int64_t rows;
  double ms;
  double bytes;
  double tbs;
  double cublas_ms;
  double dequant_ms;  // dequantize to FP16 + cuBLAS, as the backend from kQuantDequantMinRows rows
  int group;
  double mma_ms;           // W4: the mma kernel, the tile kAuto picks (0: not run)
  std::string tile_times;  // W4: every tile's time, "8x16:0.0123,..."
  std::string best_tile;
  double best_tile_ms;
};

// Copies of a weight's planes, rotated per launch.
struct Planes {
  std::vector<void*> buffers;  // [copies * 4]: data, scales, zeros, global
  LinearView base;
  int copies = 1;
  LinearView view(int i) const {
    LinearView v = base;
    const int c = i % copies;
    v.data = buffers[size_t(4 * c)];
    v.scales = buffers[size_t(4 * c + 1)];
    v.zeros = buffers[size_t(4 * c + 2)];
    v.global = static_cast<const float*>(buffers[size_t(4 * c + 3)]);
    return v;
  }
  ~Planes() {
    for (void* b : buffers) cudaFree(b);
  }
};

void* alloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) return nullptr;
  E4KV_CUDA_CHECK(cudaMalloc(&p, bytes));
  E4KV_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

// Planes of `format` for [out, in] with plausible values (no NaN codes, zero points 8).
void make_planes(Planes& planes, WeightFormat format, int64_t out, int64_t in, int64_t group) {
  LinearView& v = planes.base;
  v.format = format;
  v.out = out;
  v.in = in;
  v.group = format == WeightFormat::kNvfp4 ? 16 : group;
  const size_t data_bytes = size_t(out * v.data_row_bytes());
  const size_t scale_bytes = size_t(out * v.scale_row_bytes());
  const size_t zero_bytes = format == WeightFormat::kW4 ? size_t(out * (in / v.group)) : 0;
  const size_t global_bytes = format == WeightFormat::kNvfp4 ? size_t(out) * 4 : 0;
  const size_t total = data_bytes + scale_bytes + zero_bytes + global_bytes;
  planes.copies = int(std::clamp<size_t>((size_t(512) << 20) / total, 1, 64));
  for (int c = 0; c < planes.copies; ++c) {
    void* data = alloc(data_bytes);
    fill_cache_bytes(data, data_bytes, 11u + unsigned(c), format == WeightFormat::kFp8Block);
    void* scales = alloc(scale_bytes);
    if (format == WeightFormat::kW4) {
      fill_f16(static_cast<uint16_t*>(scales), scale_bytes / 2, 5u, 5u, 3u);  // 2^-10 .. 2^-8
    } else if (format == WeightFormat::kNvfp4) {
      fill_cache_bytes(scales, scale_bytes, 7u, true);
    } else {
      E4KV_CUDA_CHECK(cudaMemset(scales, 0x3C, scale_bytes));  // 0.0115 as fp32
    }
    void* zeros = alloc(zero_bytes);
    if (zeros != nullptr) E4KV_CUDA_CHECK(cudaMemset(zeros, 8, zero_bytes));
    void* global = alloc(global_bytes);
    if (global != nullptr) E4KV_CUDA_CHECK(cudaMemset(global, 0x43, global_bytes));  // ~195
    planes.buffers.insert(planes.buffers.end(), {data, scales, zeros, global});
  }
  planes.base = planes.view(0);  // bytes() counts the planes present
}

}  // namespace

// Usage: e4kv_bench_quant_linear [OUT.json [FORMAT_FILTER]] (a substring of awq-w4, nvfp4,
// fp8-block).
int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "quant_linear.json";
  const std::string format_filter = argc > 2 ? argv[2] : "";
  const Shape shapes[] = {{"q/o_proj", 4096, 4096},
                          {"k/v_proj", 1024, 4096},
                          {"gate/up_proj", 14336, 4096},
                          {"down_proj", 4096, 14336}};
  struct Plan {
    WeightFormat format;
    int64_t group;
    std::vector<int64_t> rows;
  };
  const Plan plans[] = {{WeightFormat::kW4, 128, {1, 4, 8, 16, 32, 64, 128, 256}},
                        {WeightFormat::kW4, 32, {1, 4, 16, 64, 256}},
                        {WeightFormat::kNvfp4, 16, {1, 16, 256}},
                        {WeightFormat::kFp8Block, 128, {1, 16, 256}}};
  const cuda::W4MmaTile tiles[] = {cuda::W4MmaTile::k8x16,  cuda::W4MmaTile::k8x64,
                                   cuda::W4MmaTile::k16x32, cuda::W4MmaTile::k16x64,
                                   cuda::W4MmaTile::k32x64, cuda::W4MmaTile::k64x64};
  const double copy_tbs = copy_bandwidth_tbs();
  std::printf("device-to-device copy: %.2f TB/s\n", copy_tbs);

  cublasHandle_t cublas;
  BENCH_CUBLAS_CHECK(cublasCreate(&cublas));
  BENCH_CUBLAS_CHECK(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));
  constexpr int64_t kMaxRows = 256;
  constexpr int64_t kMaxDim = 14336;
  uint16_t* x = static_cast<uint16_t*>(alloc(size_t(kMaxRows * kMaxDim) * 2));
  uint16_t* y = static_cast<uint16_t*>(alloc(size_t(kMaxRows * kMaxDim) * 2));
  // The CUDA backend's dequantization scratch and slices (cuda_backend.cu: 32 MB).
  constexpr size_t kScratchBytes = size_t(32) << 20;
  uint16_t* scratch = static_cast<uint16_t*>(alloc(kScratchBytes));
  fill_f16(x, size_t(kMaxRows * kMaxDim), 3u, 13u, 3u);

  std::vector<Measurement> results;
  for (const Shape& s : shapes) {
    // cuBLAS FP16 weights, replicated like the quantized planes.
    const size_t dense_bytes = size_t(s.out * s.in) * 2;
    const int dense_copies = int(std::clamp<size_t>((size_t(512) << 20) / dense_bytes, 1, 64));
    std::vector<void*> dense(static_cast<size_t>(dense_copies));
    for (int c = 0; c < dense_copies; ++c) {
      dense[size_t(c)] = alloc(dense_bytes);
      fill_f16(static_cast<uint16_t*>(dense[size_t(c)]), dense_bytes / 2, 17u + unsigned(c), 8u,
               3u);
    }
    for (const Plan& plan : plans) {
      const std::string name(weight_format_name(plan.format));
      if (name.find(format_filter) == std::string::npos) continue;
      Planes planes;
      make_planes(planes, plan.format, s.out, s.in, plan.group);
      const bool w4 = plan.format == WeightFormat::kW4;
      for (int64_t rows : plan.rows) {
        int call = 0;
        const auto check = [](const Status& st) {
          if (!st.ok()) {
            std::fprintf(stderr, "%s\n", st.message().c_str());
            std::exit(1);
          }
        };
        const float ms = time_ms([&] {
          check(cuda::quant_linear(x, planes.view(call++), nullptr, rows, y, false, nullptr,
                                   cuda::QuantLinearPath::kRegisters));
        });
        float mma_ms = 0.0f;
        std::string tile_times;
        std::string best_tile;
        float best_tile_ms = 0.0f;
        if (w4 && cuda::w4_mma_supported(planes.base, x)) {
          mma_ms = time_ms([&] {
            check(cuda::quant_linear_w4_mma(x, planes.view(call++), nullptr, rows, y, false,
                                            nullptr));
          });
          for (cuda::W4MmaTile tile : tiles) {
            const float t_ms = time_ms([&] {
              check(cuda::quant_linear_w4_mma(x, planes.view(call++), nullptr, rows, y, false,
                                              nullptr, tile));
            });
            tile_times +=
                cat(tile_times.empty() ? "" : ",", cuda::w4_mma_tile_name(tile), ":", t_ms);
            if (best_tile.empty() || t_ms < best_tile_ms) {
              best_tile = cuda::w4_mma_tile_name(tile);
              best_tile_ms = t_ms;
            }
          }
        }
        int dense_call = 0;
        const float alpha = 1.0f;
        const float beta = 0.0f;
        const float cublas_ms = time_ms([&] {
          BENCH_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(s.out), int(rows),
                                          int(s.in), &alpha,
                                          dense[size_t(dense_call++ % dense_copies)], CUDA_R_16F,
                                          int(s.in), x, CUDA_R_16F, int(s.in), &beta, y, CUDA_R_16F,
                                          int(s.out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        });
        float dequant_ms = 0.0f;
        if (rows >= 4) {
          int dq_call = 0;
          const int64_t slice = std::max<int64_t>(1, int64_t(kScratchBytes) / (s.in * 2));
          dequant_ms = time_ms([&] {
            const LinearView view = planes.view(dq_call++);
            for (int64_t o0 = 0; o0 < s.out; o0 += slice) {
              const int64_t n_out = std::min(slice, s.out - o0);
              const Status st = cuda::quant_dequantize_rows(view, o0, n_out, scratch, nullptr);
              if (!st.ok()) {
                std::fprintf(stderr, "%s\n", st.message().c_str());
                std::exit(1);
              }
              BENCH_CUBLAS_CHECK(cublasGemmEx(
                  cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(n_out), int(rows), int(s.in), &alpha,
                  scratch, CUDA_R_16F, int(s.in), x, CUDA_R_16F, int(s.in), &beta, y + o0,
                  CUDA_R_16F, int(s.out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            }
          });
        }
        const double bytes =
            double(planes.base.bytes()) + double(rows) * double(s.in + s.out) * 2.0;
        results.push_back({name, s.name, s.out, s.in, rows, ms, bytes, bytes / (ms * 1e-3) / 1e12,
                           cublas_ms, dequant_ms, int(planes.base.group), mma_ms, tile_times,
                           best_tile, best_tile_ms});
        const Measurement& m = results.back();
        std::printf(
            "%-10s g%-3d %-13s %6lldx%-6lld rows %4lld  %8.4f ms  %6.3f TB/s  cuBLAS FP16 %8.4f ms"
            "  speedup %5.2fx  dequant+cuBLAS %8.4f ms (%5.2fx)",
            m.format.c_str(), m.group, m.shape.c_str(), (long long)m.out, (long long)m.in,
            (long long)m.rows, m.ms, m.tbs, m.cublas_ms, m.cublas_ms / m.ms, m.dequant_ms,
            m.dequant_ms > 0 ? m.cublas_ms / m.dequant_ms : 0.0);
        if (m.mma_ms > 0) {
          std::printf("  mma %8.4f ms (%5.2fx, %6.3f TB/s)  best tile %s %8.4f ms (%5.2fx)",
                      m.mma_ms, m.cublas_ms / m.mma_ms, m.bytes / (m.mma_ms * 1e-3) / 1e12,
                      m.best_tile.c_str(), m.best_tile_ms, m.cublas_ms / m.best_tile_ms);
        }
        std::printf("\n");
      }
    }
    for (void* d : dense) cudaFree(d);
  }
  cudaFree(x);
  cudaFree(y);
  cudaFree(scratch);
  cublasDestroy(cublas);

  FILE* f = std::fopen(json_path, "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", json_path);
    return 1;
  }
  std::fprintf(f, "{\n  \"copy_tbs\": %.4f,\n  \"results\": [\n", copy_tbs);
  for (size_t i = 0; i < results.size(); ++i) {
    const Measurement& m = results[i];
    std::fprintf(f,
                 "    {\"format\": \"%s\", \"shape\": \"%s\", \"out\": %lld, \"in\": %lld, "
                 "\"rows\": %lld, \"ms\": %.6f, \"bytes\": %.0f, \"tbs\": %.4f, "
                 "\"cublas_f16_ms\": %.6f, \"dequant_cublas_ms\": %.6f, \"group\": %d, "
                 "\"mma_ms\": %.6f, \"mma_tiles\": \"%s\", \"best_tile\": \"%s\", "
                 "\"best_tile_ms\": %.6f}%s\n",
                 m.format.c_str(), m.shape.c_str(), (long long)m.out, (long long)m.in,
                 (long long)m.rows, m.ms, m.bytes, m.tbs, m.cublas_ms, m.dequant_ms, m.group,
                 m.mma_ms, m.tile_times.c_str(), m.best_tile.c_str(), m.best_tile_ms,
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
  return 0;
}
