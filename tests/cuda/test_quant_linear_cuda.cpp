// The CUDA backend's linear over quantized weights (backend/cuda/quant_linear.cuh) against the CPU
// backend's (the oracle: every weight dequantized in fp32 by quant/dequantize.h, then sgemm), on
// the same random planes and the same FP16 x (widened for the CPU).
// Grid: AWQ W4 (zero points on and off, groups 32 and 128, several groups per row), NVFP4 (16-
// element groups, rows longer than one 1024-element chunk and not a multiple of it), FP8 with
// 128- and 32-column blocks whose last block is partial; the per-element fallback (in not a
// multiple of 32 or 16, W4 group 16); out not a multiple of the CTA's 8 or 16 rows; n = 1, 3,
// 16, 17, 64 rows, each on two CUDA backends: one that may allocate its dequantization scratch
// (from kQuantDequantMinRows rows the weight is dequantized to FP16 in 32 MB slices and multiplied
// by cuBLAS; a 4200 x 4096 weight takes two slices) and one that may not, which runs the quantized
// kernels at every n (n <= 16 the GEMV, in tiles of 1, 4 and 8 rows; n = 17 and 64 the
// tensor-core tiles where a 64-wide k-tile lies in one group: W4 and FP8 with group 128, every
// NVFP4 weight; the GEMV in 8-row tiles for groups 32); bias on and off; y FP16 and fp32
// (logits). Outputs are poisoned with NaN first.
// Also: the launch captured in a CUDA graph (no allocation, no host wait) replays bit for bit, and
// shapes the kernels cannot take are refused with the shape named (that part runs without a GPU).
//
// The bound, per element (row r, column o), with A = sum_k |w[o, k] x[r, k]| + |bias[o]| in
// double from the dequantized weights: both results are fp32 sums of the same exact products
// (the GPU multiplies codes by x exactly, on CUDA cores or tensor cores, and the group's scale
// once, the CPU rounds each dequantized weight once: no more than one extra rounding per term) in
// different orders, each within (K + 8) 2^-24 A of the exact sum (K = in terms, the bias add and
// the scale products; the tensor cores' K / 16 accumulation steps stay well inside it), so
//   fp32 y:  |gpu - cpu| <= 2 (K + 8) 2^-24 A
//   FP16 y:  |gpu - cpu| <= 2^-11 (|cpu| + b32) + b32 + 2^-25   (b32 the fp32 bound; the final
//            rounding to FP16 is half an ulp, 2^-25 at the subnormal end)
// A wrong code, group, scale or row costs about |w x| ~ A / K per term and far more in sum, which
// is above the bound for every K used here (K <= 4096: 2 (K + 8) 2^-24 <= 5e-4 of A). The
// dequantized path rounds each weight to FP16 once more (|w16 - w| <= 2^-11 |w|): its fp32 bound
// adds 2^-11 sum_k |w x|.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/quant_linear.cuh"
#include "backend/cuda/quant_w4_mma.cuh"
#include "core/half.h"
#include "cuda/quant_data.h"
#include "cuda/require_gpu.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

using test::HostQuantWeight;
using test::kF16HalfSpacing;
using test::kU16;
using test::kU32;

constexpr uint16_t kF16Nan = 0x7E00u;

struct LinearCase {
  WeightFormat format;
  int64_t out;
  int64_t in;
  int64_t group;
  bool zeros;
  uint64_t seed;
};

std::string describe(const LinearCase& c) {
  return cat(weight_format_name(c.format), " out ", c.out, " in ", c.in, " group ", c.group,
             c.zeros ? " zeros" : "");
}

class QuantLinearCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    E4KV_REQUIRE_GPU();
    Result<std::unique_ptr<Backend>> made = make_cuda_backend();
    ASSERT_TRUE(made.ok()) << made.message();
    gpu_ = std::move(*made);
    // A second backend whose workspaces may not grow: it never gets the dequantization scratch,
    // so every row count runs the quantized kernels (the GEMV, the tensor-core tiles).
    Result<std::unique_ptr<Backend>> kernels = make_cuda_backend();
    ASSERT_TRUE(kernels.ok()) << kernels.message();
    kernels_ = std::move(*kernels);
    kernels_->allow_workspace_growth(false);
    cpu_ = make_cpu_backend();
  }

  // y of the CPU backend (fp32) on the widened x and bias.
  std::vector<float> cpu_linear(const HostQuantWeight& w, const std::vector<uint16_t>& x,
                                const std::vector<uint16_t>* bias, int64_t n) {
    const std::vector<float> xf = test::widen(x);
    std::vector<float> bf;
    if (bias != nullptr) bf = test::widen(*bias);
    std::vector<float> y(size_t(n * w.out), NAN);
    const Status st = cpu_->linear(xf.data(), w.view(), bias != nullptr ? bf.data() : nullptr, n,
                                   y.data(), DType::kF32);
    EXPECT_TRUE(st.ok()) << st.message();
    return y;
  }

  // y of the CUDA backend, widened to fp32 when FP16.
  // How one path issues y = x w^T + bias on device pointers.
  using Issue = std::function<Status(const void* x, const void* bias, void* y)>;

  std::vector<float> gpu_linear(Backend& gpu, const test::BackendQuantWeight& w,
                                const std::vector<uint16_t>& x, const std::vector<uint16_t>* bias,
                                int64_t n, DType y_dtype) {
    return gpu_linear(gpu, w.view().out, x, bias, n, y_dtype,
                      [&](const void* d_x, const void* d_bias, void* d_y) {
                        return gpu.linear(d_x, w.view(), d_bias, n, d_y, y_dtype);
                      });
  }

  std::vector<float> gpu_linear(Backend& gpu, int64_t out, const std::vector<uint16_t>& x,
                                const std::vector<uint16_t>* bias, int64_t n, DType y_dtype,
                                const Issue& issue) {
    auto d_x = test::upload_bytes(gpu, x.data(), x.size() * 2);
    EXPECT_TRUE(d_x.ok()) << d_x.message();
    BackendBuffer d_bias;
    if (bias != nullptr) {
      auto b = test::upload_bytes(gpu, bias->data(), bias->size() * 2);
      EXPECT_TRUE(b.ok()) << b.message();
      d_bias = std::move(*b);
    }
    const size_t y_bytes = size_t(n * out) * (y_dtype == DType::kF32 ? 4 : 2);
    std::vector<uint8_t> poison(y_bytes);
    if (y_dtype == DType::kF32) {
      const std::vector<float> nan(size_t(n * out), NAN);
      std::memcpy(poison.data(), nan.data(), y_bytes);
    } else {
      const std::vector<uint16_t> nan(size_t(n * out), kF16Nan);
      std::memcpy(poison.data(), nan.data(), y_bytes);
    }
    auto d_y = test::upload_bytes(gpu, poison.data(), y_bytes);
    EXPECT_TRUE(d_y.ok()) << d_y.message();
    // The paths run on other streams (the second backend's, the legacy default stream of the
    // direct kernel calls): the device waits around the issue.
    gpu.synchronize();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Status st = issue(d_x->data(), bias != nullptr ? d_bias.data() : nullptr, d_y->data());
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> y(size_t(n * out));
    if (y_dtype == DType::kF32) {
      gpu.copy_to_host(y.data(), d_y->data(), y_bytes);
    } else {
      std::vector<uint16_t> h(size_t(n * out));
      gpu.copy_to_host(h.data(), d_y->data(), y_bytes);
      y = test::widen(h);
    }
    return y;
  }

  // One path of the GPU's: its name, how it issues, and whether it rounds every weight to FP16
  // first (the dequantize-and-cuBLAS path, the W4 mma kernel).
  struct Path {
    std::string name;
    Issue issue;
    bool fp16_weights;
  };

  // The paths run_case checks at n rows: both backends' linear (what the model runs), and for an
  // AWQ weight the two kernel families called directly, each W4 mma tile where it takes w.
  std::vector<Path> paths(const test::BackendQuantWeight& w, int64_t n, DType y_dtype,
                          bool every_tile) {
    const LinearView view = w.view();
    alignas(16) static const uint16_t probe[8] = {};
    const bool mma = cuda::w4_mma_supported(view, probe);
    const bool y_f32 = y_dtype == DType::kF32;
    std::vector<Path> out;
    for (Backend* gpu : {gpu_.get(), kernels_.get()}) {
      const bool dequantized =
          gpu == gpu_.get() && n >= cuda::kQuantDequantMinRows && !(mma && n < cuda::kW4MmaMaxRows);
      out.push_back({gpu == gpu_.get() ? "backend linear" : "backend linear, no scratch",
                     [gpu, view, n, y_dtype](const void* x, const void* bias, void* y) {
                       return gpu->linear(x, view, bias, n, y, y_dtype);
                     },
                     dequantized || mma});
    }
    if (view.format != WeightFormat::kW4) return out;
    out.push_back({"register kernels",
                   [view, n, y_f32](const void* x, const void* bias, void* y) {
                     return cuda::quant_linear(static_cast<const uint16_t*>(x), view,
                                               static_cast<const uint16_t*>(bias), n, y, y_f32,
                                               nullptr, cuda::QuantLinearPath::kRegisters);
                   },
                   false});
    if (!mma || !every_tile) return out;
    for (cuda::W4MmaTile tile :
         {cuda::W4MmaTile::kAuto, cuda::W4MmaTile::k8x16, cuda::W4MmaTile::k8x64,
          cuda::W4MmaTile::k16x32, cuda::W4MmaTile::k16x64, cuda::W4MmaTile::k32x64,
          cuda::W4MmaTile::k64x64}) {
      out.push_back({cat("W4 mma tile ", cuda::w4_mma_tile_name(tile)),
                     [view, n, y_f32, tile](const void* x, const void* bias, void* y) {
                       return cuda::quant_linear_w4_mma(static_cast<const uint16_t*>(x), view,
                                                        static_cast<const uint16_t*>(bias), n, y,
                                                        y_f32, nullptr, tile);
                     },
                     true});
    }
    return out;
  }

  void run_case(const LinearCase& c, std::initializer_list<int64_t> rows = {1, 3, 16, 17, 64},
                bool every_tile = false) {
    SCOPED_TRACE(describe(c));
    const HostQuantWeight w =
        test::random_quant_weight(c.format, c.out, c.in, c.group, c.zeros, c.seed);
    const std::vector<float> wf = test::dequantized(w);
    auto d_w = test::upload(*gpu_, w);
    ASSERT_TRUE(d_w.ok()) << d_w.message();
    const std::vector<uint16_t> bias = test::random_f16(c.seed + 1, size_t(c.out), -0.5f, 0.5f);
    for (int64_t n : rows) {
      const std::vector<uint16_t> x =
          test::random_f16(c.seed + 2 + uint64_t(n), size_t(n * c.in), -1.0f, 1.0f);
      const std::vector<float> xf = test::widen(x);
      // A[r, o] = sum_k |w x| (the bias is added per combination below); X[r] = sum_k |x|.
      std::vector<double> magnitude(size_t(n * c.out), 0.0);
      std::vector<double> x_sum(size_t(n), 0.0);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t k = 0; k < c.in; ++k) x_sum[size_t(r)] += std::fabs(xf[size_t(r * c.in + k)]);
        for (int64_t o = 0; o < c.out; ++o) {
          double a = 0.0;
          for (int64_t k = 0; k < c.in; ++k) {
            a += std::fabs(double(wf[size_t(o * c.in + k)]) * double(xf[size_t(r * c.in + k)]));
          }
          magnitude[size_t(r * c.out + o)] = a;
        }
      }
      for (int combo = 0; combo < 4; ++combo) {
        const bool with_bias = (combo & 1) != 0;
        const DType y_dtype = (combo & 2) != 0 ? DType::kF16 : DType::kF32;
        SCOPED_TRACE(cat("n ", n, with_bias ? " bias" : "", " y ", dtype_name(y_dtype)));
        const std::vector<float> ref = cpu_linear(w, x, with_bias ? &bias : nullptr, n);
        for (const Path& path : paths(*d_w, n, y_dtype, every_tile)) {
          // A path that rounds each weight to FP16 first (from kQuantDequantMinRows rows gpu_
          // dequantizes to FP16 and multiplies with cuBLAS; the W4 mma kernel decodes into FP16
          // fragments): |w16 - w| <= 2^-11 |w| + 2^-25 adds up to 2^-11 A + 2^-25 X.
          const bool dequantized = path.fp16_weights;
          SCOPED_TRACE(path.name);
          const std::vector<float> got =
              gpu_linear(*gpu_, c.out, x, with_bias ? &bias : nullptr, n, y_dtype, path.issue);
          int64_t n_bad = 0;
          for (int64_t r = 0; r < n; ++r) {
            for (int64_t o = 0; o < c.out; ++o) {
              const size_t i = size_t(r * c.out + o);
              const double a =
                  magnitude[i] + (with_bias ? std::fabs(double(f16_to_f32(bias[size_t(o)]))) : 0.0);
              const double b32 =
                  2.0 * double(c.in + 8) * kU32 * a +
                  (dequantized ? kU16 * magnitude[i] + kF16HalfSpacing * x_sum[size_t(r)] : 0.0);
              const double bound =
                  y_dtype == DType::kF32
                      ? b32
                      : kU16 * (std::fabs(double(ref[i])) + b32) + b32 + kF16HalfSpacing;
              const double err = std::fabs(double(got[i]) - double(ref[i]));
              if (!(err <= bound) && n_bad++ < 5) {
                ADD_FAILURE() << "y[" << r << ", " << o << "]: got " << got[i] << ", ref " << ref[i]
                              << ", bound " << bound;
              }
            }
          }
          EXPECT_EQ(n_bad, 0) << test::compare(got, ref, 0.0, 0.0).summary();
        }
      }
    }
  }

  std::unique_ptr<Backend> gpu_;
  std::unique_ptr<Backend> kernels_;
  std::unique_ptr<Backend> cpu_;
};

