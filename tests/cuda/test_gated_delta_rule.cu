// CUDA gated delta rule (backend/cuda/gated_delta_rule.cuh) against the CPU reference
// (backend/cpu/gated_delta_net.h), driven as CpuBackend::gated_delta_rule drives it: per sequence,
// the recurrent form for one row with start_pos > 0, the chunked form otherwise, on the FP16 q/k/v
// widened to fp32. Fresh random data: nK 1, 2 (3) with nV = nK and 2 nK (and 3 nK), dk and dv 16,
// 64, 128 (and 256, odd and partial-tile sizes), several sequences of different lengths in one
// call (decode rows, prefills shorter and longer than a chunk, continuations, an empty sequence)
// over shuffled, non-contiguous state slots whose unused neighbours must stay bit for bit; the
// launcher's decode path (decode-only batches) and prefill path (any other, or no host row
// offsets); the model's decode shape (nK 16, nV 32, dk = dv = 128) at batch 32 and 1; long
// prefills with slow and fast decay; a prefill followed by decode calls equal to one longer call;
// calls with no rows; and the shapes the launcher refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/gated_delta_net.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/gated_delta_rule.cuh"
#include "core/half.h"
#include "core/status.h"
#include "device_buffer.cuh"
#include "testing/compare.h"

namespace e4kv::cuda {
namespace {

using test::all_close;

// Tolerances (values of order 1: q, k, v in [-1, 1], states in [-0.5, 0.5]).
// The output is rounded to FP16 once: half an FP16 ulp is at most 2^-11 ~ 4.9e-4 of the value
// (2^-25 absolute below the normal range); on top, the GPU's fp32 differs from the CPU's by
// rounding (the kernel factors the decay and the norms out of its sums, sums over warps and
// contracts to FMA; the CPU's chunked form has its own order), a few fp32 ulps of the order-1
// terms that cancel into o: hence atol 1e-5 and rtol 6e-4. Observed on the H200: relative L2 error
// 2.3e-4 (the FP16 rounding), largest absolute 2.4e-4.
constexpr double kOutAtol = 1e-5;
constexpr double kOutRtol = 6e-4;
// The state stays fp32 on both sides: only that rounding (the CPU's two forms agree to 2e-6 +
// 1e-5 relative); the delta rule contracts, so errors do not grow with the length. Observed: at
// most 3e-7 absolute, also after 300 tokens.
constexpr double kStateAtol = 5e-6;
constexpr double kStateRtol = 2e-5;

constexpr uint16_t kPoisonF16 = 0x7E00;  // an FP16 NaN: an output row left unwritten fails

struct Shape {
  int64_t n_k_heads;
  int64_t n_v_heads;
  int64_t head_k_dim;
  int64_t head_v_dim;

  int64_t row_width() const { return 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim; }
  int64_t state_elems() const { return n_v_heads * head_k_dim * head_v_dim; }
};

std::string describe(const Shape& s) {
  return cat("nK ", s.n_k_heads, " nV ", s.n_v_heads, " dk ", s.head_k_dim, " dv ", s.head_v_dim);
}

struct SeqSpec {
  int64_t n_rows;
  int32_t slot;
  int64_t start_pos;
};

// The inputs of one call.
struct Call {
  Shape shape;
  std::vector<SeqSpec> seqs;
  std::vector<int32_t> row_begin;  // [n_seqs + 1]
  std::vector<uint16_t> qkv;       // [n_rows, row_width] FP16 bits
  std::vector<float> g;            // [n_rows, n_v_heads]
  std::vector<float> beta;         // [n_rows, n_v_heads]

