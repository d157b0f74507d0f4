// CUDA MoE (backend/cuda/moe.cuh) against the CPU reference (backend/cpu/moe.h) on fresh random
// FP16 data, the CPU given the same FP16 values widened to fp32.
// Router: n_experts {8, 64, 512} x top_k {1, 3, 10} x renormalisation off/on, rows with exact ties
// at the top and across the k-th place, rows whose other p underflow to 0 (a tie at 0), and NaN
// logits (only sanity: the selection is unspecified). Ids must match exactly, weights within the
// bound of fp32 softmax sums taken in different orders.
// Experts: hidden 64..2048 (also 520: k tails) x inter 32..512 (also 96, 200: column tails) x
// n_experts 4..512 x top_k 1..10, n_rows 1 (decode) to 300, uniform and uneven routing (empty
// experts, one expert with most or all pairs, two experts only), repeated ids in a row, ids out of
// range (they contribute nothing), both GEMM tile shapes, several passes over a small workspace;
// the end-to-end router + experts; the same calls captured in a CUDA graph (no host sync, no
// allocation), replayed bit for bit. Outputs are poisoned with NaN first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/moe.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/hybrid_ops.cuh"
#include "backend/cuda/moe.cuh"
#include "core/half.h"
#include "core/status.h"
#include "device_buffer.cuh"
#include "testing/compare.h"

namespace e4kv::cuda {
namespace {

constexpr uint16_t kF16Nan = 0x7E00u;
constexpr double kU16 = 1.0 / 2048.0;  // FP16 unit roundoff (2^-11)
constexpr double kU32 = 1.0 / 16777216.0;

std::vector<uint16_t> to_f16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_f16(v[i]);
  return out;
}

std::vector<float> widen(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f16_to_f32(v[i]);
  return out;
}

// Uniform FP16 values in [-scale, scale): a cheap generator, the weight tensors are large.
std::vector<uint16_t> random_f16(uint64_t seed, size_t n, float scale) {
  std::vector<uint16_t> out(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const float u = float(s >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[i] = f32_to_f16((2.0f * u - 1.0f) * scale);
  }
  return out;
}

// ---- router ------------------------------------------------------------------------------------

struct RouteCase {
  int64_t n_rows;
  int64_t n_experts;
  int64_t top_k;
  bool norm;
  uint32_t seed;
};

// Row kinds by r % 5: 0 distinct logits; 1 a tie of top_k + 2 experts at the top; 2 a tie of three
// at the k-th place; 3 one large logit, the rest so small that their p are exactly 0 (a tie at 0,
// taken in id order); 4 distinct logits. Distinct logits are spaced 8 / n_experts apart (after FP16
// rounding still >= 0.0117 apart), so their p differ by >= 1.2%, far beyond the ulps by which the
// GPU's softmax may differ: the selections must then agree exactly.
std::vector<uint16_t> route_logits(const RouteCase& c, std::mt19937& rng) {
  const int64_t n = c.n_experts;
  std::vector<float> logits(size_t(c.n_rows * n));
  std::vector<int> order(static_cast<size_t>(n));
  std::uniform_real_distribution<float> offset_dist(-3.0f, 3.0f);
  for (int64_t r = 0; r < c.n_rows; ++r) {
    float* row = logits.data() + r * n;
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const float offset = offset_dist(rng);
    const float step = 8.0f / float(n);
    for (int64_t e = 0; e < n; ++e)
      row[e] = offset + (float(order[size_t(e)]) - float(n / 2)) * step;
    // Experts by descending logit.
    std::vector<int> by_value(static_cast<size_t>(n));
    std::iota(by_value.begin(), by_value.end(), 0);
    std::sort(by_value.begin(), by_value.end(), [&](int a, int b) { return row[a] > row[b]; });
    const int kind = int(r % 5);
    if (kind == 1) {
      const int64_t tied = std::min(n, c.top_k + 2);
      std::vector<int> pick(order.begin(), order.begin() + tied);  // random experts
      const float top = f16_to_f32(f32_to_f16(row[by_value[0]] + 0.5f));
      for (int e : pick) row[e] = top;
    } else if (kind == 2 && c.top_k + 2 <= n) {
      // The next two experts (random ids) join the k-th: one of three tied takes the k-th place.
      const float kth = row[by_value[size_t(c.top_k - 1)]];
      row[by_value[size_t(c.top_k)]] = kth;
      row[by_value[size_t(c.top_k + 1)]] = kth;
    } else if (kind == 3) {
      for (int64_t e = 0; e < n; ++e) row[e] = -100.0f;
      row[order[0]] = 100.0f;
    }
  }
  return to_f16(logits);
}

void run_route_case(const RouteCase& c) {
  SCOPED_TRACE(
      cat("n_experts ", c.n_experts, " top_k ", c.top_k, " norm ", c.norm, " rows ", c.n_rows));
  std::mt19937 rng(c.seed);
  const std::vector<uint16_t> logits = route_logits(c, rng);
  const size_t n_out = size_t(c.n_rows * c.top_k);
  std::vector<int32_t> ref_ids(n_out);
  std::vector<float> ref_w(n_out);
  moe_route(widen(logits).data(), c.n_rows, c.n_experts, c.top_k, c.norm, ref_ids.data(),
            ref_w.data());

  DeviceBuffer<uint16_t> d_logits(logits);
  DeviceBuffer<int32_t> d_ids(std::vector<int32_t>(n_out, -7));
  DeviceBuffer<float> d_w(std::vector<float>(n_out, NAN));
  const Status st = moe_route_f16(d_logits.ptr, c.n_rows, c.n_experts, c.top_k, c.norm, d_ids.ptr,
                                  d_w.ptr, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<int32_t> ids = d_ids.to_host();
  const std::vector<float> w = d_w.to_host();
  for (size_t i = 0; i < n_out; ++i) {
    ASSERT_EQ(ids[i], ref_ids[i]) << "row " << i / size_t(c.top_k) << " slot "
                                  << i % size_t(c.top_k);
  }
  // p = e_i / s: the GPU sums s in a tree, the CPU in index order; each sum of n positive terms
  // errs by at most (n - 1) 2^-24 of itself, so the two differ by <= 2 (n - 1) 2^-24; expf and exp
  // add a few ulps, the division one; renormalising by the sum of k such p (same order on both)
  // doubles the relative error and adds k roundings.
  const double rtol = double(4 * c.n_experts + 4 * c.top_k + 32) * kU32;
  EXPECT_TRUE(test::all_close(w, ref_w, 1e-30, rtol));
}

TEST(MoeRouteCuda, MatchesCpuReference) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1;
  for (int64_t n_experts : {8, 64, 512}) {
    for (int64_t top_k : {1, 3, 10}) {
      if (top_k > n_experts) continue;
      for (bool norm : {false, true}) {
        run_route_case(RouteCase{37, n_experts, top_k, norm, seed++});
      }
    }
  }
  // The limits: 1024 experts, 32 chosen; one row; many rows.
  run_route_case(RouteCase{5, 1024, 32, true, seed++});
  run_route_case(RouteCase{1, 64, 8, true, seed++});
  run_route_case(RouteCase{1000, 128, 8, false, seed++});
  run_route_case(RouteCase{3, 4, 4, true, seed++});  // top_k = n_experts
}

TEST(MoeRouteCuda, NanLogitsGiveValidDistinctIds) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t n_experts = 40;
  const int64_t top_k = 6;
  std::vector<uint16_t> logits = random_f16(3, size_t(4 * n_experts), 2.0f);
  logits[5] = kF16Nan;                                                              // one NaN
  for (int64_t e = 0; e < n_experts; ++e) logits[size_t(n_experts + e)] = kF16Nan;  // all NaN
  for (int64_t e = 0; e < n_experts; e += 3) logits[size_t(2 * n_experts + e)] = kF16Nan;
  logits[size_t(3 * n_experts + 7)] = 0x7C00u;  // +inf: every p NaN
  DeviceBuffer<uint16_t> d_logits(logits);
  DeviceBuffer<int32_t> d_ids(size_t(4 * top_k));
  DeviceBuffer<float> d_w(size_t(4 * top_k));
  const Status st =
      moe_route_f16(d_logits.ptr, 4, n_experts, top_k, true, d_ids.ptr, d_w.ptr, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  const std::vector<int32_t> ids = d_ids.to_host();
  for (int64_t r = 0; r < 4; ++r) {
    std::vector<int32_t> row(ids.begin() + r * top_k, ids.begin() + (r + 1) * top_k);
    for (int32_t id : row) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, n_experts);
    }
    std::sort(row.begin(), row.end());
    EXPECT_EQ(std::unique(row.begin(), row.end()), row.end()) << "row " << r;
  }
}