TEST_F(QuantLinearCuda, AwqW4) {
  run_case({WeightFormat::kW4, 96, 256, 32, true, 11});          // 8 groups per row
  run_case({WeightFormat::kW4, 83, 512, 128, false, 12});        // symmetric; out % 16 != 0
  run_case({WeightFormat::kW4, 40, 2048 + 128, 128, true, 13});  // 3 chunks, the last partial
  run_case({WeightFormat::kW4, 24, 4096, 128, true, 14});        // a Llama row length
  // 4200 rows of 4096: two slices of the backend's 32 MB dequantization scratch (4096 + 104).
  run_case({WeightFormat::kW4, 4200, 4096, 128, true, 15});
}

// The W4 mma kernel (quant_w4_mma.cuh) in each of its CTA tiles: groups 32, 64 and 128, zero
// points on and off, out not a multiple of 16 or 64, in of 3 and 17 chunks of 128 (a last block
// the 4-warp reduction split only partly fills), x rows that fill no tile, one tile, and several.
TEST_F(QuantLinearCuda, AwqW4MmaEveryTile) {
  const std::initializer_list<int64_t> rows = {1, 5, 8, 9, 24, 33, 64, 70};
  run_case({WeightFormat::kW4, 83, 384, 32, true, 61}, rows, true);
  run_case({WeightFormat::kW4, 64, 384, 64, false, 62}, rows, true);
  run_case({WeightFormat::kW4, 150, 2176, 128, true, 63}, rows, true);
  run_case({WeightFormat::kW4, 16, 2048, 32, true, 64}, {1, 130}, true);
}

