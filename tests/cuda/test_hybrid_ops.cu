// The hybrid-model FP16 ops (backend/cuda/hybrid_ops.cuh) against their CPU references
// (backend/cpu/hyper_connection.h, gated_delta_net.h, moe.h, ple.h) on fresh random data: every
// launcher runs on FP16 inputs, the reference on the same values widened to float. Shapes cover
// each vector width (8, 2 and 1 values per load: row widths that are multiples of 8, even ones,
// odd ones, and a misaligned pointer), the warp-per-row and CTA-per-row norms, in-place calls,
// n_rows = 0 with null pointers, and for conv1d_silu several sequences of different lengths (one
// empty, one shorter than the state) in shuffled slots, kernel 4 with dilation 1 and 3, channel
// counts that are not multiples of the 128-channel tile, short and 64-row chunks, and a prefill
// followed by a one-token decode that must equal one call bit for bit. Outputs are poisoned with
// NaN before each launch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/gated_delta_net.h"
#include "backend/cpu/hyper_connection.h"
#include "backend/cpu/moe.h"
#include "backend/cpu/ple.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/hybrid_ops.cuh"
#include "core/half.h"
#include "core/status.h"
#include "device_buffer.cuh"
#include "require_gpu.h"
#include "testing/compare.h"

namespace e4kv::cuda {
namespace {

// Tolerance of an FP16 output against the fp32 reference. The kernels compute in fp32 with the
// reference's products (no FMA contraction where the reference adds them) and differ from it only
// by reduction order and expf / log1pf (a few fp32 ulps, ~1e-6 relative), then round once to FP16:
// that rounding is at most half an FP16 ulp, 2^-11 = 4.9e-4 relative for normal values. rtol 1e-3
// (about twice that) covers both; atol 1e-5 covers FP16 subnormal spacing (6e-8) and the fp32
// error of sums of O(1) terms that cancel to near zero. A wrong index or formula is off by O(1).
constexpr double kF16Rtol = 1e-3;
constexpr double kF16Atol = 1e-5;
// fp32 outputs (gated_delta_gates): expf / log1pf within 2 ulp each, a product and a sum.
constexpr double kF32Rtol = 1e-5;
constexpr double kF32Atol = 1e-7;

constexpr uint16_t kF16NaN = 0xFFFFu;

std::vector<uint16_t> random_f16(std::mt19937& rng, size_t n, float mean, float sigma) {
  std::normal_distribution<float> normal(mean, sigma);
  std::vector<uint16_t> out(n);
  for (uint16_t& h : out) h = f32_to_f16(normal(rng));
  return out;
}

std::vector<float> widen(const std::vector<uint16_t>& h) {
  std::vector<float> out(h.size());
  std::transform(h.begin(), h.end(), out.begin(), f16_to_f32);
  return out;
}

std::vector<float> download(const DeviceBuffer<uint16_t>& d) {
  return widen(d.to_host());
}

// A device buffer filled with FP16 NaN, for outputs.
struct PoisonedBuffer : DeviceBuffer<uint16_t> {
  explicit PoisonedBuffer(size_t n) : DeviceBuffer<uint16_t>(std::vector<uint16_t>(n, kF16NaN)) {}
};

void sync() {
  E4KV_CUDA_CHECK(cudaGetLastError());
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
}

// ---- row norms ----------------------------------------------------------------------------------

struct NormShape {
  int64_t n_rows;
  int64_t n_groups;
  int64_t dim;
};

TEST(HybridOpsCuda, RmsNormGroupedMatchesCpuReference) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(11);
  // dim 2048 / 1500 / 1031: CTA per row (vector 8 / 2 / 1); 256 / 100 / 37: 32 lanes per row;
  // 128 / 30: 16 lanes; 64 / 7: 8 lanes, with a last CTA only partly used (33 x 1 rows of 8 lanes).
  const NormShape shapes[] = {{3, 4, 2048}, {2, 3, 1500}, {3, 2, 1031}, {5, 4, 256}, {7, 1, 100},
                              {4, 3, 37},   {5, 4, 128},  {9, 2, 30},   {33, 1, 64}, {3, 5, 7}};
  const float eps = 1e-6f;
  for (const NormShape& s : shapes) {
    for (const RmsNormForm form : {RmsNormForm::kWeight, RmsNormForm::kOnePlusWeight}) {
      for (const bool in_place : {false, true}) {
        SCOPED_TRACE(cat("rows ", s.n_rows, " groups ", s.n_groups, " dim ", s.dim,
                         form == RmsNormForm::kWeight ? " weight" : " one_plus",
                         in_place ? " in place" : ""));
        const size_t n = size_t(s.n_rows * s.n_groups * s.dim);
        const std::vector<uint16_t> x = random_f16(rng, n, 0.3f, 2.0f);
        const std::vector<uint16_t> w = random_f16(
            rng, size_t(s.n_groups * s.dim), form == RmsNormForm::kWeight ? 1.0f : 0.0f, 0.2f);
        std::vector<float> ref(n);
        rms_norm_grouped(widen(x).data(), widen(w).data(), s.n_rows, s.n_groups, s.dim, eps, form,
                         ref.data());
        DeviceBuffer<uint16_t> d_x(x);
        DeviceBuffer<uint16_t> d_w(w);
        PoisonedBuffer d_out(n);
        rms_norm_grouped_f16(d_x.ptr, d_w.ptr, s.n_rows, s.n_groups, s.dim, eps, form,
                             in_place ? d_x.ptr : d_out.ptr, nullptr);
        sync();
        EXPECT_TRUE(test::all_close(download(in_place ? d_x : d_out), ref, kF16Atol, kF16Rtol));
      }
    }
  }
}

TEST(HybridOpsCuda, RmsNormGroupedMisalignedAndEmpty) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(12);
  const int64_t n_rows = 2;
  const int64_t n_groups = 2;
  const int64_t dim = 512;
  const size_t n = size_t(n_rows * n_groups * dim);
  // Every pointer one element past a 16-byte boundary: the scalar path on a width of 512.
  std::vector<uint16_t> x = random_f16(rng, n + 1, 0.0f, 1.0f);
  const std::vector<uint16_t> w = random_f16(rng, size_t(n_groups * dim) + 1, 1.0f, 0.2f);
  std::vector<float> ref(n);
  rms_norm_grouped(widen(x).data() + 1, widen(w).data() + 1, n_rows, n_groups, dim, 1e-5f,
                   RmsNormForm::kWeight, ref.data());
  DeviceBuffer<uint16_t> d_x(x);
  DeviceBuffer<uint16_t> d_w(w);
  PoisonedBuffer d_out(n + 1);
  rms_norm_grouped_f16(d_x.ptr + 1, d_w.ptr + 1, n_rows, n_groups, dim, 1e-5f, RmsNormForm::kWeight,
                       d_out.ptr + 1, nullptr);
  sync();
  const std::vector<float> got = download(d_out);
  EXPECT_TRUE(
      test::all_close(std::vector<float>(got.begin() + 1, got.end()), ref, kF16Atol, kF16Rtol));
  EXPECT_EQ(d_out.to_host()[0], kF16NaN);  // nothing written before the row