  int64_t n_rows() const { return row_begin.back(); }
};

Call make_call(std::mt19937& rng, const Shape& shape, const std::vector<SeqSpec>& seqs,
               float g_min = -1.5f) {
  Call c;
  c.shape = shape;
  c.seqs = seqs;
  c.row_begin.push_back(0);
  for (const SeqSpec& s : seqs) c.row_begin.push_back(c.row_begin.back() + int32_t(s.n_rows));
  const int64_t n = c.n_rows();
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_real_distribution<float> log_decay(g_min, -0.001f);
  std::uniform_real_distribution<float> strength(0.0f, 1.0f);
  c.qkv.resize(size_t(n * shape.row_width()));
  for (uint16_t& x : c.qkv) x = f32_to_f16(unit(rng));
  c.g.resize(size_t(n * shape.n_v_heads));
  c.beta.resize(c.g.size());
  for (float& x : c.g) x = log_decay(rng);
  for (float& x : c.beta) x = strength(rng);
  return c;
}

std::vector<float> random_states(std::mt19937& rng, const Shape& shape, int64_t n_slots) {
  std::uniform_real_distribution<float> dist(-0.5f, 0.5f);
  std::vector<float> states(size_t(n_slots * shape.state_elems()));
  for (float& x : states) x = dist(rng);
  return states;
}

// Zeros the slots of the sequences that start at position 0 (the engine's job at a sequence start).
void zero_started_slots(const Call& c, std::vector<float>& states) {
  for (const SeqSpec& s : c.seqs) {
    if (s.start_pos != 0) continue;
    const int64_t elems = c.shape.state_elems();
    std::fill_n(states.begin() + s.slot * elems, elems, 0.0f);
  }
}

// CpuBackend::gated_delta_rule on the widened FP16 inputs. states: in/out; returns the output
// [n_rows, n_v_heads, head_v_dim] in fp32.
std::vector<float> cpu_reference(const Call& c, std::vector<float>& states) {
  const Shape& sh = c.shape;
  const int64_t k_dim = sh.n_k_heads * sh.head_k_dim;
  const int64_t v_dim = sh.n_v_heads * sh.head_v_dim;
  std::vector<float> out(size_t(c.n_rows() * v_dim), -99.0f);
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const int64_t begin = c.row_begin[s];
    const int64_t n = c.row_begin[s + 1] - begin;
    std::vector<float> q(size_t(n * k_dim)), k(size_t(n * k_dim)), v(size_t(n * v_dim));
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t* row = c.qkv.data() + (begin + r) * sh.row_width();
      for (int64_t i = 0; i < k_dim; ++i) {
        q[size_t(r * k_dim + i)] = f16_to_f32(row[i]);
        k[size_t(r * k_dim + i)] = f16_to_f32(row[k_dim + i]);
      }
      for (int64_t i = 0; i < v_dim; ++i) v[size_t(r * v_dim + i)] = f16_to_f32(row[2 * k_dim + i]);
    }
    GatedDeltaRuleParams p;
    p.n_tokens = n;
    p.n_k_heads = sh.n_k_heads;
    p.n_v_heads = sh.n_v_heads;
    p.head_k_dim = sh.head_k_dim;
    p.head_v_dim = sh.head_v_dim;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.g = c.g.data() + begin * sh.n_v_heads;
    p.beta = c.beta.data() + begin * sh.n_v_heads;
    p.state = states.data() + int64_t(c.seqs[s].slot) * sh.state_elems();
    p.out = out.data() + begin * v_dim;
    if (n == 1 && c.seqs[s].start_pos > 0) {
      gated_delta_rule_recurrent(p);
    } else {
      gated_delta_rule_chunked(p);
    }
  }
  return out;
}