TEST(MoeRouteCuda, RejectsUnsupportedShapes) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer<uint16_t> logits(size_t(2048));
  DeviceBuffer<int32_t> ids(size_t(64));
  DeviceBuffer<float> w(size_t(64));
  EXPECT_FALSE(moe_route_f16(logits.ptr, 1, 8, 9, false, ids.ptr, w.ptr, nullptr).ok());
  EXPECT_FALSE(moe_route_f16(logits.ptr, 1, 8, 0, false, ids.ptr, w.ptr, nullptr).ok());
  EXPECT_FALSE(moe_route_f16(logits.ptr, 1, 2048, 4, false, ids.ptr, w.ptr, nullptr).ok());
  EXPECT_FALSE(moe_route_f16(logits.ptr, 1, 64, 33, false, ids.ptr, w.ptr, nullptr).ok());
  EXPECT_TRUE(moe_route_f16(nullptr, 0, 8, 2, false, nullptr, nullptr, nullptr).ok());
}

// ---- experts -----------------------------------------------------------------------------------

enum class Routing {
  kUniform,     // top_k distinct experts per row, uniformly
  kSkewed,      // a hot expert in ~90% of the rows, the rest from the lower half: many empty
  kOneExpert,   // every pair on expert n_experts / 2 (top_k 1)
  kTwoExperts,  // experts 1 and n_experts - 1 only (top_k <= 2)
  kRepeated,    // ids drawn with replacement: repeats within a row
  kInvalid,     // like kUniform, ~15% of the ids -1 or n_experts (they contribute nothing)
};

struct ExpertsCase {
  int64_t n_rows;
  int64_t n_experts;
  int64_t hidden;
  int64_t inter;
  int64_t top_k;
  Routing routing;
  uint32_t seed;
  int64_t workspace_rows = 0;  // the workspace holds this many rows (0: n_rows)
};

std::string describe(const ExpertsCase& c) {
  return cat("rows ", c.n_rows, " experts ", c.n_experts, " hidden ", c.hidden, " inter ", c.inter,
             " top_k ", c.top_k, " routing ", int(c.routing), " workspace rows ", c.workspace_rows);
}

