// The fused hyper-connection mix (backend/cuda/hc_mix_fused.cuh) against the composition of the
// CUDA backend's own ops it replaces (rms_norm_grouped, linear, silu_scaled, linear, hc_mix, and
// linear for the injection logits) on the same FP16 inputs, at 1, 3 and 8 rows, with and without
// the injection, at a small shape and the benchmark model's (4 streams of 2048, rank 320). Both
// paths round every intermediate to FP16 at the same points; they differ by the order of their
// fp32 sums, so the outputs agree to a few FP16 ulps (relative L2 <= 2e-3, where a wrong stream,
// row or weight layout is of order 1). With a previous block's injection pending, the fused form
// against hc_inject followed by the composition, and x left as hc_inject leaves it, bit for bit.
// Both kernel pairs (cuda::HcMixKernels): the backend's and the load-first pair, called directly.
// Also: more rows than the fused form takes run the composition (hc_mix_fused returns false and
// writes nothing).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/hc_mix_fused.cuh"
#include "core/half.h"
#include "cuda/require_gpu.h"

namespace e4kv {
namespace {

struct Shape {
  int64_t streams, hidden, rank;
};

std::vector<uint16_t> random_f16(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> out(n);
  for (uint16_t& v : out) v = f32_to_f16(d(rng));
  return out;
}

BackendBuffer upload(Backend& b, const std::vector<uint16_t>& host) {
  Result<BackendBuffer> buf = b.allocate(host.size() * 2);
  EXPECT_TRUE(buf.ok()) << buf.message();
  b.copy_from_host(buf->data(), host.data(), host.size() * 2);
  return std::move(buf).value();
}

std::vector<float> download(Backend& b, const BackendBuffer& buf, size_t n) {
  std::vector<uint16_t> raw(n);
  b.copy_to_host(raw.data(), buf.data(), n * 2);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(raw[i]);
  return out;
}

const uint16_t* h(const BackendBuffer& buf) {
  return static_cast<const uint16_t*>(buf.data());
}

double rel_l2(const std::vector<float>& want, const std::vector<float>& got) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (double(want[i]) - got[i]) * (double(want[i]) - got[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

TEST(HcMixFusedCuda, EqualsTheComposedOps) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> made = make_cuda_backend();
  ASSERT_TRUE(made.ok()) << made.message();
  Backend& b = **made;
  std::mt19937 rng(11);
  for (const Shape shape :
       {Shape{4, 256, 64}, Shape{4, 2048, 320}, Shape{2, 512, 40}, Shape{1, 4096 + 64, 24}}) {
    const int64_t width = shape.streams * shape.hidden;
    const float eps = 1e-6f;
    const auto x_host = random_f16(size_t(8 * width), 1.0f, rng);
    const BackendBuffer x = upload(b, x_host);
    const BackendBuffer norm = upload(b, random_f16(size_t(width), 0.1f, rng));
    const BackendBuffer down =
        upload(b, random_f16(size_t(shape.rank * width), 1.0f / std::sqrt(float(width)), rng));
    const BackendBuffer up =
        upload(b, random_f16(size_t(width * shape.rank), 1.0f / std::sqrt(float(shape.rank)), rng));
    const BackendBuffer inject =
        upload(b, random_f16(size_t(shape.streams * width), 1.0f / std::sqrt(float(width)), rng));
    // A previous block's injection: its output rows and logits.
    const BackendBuffer pending_y = upload(b, random_f16(size_t(8 * shape.hidden), 1.0f, rng));
    const BackendBuffer pending_inj = upload(b, random_f16(size_t(8 * shape.streams), 2.0f, rng));
    for (const int64_t n : {1, 3, 8}) {
      for (const int variant : {0, 1, 2}) {
        const bool with_inject = variant != 1;
        const bool pending = variant == 2;
        SCOPED_TRACE(testing::Message()
                     << shape.streams << " x " << shape.hidden << ", rank " << shape.rank << ", "
                     << n << " rows, inject " << with_inject << ", pending " << pending);
        // The composition, as model/layers/hyper_connection.cpp runs it, on its own copy of x
        // (with a pending injection applied first by hc_inject).
        const BackendBuffer x_want = upload(b, x_host);
        if (pending) {
          ASSERT_TRUE(b.hc_inject(x_want.data(), pending_y.data(), pending_inj.data(), n,
                                  shape.streams, shape.hidden)
                          .ok());
        }
        const BackendBuffer& x_in = x_want;
        Result<BackendBuffer> xn = b.allocate(size_t(n * width) * 2);
        Result<BackendBuffer> a = b.allocate(size_t(n * shape.rank) * 2);
        Result<BackendBuffer> u = b.allocate(size_t(n * width) * 2);
        Result<BackendBuffer> mix_want = b.allocate(size_t(n * shape.hidden) * 2);
        Result<BackendBuffer> inj_want = b.allocate(size_t(n * shape.streams) * 2);
        ASSERT_TRUE(xn.ok() && a.ok() && u.ok() && mix_want.ok() && inj_want.ok());
        ASSERT_TRUE(b.rms_norm_grouped(x_in.data(), norm.data(), n, shape.streams, shape.hidden,
                                       eps, RmsNormForm::kOnePlusWeight, xn->data())
                        .ok());
        ASSERT_TRUE(
            b.linear(xn->data(), down.data(), nullptr, n, width, shape.rank, a->data(), DType::kF16)
                .ok());
        ASSERT_TRUE(
            b.silu_scaled(a->data(), n * shape.rank, 1.0f / float(shape.streams), a->data()).ok());
        ASSERT_TRUE(
            b.linear(a->data(), up.data(), nullptr, n, shape.rank, width, u->data(), DType::kF16)
                .ok());
        ASSERT_TRUE(
            b.hc_mix(u->data(), xn->data(), n, shape.streams, shape.hidden, mix_want->data()).ok());
        ASSERT_TRUE(b.linear(xn->data(), inject.data(), nullptr, n, width, shape.streams,
                             inj_want->data(), DType::kF16)
                        .ok());
        // The fused form.
        Result<BackendBuffer> mix_got = b.allocate(size_t(n * shape.hidden) * 2);
        Result<BackendBuffer> inj_got = b.allocate(size_t(n * shape.streams) * 2);
        const size_t scratch_bytes = cuda::hc_mix_fused_scratch_bytes(n, shape.streams, shape.rank);
        Result<BackendBuffer> scratch = b.allocate(scratch_bytes);
        ASSERT_TRUE(mix_got.ok() && inj_got.ok() && scratch.ok());
        for (const cuda::HcMixKernels kernels :
             {cuda::HcMixKernels::kWarpPerSlice, cuda::HcMixKernels::kLoadFirst}) {
          SCOPED_TRACE(kernels == cuda::HcMixKernels::kLoadFirst ? "load-first kernels"
                                                                 : "warp-per-slice kernels");
          const BackendBuffer x_got = upload(b, x_host);
          if (kernels == cuda::HcMixKernels::kLoadFirst) {  // the backend's choice
            Result<bool> fused = b.hc_mix_fused(
                x_got.data(), norm.data(), down.data(), up.data(),
                with_inject ? inject.data() : nullptr, n, shape.streams, shape.hidden, shape.rank,
                eps, mix_got->data(), with_inject ? inj_got->data() : nullptr, scratch->data(),
                scratch_bytes, pending ? pending_y.data() : nullptr,
                pending ? pending_inj.data() : nullptr);
            ASSERT_TRUE(fused.ok()) << fused.message();
            ASSERT_TRUE(*fused);
          } else {
            b.synchronize();
            cuda::hc_mix_fused_f16(static_cast<uint16_t*>(x_got.data()), h(norm), h(down), h(up),
                                   with_inject ? h(inject) : nullptr, n, shape.streams,
                                   shape.hidden, shape.rank, eps,
                                   static_cast<uint16_t*>(mix_got->data()),
                                   with_inject ? static_cast<uint16_t*>(inj_got->data()) : nullptr,
                                   scratch->data(), pending ? h(pending_y) : nullptr,
                                   pending ? h(pending_inj) : nullptr, nullptr, kernels);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          }
          // x after the call: hc_inject's result bit for bit (the same fp32 operations), or x
          // unchanged without a pending injection; rows past n untouched either way.
          {
            std::vector<uint16_t> got_x(x_host.size()), want_x(x_host.size());
            b.copy_to_host(got_x.data(), x_got.data(), got_x.size() * 2);
            b.copy_to_host(want_x.data(), x_want.data(), want_x.size() * 2);
            EXPECT_EQ(got_x, want_x);
          }
          const size_t mix_n = size_t(n * shape.hidden);
          const std::vector<float> want = download(b, *mix_want, mix_n);
          const std::vector<float> got = download(b, *mix_got, mix_n);
          EXPECT_LE(rel_l2(want, got), 2e-3);
          if (with_inject) {
            const size_t inj_n = size_t(n * shape.streams);
            EXPECT_LE(rel_l2(download(b, *inj_want, inj_n), download(b, *inj_got, inj_n)), 2e-3);
          }
        }
      }
    }
    // Beyond the fused form's rows: false, and the caller composes.
    Result<BackendBuffer> scratch = b.allocate(1 << 20);
    Result<BackendBuffer> mix = b.allocate(size_t(16 * shape.hidden) * 2);
    ASSERT_TRUE(scratch.ok() && mix.ok());
    Result<bool> too_many =
        b.hc_mix_fused(x.data(), norm.data(), down.data(), up.data(), nullptr,
                       cuda::kHcFusedMaxRows + 1, shape.streams, shape.hidden, shape.rank, eps,
                       mix->data(), nullptr, scratch->data(), 1 << 20, nullptr, nullptr);
    ASSERT_TRUE(too_many.ok());
    EXPECT_FALSE(*too_many);
  }
}

// A stream count that does not divide a CTA's 8 warps (launch 1 keeps every stream of an output in
// one CTA) is left to the composition, as are more rows than kHcFusedMaxRows.
TEST(HcMixFusedCuda, ShapesItTakes) {
  EXPECT_TRUE(cuda::hc_mix_fused_supported(1, 4, 2048, 320));
  EXPECT_TRUE(cuda::hc_mix_fused_supported(8, 8, 512, 64));
  EXPECT_FALSE(cuda::hc_mix_fused_supported(1, 3, 2048, 320));
  EXPECT_FALSE(cuda::hc_mix_fused_supported(cuda::kHcFusedMaxRows + 1, 4, 2048, 320));
  EXPECT_FALSE(cuda::hc_mix_fused_supported(1, 4, 2048, 1032));
}

}  // namespace
}  // namespace e4kv