  // n_rows = 0 launches nothing and touches no pointer.
  rms_norm_grouped_f16(nullptr, nullptr, 0, 4, 2048, 1e-6f, RmsNormForm::kOnePlusWeight, nullptr,
                       nullptr);
  gated_rms_norm_f16(nullptr, nullptr, nullptr, 0, 128, 1e-6f, false, nullptr, nullptr);
  sync();
}

TEST(HybridOpsCuda, GatedRmsNormMatchesCpuReference) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(13);
  // 128 (the DeltaNet head_v_dim; 16 lanes, 16 rows per CTA: 70 rows leave a partial CTA) / 48
  // (8 lanes) / 90 / 45 (32 lanes); 2000 / 1025: CTA per row.
  const NormShape shapes[] = {{70, 1, 128}, {13, 1, 48},  {5, 1, 90},
                              {7, 1, 45},   {3, 1, 2000}, {2, 1, 1025}};
  const float eps = 1e-6f;
  for (const NormShape& s : shapes) {
    for (const bool sigmoid_gate : {false, true}) {
      for (const int alias : {0, 1, 2}) {  // out separate, out = x, out = z
        SCOPED_TRACE(cat("rows ", s.n_rows, " dim ", s.dim, sigmoid_gate ? " sigmoid" : " silu",
                         " alias ", alias));
        const size_t n = size_t(s.n_rows * s.dim);
        const std::vector<uint16_t> x = random_f16(rng, n, 0.0f, 1.5f);
        const std::vector<uint16_t> z = random_f16(rng, n, 0.0f, 2.0f);
        const std::vector<uint16_t> w = random_f16(rng, size_t(s.dim), 1.0f, 0.2f);
        std::vector<float> ref(n);
        gated_rms_norm(widen(x).data(), widen(z).data(), widen(w).data(), s.n_rows, s.dim, eps,
                       sigmoid_gate ? GateActivation::kSigmoid : GateActivation::kSilu, ref.data());
        DeviceBuffer<uint16_t> d_x(x);
        DeviceBuffer<uint16_t> d_z(z);
        DeviceBuffer<uint16_t> d_w(w);
        PoisonedBuffer d_out(n);
        DeviceBuffer<uint16_t>& out = alias == 1 ? d_x : alias == 2 ? d_z : d_out;
        gated_rms_norm_f16(d_x.ptr, d_z.ptr, d_w.ptr, s.n_rows, s.dim, eps, sigmoid_gate, out.ptr,
                           nullptr);
        sync();
        EXPECT_TRUE(test::all_close(download(out), ref, kF16Atol, kF16Rtol));
      }
    }
  }
}

