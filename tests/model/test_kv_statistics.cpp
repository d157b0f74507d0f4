// Calibration statistics of a model's forwards on the CPU (Model::start_kv_statistics, DESIGN.md
// section 6; the check is testing/kv_statistics_check.h): both families; an E4M3 cache refuses to
// collect.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "testing/files.h"
#include "testing/kv_statistics_check.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

TEST(KvStatistics, DenseForwardsCollectWhatTheFp16CacheReceived) {
  auto backend = make_cpu_backend();
  test::check_kv_statistics(SynthFamily::kLlama, *backend);
}

TEST(KvStatistics, Qwen4ExpForwardsCollectWhatTheFp16CacheReceived) {
  auto backend = make_cpu_backend();
  test::check_kv_statistics(SynthFamily::kQwen4Exp, *backend);
}

TEST(KvStatistics, E4m3CacheRefusesToCollect) {
  testing_support::TempDir tmp;
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kQwen4Exp;
  synth.with_kv_scales = true;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  auto backend = make_cpu_backend();
  ModelOptions options;
  options.kv_cache_dtype = KvCacheDtype::kE4m3;
  options.n_blocks = 4;
  options.max_model_len = 64;
  Result<std::unique_ptr<Model>> model = load_model(*ckpt, *backend, options);
  ASSERT_TRUE(model.ok()) << model.message();
  const Status st = (*model)->start_kv_statistics();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("FP16 KV cache"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace e4kv