struct Routes {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routes make_routes(const ExpertsCase& c, std::mt19937& rng) {
  const int64_t n = c.n_experts;
  Routes out;
  out.ids.resize(size_t(c.n_rows * c.top_k));
  out.weights.resize(out.ids.size());
  std::uniform_real_distribution<float> weight_dist(0.05f, 1.0f);
  std::vector<int32_t> order(static_cast<size_t>(n));
  for (int64_t r = 0; r < c.n_rows; ++r) {
    int32_t* ids = out.ids.data() + r * c.top_k;
    std::iota(order.begin(), order.end(), 0);
    switch (c.routing) {
      case Routing::kUniform:
      case Routing::kInvalid:
        std::shuffle(order.begin(), order.end(), rng);
        std::copy_n(order.begin(), c.top_k, ids);
        if (c.routing == Routing::kInvalid) {
          for (int64_t j = 0; j < c.top_k; ++j) {
            if (rng() % 100 < 15) ids[j] = (rng() & 1) != 0 ? -1 : int32_t(n);
          }
        }
        break;
      case Routing::kSkewed: {
        const int32_t hot = int32_t(n / 2);  // in the upper half, which is otherwise empty
        std::vector<int32_t> pool(order.begin(), order.begin() + n / 2);
        std::shuffle(pool.begin(), pool.end(), rng);
        int64_t j = 0;
        if (rng() % 10 != 0) ids[j++] = hot;
        for (size_t i = 0; j < c.top_k; ++i) ids[j++] = pool[i];
        std::shuffle(ids, ids + c.top_k, rng);
        break;
      }
      case Routing::kOneExpert:
        for (int64_t j = 0; j < c.top_k; ++j) ids[j] = int32_t(n / 2);
        break;
      case Routing::kTwoExperts: {
        const bool swap = (rng() & 1) != 0;
        ids[0] = swap ? int32_t(n - 1) : 1;
        if (c.top_k > 1) ids[1] = swap ? 1 : int32_t(n - 1);
        break;
      }
      case Routing::kRepeated:
        for (int64_t j = 0; j < c.top_k; ++j) ids[j] = int32_t(rng() % uint32_t(n));
        break;
    }
    for (int64_t j = 0; j < c.top_k; ++j) out.weights[size_t(r * c.top_k + j)] = weight_dist(rng);
  }
  return out;
}

struct ExpertsData {
  std::vector<uint16_t> x;        // [n_rows, hidden]
  std::vector<uint16_t> gate_up;  // [n_experts, 2 inter, hidden]
  std::vector<uint16_t> down;     // [n_experts, hidden, inter]
};

ExpertsData make_experts_data(const ExpertsCase& c) {
  ExpertsData d;
  // Scales that keep the projections O(1): sums of hidden (inter) terms of size ~ 1/sqrt(.).
  d.x = random_f16(c.seed * 3 + 0, size_t(c.n_rows * c.hidden), 1.0f);
  d.gate_up = random_f16(c.seed * 3 + 1, size_t(c.n_experts * 2 * c.inter * c.hidden),
                         2.0f / std::sqrt(float(c.hidden)));
  d.down = random_f16(c.seed * 3 + 2, size_t(c.n_experts * c.hidden * c.inter),
                      2.0f / std::sqrt(float(c.inter)));
  return d;
}

// The CPU reference on the widened inputs; an id out of range becomes expert 0 with weight 0
// (the GPU skips it; 0 * term adds +-0).
std::vector<float> cpu_experts(const ExpertsCase& c, const ExpertsData& d, const Routes& routes) {
  std::vector<int32_t> ids = routes.ids;
  std::vector<float> weights = routes.weights;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= c.n_experts) {
      ids[i] = 0;
      weights[i] = 0.0f;
    }
  }
  const std::vector<float> x = widen(d.x);
  const std::vector<float> gate_up = widen(d.gate_up);
  const std::vector<float> down = widen(d.down);
  MoeExpertsView view;
  view.gate_up = gate_up.data();
  view.down = down.data();
  view.n_experts = c.n_experts;
  view.hidden = c.hidden;
  view.inter = c.inter;
  std::vector<float> out(size_t(c.n_rows * c.hidden));
  moe_experts(view, x.data(), c.n_rows, ids.data(), weights.data(), c.top_k, out.data());
  return out;
}

// The elementwise bound of out[r, c], in double from the same inputs. The GPU rounds
// act_i = silu(g_i) u_i to FP16 (error <= 2^-11 |act_i| + 2^-25, the FP16 subnormal half-spacing)
// and the output to FP16 (<= 2^-11 |out| + 2^-25); everything else is fp32 sums in another order,
// whose difference is bounded by about (hidden + inter) 2^-24 of the magnitudes (<= 2^-13 of them
// here), covered by the 1.25 factor. So
//   |gpu - cpu| <= 1.25 * 2^-11 * (|cpu| + M[r, c]) + 2^-24,
//   M[r, c] = sum_j |w_j| sum_i (|act_i| + 2^-14) |down_e[c, i]|.
std::vector<double> error_bound_row(const ExpertsCase& c, const ExpertsData& d,
                                    const Routes& routes, int64_t r) {
  std::vector<double> m(size_t(c.hidden), 0.0);
  std::vector<double> act(size_t(c.inter));
  const uint16_t* x = d.x.data() + r * c.hidden;
  for (int64_t j = 0; j < c.top_k; ++j) {
    const int32_t e = routes.ids[size_t(r * c.top_k + j)];
    if (e < 0 || e >= c.n_experts) continue;
    const double w = std::fabs(double(routes.weights[size_t(r * c.top_k + j)]));
    for (int64_t i = 0; i < c.inter; ++i) {
      const uint16_t* g_row = d.gate_up.data() + (e * 2 * c.inter + i) * c.hidden;
      const uint16_t* u_row = d.gate_up.data() + (e * 2 * c.inter + c.inter + i) * c.hidden;
      double g = 0.0;
      double u = 0.0;
      for (int64_t h = 0; h < c.hidden; ++h) {
        const double xv = f16_to_f32(x[h]);
        g += xv * f16_to_f32(g_row[h]);
        u += xv * f16_to_f32(u_row[h]);
      }
      act[size_t(i)] = std::fabs(g / (1.0 + std::exp(-g)) * u) + 1.0 / 16384.0;
    }
    for (int64_t h = 0; h < c.hidden; ++h) {
      const uint16_t* d_row = d.down.data() + (e * c.hidden + h) * c.inter;
      double s = 0.0;
      for (int64_t i = 0; i < c.inter; ++i) s += act[size_t(i)] * std::fabs(f16_to_f32(d_row[i]));
      m[size_t(h)] += w * s;
    }
  }
  return m;
}