// ---- elementwise --------------------------------------------------------------------------------

TEST(HybridOpsCuda, SiluScaledMatchesCpuReference) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(14);
  for (const int64_t n : {int64_t(1), int64_t(7), int64_t(130), int64_t(1024), int64_t(70001)}) {
    for (const bool in_place : {false, true}) {
      SCOPED_TRACE(cat("n ", n, in_place ? " in place" : ""));
      const float scale = 0.25f;
      const std::vector<uint16_t> x = random_f16(rng, size_t(n), 0.0f, 8.0f);
      std::vector<float> ref(static_cast<size_t>(n));
      silu_scaled(widen(x).data(), n, scale, ref.data());
      DeviceBuffer<uint16_t> d_x(x);
      PoisonedBuffer d_out(static_cast<size_t>(n));
      silu_scaled_f16(d_x.ptr, n, scale, in_place ? d_x.ptr : d_out.ptr, nullptr);
      sync();
      EXPECT_TRUE(test::all_close(download(in_place ? d_x : d_out), ref, kF16Atol, kF16Rtol));
    }
  }
  silu_scaled_f16(nullptr, 0, 1.0f, nullptr, nullptr);
  sync();
}

struct StreamShape {
  int64_t n_rows;
  int64_t n_streams;
  int64_t hidden;
};
// Vector widths 8, 2, 1; the released shape (S = 4, H = 2048) at decode and a prefill-sized one.
const StreamShape kStreamShapes[] = {{1, 4, 2048}, {5, 4, 200}, {3, 3, 37}, {300, 4, 256}};