// One launcher call on the device states (carried between calls); returns the output widened to
// fp32. with_host_rows false forces the prefill path (max_seq_rows > 1), which takes any rows.
std::vector<float> gpu_call(const Call& c, DeviceBuffer<float>& states,
                            bool with_host_rows = true) {
  std::vector<int32_t> slots;
  std::vector<int64_t> start_pos;
  for (const SeqSpec& s : c.seqs) {
    slots.push_back(s.slot);
    start_pos.push_back(s.start_pos);
  }
  const DeviceBuffer<uint16_t> qkv(c.qkv);
  const DeviceBuffer<float> g(c.g);
  const DeviceBuffer<float> beta(c.beta);
  const DeviceBuffer<int32_t> row_begin(c.row_begin);
  const DeviceBuffer<int32_t> slot_buf(slots);
  const DeviceBuffer<int64_t> start_buf(start_pos);
  const std::vector<uint16_t> poison(size_t(c.n_rows() * c.shape.n_v_heads * c.shape.head_v_dim),
                                     kPoisonF16);
  DeviceBuffer<uint16_t> out(poison);

  SequenceRowsView seqs;
  seqs.n_seqs = int64_t(c.seqs.size());
  seqs.row_begin = row_begin.ptr;
  seqs.state_slot = slot_buf.ptr;
  seqs.start_pos = start_buf.ptr;
  set_sequence_launch_facts(seqs, c.row_begin.data(), start_pos.data());
  // The prefill path runs any rows: forced where the step's facts would pick the decode path.
  if (!with_host_rows) seqs.max_seq_rows = std::max<int64_t>(seqs.max_seq_rows, 2);
  const Shape& sh = c.shape;
  const Status status =
      gated_delta_rule_f16(qkv.ptr, g.ptr, beta.ptr, sh.n_k_heads, sh.n_v_heads, sh.head_k_dim,
                           sh.head_v_dim, states.ptr, seqs, out.ptr, /*stream=*/nullptr);
  EXPECT_TRUE(status.ok()) << status.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> result;
  for (const uint16_t h : out.to_host()) result.push_back(f16_to_f32(h));
  return result;
}

// The slots no sequence with rows names: the launcher must leave them bit for bit.
std::vector<int32_t> untouched_slots(const std::vector<SeqSpec>& seqs, int64_t n_slots) {
  std::vector<int32_t> out;
  for (int32_t slot = 0; slot < n_slots; ++slot) {
    const bool written = std::any_of(
        seqs.begin(), seqs.end(), [&](const SeqSpec& s) { return s.slot == slot && s.n_rows > 0; });
    if (!written) out.push_back(slot);
  }
  return out;
}

// One call on both sides from the same states: outputs and states within tolerance, untouched
// slots identical.
void check_call(const Call& c, std::vector<float> states, int64_t n_slots,
                bool with_host_rows = true) {
  DeviceBuffer<float> device_states(states);
  const std::vector<float> gpu_out = gpu_call(c, device_states, with_host_rows);
  const std::vector<float> gpu_states = device_states.to_host();
  const std::vector<float> initial = states;
  const std::vector<float> ref_out = cpu_reference(c, states);
  EXPECT_TRUE(all_close(gpu_out, ref_out, kOutAtol, kOutRtol)) << "output";
  EXPECT_TRUE(all_close(gpu_states, states, kStateAtol, kStateRtol)) << "states";
  const int64_t elems = c.shape.state_elems();
  for (const int32_t slot : untouched_slots(c.seqs, n_slots)) {
    const auto begin = size_t(slot * elems);
    EXPECT_EQ(std::memcmp(gpu_states.data() + begin, initial.data() + begin,
                          size_t(elems) * sizeof(float)),
              0)
        << "slot " << slot << " was written";
  }
}

// Decode rows, a first token, prefills shorter and longer than a chunk (64), a continuation and
// an empty sequence, on shuffled slots of 10 (1, 3, 6 and 9 unused; 4 named by the empty one).
const std::vector<SeqSpec> kMixedSeqs = {
    {1, 7, 40}, {37, 2, 0}, {0, 4, 5}, {70, 0, 0}, {5, 5, 12}, {1, 8, 0},
};
constexpr int64_t kMixedSlots = 10;
// A decode batch (the launcher's decode path: no sequence with more than one row) on the same
// slots: 7, 2 and 0 written.
const std::vector<SeqSpec> kDecodeSeqs = {{1, 7, 40}, {0, 4, 5}, {1, 2, 9}, {1, 0, 3}};

