// The CUDA backend's MoE experts over quantized expert weights (backend/cuda/quant_moe.cuh)
// against the CPU backend's (backend/cpu/moe.h, each expert dequantized by quant/dequantize.h),
// on the same random planes, FP16 x (widened for the CPU) and routing.
// Cases: every format for both projections (W4 with and without zero points, NVFP4, FP8 with a
// partial last block), a quantized projection beside an FP16 one (both orders), the per-element
// fallback (NVFP4 hidden 16, as the small test models have), decode (one pair per expert:
// 1-pair tiles), 2- and 4-pair tiles, prefill rows with 8-pair tiles and several tiles per expert,
// repeated and out-of-range ids; several passes over a small workspace; the call captured in a
// CUDA graph after the workspace is reserved (growth off), replayed bit for bit.
//
// The bound, per output element (row r, hidden column c), first order, in double from the
// dequantized weights: for each pair j (expert e, weight w_j) and intermediate i, with
// g_i, u_i the exact gate and up sums, G_i = sum_h |x_h wg_ih|, U_i = sum_h |x_h wu_ih|,
// act_i = silu(g_i) u_i:
//   the GPU's FP16 act differs from the CPU's fp32 act by at most
//     e_i = 2^-11 |act_i| + 2^-25 + 2 (H + 8) 2^-24 (1.1 |u_i| G_i + |silu(g_i)| U_i)
//   (the FP16 rounding; both sides' fp32 gate and up sums in different orders, |silu'| <= 1.1);
//   the down sums add 2 (I + 8) 2^-24 sum_i |act_i d_ci|, the weighted sum over j (top_k + 1)
//   roundings of sum_j |w_j| sum_i |act_i d_ci| on each side; then the FP16 output rounding
//   2^-11 |out| + 2^-25. A factor 1.25 covers the second-order terms.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/quant_moe.cuh"
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

struct Projection {
  WeightFormat format;
  int64_t group;
  bool zeros;
};

enum class Routing { kDistinct, kRepeated, kInvalid };

struct MoeCase {
  Projection gate_up;
  Projection down;
  int64_t n_rows;
  int64_t n_experts;
  int64_t hidden;
  int64_t inter;
  int64_t top_k;
  Routing routing;
  uint64_t seed;
  int64_t workspace_rows = 0;  // > 0: call the kernels directly with a workspace of this many rows
};

std::string describe(const MoeCase& c) {
  return cat("gate_up ", weight_format_name(c.gate_up.format), " g", c.gate_up.group,
             c.gate_up.zeros ? "z" : "", " down ", weight_format_name(c.down.format), " g",
             c.down.group, c.down.zeros ? "z" : "", " rows ", c.n_rows, " experts ", c.n_experts,
             " hidden ", c.hidden, " inter ", c.inter, " top_k ", c.top_k, " routing ",
             int(c.routing), " workspace_rows ", c.workspace_rows);
}

struct MoeData {
  HostQuantWeight gate_up;
  HostQuantWeight down;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

MoeData make_data(const MoeCase& c) {
  MoeData d;
  d.gate_up = test::random_quant_weight(c.gate_up.format, c.n_experts * 2 * c.inter, c.hidden,
                                        c.gate_up.group, c.gate_up.zeros, c.seed);
  d.down = test::random_quant_weight(c.down.format, c.n_experts * c.hidden, c.inter, c.down.group,
                                     c.down.zeros, c.seed + 1);
  d.x = test::random_f16(c.seed + 2, size_t(c.n_rows * c.hidden), -1.0f, 1.0f);
  std::mt19937 rng(uint32_t(c.seed));
  std::uniform_real_distribution<float> weight_dist(0.05f, 1.0f);
  std::vector<int32_t> order(size_t(c.n_experts));
  for (int64_t r = 0; r < c.n_rows; ++r) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t j = 0; j < c.top_k; ++j) {
      int32_t id = order[size_t(j)];
      if (c.routing == Routing::kRepeated && j > 0 && r % 2 == 0) id = order[0];
      if (c.routing == Routing::kInvalid && (r + j) % 5 == 0) {
        id = (r % 2 == 0) ? -1 : int32_t(c.n_experts);
      }
      d.ids.push_back(id);
      d.weights.push_back(weight_dist(rng));
    }
  }
  return d;
}