TEST(HybridOpsCuda, HcMixMatchesCpuReference) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(15);
  for (const StreamShape& s : kStreamShapes) {
    SCOPED_TRACE(cat("rows ", s.n_rows, " streams ", s.n_streams, " hidden ", s.hidden));
    const size_t n = size_t(s.n_rows * s.n_streams * s.hidden);
    const std::vector<uint16_t> up = random_f16(rng, n, 0.0f, 2.0f);
    const std::vector<uint16_t> xn = random_f16(rng, n, 0.0f, 1.0f);
    std::vector<float> ref(size_t(s.n_rows * s.hidden));
    hc_mix(widen(up).data(), widen(xn).data(), s.n_rows, s.n_streams, s.hidden, ref.data());
    DeviceBuffer<uint16_t> d_up(up);
    DeviceBuffer<uint16_t> d_xn(xn);
    PoisonedBuffer d_mix(ref.size());
    hc_mix_f16(d_up.ptr, d_xn.ptr, s.n_rows, s.n_streams, s.hidden, d_mix.ptr, nullptr);
    sync();
    EXPECT_TRUE(test::all_close(download(d_mix), ref, kF16Atol, kF16Rtol));
  }
  hc_mix_f16(nullptr, nullptr, 0, 4, 2048, nullptr, nullptr);
  sync();
}

TEST(HybridOpsCuda, HcInjectMatchesCpuReference) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(16);
  for (const StreamShape& s : kStreamShapes) {
    SCOPED_TRACE(cat("rows ", s.n_rows, " streams ", s.n_streams, " hidden ", s.hidden));
    const size_t n = size_t(s.n_rows * s.n_streams * s.hidden);
    const std::vector<uint16_t> x = random_f16(rng, n, 0.0f, 1.0f);
    const std::vector<uint16_t> y = random_f16(rng, size_t(s.n_rows * s.hidden), 0.0f, 1.0f);
    const std::vector<uint16_t> inj = random_f16(rng, size_t(s.n_rows * s.n_streams), 0.0f, 3.0f);
    std::vector<float> ref = widen(x);
    hc_inject(ref.data(), widen(y).data(), widen(inj).data(), s.n_rows, s.n_streams, s.hidden);
    DeviceBuffer<uint16_t> d_x(x);
    DeviceBuffer<uint16_t> d_y(y);
    DeviceBuffer<uint16_t> d_inj(inj);
    hc_inject_f16(d_x.ptr, d_y.ptr, d_inj.ptr, s.n_rows, s.n_streams, s.hidden, nullptr);
    sync();
    EXPECT_TRUE(test::all_close(download(d_x), ref, kF16Atol, kF16Rtol));
  }
  hc_inject_f16(nullptr, nullptr, nullptr, 0, 4, 2048, nullptr);
  sync();
}

TEST(HybridOpsCuda, HcExpandCopiesBits) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(17);
  for (const StreamShape& s : kStreamShapes) {
    SCOPED_TRACE(cat("rows ", s.n_rows, " streams ", s.n_streams, " hidden ", s.hidden));
    const std::vector<uint16_t> e = random_f16(rng, size_t(s.n_rows * s.hidden), 0.0f, 1.0f);
    std::vector<float> ref(size_t(s.n_rows * s.n_streams * s.hidden));
    hc_expand(widen(e).data(), s.n_rows, s.n_streams, s.hidden, ref.data());
    DeviceBuffer<uint16_t> d_e(e);
    PoisonedBuffer d_x(ref.size());
    hc_expand_f16(d_e.ptr, s.n_rows, s.n_streams, s.hidden, d_x.ptr, nullptr);
    sync();
    EXPECT_TRUE(test::all_close(download(d_x), ref, 0.0, 0.0));
  }
  hc_expand_f16(nullptr, 0, 4, 2048, nullptr, nullptr);
  sync();
}