TEST_F(QuantLinearCuda, Nvfp4) {
  run_case({WeightFormat::kNvfp4, 96, 256, 16, false, 21});
  run_case({WeightFormat::kNvfp4, 37, 1024 + 32, 16, false, 22});  // a 32-element last chunk
  run_case({WeightFormat::kNvfp4, 16, 4096, 16, false, 23});
}

TEST_F(QuantLinearCuda, Fp8Block) {
  run_case({WeightFormat::kFp8Block, 96, 320, 128, false, 31});  // blocks 128, 128, 64
  run_case({WeightFormat::kFp8Block, 45, 80, 32, false, 32});    // blocks 32, 32, 16
  run_case({WeightFormat::kFp8Block, 24, 4096, 128, false, 33});
}

// Shapes the 16-byte paths do not take run the per-element fallback.
TEST_F(QuantLinearCuda, PerElementFallback) {
  run_case({WeightFormat::kW4, 40, 48, 16, true, 41});      // group 16, in % 32 != 0
  run_case({WeightFormat::kNvfp4, 40, 16, 16, false, 42});  // in 16 (a small model's hidden)
  run_case({WeightFormat::kNvfp4, 19, 48, 16, false, 43});
  run_case({WeightFormat::kFp8Block, 21, 36, 32, false, 44});  // in % 16 != 0; block 32, 4
}