// Runs moe_experts_f16 on the device copies; returns the widened output.
std::vector<float> gpu_experts(const ExpertsCase& c, const ExpertsData& d, const Routes& routes) {
  DeviceBuffer<uint16_t> x(d.x);
  DeviceBuffer<uint16_t> gate_up(d.gate_up);
  DeviceBuffer<uint16_t> down(d.down);
  DeviceBuffer<int32_t> ids(routes.ids);
  DeviceBuffer<float> weights(routes.weights);
  DeviceBuffer<uint16_t> out(std::vector<uint16_t>(size_t(c.n_rows * c.hidden), kF16Nan));
  const int64_t ws_rows = c.workspace_rows > 0 ? c.workspace_rows : c.n_rows;
  const size_t ws_bytes =
      moe_experts_workspace_bytes(ws_rows, c.top_k, c.n_experts, c.hidden, c.inter);
  DeviceBuffer<unsigned char> workspace(ws_bytes);
  E4KV_CUDA_CHECK(cudaMemset(workspace.ptr, 0xA5, ws_bytes));  // stale scratch must not matter
  const Status st =
      moe_experts_f16(x.ptr, gate_up.ptr, down.ptr, c.n_experts, c.hidden, c.inter, ids.ptr,
                      weights.ptr, c.n_rows, c.top_k, out.ptr, workspace.ptr, ws_bytes, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  return widen(out.to_host());
}

// Relative L2 bound over a whole output: each of the two FP16 roundings (act, out) has a relative
// RMS error of about 2^-10 / sqrt(12) / 1.5 ~ 2e-4 (errors uniform within half an ulp, values
// spread over a binade), and the act errors average out in the down projection the same way, so
// the measured values sit near 3e-4; 1e-3 leaves room while a wrong term (a weight, a row, an
// expert) costs far more.
constexpr double kMaxRelL2 = 1e-3;

void check_experts(const ExpertsCase& c, const ExpertsData& d, const Routes& routes,
                   const std::vector<float>& got, const std::vector<float>& ref) {
  const test::CompareReport report = test::compare(got, ref, 0.0, 0.0);
  EXPECT_EQ(report.n_nan, 0) << report.summary();
  EXPECT_LE(report.rel_l2, kMaxRelL2) << report.summary();
  // The elementwise bound on a sample of rows (the bound costs 3 hidden inter multiply-adds per
  // pair in double): every row for small cases, else evenly spread rows with the first and last.
  const double cost_per_row = double(c.top_k) * 3.0 * double(c.hidden) * double(c.inter);
  const int64_t n_sample = std::min(c.n_rows, std::max<int64_t>(int64_t(2e8 / cost_per_row), 2));
  int64_t n_bad = 0;
  for (int64_t s = 0; s < n_sample; ++s) {
    const int64_t r = n_sample == 1 ? 0 : s * (c.n_rows - 1) / (n_sample - 1);
    const std::vector<double> m = error_bound_row(c, d, routes, r);
    for (int64_t h = 0; h < c.hidden; ++h) {
      const size_t i = size_t(r * c.hidden + h);
      const double bound = 1.25 * kU16 * (std::fabs(double(ref[i])) + m[size_t(h)]) + kU32;
      const double err = std::fabs(double(got[i]) - double(ref[i]));
      if (!(err <= bound) && n_bad++ < 5) {
        ADD_FAILURE() << "row " << r << " col " << h << ": got " << got[i] << ", ref " << ref[i]
                      << ", bound " << bound;
      }
    }
  }
  EXPECT_EQ(n_bad, 0) << report.summary();
}

void run_experts_case(const ExpertsCase& c) {
  SCOPED_TRACE(describe(c));
  std::mt19937 rng(c.seed);
  const Routes routes = make_routes(c, rng);
  const ExpertsData d = make_experts_data(c);
  const std::vector<float> ref = cpu_experts(c, d, routes);
  const std::vector<float> got = gpu_experts(c, d, routes);
  check_experts(c, d, routes, got, ref);
}

// Up to 4 pairs per non-empty expert on average (n_pairs <= 4 * min(n_pairs, n_experts)) the
// projections are warp-per-weight-row kernels over 8-pair tiles ("vec"); else 16-pair MMA tiles
// when n_pairs < 32 * min(n_pairs, n_experts), else 64-pair tiles; the cases below cover all three
// (noted per case).
TEST(MoeExpertsCuda, DecodeRows) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  run_experts_case({1, 8, 2048, 512, 6, Routing::kUniform, 11});    // vec
  run_experts_case({1, 4, 64, 32, 1, Routing::kUniform, 12});       // vec; a single pair
  run_experts_case({1, 12, 2048, 512, 10, Routing::kUniform, 13});  // vec; top_k 10
  run_experts_case({4, 64, 256, 128, 8, Routing::kUniform, 14});    // vec; a decode batch
  run_experts_case({3, 16, 520, 200, 4, Routing::kUniform, 15});    // vec; k and column tails
  run_experts_case({1, 8, 4096 + 8, 8, 2, Routing::kUniform, 16});  // vec; two passes over k
  run_experts_case({12, 64, 128, 64, 8, Routing::kSkewed, 17});     // vec; a hot expert: 2 tiles
  run_experts_case({2, 8, 96, 48, 3, Routing::kRepeated, 18});      // vec; repeats within rows
  run_experts_case({4, 16, 64, 1032, 3, Routing::kInvalid, 19});    // vec; ids out of range
}