TEST(GatedDeltaRuleCuda, MatchesCpuReferenceOverShapes) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1;
  for (const int64_t n_k_heads : {1, 2}) {
    for (const int64_t group : {1, 2}) {
      for (const int64_t head_k_dim : {16, 64, 128}) {
        for (const int64_t head_v_dim : {16, 64, 128}) {
          const Shape shape{n_k_heads, n_k_heads * group, head_k_dim, head_v_dim};
          SCOPED_TRACE(describe(shape));
          std::mt19937 rng(seed++);
          for (const auto* seqs : {&kMixedSeqs, &kDecodeSeqs}) {
            SCOPED_TRACE(seqs == &kMixedSeqs ? "mixed rows" : "decode rows");
            const Call c = make_call(rng, shape, *seqs);
            std::vector<float> states = random_states(rng, shape, kMixedSlots);
            zero_started_slots(c, states);
            check_call(c, states, kMixedSlots);
          }
        }
      }
    }
  }
}

// The 32-row path (dk > 128, up to 8 warps), warps with rows past dk, partial column tiles, and
// q/k groups of 3.
TEST(GatedDeltaRuleCuda, MatchesCpuReferenceOnOddShapes) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Shape shapes[] = {
      {1, 2, 256, 256}, {2, 6, 100, 40}, {3, 3, 24, 200}, {1, 1, 129, 33}, {1, 3, 1, 1},
  };
  uint32_t seed = 100;
  for (const Shape& shape : shapes) {
    SCOPED_TRACE(describe(shape));
    std::mt19937 rng(seed++);
    for (const auto* seqs : {&kMixedSeqs, &kDecodeSeqs}) {
      SCOPED_TRACE(seqs == &kMixedSeqs ? "mixed rows" : "decode rows");
      const Call c = make_call(rng, shape, *seqs);
      std::vector<float> states = random_states(rng, shape, kMixedSlots);
      zero_started_slots(c, states);
      check_call(c, states, kMixedSlots);
    }
  }
}

// The model's shape in decode: one token per sequence, slots scattered over a pool of 40; on the
// decode path, and on the prefill path (no host row offsets to plan with).
TEST(GatedDeltaRuleCuda, ModelDecodeShape) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Shape shape{16, 32, 128, 128};
  constexpr int64_t kSlots = 40;
  for (const int64_t batch : {32, 1}) {
    SCOPED_TRACE(cat("batch ", batch));
    std::mt19937 rng(uint32_t(200 + batch));
    std::vector<int32_t> pool(kSlots);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<SeqSpec> seqs;
    for (int64_t s = 0; s < batch; ++s)
      seqs.push_back({1, pool[size_t(s)], 1 + int64_t(rng() % 5000)});
    const Call c = make_call(rng, shape, seqs);
    const std::vector<float> states = random_states(rng, shape, kSlots);
    check_call(c, states, kSlots);
    check_call(c, states, kSlots, /*with_host_rows=*/false);
  }
}

// Long prefills (5 chunks) from a zero state and from a carried one: slow decay (g near 0, the
// state accumulates the most) and fast decay (exp(g) down to ~3e-4).
TEST(GatedDeltaRuleCuda, LongPrefill) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Shape shape{1, 2, 128, 128};
  for (const float g_min : {-0.05f, -8.0f}) {
    SCOPED_TRACE(cat("g_min ", g_min));
    std::mt19937 rng(uint32_t(300 - g_min * 10));
    const Call c = make_call(rng, shape, {{300, 1, 0}, {260, 0, 77}}, g_min);
    std::vector<float> states = random_states(rng, shape, 2);
    zero_started_slots(c, states);
    check_call(c, states, 2);
  }
}

