// Calibration statistics of a model's forwards on CUDA: the cache write's fused device statistics
// (backend/cuda/cache_write.cuh) reached through Model::start_kv_statistics equal the CPU collector
// run over the FP16 cache the GPU wrote (testing/kv_statistics_check.h), for both families.
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"
#include "testing/kv_statistics_check.h"

namespace e4kv {
namespace {

void check_on_cuda(SynthFamily family) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  ASSERT_TRUE(backend.ok()) << backend.message();
  test::check_kv_statistics(family, **backend);
}

TEST(KvStatisticsCuda, DenseForwardsCollectWhatTheFp16CacheReceived) {
  check_on_cuda(SynthFamily::kLlama);
}

TEST(KvStatisticsCuda, Qwen4ExpForwardsCollectWhatTheFp16CacheReceived) {
  check_on_cuda(SynthFamily::kQwen4Exp);
}

}  // namespace
}  // namespace e4kv