// The CPU backend on the widened x; an id out of range becomes expert 0 with weight 0 (the GPU
// skips it; the CPU reference asserts).
std::vector<float> cpu_experts(const MoeCase& c, const MoeData& d) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::vector<int32_t> ids = d.ids;
  std::vector<float> weights = d.weights;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= c.n_experts) {
      ids[i] = 0;
      weights[i] = 0.0f;
    }
  }
  const std::vector<float> x = test::widen(d.x);
  // The CPU backend's dense weights are fp32 (its activation dtype): widen an FP16 projection.
  std::vector<float> gate_up_f32;
  std::vector<float> down_f32;
  const auto cpu_view = [](const HostQuantWeight& w, std::vector<float>& widened) {
    LinearView v = w.view();
    if (w.format == WeightFormat::kDense) {
      widened = test::dequantized(w);
      v.data = widened.data();
      v.act_size = 4;
    }
    return v;
  };
  const LinearView gate_up = cpu_view(d.gate_up, gate_up_f32);
  const LinearView down = cpu_view(d.down, down_f32);
  std::vector<float> out(size_t(c.n_rows * c.hidden), NAN);
  const Status st = cpu->moe_experts(x.data(), gate_up, down, c.n_experts, c.hidden, c.inter,
                                     ids.data(), weights.data(), c.n_rows, c.top_k, out.data());
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

// The bound of the header, for every element of row r.
std::vector<double> error_bound_row(const MoeCase& c, const MoeData& d,
                                    const std::vector<float>& gate_up,
                                    const std::vector<float>& down, int64_t r) {
  const int64_t hidden = c.hidden;
  const int64_t inter = c.inter;
  std::vector<double> bound(size_t(hidden), 0.0);
  std::vector<double> act(static_cast<size_t>(inter));
  std::vector<double> act_err(static_cast<size_t>(inter));
  const std::vector<float> x =
      test::widen(std::vector<uint16_t>(d.x.begin() + r * hidden, d.x.begin() + (r + 1) * hidden));
  for (int64_t j = 0; j < c.top_k; ++j) {
    const int32_t e = d.ids[size_t(r * c.top_k + j)];
    if (e < 0 || e >= c.n_experts) continue;
    const double w = std::fabs(double(d.weights[size_t(r * c.top_k + j)]));
    for (int64_t i = 0; i < inter; ++i) {
      const float* wg = gate_up.data() + (e * 2 * inter + i) * hidden;
      const float* wu = gate_up.data() + (e * 2 * inter + inter + i) * hidden;
      double g = 0.0, u = 0.0, gm = 0.0, um = 0.0;
      for (int64_t h = 0; h < hidden; ++h) {
        g += double(x[size_t(h)]) * wg[h];
        u += double(x[size_t(h)]) * wu[h];
        gm += std::fabs(double(x[size_t(h)]) * wg[h]);
        um += std::fabs(double(x[size_t(h)]) * wu[h]);
      }
      const double silu = g / (1.0 + std::exp(-g));
      act[size_t(i)] = std::fabs(silu * u);
      act_err[size_t(i)] =
          kU16 * act[size_t(i)] + kF16HalfSpacing +
          2.0 * double(hidden + 8) * kU32 * (1.1 * std::fabs(u) * gm + std::fabs(silu) * um);
    }
    for (int64_t h = 0; h < hidden; ++h) {
      const float* dr = down.data() + (e * hidden + h) * inter;
      double from_act = 0.0, magnitude = 0.0;
      for (int64_t i = 0; i < inter; ++i) {
        from_act += act_err[size_t(i)] * std::fabs(double(dr[i]));
        magnitude += act[size_t(i)] * std::fabs(double(dr[i]));
      }
      bound[size_t(h)] +=
          w * (from_act + (2.0 * double(inter + 8) + 2.0 * double(c.top_k + 1)) * kU32 * magnitude);
    }
  }
  return bound;
}

class QuantMoeCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    E4KV_REQUIRE_GPU();
    Result<std::unique_ptr<Backend>> made = make_cuda_backend();
    ASSERT_TRUE(made.ok()) << made.message();
    gpu_ = std::move(*made);
  }

  struct DeviceInputs {
    test::BackendQuantWeight gate_up;
    test::BackendQuantWeight down;
    BackendBuffer x, ids, weights, out;
  };

  DeviceInputs upload(const MoeCase& c, const MoeData& d) {
    DeviceInputs in;
    auto gate_up = test::upload(*gpu_, d.gate_up);
    auto down = test::upload(*gpu_, d.down);
    auto x = test::upload_bytes(*gpu_, d.x.data(), d.x.size() * 2);
    auto ids = test::upload_bytes(*gpu_, d.ids.data(), d.ids.size() * 4);
    auto weights = test::upload_bytes(*gpu_, d.weights.data(), d.weights.size() * 4);
    const std::vector<uint16_t> nan(size_t(c.n_rows * c.hidden), kF16Nan);
    auto out = test::upload_bytes(*gpu_, nan.data(), nan.size() * 2);
    EXPECT_TRUE(gate_up.ok() && down.ok() && x.ok() && ids.ok() && weights.ok() && out.ok());
    in.gate_up = std::move(*gate_up);
    in.down = std::move(*down);
    in.x = std::move(*x);
    in.ids = std::move(*ids);
    in.weights = std::move(*weights);
    in.out = std::move(*out);
    return in;
  }

  Status issue(const MoeCase& c, const DeviceInputs& in) {
    return gpu_->moe_experts(in.x.data(), in.gate_up.view(), in.down.view(), c.n_experts, c.hidden,
                             c.inter, in.ids.as<int32_t>(), in.weights.as<float>(), c.n_rows,
                             c.top_k, in.out.data());
  }

  std::vector<float> gpu_experts(const MoeCase& c, const MoeData& d) {
    DeviceInputs in = upload(c, d);
    if (c.workspace_rows > 0) {
      // The kernels directly, in passes over a workspace of workspace_rows rows (stale bytes).
      const size_t bytes = cuda::quant_moe_workspace_bytes(c.workspace_rows, c.top_k, c.n_experts,
                                                           c.hidden, c.inter);
      auto workspace = gpu_->allocate(bytes);
      EXPECT_TRUE(workspace.ok());
      const std::vector<uint8_t> stale(bytes, 0xA5);
      gpu_->copy_from_host(workspace->data(), stale.data(), bytes);
      gpu_->synchronize();  // the default stream below does not wait for the backend's
      const Status st = cuda::quant_moe_experts(
          static_cast<const uint16_t*>(in.x.data()), in.gate_up.view(), in.down.view(), c.n_experts,
          c.hidden, c.inter, in.ids.as<int32_t>(), in.weights.as<float>(), c.n_rows, c.top_k,
          in.out.as<uint16_t>(), workspace->data(), bytes, nullptr);
      EXPECT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    } else {
      const Status st = issue(c, in);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    std::vector<uint16_t> out(size_t(c.n_rows * c.hidden));
    gpu_->copy_to_host(out.data(), in.out.data(), out.size() * 2);
    return test::widen(out);
  }

  void run_case(const MoeCase& c) {
    SCOPED_TRACE(describe(c));
    const MoeData d = make_data(c);
    const std::vector<float> ref = cpu_experts(c, d);
    const std::vector<float> got = gpu_experts(c, d);
    const std::vector<float> gate_up = test::dequantized(d.gate_up);
    const std::vector<float> down = test::dequantized(d.down);
    const test::CompareReport report = test::compare(got, ref, 0.0, 0.0);
    EXPECT_EQ(report.n_nan, 0) << report.summary();
    int64_t n_bad = 0;
    for (int64_t r = 0; r < c.n_rows; ++r) {
      const std::vector<double> m = error_bound_row(c, d, gate_up, down, r);
      for (int64_t h = 0; h < c.hidden; ++h) {
        const size_t i = size_t(r * c.hidden + h);
        const double inner = 1.25 * m[size_t(h)];
        const double bound = inner + kU16 * (std::fabs(double(ref[i])) + inner) + kF16HalfSpacing;
        const double err = std::fabs(double(got[i]) - double(ref[i]));
        if (!(err <= bound) && n_bad++ < 5) {
          ADD_FAILURE() << "out[" << r << ", " << h << "]: got " << got[i] << ", ref " << ref[i]
                        << ", bound " << bound;
        }
      }
    }
    EXPECT_EQ(n_bad, 0) << report.summary();
  }

  std::unique_ptr<Backend> gpu_;
};

constexpr Projection kW4G32{WeightFormat::kW4, 32, true};
constexpr Projection kW4G64Sym{WeightFormat::kW4, 64, false};
constexpr Projection kNvfp4{WeightFormat::kNvfp4, 16, false};
constexpr Projection kFp8B128{WeightFormat::kFp8Block, 128, false};
constexpr Projection kFp8B32{WeightFormat::kFp8Block, 32, false};
constexpr Projection kDense{WeightFormat::kDense, 0, false};