// A prefill then single-token decode calls (all sequences at once) equal one call over all the
// tokens, and each side is within tolerance of the CPU (its chunked form for the prefill, its
// recurrent form for the decode rows). The GPU sides agree bit for bit: the kernel walks the
// tokens the same way whatever the split, its decode and prefill paths are the same arithmetic
// in the same order, and the state round-trips through memory in fp32 exactly. (A chunked prefill
// kernel would change that: then compare with kOutAtol / kOutRtol and kStateAtol / kStateRtol.)
TEST(GatedDeltaRuleCuda, PrefillThenDecodeEqualsOneCall) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Shape shape{2, 4, 128, 128};
  constexpr int64_t kSlots = 5;
  const std::vector<SeqSpec> prefill = {{50, 3, 0}, {1, 0, 0}, {20, 4, 0}};
  constexpr int64_t kDecodeSteps = 6;
  std::mt19937 rng(400);

  // The whole token stream of each sequence, as one call.
  std::vector<SeqSpec> whole_seqs = prefill;
  for (SeqSpec& s : whole_seqs) s.n_rows += kDecodeSteps;
  const Call whole = make_call(rng, shape, whole_seqs);
  std::vector<float> initial(size_t(kSlots * shape.state_elems()), 0.0f);
  {
    std::vector<float> noise = random_states(rng, shape, kSlots);
    // Slots no sequence uses (1, 2) keep noise; the sequences start from zeros.
    for (const int32_t slot : {1, 2}) {
      const int64_t elems = shape.state_elems();
      std::copy_n(noise.begin() + slot * elems, elems, initial.begin() + slot * elems);
    }
  }

  // Rows [first, first + n) of sequence s of `whole` as a call of one row range per sequence.
  auto sub_call = [&](const std::vector<int64_t>& first, const std::vector<int64_t>& count) {
    Call c;
    c.shape = shape;
    c.row_begin.push_back(0);
    const int64_t width = shape.row_width();
    for (size_t s = 0; s < whole.seqs.size(); ++s) {
      c.seqs.push_back({count[s], whole.seqs[s].slot, first[s]});
      c.row_begin.push_back(c.row_begin.back() + int32_t(count[s]));
      for (int64_t r = whole.row_begin[s] + first[s]; r < whole.row_begin[s] + first[s] + count[s];
           ++r) {
        c.qkv.insert(c.qkv.end(), whole.qkv.begin() + r * width,
                     whole.qkv.begin() + (r + 1) * width);
        c.g.insert(c.g.end(), whole.g.begin() + r * shape.n_v_heads,
                   whole.g.begin() + (r + 1) * shape.n_v_heads);
        c.beta.insert(c.beta.end(), whole.beta.begin() + r * shape.n_v_heads,
                      whole.beta.begin() + (r + 1) * shape.n_v_heads);
      }
    }
    return c;
  };

  // One call.
  DeviceBuffer<float> whole_states(initial);
  const std::vector<float> whole_out = gpu_call(whole, whole_states);
  std::vector<float> cpu_whole_states = initial;
  const std::vector<float> cpu_whole_out = cpu_reference(whole, cpu_whole_states);
  EXPECT_TRUE(all_close(whole_out, cpu_whole_out, kOutAtol, kOutRtol)) << "one call: output";
  EXPECT_TRUE(all_close(whole_states.to_host(), cpu_whole_states, kStateAtol, kStateRtol))
      << "one call: states";

  // Prefill, then the decode steps, outputs scattered back to the rows of `whole`.
  const int64_t v_dim = shape.n_v_heads * shape.head_v_dim;
  std::vector<float> split_out(whole_out.size(), -99.0f);
  std::vector<float> cpu_split_out(whole_out.size(), -99.0f);
  DeviceBuffer<float> split_states(initial);
  std::vector<float> cpu_split_states = initial;
  std::vector<int64_t> done(prefill.size(), 0);
  for (int64_t step = 0; step <= kDecodeSteps; ++step) {
    std::vector<int64_t> count;
    for (const SeqSpec& s : prefill) count.push_back(step == 0 ? s.n_rows : 1);
    const Call c = sub_call(done, count);
    const std::vector<float> out = gpu_call(c, split_states);
    const std::vector<float> cpu_out = cpu_reference(c, cpu_split_states);
    for (size_t s = 0; s < prefill.size(); ++s) {
      const int64_t dst = (whole.row_begin[s] + done[s]) * v_dim;
      std::copy_n(out.begin() + c.row_begin[s] * v_dim, count[s] * v_dim, split_out.begin() + dst);
      std::copy_n(cpu_out.begin() + c.row_begin[s] * v_dim, count[s] * v_dim,
                  cpu_split_out.begin() + dst);
      done[s] += count[s];
    }
  }
  EXPECT_TRUE(all_close(split_out, whole_out, 0.0, 0.0)) << "split vs one call: output";
  EXPECT_TRUE(all_close(split_states.to_host(), whole_states.to_host(), 0.0, 0.0))
      << "split vs one call: states";
  EXPECT_TRUE(all_close(split_out, cpu_split_out, kOutAtol, kOutRtol)) << "split: output";
  EXPECT_TRUE(all_close(split_states.to_host(), cpu_split_states, kStateAtol, kStateRtol))
      << "split: states";
}