// One launch captured in a CUDA graph (global capture mode: an allocation or a host wait inside
// fails it) replays to the eager result, bit for bit, without allocating or waiting.
TEST_F(QuantLinearCuda, CapturedInAGraphReplaysTheEagerResult) {
  const WeightFormat formats[] = {WeightFormat::kW4, WeightFormat::kNvfp4, WeightFormat::kFp8Block};
  for (WeightFormat format : formats) {
    for (int64_t n : {int64_t(1), int64_t(17)}) {
      SCOPED_TRACE(cat(weight_format_name(format), " n ", n));
      const int64_t out = 72;
      const int64_t in = 512;
      const int64_t group = format == WeightFormat::kNvfp4 ? 16 : 128;
      const HostQuantWeight w = test::random_quant_weight(format, out, in, group, true, 51);
      auto d_w = test::upload(*gpu_, w);
      ASSERT_TRUE(d_w.ok()) << d_w.message();
      const std::vector<uint16_t> x = test::random_f16(52, size_t(n * in), -1.0f, 1.0f);
      const std::vector<uint16_t> bias = test::random_f16(53, size_t(out), -0.5f, 0.5f);
      auto d_x = test::upload_bytes(*gpu_, x.data(), x.size() * 2);
      auto d_bias = test::upload_bytes(*gpu_, bias.data(), bias.size() * 2);
      auto d_y = gpu_->allocate(size_t(n * out) * 2);
      ASSERT_TRUE(d_x.ok() && d_bias.ok() && d_y.ok());
      const auto issue = [&] {
        return gpu_->linear(d_x->data(), d_w->view(), d_bias->data(), n, d_y->data(), DType::kF16);
      };
      ASSERT_TRUE(issue().ok());
      std::vector<uint16_t> eager(size_t(n * out));
      gpu_->copy_to_host(eager.data(), d_y->data(), eager.size() * 2);

      const std::vector<uint16_t> nan(size_t(n * out), kF16Nan);
      gpu_->copy_from_host(d_y->data(), nan.data(), nan.size() * 2);
      gpu_->synchronize();
      const CudaBackendCounters before = cuda_backend_counters(*gpu_);
      auto graph = capture_cuda_graph(*gpu_, issue);
      ASSERT_TRUE(graph.ok()) << graph.message();
      const CudaBackendCounters after = cuda_backend_counters(*gpu_);
      EXPECT_EQ(after.allocations, before.allocations);
      EXPECT_EQ(after.host_waits, before.host_waits);
      ASSERT_TRUE((*graph)->replay().ok());
      std::vector<uint16_t> replayed(size_t(n * out));
      gpu_->copy_to_host(replayed.data(), d_y->data(), replayed.size() * 2);
      EXPECT_EQ(replayed, eager);
    }
  }
}

TEST(QuantLinearCudaShapes, RunsEveryQuantizedFormat) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  for (WeightFormat f :
       {WeightFormat::kDense, WeightFormat::kW4, WeightFormat::kNvfp4, WeightFormat::kFp8Block}) {
    EXPECT_TRUE((*gpu)->runs_weight_format(f)) << weight_format_name(f);
  }
}

// The host checks only (no launch): a shape the kernels cannot take is an error naming it.
TEST(QuantLinearCudaShapes, RefusesShapesItCannotRunNamingThem) {
  alignas(16) static const uint8_t planes[64] = {};
  static const float global[4] = {1, 1, 1, 1};
  LinearView w;
  w.format = WeightFormat::kW4;
  w.out = 4;
  w.in = 6;  // not a multiple of 4
  w.group = 2;
  w.data = planes;
  w.scales = planes;
  Status st = cuda::quant_linear(nullptr, w, nullptr, 1, nullptr, false, nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("awq-w4"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("in=6"), std::string::npos) << st.message();

  w.in = 96;
  w.group = 64;  // does not divide in
  st = cuda::quant_weight_supported(w, "test");
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("group=64"), std::string::npos) << st.message();

  w.format = WeightFormat::kNvfp4;
  w.group = 16;
  w.global = nullptr;
  st = cuda::quant_weight_supported(w, "test");
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("global"), std::string::npos) << st.message();
  w.global = global;
  EXPECT_TRUE(cuda::quant_weight_supported(w, "test").ok());

  // The 16-byte paths: in and group multiples of 32 (W4), group 16 (NVFP4), multiples of 16 (FP8).
  w.format = WeightFormat::kW4;
  w.in = 96;
  w.group = 32;
  EXPECT_TRUE(cuda::quant_weight_fast_path(w));
  w.group = 16;
  EXPECT_FALSE(cuda::quant_weight_fast_path(w));
  w.format = WeightFormat::kNvfp4;
  w.in = 48;
  EXPECT_FALSE(cuda::quant_weight_fast_path(w));
  w.format = WeightFormat::kFp8Block;
  w.in = 80;
  w.group = 32;
  EXPECT_TRUE(cuda::quant_weight_fast_path(w));
  w.in = 36;
  EXPECT_FALSE(cuda::quant_weight_fast_path(w));

  // A dense weight is cuBLAS's, never these kernels'.
  w.format = WeightFormat::kDense;
  EXPECT_FALSE(cuda::quant_linear(nullptr, w, nullptr, 1, nullptr, false, nullptr).ok());
}

}  // namespace
}  // namespace e4kv