TEST_F(QuantMoeCuda, DecodeRows) {
  run_case({kW4G32, kW4G32, 1, 8, 256, 128, 4, Routing::kDistinct, 11});  // 1-pair tiles
  run_case({kNvfp4, kNvfp4, 1, 8, 256, 128, 8, Routing::kDistinct, 12});
  run_case({kFp8B128, kFp8B128, 1, 16, 256, 192, 4, Routing::kDistinct, 13});  // partial block
  run_case({kW4G64Sym, kFp8B32, 4, 16, 128, 64, 4, Routing::kDistinct, 14});   // a decode batch
}

TEST_F(QuantMoeCuda, PrefillRows) {
  run_case({kW4G32, kW4G64Sym, 37, 8, 256, 128, 2, Routing::kDistinct, 21});  // 8-pair tiles
  run_case({kNvfp4, kFp8B128, 64, 4, 128, 160, 2, Routing::kDistinct, 22});   // partial block
  run_case({kFp8B32, kNvfp4, 9, 8, 64, 96, 3, Routing::kDistinct, 23});       // 4-pair tiles
  run_case({kW4G32, kW4G32, 5, 8, 64, 64, 3, Routing::kDistinct, 24});        // 2-pair tiles
}

TEST_F(QuantMoeCuda, QuantizedBesideFp16) {
  run_case({kW4G32, kDense, 3, 8, 128, 64, 2, Routing::kDistinct, 31});
  run_case({kDense, kFp8B128, 20, 4, 128, 128, 2, Routing::kDistinct, 32});
}

TEST_F(QuantMoeCuda, PerElementFallback) {
  // NVFP4 gate_up rows of in = hidden = 16 (as the small test models have) and FP8 down rows of
  // in = inter = 36 take the fallback; FP8 gate_up rows of in 16 < block 32 the 16-byte path.
  run_case({kNvfp4, kNvfp4, 6, 4, 16, 32, 2, Routing::kDistinct, 41});
  run_case({kFp8B32, kFp8B32, 6, 4, 16, 36, 2, Routing::kDistinct, 42});
}

TEST_F(QuantMoeCuda, RepeatedAndInvalidIds) {
  run_case({kW4G32, kNvfp4, 12, 8, 64, 64, 3, Routing::kRepeated, 51});
  run_case({kFp8B32, kW4G32, 12, 8, 64, 64, 3, Routing::kInvalid, 52});
}

TEST_F(QuantMoeCuda, SeveralPassesOverASmallWorkspace) {
  run_case({kW4G32, kFp8B32, 23, 8, 64, 64, 3, Routing::kDistinct, 61, /*workspace_rows=*/5});
  run_case({kNvfp4, kW4G32, 9, 4, 64, 32, 2, Routing::kDistinct, 62, /*workspace_rows=*/1});
}

// The call captured in a CUDA graph once the workspace is reserved and growth is off: no
// allocation, no host wait; the replay equals the eager result bit for bit.
TEST_F(QuantMoeCuda, CapturedInAGraphReplaysTheEagerResult) {
  const MoeCase c{kW4G32, kFp8B128, 4, 8, 128, 128, 2, Routing::kDistinct, 71};
  const MoeData d = make_data(c);
  Backend::HybridWorkspaceNeeds needs;
  needs.max_rows = 16;
  needs.moe_experts = c.n_experts;
  needs.moe_top_k = c.top_k;
  needs.moe_hidden = c.hidden;
  needs.moe_inter = c.inter;
  ASSERT_TRUE(gpu_->reserve_hybrid_workspaces(needs).ok());
  gpu_->allow_workspace_growth(false);
  DeviceInputs in = upload(c, d);
  ASSERT_TRUE(issue(c, in).ok());
  std::vector<uint16_t> eager(size_t(c.n_rows * c.hidden));
  gpu_->copy_to_host(eager.data(), in.out.data(), eager.size() * 2);
  const std::vector<uint16_t> nan(eager.size(), kF16Nan);
  gpu_->copy_from_host(in.out.data(), nan.data(), nan.size() * 2);
  gpu_->synchronize();
  const CudaBackendCounters before = cuda_backend_counters(*gpu_);
  auto graph = capture_cuda_graph(*gpu_, [&] { return issue(c, in); });
  ASSERT_TRUE(graph.ok()) << graph.message();
  const CudaBackendCounters after = cuda_backend_counters(*gpu_);
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_EQ(after.host_waits, before.host_waits);
  ASSERT_TRUE((*graph)->replay().ok());
  std::vector<uint16_t> replayed(eager.size());
  gpu_->copy_to_host(replayed.data(), in.out.data(), replayed.size() * 2);
  EXPECT_EQ(replayed, eager);
}

}  // namespace
}  // namespace e4kv