// No rows at all: nothing is written, with and without the host row offsets (without them the
// kernel launches and every CTA finds its sequence empty); no sequences at all.
TEST(GatedDeltaRuleCuda, NoRows) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Shape shape{2, 4, 64, 64};
  std::mt19937 rng(500);
  const Call c = make_call(rng, shape, {{0, 2, 0}, {0, 0, 9}, {0, 1, 3}});
  ASSERT_EQ(c.n_rows(), 0);
  const std::vector<float> initial = random_states(rng, shape, 3);
  for (const bool with_host_rows : {true, false}) {
    SCOPED_TRACE(with_host_rows ? "host row offsets" : "no host row offsets");
    DeviceBuffer<float> states(initial);
    EXPECT_TRUE(gpu_call(c, states, with_host_rows).empty());
    EXPECT_TRUE(all_close(states.to_host(), initial, 0.0, 0.0));
  }
  SequenceRowsView none;
  DeviceBuffer<float> states(initial);
  const Status status = gated_delta_rule_f16(nullptr, nullptr, nullptr, 2, 4, 64, 64, states.ptr,
                                             none, nullptr, nullptr);
  EXPECT_TRUE(status.ok()) << status.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(all_close(states.to_host(), initial, 0.0, 0.0));
}

// Shapes outside the limits are refused with a message naming the limit (no device needed).
TEST(GatedDeltaRuleCuda, RejectsUnsupportedShapes) {
  SequenceRowsView seqs;
  seqs.n_seqs = 1;
  auto message = [&](int64_t nk, int64_t nv, int64_t dk, int64_t dv) {
    const Status status = gated_delta_rule_f16(nullptr, nullptr, nullptr, nk, nv, dk, dv, nullptr,
                                               seqs, nullptr, nullptr);
    EXPECT_FALSE(status.ok()) << "nK " << nk << " nV " << nv << " dk " << dk << " dv " << dv;
    return status.message();
  };
  EXPECT_NE(message(1, 1, 257, 128).find("head_k_dim 257 is above the limit 256"),
            std::string::npos);
  EXPECT_NE(message(2, 3, 128, 128).find("not a multiple of n_k_heads"), std::string::npos);
  EXPECT_NE(message(1, 1, 0, 128).find("head_k_dim 0"), std::string::npos);
  EXPECT_NE(message(1, 1, 128, 0).find("head_v_dim 0"), std::string::npos);
}

}  // namespace
}  // namespace e4kv::cuda