TEST(HybridOpsCuda, SigmoidGatedAddMatchesCpuReference) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(18);
  const NormShape shapes[] = {{1, 1, 2048}, {9, 1, 130}, {4, 1, 33}, {257, 1, 512}};
  for (const NormShape& s : shapes) {
    SCOPED_TRACE(cat("rows ", s.n_rows, " dim ", s.dim));
    const size_t n = size_t(s.n_rows * s.dim);
    const std::vector<uint16_t> out = random_f16(rng, n, 0.0f, 1.0f);
    const std::vector<uint16_t> y = random_f16(rng, n, 0.0f, 1.0f);
    const std::vector<uint16_t> gate = random_f16(rng, size_t(s.n_rows), 0.0f, 3.0f);
    std::vector<float> ref = widen(out);
    sigmoid_gated_add(ref.data(), widen(y).data(), widen(gate).data(), s.n_rows, s.dim);
    DeviceBuffer<uint16_t> d_out(out);
    DeviceBuffer<uint16_t> d_y(y);
    DeviceBuffer<float> d_gate(widen(gate));
    sigmoid_gated_add_f16(d_out.ptr, d_y.ptr, d_gate.ptr, s.n_rows, s.dim, nullptr);
    sync();
    EXPECT_TRUE(test::all_close(download(d_out), ref, kF16Atol, kF16Rtol));
  }
  sigmoid_gated_add_f16(nullptr, nullptr, nullptr, 0, 2048, nullptr);
  sync();
}

TEST(HybridOpsCuda, GatedDeltaGatesMatchCpuReference) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(19);
  // An explicit array: CUDA 12.4's front end cannot deduce a braced list of pairs here.
  constexpr std::pair<int64_t, int64_t> kShapes[] = {{1, 32}, {33, 32}, {5, 7}};
  for (const auto& [n_rows, n_heads] : kShapes) {
    SCOPED_TRACE(cat("rows ", n_rows, " heads ", n_heads));
    const size_t n = size_t(n_rows * n_heads);
    std::vector<uint16_t> a = random_f16(rng, n, 0.0f, 4.0f);
    for (size_t i = 0; i < n; i += 5) a[i] = f32_to_f16(25.0f);  // softplus's linear branch
    const std::vector<uint16_t> b = random_f16(rng, n, 0.0f, 3.0f);
    const std::vector<uint16_t> a_log = random_f16(rng, size_t(n_heads), 0.0f, 1.0f);
    const std::vector<uint16_t> dt_bias = random_f16(rng, size_t(n_heads), 0.0f, 1.0f);
    std::vector<float> ref_g(n);
    std::vector<float> ref_beta(n);
    gated_delta_gates(widen(a).data(), widen(b).data(), widen(a_log).data(), widen(dt_bias).data(),
                      n_rows, n_heads, ref_g.data(), ref_beta.data());
    DeviceBuffer<uint16_t> d_a(a);
    DeviceBuffer<uint16_t> d_b(b);
    DeviceBuffer<uint16_t> d_a_log(a_log);
    DeviceBuffer<uint16_t> d_dt_bias(dt_bias);
    DeviceBuffer<float> d_g(std::vector<float>(n, NAN));
    DeviceBuffer<float> d_beta(std::vector<float>(n, NAN));
    gated_delta_gates_f16(d_a.ptr, d_b.ptr, d_a_log.ptr, d_dt_bias.ptr, n_rows, n_heads, d_g.ptr,
                          d_beta.ptr, nullptr);
    sync();
    EXPECT_TRUE(test::all_close(d_g.to_host(), ref_g, kF32Atol, kF32Rtol));
    EXPECT_TRUE(test::all_close(d_beta.to_host(), ref_beta, kF32Atol, kF32Rtol));
  }
  gated_delta_gates_f16(nullptr, nullptr, nullptr, nullptr, 0, 32, nullptr, nullptr, nullptr);
  sync();
}