TEST(MoeExpertsCuda, PrefillRows) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  run_experts_case({300, 4, 64, 32, 1, Routing::kUniform, 21});      // large tiles
  run_experts_case({300, 8, 128, 96, 2, Routing::kSkewed, 22});      // large; column tails
  run_experts_case({37, 16, 520, 200, 4, Routing::kUniform, 23});    // small; k and column tails
  run_experts_case({300, 64, 512, 256, 8, Routing::kSkewed, 24});    // large; half the experts idle
  run_experts_case({64, 12, 2048, 512, 10, Routing::kUniform, 25});  // large; the widest shape
  run_experts_case({300, 64, 256, 64, 10, Routing::kUniform, 26});   // large
  run_experts_case({300, 512, 64, 32, 10, Routing::kUniform, 27});   // small; 512 experts
}

TEST(MoeExpertsCuda, UnevenRouting) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  run_experts_case({300, 32, 256, 128, 1, Routing::kOneExpert, 31});  // small; 19 tiles, 1 expert
  run_experts_case({300, 4, 192, 64, 2, Routing::kTwoExperts, 32});   // large; experts 0, 2 idle
  run_experts_case({1, 64, 128, 64, 1, Routing::kOneExpert, 33});     // decode, 63 idle
  run_experts_case({50, 4, 96, 48, 3, Routing::kRepeated, 34});       // repeats within rows
  run_experts_case({300, 8, 64, 64, 8, Routing::kRepeated, 35});      // large; repeats
  run_experts_case({20, 8, 64, 64, 3, Routing::kInvalid, 36});        // ids out of range
  run_experts_case({300, 16, 64, 32, 4, Routing::kInvalid, 37});      // large; ids out of range
}

TEST(MoeExpertsCuda, SeveralPassesOverASmallWorkspace) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  run_experts_case({50, 8, 128, 64, 3, Routing::kUniform, 41, /*workspace_rows=*/7});
  run_experts_case({300, 4, 64, 32, 2, Routing::kSkewed, 42, /*workspace_rows=*/128});
  run_experts_case({9, 64, 64, 32, 8, Routing::kUniform, 43, /*workspace_rows=*/1});
}

// Router then experts on the GPU against the same on the CPU, and the same two calls captured in
// a CUDA graph (global capture mode: a host synchronisation or an allocation inside would fail the
// capture) and replayed twice: the replays must equal the direct run bit for bit.
TEST(MoeExpertsCuda, RouterThenExpertsDirectAndInAGraph) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ExpertsCase c{6, 64, 256, 128, 8, Routing::kUniform, 51};
  const ExpertsData d = make_experts_data(c);
  std::vector<float> logits_f(size_t(c.n_rows * c.n_experts));
  std::mt19937 rng(c.seed);
  std::vector<int> order(static_cast<size_t>(c.n_experts));
  for (int64_t r = 0; r < c.n_rows; ++r) {  // distinct logits (see route_logits)
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t e = 0; e < c.n_experts; ++e) {
      logits_f[size_t(r * c.n_experts + e)] = float(order[size_t(e)] - 32) * 0.125f;
    }
  }
  const std::vector<uint16_t> logits = to_f16(logits_f);

  Routes ref_routes;
  ref_routes.ids.resize(size_t(c.n_rows * c.top_k));
  ref_routes.weights.resize(ref_routes.ids.size());
  moe_route(widen(logits).data(), c.n_rows, c.n_experts, c.top_k, true, ref_routes.ids.data(),
            ref_routes.weights.data());
  const std::vector<float> ref = cpu_experts(c, d, ref_routes);

  DeviceBuffer<uint16_t> d_logits(logits);
  DeviceBuffer<uint16_t> x(d.x);
  DeviceBuffer<uint16_t> gate_up(d.gate_up);
  DeviceBuffer<uint16_t> down(d.down);
  DeviceBuffer<int32_t> ids(size_t(c.n_rows * c.top_k));
  DeviceBuffer<float> weights(size_t(c.n_rows * c.top_k));
  DeviceBuffer<uint16_t> out(std::vector<uint16_t>(size_t(c.n_rows * c.hidden), kF16Nan));
  const size_t ws_bytes =
      moe_experts_workspace_bytes(c.n_rows, c.top_k, c.n_experts, c.hidden, c.inter);
  DeviceBuffer<unsigned char> workspace(ws_bytes);
  cudaStream_t stream = nullptr;
  E4KV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto step = [&]() {
    const Status routed = moe_route_f16(d_logits.ptr, c.n_rows, c.n_experts, c.top_k, true, ids.ptr,
                                        weights.ptr, stream);
    EXPECT_TRUE(routed.ok()) << routed.message();
    const Status st =
        moe_experts_f16(x.ptr, gate_up.ptr, down.ptr, c.n_experts, c.hidden, c.inter, ids.ptr,
                        weights.ptr, c.n_rows, c.top_k, out.ptr, workspace.ptr, ws_bytes, stream);
    EXPECT_TRUE(st.ok()) << st.message();
  };

  step();
  E4KV_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(ids.to_host(), ref_routes.ids);
  const std::vector<uint16_t> direct = out.to_host();
  check_experts(c, d, ref_routes, widen(direct), ref);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  E4KV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  step();
  E4KV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  E4KV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    E4KV_CUDA_CHECK(cudaMemsetAsync(out.ptr, 0xFF, out.n * sizeof(uint16_t), stream));
    E4KV_CUDA_CHECK(cudaMemsetAsync(ids.ptr, 0xFF, ids.n * sizeof(int32_t), stream));
    E4KV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    E4KV_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(out.to_host(), direct) << "replay " << replay;
  }
  E4KV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  E4KV_CUDA_CHECK(cudaGraphDestroy(graph));
  E4KV_CUDA_CHECK(cudaStreamDestroy(stream));
}

