// The CPU Backend's ops against plain loops written here from the contracts in backend/backend.h,
// and its row-parallel attention against one call of the reference.
#include "backend/cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cpu/cache_write.h"
#include "core/half.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

std::vector<float> random_floats(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

// A backend buffer holding `values`.
BackendBuffer upload(Backend& b, const void* values, size_t bytes) {
  Result<BackendBuffer> buffer = b.allocate(bytes);
  E4KV_ASSERT(buffer.ok(), buffer.message());
  b.copy_from_host(buffer->data(), values, bytes);
  return std::move(buffer).value();
}

template <class T>
std::vector<T> download(Backend& b, const BackendBuffer& buffer, size_t n) {
  std::vector<T> out(n);
  b.copy_to_host(out.data(), buffer.data(), n * sizeof(T));
  return out;
}

TEST(CpuBackend, LinearWithBias) {
  auto b = make_cpu_backend({2});
  std::mt19937 rng(1);
  const int64_t n = 5, in = 37, out = 23;
  const auto x = random_floats(rng, size_t(n * in));
  const auto w = random_floats(rng, size_t(out * in));
  const auto bias = random_floats(rng, size_t(out));
  BackendBuffer xb = upload(*b, x.data(), x.size() * 4), wb = upload(*b, w.data(), w.size() * 4),
                bb = upload(*b, bias.data(), bias.size() * 4);
  BackendBuffer yb = std::move(b->allocate(size_t(n * out) * 4).value());
  ASSERT_TRUE(b->linear(xb.data(), wb.data(), bb.data(), n, in, out, yb.data(), DType::kF32).ok());
  std::vector<double> want(size_t(n * out));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double sum = bias[size_t(o)];
      for (int64_t j = 0; j < in; ++j) sum += double(x[size_t(r * in + j)]) * w[size_t(o * in + j)];
      want[size_t(r * out + o)] = sum;
    }
  }
  EXPECT_TRUE(test::all_close(download<float>(*b, yb, want.size()), want, 1e-5, 1e-5));
}

TEST(CpuBackend, RmsNormRopeSiluAddConvert) {
  auto b = make_cpu_backend({3});
  std::mt19937 rng(2);
  const int64_t rows = 7, heads = 3, dim = 16, rotary = 12, half = rotary / 2;
  const auto x = random_floats(rng, size_t(rows * heads * dim), 2.0f);
  const auto w = random_floats(rng, size_t(dim));
  BackendBuffer xb = upload(*b, x.data(), x.size() * 4);
  BackendBuffer wb = upload(*b, w.data(), w.size() * 4);

  // rms_norm over [rows * heads, dim], in place.
  ASSERT_TRUE(
      b->rms_norm(xb.data(), wb.data(), rows * heads, dim, 1e-6f, RmsNormForm::kWeight, xb.data())
          .ok());
  std::vector<double> normed(x.size());
  for (int64_t r = 0; r < rows * heads; ++r) {
    double ss = 0.0;
    for (int64_t j = 0; j < dim; ++j) ss += double(x[size_t(r * dim + j)]) * x[size_t(r * dim + j)];
    const double inv = 1.0 / std::sqrt(ss / double(dim) + 1e-6);
    for (int64_t j = 0; j < dim; ++j) {
      normed[size_t(r * dim + j)] = x[size_t(r * dim + j)] * inv * w[size_t(j)];
    }
  }
  EXPECT_TRUE(test::all_close(download<float>(*b, xb, x.size()), normed, 1e-5, 1e-5));

  // rope with arbitrary tables: pairs (i, i + rotary/2), dims past rotary_dim unchanged.
  const auto cos = random_floats(rng, size_t(rows * half));
  const auto sin = random_floats(rng, size_t(rows * half));
  BackendBuffer cb = upload(*b, cos.data(), cos.size() * 4);
  BackendBuffer sb = upload(*b, sin.data(), sin.size() * 4);
  ASSERT_TRUE(
      b->rope_neox(xb.data(), cb.as<float>(), sb.as<float>(), rows, heads, dim, rotary).ok());
  const std::vector<float> before = [&] {
    std::vector<float> v(normed.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(normed[i]);
    return v;
  }();
  std::vector<double> roped(normed.begin(), normed.end());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const size_t base = size_t((r * heads + h) * dim);
      for (int64_t i = 0; i < half; ++i) {
        const double a = before[base + size_t(i)], c = before[base + size_t(i + half)];
        const double co = cos[size_t(r * half + i)], si = sin[size_t(r * half + i)];
        roped[base + size_t(i)] = a * co - c * si;
        roped[base + size_t(i + half)] = c * co + a * si;
      }
    }
  }
  const std::vector<float> got_rope = download<float>(*b, xb, x.size());
  EXPECT_TRUE(test::all_close(got_rope, roped, 1e-4, 1e-4));

  // silu_mul, add, convert to FP16 bits.
  const auto g = random_floats(rng, 64, 4.0f), u = random_floats(rng, 64);
  BackendBuffer gb = upload(*b, g.data(), 256), ub = upload(*b, u.data(), 256);
  ASSERT_TRUE(b->silu_mul(gb.data(), ub.data(), gb.data(), 64).ok());
  ASSERT_TRUE(b->add(gb.data(), ub.data(), 64).ok());
  std::vector<double> want(64);
  for (size_t i = 0; i < 64; ++i) want[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i] + u[i];
  EXPECT_TRUE(test::all_close(download<float>(*b, gb, 64), want, 1e-6, 1e-5));
  BackendBuffer hb = std::move(b->allocate(128).value());
  ASSERT_TRUE(b->convert(gb.data(), DType::kF32, hb.data(), DType::kF16, 64).ok());
  const std::vector<float> f32 = download<float>(*b, gb, 64);
  const std::vector<uint16_t> f16 = download<uint16_t>(*b, hb, 64);
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(f16[i], f32_to_f16(f32[i])) << i;
}