TEST(HybridOpsCuda, PleGateMatchesCpuReference) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(20);
  const StreamShape shapes[] = {{1, 4, 2048}, {6, 4, 96}, {3, 2, 45}, {2, 4, 3000}};
  for (const StreamShape& s : shapes) {
    for (const int alias : {0, 1, 2}) {  // out separate, out = kn, out = qn
      SCOPED_TRACE(
          cat("rows ", s.n_rows, " streams ", s.n_streams, " hidden ", s.hidden, " alias ", alias));
      const size_t n = size_t(s.n_rows * s.n_streams * s.hidden);
      std::vector<uint16_t> kn = random_f16(rng, n, 0.0f, 1.0f);
      const std::vector<uint16_t> qn = random_f16(rng, n, 0.0f, 1.0f);
      const std::vector<uint16_t> val = random_f16(rng, size_t(s.n_rows * s.hidden), 0.0f, 1.0f);
      // One (row, stream) with a zero key: g = 0 exactly, sign(0) = 0, gate 1/2.
      std::fill_n(kn.begin() + s.hidden, s.hidden, uint16_t(0));
      std::vector<float> ref(n);
      ple_gate(widen(kn).data(), widen(qn).data(), widen(val).data(), s.n_rows, s.n_streams,
               s.hidden, ref.data());
      DeviceBuffer<uint16_t> d_kn(kn);
      DeviceBuffer<uint16_t> d_qn(qn);
      DeviceBuffer<uint16_t> d_val(val);
      PoisonedBuffer d_out(n);
      DeviceBuffer<uint16_t>& out = alias == 1 ? d_kn : alias == 2 ? d_qn : d_out;
      ple_gate_f16(d_kn.ptr, d_qn.ptr, d_val.ptr, s.n_rows, s.n_streams, s.hidden, out.ptr,
                   nullptr);
      sync();
      EXPECT_TRUE(test::all_close(download(out), ref, kF16Atol, kF16Rtol));
    }
  }
  ple_gate_f16(nullptr, nullptr, nullptr, 0, 4, 2048, nullptr, nullptr);
  sync();
}

// ---- conv1d_silu --------------------------------------------------------------------------------

// The rows of a batch of sequences (in batch order) on the device and the host.
struct DeviceSeqRows {
  std::vector<int32_t> row_begin;
  std::vector<int32_t> state_slot;
  std::vector<int64_t> start_pos;
  DeviceBuffer<int32_t> d_row_begin;
  DeviceBuffer<int32_t> d_state_slot;
  DeviceBuffer<int64_t> d_start_pos;

  DeviceSeqRows(const std::vector<int32_t>& lengths, std::vector<int32_t> slots,
                std::vector<int64_t> starts)
      : row_begin(prefix(lengths)),
        state_slot(std::move(slots)),
        start_pos(std::move(starts)),
        d_row_begin(row_begin),
        d_state_slot(state_slot),
        d_start_pos(start_pos) {}

  static std::vector<int32_t> prefix(const std::vector<int32_t>& lengths) {
    std::vector<int32_t> out{0};
    for (const int32_t n : lengths) out.push_back(out.back() + n);
    return out;
  }
  int64_t n_rows() const { return row_begin.back(); }
  SequenceRowsView view() const {
    SequenceRowsView v;
    v.n_seqs = int64_t(state_slot.size());
    v.row_begin = d_row_begin.ptr;
    v.state_slot = d_state_slot.ptr;
    v.start_pos = d_start_pos.ptr;
    set_sequence_launch_facts(v, row_begin.data(), start_pos.data());
    return v;
  }
};

// CpuBackend::conv1d_silu over fp32 copies.
void conv_reference(const std::vector<float>& x, int64_t channels, const std::vector<float>& w,
                    int64_t kernel, int64_t dilation, std::vector<float>& states,
                    const DeviceSeqRows& seqs, std::vector<float>& out) {
  const int64_t state_elems = (kernel - 1) * dilation * channels;
  for (size_t s = 0; s < seqs.state_slot.size(); ++s) {
    const int64_t begin = seqs.row_begin[s];
    const int64_t n = seqs.row_begin[s + 1] - begin;
    dilated_conv1d_silu(x.data() + begin * channels, n, channels, w.data(), kernel, dilation,
                        states.data() + seqs.state_slot[s] * state_elems,
                        out.data() + begin * channels);
  }
}

struct ConvCase {
  int64_t channels;
  int64_t kernel;
  int64_t dilation;
  std::vector<int32_t> lengths;  // per sequence, in batch order
};