// moe_route_experts_f16 (the router inside the grouping launch for a decode step, its own launch
// otherwise; the shared expert's gated add inside the combine) gives moe_route_f32, then
// moe_experts_f16, then sigmoid_gated_add_f16's ids, weights and output bit for bit: 1, 3 and 8
// rows take the fused launch, 9 rows and a workspace of fewer rows than the step do not; with
// and without the shared expert.
TEST(MoeExpertsCuda, RouteInsideTheGroupingEqualsRouteThenExperts) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const ExpertsCase& c : {ExpertsCase{1, 512, 256, 128, 10, Routing::kUniform, 61},
                               ExpertsCase{3, 64, 256, 128, 8, Routing::kUniform, 62},
                               ExpertsCase{8, 512, 128, 64, 10, Routing::kUniform, 63},
                               ExpertsCase{9, 64, 128, 64, 4, Routing::kUniform, 64},
                               ExpertsCase{6, 64, 128, 64, 4, Routing::kUniform, 65, 2}}) {
    SCOPED_TRACE(describe(c));
    const ExpertsData d = make_experts_data(c);
    std::vector<float> logits(size_t(c.n_rows * c.n_experts));
    std::mt19937 rng(c.seed);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    for (float& v : logits) v = normal(rng);
    DeviceBuffer<float> d_logits(logits);
    DeviceBuffer<uint16_t> x(d.x);
    DeviceBuffer<uint16_t> gate_up(d.gate_up);
    DeviceBuffer<uint16_t> down(d.down);
    const int64_t ws_rows = c.workspace_rows > 0 ? c.workspace_rows : c.n_rows;
    const size_t ws_bytes =
        moe_experts_workspace_bytes(ws_rows, c.top_k, c.n_experts, c.hidden, c.inter);
    DeviceBuffer<unsigned char> workspace(ws_bytes);
    const size_t pairs = size_t(c.n_rows * c.top_k);
    DeviceBuffer<int32_t> ids_a(pairs), ids_b(pairs);
    DeviceBuffer<float> w_a(pairs), w_b(pairs);
    DeviceBuffer<uint16_t> out_a(std::vector<uint16_t>(size_t(c.n_rows * c.hidden), kF16Nan));
    DeviceBuffer<uint16_t> out_b(std::vector<uint16_t>(size_t(c.n_rows * c.hidden), kF16Nan));
    const bool shared = c.seed % 2 == 1;  // 61, 63, 65: with the shared expert
    std::vector<float> shared_f(size_t(c.n_rows * c.hidden)), gate_f(size_t(c.n_rows));
    for (float& v : shared_f) v = normal(rng) * 0.25f;
    for (float& v : gate_f) v = normal(rng);
    DeviceBuffer<uint16_t> shared_y(to_f16(shared_f));
    DeviceBuffer<float> shared_gate(gate_f);
    const Status routed = moe_route_f32(d_logits.ptr, c.n_rows, c.n_experts, c.top_k, true,
                                        ids_a.ptr, w_a.ptr, nullptr);
    ASSERT_TRUE(routed.ok()) << routed.message();
    const Status separate =
        moe_experts_f16(x.ptr, gate_up.ptr, down.ptr, c.n_experts, c.hidden, c.inter, ids_a.ptr,
                        w_a.ptr, c.n_rows, c.top_k, out_a.ptr, workspace.ptr, ws_bytes, nullptr);
    ASSERT_TRUE(separate.ok()) << separate.message();
    if (shared) {
      sigmoid_gated_add_f16(out_a.ptr, shared_y.ptr, shared_gate.ptr, c.n_rows, c.hidden, nullptr);
    }
    const Status fused = moe_route_experts_f16(
        d_logits.ptr, true, x.ptr, gate_up.ptr, down.ptr, c.n_experts, c.hidden, c.inter, ids_b.ptr,
        w_b.ptr, c.n_rows, c.top_k, out_b.ptr, shared ? shared_y.ptr : nullptr,
        shared ? shared_gate.ptr : nullptr, workspace.ptr, ws_bytes, nullptr);
    ASSERT_TRUE(fused.ok()) << fused.message();
    E4KV_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(ids_b.to_host(), ids_a.to_host());
    EXPECT_EQ(w_b.to_host(), w_a.to_host());
    const std::vector<uint16_t> got = out_b.to_host();
    EXPECT_EQ(got, out_a.to_host());
    if (!shared) {  // and the CPU reference on those routes (the separate path's own bounds)
      Routes routes;
      routes.ids = ids_a.to_host();
      routes.weights = w_a.to_host();
      check_experts(c, d, routes, widen(got), cpu_experts(c, d, routes));
    }
  }
}

