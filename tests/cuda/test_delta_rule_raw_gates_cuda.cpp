// The gated delta rule with its gates computed inside (Backend::gated_delta_rule_raw_gates on the
// CUDA backend) against the two ops it replaces (gated_delta_gates, then gated_delta_rule) on the
// same inputs: the same fp32 operations, so the outputs and the updated states are equal bit for
// bit, for decode steps (one row per sequence) and prefill (several rows), at the benchmark
// model's head shape and a small one.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/half.h"
#include "cuda/require_gpu.h"

namespace e4kv {
namespace {

template <class T>
BackendBuffer upload(Backend& b, const std::vector<T>& host) {
  Result<BackendBuffer> buf = b.allocate(std::max<size_t>(64, host.size() * sizeof(T)));
  EXPECT_TRUE(buf.ok()) << buf.message();
  b.copy_from_host(buf->data(), host.data(), host.size() * sizeof(T));
  return std::move(buf).value();
}

template <class T>
std::vector<T> download(Backend& b, const BackendBuffer& buf, size_t n) {
  std::vector<T> out(n);
  b.copy_to_host(out.data(), buf.data(), n * sizeof(T));
  return out;
}

std::vector<uint16_t> random_f16(size_t n, float mean, float scale, std::mt19937& rng) {
  std::normal_distribution<float> d(mean, scale);
  std::vector<uint16_t> out(n);
  for (uint16_t& v : out) v = f32_to_f16(d(rng));
  return out;
}

struct Shape {
  int64_t n_k_heads, n_v_heads, dk, dv;
};

TEST(DeltaRuleRawGatesCuda, EqualsGatesThenRuleBitForBit) {
  E4KV_REQUIRE_GPU();
  Result<std::unique_ptr<Backend>> made = make_cuda_backend();
  ASSERT_TRUE(made.ok()) << made.message();
  Backend& b = **made;
  std::mt19937 rng(3);
  for (const Shape shape : {Shape{16, 32, 128, 128}, Shape{2, 4, 64, 48}}) {
    // Decode: 3 sequences of one row; prefill: rows 5, 1, 9.
    for (const std::vector<int32_t>& seq_rows :
         {std::vector<int32_t>{1, 1, 1}, std::vector<int32_t>{5, 1, 9}}) {
      SCOPED_TRACE(testing::Message()
                   << shape.n_v_heads << " heads of " << shape.dk << " x " << shape.dv << ", rows "
                   << seq_rows[0] << "," << seq_rows[2]);
      const int64_t n_seqs = int64_t(seq_rows.size());
      std::vector<int32_t> row_begin{0};
      for (int32_t r : seq_rows) row_begin.push_back(row_begin.back() + r);
      const int64_t n = row_begin.back();
      const std::vector<int32_t> slots{2, 0, 3};
      const std::vector<int64_t> start_pos{7, 0, 30};
      const int64_t width = 2 * shape.n_k_heads * shape.dk + shape.n_v_heads * shape.dv;
      const size_t state_elems = size_t(4 * shape.n_v_heads * shape.dk * shape.dv);
      std::normal_distribution<float> d(0.0f, 0.1f);
      std::vector<float> state0(state_elems);
      for (float& v : state0) v = d(rng);

      const BackendBuffer qkv = upload(b, random_f16(size_t(n * width), 0.0f, 1.0f, rng));
      const BackendBuffer a = upload(b, random_f16(size_t(n * shape.n_v_heads), 0.0f, 2.0f, rng));
      const BackendBuffer bb = upload(b, random_f16(size_t(n * shape.n_v_heads), 0.0f, 2.0f, rng));
      const BackendBuffer a_log = upload(b, random_f16(size_t(shape.n_v_heads), -1.0f, 1.0f, rng));
      const BackendBuffer dt_bias = upload(b, random_f16(size_t(shape.n_v_heads), 0.0f, 1.0f, rng));
      const BackendBuffer rb = upload(b, row_begin);
      const BackendBuffer sl = upload(b, slots);
      const BackendBuffer sp = upload(b, start_pos);
      SequenceRowsView seqs;
      seqs.n_seqs = n_seqs;
      seqs.row_begin = rb.as<int32_t>();
      seqs.state_slot = sl.as<int32_t>();
      seqs.start_pos = sp.as<int64_t>();
      set_sequence_launch_facts(seqs, row_begin.data(), start_pos.data());

      // The two ops.
      BackendBuffer state_want = upload(b, state0);
      BackendBuffer g = upload(b, std::vector<float>(size_t(n * shape.n_v_heads)));
      BackendBuffer beta = upload(b, std::vector<float>(size_t(n * shape.n_v_heads)));
      BackendBuffer out_want =
          upload(b, std::vector<uint16_t>(size_t(n * shape.n_v_heads * shape.dv)));
      ASSERT_TRUE(b.gated_delta_gates(a.data(), bb.data(), a_log.data(), dt_bias.data(), n,
                                      shape.n_v_heads, g.as<float>(), beta.as<float>())
                      .ok());
      ASSERT_TRUE(b.gated_delta_rule(qkv.data(), g.as<float>(), beta.as<float>(), shape.n_k_heads,
                                     shape.n_v_heads, shape.dk, shape.dv, state_want.as<float>(),
                                     seqs, out_want.data())
                      .ok());
      // The fused form.
      BackendBuffer state_got = upload(b, state0);
      BackendBuffer out_got =
          upload(b, std::vector<uint16_t>(size_t(n * shape.n_v_heads * shape.dv)));
      Result<bool> fused = b.gated_delta_rule_raw_gates(
          qkv.data(), a.data(), bb.data(), a_log.data(), dt_bias.data(), shape.n_k_heads,
          shape.n_v_heads, shape.dk, shape.dv, state_got.as<float>(), seqs, out_got.data());
      ASSERT_TRUE(fused.ok()) << fused.message();
      ASSERT_TRUE(*fused);
      const size_t out_n = size_t(n * shape.n_v_heads * shape.dv);
      EXPECT_EQ(download<uint16_t>(b, out_want, out_n), download<uint16_t>(b, out_got, out_n));
      const std::vector<float> sw = download<float>(b, state_want, state_elems);
      const std::vector<float> sg = download<float>(b, state_got, state_elems);
      EXPECT_EQ(0, std::memcmp(sw.data(), sg.data(), state_elems * 4));
      // The slots no sequence names (1) are untouched, and the named ones moved.
      EXPECT_NE(sw, state0);
    }
  }
}

}  // namespace
}  // namespace e4kv