// One call over each sequence's rows (continuing from random states) against the reference; then
// the same rows as a prefill of all but each sequence's last row followed by a one-token decode of
// that row, which must give the same outputs and states bit for bit.
void run_conv_case(const ConvCase& c, uint32_t seed) {
  SCOPED_TRACE(cat("channels ", c.channels, " kernel ", c.kernel, " dilation ", c.dilation,
                   " sequences ", c.lengths.size(), " seed ", seed));
  std::mt19937 rng(seed);
  const int64_t kernel = c.kernel;
  const int64_t n_state = (kernel - 1) * c.dilation;
  const int64_t n_seqs = int64_t(c.lengths.size());
  const int64_t n_slots = n_seqs + 2;
  // Slots in a shuffled order, two left unused (they must not change).
  std::vector<int32_t> slots(static_cast<size_t>(n_slots));
  for (int32_t i = 0; i < int32_t(n_slots); ++i) slots[size_t(i)] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(size_t(n_seqs));
  std::vector<int64_t> starts(static_cast<size_t>(n_seqs));
  for (int64_t& p : starts) p = 1000;  // not read by the op; continuing sequences
  const DeviceSeqRows seqs(c.lengths, slots, starts);
  const int64_t n_rows = seqs.n_rows();

  const std::vector<uint16_t> x = random_f16(rng, size_t(n_rows * c.channels), 0.0f, 1.0f);
  const std::vector<uint16_t> w = random_f16(rng, size_t(c.channels * kernel), 0.0f, 0.5f);
  const std::vector<uint16_t> states0 =
      random_f16(rng, size_t(n_slots * n_state * c.channels), 0.0f, 1.0f);

  std::vector<float> ref_out(x.size());
  std::vector<float> ref_states = widen(states0);
  conv_reference(widen(x), c.channels, widen(w), kernel, c.dilation, ref_states, seqs, ref_out);

  DeviceBuffer<uint16_t> d_x(x);
  DeviceBuffer<uint16_t> d_w(w);
  DeviceBuffer<uint16_t> d_states(states0);
  PoisonedBuffer d_out(x.size());
  conv1d_silu_f16(d_x.ptr, c.channels, d_w.ptr, kernel, c.dilation, d_states.ptr, seqs.view(),
                  d_out.ptr, nullptr);
  sync();
  const std::vector<uint16_t> whole_out = d_out.to_host();
  const std::vector<uint16_t> whole_states = d_states.to_host();
  EXPECT_TRUE(test::all_close(widen(whole_out), ref_out, kF16Atol, kF16Rtol));
  // The state is a copy of FP16 inputs: exact.
  EXPECT_TRUE(test::all_close(widen(whole_states), ref_states, 0.0, 0.0));

  // Split: prefill rows (all but the last of each sequence), then the last rows.
  std::vector<int32_t> prefill_lengths;
  std::vector<int32_t> decode_lengths;
  std::vector<uint16_t> prefill_x;
  std::vector<uint16_t> decode_x;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int32_t n = c.lengths[size_t(s)];
    const auto row = [&](int64_t r) {
      return x.begin() + (seqs.row_begin[size_t(s)] + r) * c.channels;
    };
    prefill_lengths.push_back(std::max(n - 1, 0));
    decode_lengths.push_back(n > 0 ? 1 : 0);
    if (n > 0) {
      prefill_x.insert(prefill_x.end(), row(0), row(n - 1));
      decode_x.insert(decode_x.end(), row(n - 1), row(n));
    }
  }
  const DeviceSeqRows prefill(prefill_lengths, slots, starts);
  const DeviceSeqRows decode(decode_lengths, slots, starts);
  DeviceBuffer<uint16_t> d_states_split(states0);
  DeviceBuffer<uint16_t> d_prefill_x(prefill_x);
  DeviceBuffer<uint16_t> d_decode_x(decode_x);
  PoisonedBuffer d_prefill_out(prefill_x.size());
  PoisonedBuffer d_decode_out(decode_x.size());
  conv1d_silu_f16(d_prefill_x.ptr, c.channels, d_w.ptr, kernel, c.dilation, d_states_split.ptr,
                  prefill.view(), d_prefill_out.ptr, nullptr);
  conv1d_silu_f16(d_decode_x.ptr, c.channels, d_w.ptr, kernel, c.dilation, d_states_split.ptr,
                  decode.view(), d_decode_out.ptr, nullptr);
  sync();
  const std::vector<uint16_t> prefill_out = d_prefill_out.to_host();
  const std::vector<uint16_t> decode_out = d_decode_out.to_host();
  std::vector<uint16_t> split_out;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t channels = c.channels;
    split_out.insert(split_out.end(), prefill_out.begin() + prefill.row_begin[size_t(s)] * channels,
                     prefill_out.begin() + prefill.row_begin[size_t(s) + 1] * channels);
    split_out.insert(split_out.end(), decode_out.begin() + decode.row_begin[size_t(s)] * channels,
                     decode_out.begin() + decode.row_begin[size_t(s) + 1] * channels);
  }
  EXPECT_EQ(split_out, whole_out);
  EXPECT_EQ(d_states_split.to_host(), whole_states);
}