// moe_route_experts_shared_f16 (the shared expert as expert n_experts of every row, in the routed
// experts' launches) against the separate path: the shared MLP on the host as the dense MLP
// rounds it (FP16 gate and up sums, FP16 act, FP16 output: the values cuBLAS, silu_mul_f16 and
// cuBLAS write, up to the order of their fp32 sums), then moe_route_f32, moe_experts_f16 and
// sigmoid_gated_add_f16. ids and weights: the routed top_k columns bit for bit, then expert
// n_experts with weight 1. Output: within 2^-8 of the reference's scale per element (an FP16
// rounding flip of gate, up or the shared output moves it by about 2^-11 relative; a wrong
// shared expert, gate or routing moves it by O(1)). Also replayed from a CUDA graph.
TEST(MoeExpertsCuda, SharedExpertAmongTheExpertsEqualsTheSeparateMlp) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const ExpertsCase& c : {ExpertsCase{1, 512, 256, 128, 10, Routing::kUniform, 71},
                               ExpertsCase{3, 64, 256, 128, 8, Routing::kUniform, 72},
                               ExpertsCase{8, 60, 128, 64, 4, Routing::kUniform, 73}}) {
    SCOPED_TRACE(describe(c));
    const ExpertsData d = make_experts_data(c);
    std::mt19937 rng(c.seed);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> logits(size_t(c.n_rows * c.n_experts));
    for (float& v : logits) v = normal(rng);
    std::vector<float> gate_f(size_t(c.n_rows));
    for (float& v : gate_f) v = normal(rng);
    const std::vector<uint16_t> s_gate_up = random_f16(
        c.seed * 7 + 1, size_t(2 * c.inter * c.hidden), 2.0f / std::sqrt(float(c.hidden)));
    const std::vector<uint16_t> s_down =
        random_f16(c.seed * 7 + 2, size_t(c.hidden * c.inter), 2.0f / std::sqrt(float(c.inter)));

    // The shared MLP as the dense one rounds it.
    const auto r16 = [](double v) { return f16_to_f32(f32_to_f16(float(v))); };
    std::vector<float> shared_y(size_t(c.n_rows * c.hidden));
    for (int64_t r = 0; r < c.n_rows; ++r) {
      std::vector<float> act(size_t(c.inter));
      for (int64_t i = 0; i < c.inter; ++i) {
        double g = 0.0;
        double u = 0.0;
        for (int64_t k = 0; k < c.hidden; ++k) {
          const double xv = f16_to_f32(d.x[size_t(r * c.hidden + k)]);
          g += xv * f16_to_f32(s_gate_up[size_t(i * c.hidden + k)]);
          u += xv * f16_to_f32(s_gate_up[size_t((c.inter + i) * c.hidden + k)]);
        }
        const float gf = r16(g);
        act[size_t(i)] = r16(double(gf / (1.0f + std::exp(-gf)) * r16(u)));
      }
      for (int64_t h = 0; h < c.hidden; ++h) {
        double y = 0.0;
        for (int64_t i = 0; i < c.inter; ++i) {
          y += double(act[size_t(i)]) * f16_to_f32(s_down[size_t(h * c.inter + i)]);
        }
        shared_y[size_t(r * c.hidden + h)] = r16(y);
      }
    }

    DeviceBuffer<float> d_logits(logits);
    DeviceBuffer<float> shared_gate(gate_f);
    DeviceBuffer<uint16_t> x(d.x), gate_up(d.gate_up), down(d.down);
    DeviceBuffer<uint16_t> d_s_gate_up(s_gate_up), d_s_down(s_down), d_shared_y(to_f16(shared_y));
    const size_t ws_bytes =
        moe_experts_workspace_bytes(c.n_rows, c.top_k + 1, c.n_experts + 1, c.hidden, c.inter);
    DeviceBuffer<unsigned char> workspace(ws_bytes);
    const size_t pairs = size_t(c.n_rows * c.top_k);
    const size_t pairs_b = size_t(c.n_rows * (c.top_k + 1));
    DeviceBuffer<int32_t> ids_a(pairs), ids_b(pairs_b);
    DeviceBuffer<float> w_a(pairs), w_b(pairs_b);
    DeviceBuffer<uint16_t> out_a(std::vector<uint16_t>(size_t(c.n_rows * c.hidden), kF16Nan));
    DeviceBuffer<uint16_t> out_b(std::vector<uint16_t>(size_t(c.n_rows * c.hidden), kF16Nan));
    ASSERT_TRUE(moe_route_f32(d_logits.ptr, c.n_rows, c.n_experts, c.top_k, true, ids_a.ptr,
                              w_a.ptr, nullptr)
                    .ok());
    ASSERT_TRUE(moe_experts_f16(x.ptr, gate_up.ptr, down.ptr, c.n_experts, c.hidden, c.inter,
                                ids_a.ptr, w_a.ptr, c.n_rows, c.top_k, out_a.ptr, workspace.ptr,
                                ws_bytes, nullptr)
                    .ok());
    sigmoid_gated_add_f16(out_a.ptr, d_shared_y.ptr, shared_gate.ptr, c.n_rows, c.hidden, nullptr);
    const auto fused = [&](cudaStream_t stream) {
      const Status st = moe_route_experts_shared_f16(
          d_logits.ptr, true, x.ptr, gate_up.ptr, down.ptr, c.n_experts, c.hidden, c.inter,
          ids_b.ptr, w_b.ptr, c.n_rows, c.top_k, out_b.ptr, d_s_gate_up.ptr, d_s_down.ptr,
          shared_gate.ptr, workspace.ptr, ws_bytes, stream);
      EXPECT_TRUE(st.ok()) << st.message();
    };
    fused(nullptr);
    E4KV_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<int32_t> ia = ids_a.to_host();
    const std::vector<int32_t> ib = ids_b.to_host();
    const std::vector<float> wa = w_a.to_host();
    const std::vector<float> wb = w_b.to_host();
    for (int64_t r = 0; r < c.n_rows; ++r) {
      for (int64_t j = 0; j <= c.top_k; ++j) {
        const size_t b = size_t(r * (c.top_k + 1) + j);
        if (j < c.top_k) {
          EXPECT_EQ(ib[b], ia[size_t(r * c.top_k + j)]) << "row " << r << " j " << j;
          EXPECT_EQ(wb[b], wa[size_t(r * c.top_k + j)]) << "row " << r << " j " << j;
        } else {
          EXPECT_EQ(ib[b], c.n_experts) << "row " << r;
          EXPECT_EQ(wb[b], 1.0f) << "row " << r;
        }
      }
    }
    const std::vector<float> ref = widen(out_a.to_host());
    const std::vector<uint16_t> direct = out_b.to_host();
    const std::vector<float> got = widen(direct);
    double scale = 0.0;
    for (float v : ref) scale = std::max(scale, double(std::fabs(v)));
    int64_t n_bad = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double err = std::fabs(double(got[i]) - double(ref[i]));
      if (!(err <= scale / 256.0) && n_bad++ < 5) {
        ADD_FAILURE() << "out[" << i << "]: got " << got[i] << ", ref " << ref[i] << ", scale "
                      << scale;
      }
    }
    EXPECT_EQ(n_bad, 0) << test::compare(got, ref, 0.0, 0.0).summary();
    EXPECT_LT(test::compare(got, ref, 0.0, 0.0).rel_l2, 2e-3);

    // Replayed from a graph: the same bits.
    cudaStream_t stream = nullptr;
    E4KV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    E4KV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    fused(stream);
    E4KV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    E4KV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    E4KV_CUDA_CHECK(cudaMemsetAsync(out_b.ptr, 0xFF, out_b.n * sizeof(uint16_t), stream));
    E4KV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    E4KV_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(out_b.to_host(), direct);
    E4KV_CUDA_CHECK(cudaGraphExecDestroy(exec));
    E4KV_CUDA_CHECK(cudaGraphDestroy(graph));
    E4KV_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