TEST(CpuBackend, UploadWeightWidensF16AndBf16) {
  auto b = make_cpu_backend();
  const std::vector<float> values{0.5f, -1.25f, 3.0f, 1e-3f};
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<std::byte> bytes(values.size() * dtype_size(dtype));
    for (size_t i = 0; i < values.size(); ++i) {
      if (dtype == DType::kF32) {
        std::memcpy(bytes.data() + 4 * i, &values[i], 4);
      } else {
        const uint16_t h = dtype == DType::kF16 ? f32_to_f16(values[i]) : f32_to_bf16(values[i]);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    }
    SafetensorsTensor t;
    t.name = "w";
    t.dtype = dtype;
    t.shape = {int64_t(values.size())};
    t.bytes = bytes;
    Result<BackendBuffer> w = b->upload_weight(t);
    ASSERT_TRUE(w.ok()) << w.message();
    const std::vector<float> got = download<float>(*b, *w, values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      const float want = dtype == DType::kF32   ? values[i]
                         : dtype == DType::kF16 ? f16_to_f32(f32_to_f16(values[i]))
                                                : bf16_to_f32(f32_to_bf16(values[i]));
      EXPECT_EQ(got[i], want);
    }
  }
  SafetensorsTensor bad;
  bad.name = "model.layers.0.bad";
  bad.dtype = DType::kI32;
  bad.shape = {1};
  std::vector<std::byte> four(4);
  bad.bytes = four;
  Result<BackendBuffer> w = b->upload_weight(bad);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find("model.layers.0.bad has dtype I32"), std::string::npos);
}

TEST(CpuBackend, RowParallelAttentionEqualsOneReferenceCall) {
  std::mt19937 rng(3);
  KvCacheGeometry g;
  g.n_blocks = 6;
  g.block_size = 16;
  g.n_kv_heads = 2;
  g.head_dim = 32;
  std::vector<uint16_t> cache(g.total_bytes() / 2);
  for (auto& e : cache) e = f32_to_f16(std::uniform_real_distribution<float>(-1, 1)(rng));
  KvCacheView view{cache.data(), g, 1.0f, 1.0f};
  const std::vector<int32_t> blocks{3, 1, 5, 0, 2, 4};  // two sequences of 3 blocks
  const int64_t n_rows = 9, n_heads = 4;
  std::vector<int32_t> row_seq{0, 0, 0, 1, 1, 1, 1, 0, 1}, row_pos{5, 20, 40, 0, 1, 33, 47, 47, 2};
  std::vector<int32_t> seq_lens{48, 48};
  std::vector<uint16_t> q(size_t(n_rows * n_heads * g.head_dim));
  for (auto& e : q) e = f32_to_f16(std::uniform_real_distribution<float>(-1, 1)(rng));
  std::vector<float> want(q.size()), got(q.size());
  PagedAttentionParams params;
  params.cache = view;
  params.block_table = {blocks.data(), 2, 3};
  params.rows = {n_rows, row_seq.data(), row_pos.data(), seq_lens.data()};
  params.n_heads = n_heads;
  params.q = q.data();
  params.out = want.data();
  ASSERT_TRUE(paged_attention(params).ok());
  params.out = got.data();
  auto b = make_cpu_backend({4});
  ASSERT_TRUE(b->paged_attention(params).ok());
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace e4kv
