// The CUDA backend's qsa_indexer_write against the CPU backend's through the Backend interface,
// when the RoPE frequencies change at an unchanged address: models loaded one after another on one
// backend can get a freed model's frequency array back from the allocator, and the backend's RoPE
// table must follow the values (it once compared the pointer and reused a stale table, which made
// the Qwen4Exp parity test fail or pass depending on what ran before it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"
#include "core/half.h"
#include "core/norm_rope.h"

namespace e4kv {
namespace {

constexpr int64_t kRatio = 4;
constexpr int64_t kDim = 64;
constexpr int64_t kRotary = 32;
constexpr int64_t kBlockSize = 16;
constexpr int64_t kTokens = 12;  // three completed groups

// The compressed rows the backend writes for one fresh sequence of kTokens raw keys.
std::vector<uint16_t> write_rows(Backend& b, const std::vector<uint16_t>& keys,
                                 const std::vector<uint16_t>& weight,
                                 const std::vector<double>& inv_freq) {
  const size_t compressed_elems = size_t(kBlockSize / kRatio * kDim);
  // The op alone, outside a model that reserved its workspaces: its RoPE table grows here.
  b.allow_workspace_growth(true);
  auto buffer = [&](size_t bytes, const void* host) {
    Result<BackendBuffer> buf = b.allocate(bytes);
    EXPECT_TRUE(buf.ok()) << buf.message();
    if (host != nullptr) b.copy_from_host(buf->data(), host, bytes);
    return std::move(*buf);
  };
  const std::vector<int32_t> row_begin{0, int32_t(kTokens)}, slot{0}, table{0};
  const std::vector<int64_t> start{0};
  BackendBuffer compressed = buffer(compressed_elems * 2, nullptr);
  BackendBuffer rings = buffer(size_t(kRatio * kDim * 2), nullptr);
  BackendBuffer d_keys = buffer(keys.size() * 2, keys.data());
  BackendBuffer d_weight = buffer(weight.size() * 2, weight.data());
  BackendBuffer d_row_begin = buffer(row_begin.size() * 4, row_begin.data());
  BackendBuffer d_slot = buffer(slot.size() * 4, slot.data());
  BackendBuffer d_start = buffer(start.size() * 8, start.data());
  BackendBuffer d_table = buffer(table.size() * 4, table.data());
  const IndexerCompressedView cv{static_cast<uint16_t*>(compressed.data()), 1, kBlockSize, kRatio,
                                 kDim};
  const IndexerRingView rv{static_cast<uint16_t*>(rings.data()), 1, kRatio, kDim};
  SequenceRowsView seqs;
  seqs.n_seqs = 1;
  seqs.row_begin = static_cast<const int32_t*>(d_row_begin.data());
  seqs.state_slot = static_cast<const int32_t*>(d_slot.data());
  seqs.start_pos = static_cast<const int64_t*>(d_start.data());
  set_sequence_launch_facts(seqs, row_begin.data(), start.data());
  const BlockTableView bt{static_cast<const int32_t*>(d_table.data()), 1, 1};
  const IndexerKeyNormRope nr{static_cast<const uint16_t*>(d_weight.data()), 1e-6f, kRotary,
                              inv_freq.data()};
  const Status st = b.qsa_indexer_write(cv, rv, static_cast<const uint16_t*>(d_keys.data()),
                                        seqs, bt, nr);
  EXPECT_TRUE(st.ok()) << st.message();
  std::vector<uint16_t> out(compressed_elems);
  b.copy_to_host(out.data(), compressed.data(), out.size() * 2);
  return out;
}

TEST(QsaIndexerBackendCuda, RopeTableFollowsTheFrequenciesNotTheirAddress) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Result<std::unique_ptr<Backend>> gpu = make_cuda_backend();
  ASSERT_TRUE(gpu.ok()) << gpu.message();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> keys(static_cast<size_t>(kTokens * kDim));
  std::vector<uint16_t> weight(static_cast<size_t>(kDim));
  for (auto& x : keys) x = f32_to_f16(normal(rng));
  for (auto& x : weight) x = f32_to_f16(0.1f * normal(rng));
  // One array, rewritten in place between the two writes: the same address, other values.
  std::vector<double> inv_freq = rope_inv_freq(1e4, kRotary);
  const double* address = inv_freq.data();
  ASSERT_EQ(write_rows(**gpu, keys, weight, inv_freq), write_rows(*cpu, keys, weight, inv_freq));
  const std::vector<double> other = rope_inv_freq(1e6, kRotary);
  ASSERT_NE(other, inv_freq);
  std::copy(other.begin(), other.end(), inv_freq.begin());
  ASSERT_EQ(inv_freq.data(), address);
  const std::vector<uint16_t> on_gpu = write_rows(**gpu, keys, weight, inv_freq);
  const std::vector<uint16_t> on_cpu = write_rows(*cpu, keys, weight, inv_freq);
  int64_t differ = 0;
  for (size_t i = 0; i < on_cpu.size(); ++i) differ += on_gpu[i] != on_cpu[i] ? 1 : 0;
  EXPECT_EQ(differ, 0) << "of " << on_cpu.size() << " FP16 elements of the compressed rows";
}

}  // namespace
}  // namespace e4kv