TEST(MoeExpertsCuda, RejectsUnsupportedInputs) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t hidden = 64;
  const int64_t inter = 32;
  const int64_t n_experts = 4;
  const int64_t top_k = 2;
  DeviceBuffer<uint16_t> x(size_t(4 * hidden));
  DeviceBuffer<uint16_t> gate_up(size_t(n_experts * 2 * inter * hidden));
  DeviceBuffer<uint16_t> down(size_t(n_experts * hidden * inter));
  DeviceBuffer<int32_t> ids(std::vector<int32_t>(size_t(4 * top_k), 0));
  DeviceBuffer<float> weights(std::vector<float>(size_t(4 * top_k), 1.0f));
  DeviceBuffer<uint16_t> out(size_t(4 * hidden));
  const size_t ws_bytes = moe_experts_workspace_bytes(4, top_k, n_experts, hidden, inter);
  DeviceBuffer<unsigned char> ws(ws_bytes);
  const auto call = [&](int64_t e, int64_t h, int64_t i, const uint16_t* xp, uint16_t* op,
                        size_t bytes) {
    return moe_experts_f16(xp, gate_up.ptr, down.ptr, e, h, i, ids.ptr, weights.ptr, 4, top_k, op,
                           ws.ptr, bytes, nullptr);
  };
  EXPECT_TRUE(call(n_experts, hidden, inter, x.ptr, out.ptr, ws_bytes).ok());
  EXPECT_FALSE(call(n_experts, 60, inter, x.ptr, out.ptr, ws_bytes).ok());   // hidden % 8
  EXPECT_FALSE(call(n_experts, hidden, 36, x.ptr, out.ptr, ws_bytes).ok());  // inter % 8
  EXPECT_FALSE(call(2048, hidden, inter, x.ptr, out.ptr, ws_bytes).ok());    // > 1024 experts
  EXPECT_FALSE(call(n_experts, hidden, inter, x.ptr + 4, out.ptr, ws_bytes).ok());  // misaligned
  EXPECT_FALSE(call(n_experts, hidden, inter, x.ptr, x.ptr, ws_bytes).ok());        // out == x
  const size_t one_row = moe_experts_workspace_bytes(1, top_k, n_experts, hidden, inter);
  EXPECT_FALSE(call(n_experts, hidden, inter, x.ptr, out.ptr, one_row - 1).ok());  // too small
  EXPECT_TRUE(call(n_experts, hidden, inter, x.ptr, out.ptr, one_row).ok());       // 4 passes
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace e4kv::cuda