TEST(HybridOpsCuda, Conv1dSiluMatchesCpuReference) {
  E4KV_REQUIRE_GPU();
  uint32_t seed = 30;
  // Channel counts: 300, 37 (rows staged one value per load), 1096, 2104, 8192 (8 per load); all
  // but 8192 leave a partial 128-channel tile.
  for (const int64_t dilation : {int64_t(1), int64_t(3)}) {
    // A prefill, an empty sequence, one shorter than the dilation-3 state (9 rows), a decode row.
    run_conv_case({300, 4, dilation, {150, 0, 5, 1}}, seed++);
    run_conv_case({37, 4, dilation, {2, 17, 1}}, seed++);
    // Chunks of 5 rows: shorter than the dilation-3 state, so sequences start mid-chunk and their
    // first rows run past the chunk's end.
    run_conv_case({1096, 4, dilation, {300, 7, 190, 1}}, seed++);
    // Decode only: one row per sequence.
    run_conv_case({8192, 4, dilation, {1, 1, 1}}, seed++);
    // Enough rows x channels for 64-row chunks, sequences straddling chunk boundaries.
    run_conv_case({2104, 4, dilation, {1900, 3, 2101, 70}}, seed++);
    // More sequences than the kernel keeps in shared memory (1024).
    run_conv_case({37, 4, dilation, std::vector<int32_t>(1030, 1)}, seed++);
  }
  // Other tap counts (the generic kernel): 2 taps 5 apart, 7 taps 2 apart, 1 tap (no state).
  run_conv_case({300, 2, 5, {40, 3, 0, 1}}, seed++);
  run_conv_case({1096, 7, 2, {130, 11, 1}}, seed++);
  run_conv_case({300, 1, 1, {20, 1}}, seed++);
}

TEST(HybridOpsCuda, Conv1dSiluWithoutRowsChangesNothing) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(40);
  const int64_t channels = 300;
  const std::vector<uint16_t> w = random_f16(rng, size_t(channels * 4), 0.0f, 0.5f);
  const std::vector<uint16_t> states0 = random_f16(rng, size_t(3 * 9 * channels), 0.0f, 1.0f);
  DeviceBuffer<uint16_t> d_w(w);
  DeviceBuffer<uint16_t> d_states(states0);
  const DeviceSeqRows empty({0, 0}, {2, 0}, {5, 7});
  conv1d_silu_f16(nullptr, channels, d_w.ptr, 4, 3, d_states.ptr, empty.view(), nullptr, nullptr);
  conv1d_silu_f16(nullptr, channels, d_w.ptr, 4, 3, d_states.ptr, SequenceRowsView{}, nullptr,
                  nullptr);
  sync();
  EXPECT_EQ(d_states.to_host(), states0);
}

}  // namespace
}  // namespace e4kv::cuda
