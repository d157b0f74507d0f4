// The CUDA attention op (PagedAttentionRunner: tensor-core prefill tiles + split-K decode rows,
// planned by the route planner) against the CPU reference on fresh random data: head_dim
// {64,128,256} x GQA {1,4,6,8,16} x block {16,64} x FP16/E4M3 (software and native) x dense/QSA.
// Each batch mixes a whole prompt from position 0, a 67-row chunk (more than one 64-row tile),
// short chunks and decode rows in between. Outputs are poisoned with NaN before each run.
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "attention_data.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/paged_attention.cuh"
#include "backend/cuda/paged_decode_attention.cuh"
#include "device_buffer.cuh"

namespace e4kv::cuda {
namespace {

struct RunResult {
  Comparison cmp;
  int64_t prefill_rows = 0;
};

RunResult run_case(const AttentionCase& c, uint32_t seed) {
  const std::vector<int32_t> seq_lens{1, 37, 700, 1500, 130};
  std::vector<std::pair<int32_t, int32_t>> rows;
  rows.emplace_back(0, 0);
  for (int32_t p = 0; p < 37; ++p) rows.emplace_back(1, p);
  for (int32_t p = 600; p < 667; ++p) rows.emplace_back(2, p);
  rows.emplace_back(3, 1499);
  for (int32_t p = 1000; p < 1005; ++p) rows.emplace_back(3, p);
  for (int32_t p = 100; p < 130; ++p) rows.emplace_back(4, p);
  AttentionData data;
  data.make(c, seq_lens, rows, /*selection_width=*/259, seed);

  DeviceAttentionData device(data);
  const PagedAttentionParams& dev = device.params;

  PagedAttentionRunner runner(0, /*force_software_e4m3=*/!c.native);
  const Status st = runner.run(dev, data.params.rows, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  E4KV_CUDA_CHECK(cudaDeviceSynchronize());
  RunResult result;
  result.cmp = compare_outputs(device.out.to_host(), data.ref);
  const RoutePlan& plan = runner.last_plan();
  for (const RouteLaunch& launch : plan.launches) {
    if (launch.route == 0) result.prefill_rows += launch.n_rows;
  }
  return result;
}

TEST(PagedAttentionCuda, PrefillAndDecodeRoutesMatchCpuReference) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const bool native = decode_attention_native_e4m3_usable(0);
  std::vector<AttentionCase> cases;
  for (int head_dim : {64, 128, 256}) {
    for (int group : {1, 4, 6, 8, 16}) {
      for (int block_size : {16, 64}) {
        for (int variant = 0; variant < 3; ++variant) {
          if (variant == 2 && !native) continue;
          const KvCacheDtype dtype = variant == 0 ? KvCacheDtype::kF16 : KvCacheDtype::kE4m3;
          const bool qsa = (head_dim / 64 + group + block_size / 16 + variant) % 2 == 0;
          cases.push_back(AttentionCase{head_dim, group >= 8 ? 1 : 2, group, block_size, dtype,
                                        qsa, variant == 2});
        }
      }
    }
  }
  double worst = 0;
  uint32_t seed = 100;
  for (const AttentionCase& c : cases) {
    const RunResult r = run_case(c, seed++);
    EXPECT_EQ(r.cmp.n_nan, 0) << describe(c);
    EXPECT_LE(r.cmp.rel_l2, 2e-3) << describe(c) << " max abs " << r.cmp.max_abs_err;
    // Every chunk of 2+ rows went through the prefill kernel: 37 + 67 + 5 + 30 rows.
    EXPECT_EQ(r.prefill_rows, 139) << describe(c);
    worst = std::max(worst, r.cmp.rel_l2);
  }
  std::printf("[ info ] %zu cases (native E4M3 %s), worst relative L2 %.3g\n", cases.size(),
              native ? "included" : "not available", worst);
}

}  // namespace
}  // namespace e4kv::cuda
