// The CUDA RMSNorm paths (a warp per short row, a CTA per row of at least kRmsNormBlockDim) and
// the fused residual add + RMSNorm (Backend::add_rms_norm) against the CPU backend's add and
// rms_norm on the same FP16 inputs. The CPU keeps the sum in fp32 where the GPU rounds it to FP16
// (the act dtype), so both the sum and the norm agree to FP16 rounding (relative L2 <= 2e-3; a
// wrong row, weight or reduction is of order 1).
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/model_ops.cuh"
#include "core/half.h"
#include "cuda/require_gpu.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

double rel_l2(const std::vector<float>& want, const std::vector<float>& got) {
  return test::compare(got, want, 0.0, 0.0).rel_l2;
}

// Values rounded to FP16, as floats (the CPU's inputs) and as bits (the GPU's).
struct HalfData {
  std::vector<float> f32;
  std::vector<uint16_t> f16;
};
HalfData random_half(size_t n, float mean, float scale, std::mt19937& rng) {
  std::normal_distribution<float> d(mean, scale);
  HalfData h;
  for (size_t i = 0; i < n; ++i) {
    h.f16.push_back(f32_to_f16(d(rng)));
    h.f32.push_back(f16_to_f32(h.f16.back()));
  }
  return h;
}

template <class T>
BackendBuffer upload(Backend& b, const std::vector<T>& host) {
  Result<BackendBuffer> buf = b.allocate(host.size() * sizeof(T));
  EXPECT_TRUE(buf.ok()) << buf.message();
  b.copy_from_host(buf->data(), host.data(), host.size() * sizeof(T));
  return std::move(buf).value();
}

std::vector<float> download_f16(Backend& b, const void* p, size_t n) {
  std::vector<uint16_t> raw(n);
  b.copy_to_host(raw.data(), p, n * 2);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(raw[i]);
  return out;
}

std::vector<float> download_f32(Backend& b, const void* p, size_t n) {
  std::vector<float> out(n);
  b.copy_to_host(out.data(), p, n * 4);
  return out;
}

TEST(NormOpsCuda, RmsNormAndAddRmsNormEqualTheCpu) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> made = make_cuda_backend();
  ASSERT_TRUE(made.ok()) << made.message();
  Backend& gpu = **made;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::mt19937 rng(5);
  const float eps = 1e-6f;
  for (const int64_t dim : {int64_t{128}, int64_t{1000}, cuda::kRmsNormBlockDim, int64_t{4096}}) {
    for (const int64_t rows : {1, 3, 17}) {
      for (const RmsNormForm form : {RmsNormForm::kWeight, RmsNormForm::kOnePlusWeight}) {
        SCOPED_TRACE(testing::Message() << dim << " x " << rows << ", one-plus "
                                        << (form == RmsNormForm::kOnePlusWeight));
        const size_t n = size_t(rows * dim);
        const HalfData x = random_half(n, 0.0f, 2.0f, rng);
        const HalfData y = random_half(n, 0.5f, 1.0f, rng);
        const HalfData w = random_half(size_t(dim), 1.0f, 0.2f, rng);
        // rms_norm alone, out of place and in place.
        BackendBuffer gx = upload(gpu, x.f16);
        BackendBuffer gw = upload(gpu, w.f16);
        BackendBuffer gout = upload(gpu, std::vector<uint16_t>(n));
        BackendBuffer cx = upload(*cpu, x.f32);
        BackendBuffer cw = upload(*cpu, w.f32);
        BackendBuffer cout = upload(*cpu, std::vector<float>(n));
        ASSERT_TRUE(gpu.rms_norm(gx.data(), gw.data(), rows, dim, eps, form, gout.data()).ok());
        ASSERT_TRUE(cpu->rms_norm(cx.data(), cw.data(), rows, dim, eps, form, cout.data()).ok());
        const std::vector<float> want_norm = download_f32(*cpu, cout.data(), n);
        EXPECT_LE(rel_l2(want_norm, download_f16(gpu, gout.data(), n)), 2e-3);
        ASSERT_TRUE(gpu.rms_norm(gx.data(), gw.data(), rows, dim, eps, form, gx.data()).ok());
        EXPECT_LE(rel_l2(want_norm, download_f16(gpu, gx.data(), n)), 2e-3);

        // add_rms_norm: x += y, out = norm(x).
        gx = upload(gpu, x.f16);
        cx = upload(*cpu, x.f32);
        BackendBuffer gy = upload(gpu, y.f16);
        BackendBuffer cy = upload(*cpu, y.f32);
        ASSERT_TRUE(
            gpu.add_rms_norm(gx.data(), gy.data(), gw.data(), rows, dim, eps, form, gout.data())
                .ok());
        ASSERT_TRUE(cpu->add(cx.data(), cy.data(), int64_t(n)).ok());
        ASSERT_TRUE(cpu->rms_norm(cx.data(), cw.data(), rows, dim, eps, form, cout.data()).ok());
        EXPECT_LE(rel_l2(download_f32(*cpu, cx.data(), n), download_f16(gpu, gx.data(), n)), 1e-3);
        EXPECT_LE(rel_l2(download_f32(*cpu, cout.data(), n), download_f16(gpu, gout.data(), n)),
                  2e-3);
      }
    }
  }
}

}  // namespace
}  // namespace e4kv
