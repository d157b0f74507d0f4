// The calibration-statistics check shared by the CPU and CUDA tests: a synthetic checkpoint of
// `family` on `backend`, FP16 cache; kServe forwards of one sequence (two prefill chunks, three
// decode steps) with statistics collected, then warm-up, memory-profiling and graph-capture
// forwards of a second sequence; the statistics must equal the CPU collector
// (KvTensorStats::observe) run over the first sequence's rows of the FP16 cache.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "kv/kv_histogram.h"
#include "model/model.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv::test {

// One sequence of a model, fed through forwards of a chosen purpose.
class KvStatisticsSequence {
 public:
  KvStatisticsSequence(Model& model, BlockAllocator& allocator)
      : model_(model), allocator_(allocator), held_(ScopedSequence::allocate(model)) {}

  // Runs `ids` as one forward (prefill chunk or, with one id, a decode step).
  void run(const std::vector<int32_t>& ids, ForwardPurpose purpose) {
    ASSERT_TRUE(held_.ok()) << held_.message();
    allocator_.append(table_, int64_t(ids.size()));
    std::vector<int32_t> seq(ids.size(), 0), pos(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) pos[i] = int32_t(length_ + int64_t(i));
    const int32_t last = int32_t(ids.size() - 1);
    const int32_t slot = held_->slot();
    ForwardBatch batch{ids,
                       seq,
                       pos,
                       {&table_},
                       std::span<const int32_t>(&last, 1),
                       std::span<const int32_t>(&slot, 1)};
    batch.purpose = purpose;
    Result<std::vector<float>> logits = model_.forward(batch);
    ASSERT_TRUE(logits.ok()) << logits.message();
    length_ += int64_t(ids.size());
  }

  // The CPU collector over the K and V rows this sequence's forwards left in `layer`'s FP16 cache.
  std::pair<KvTensorStats, KvTensorStats> cache_stats(int64_t layer) const {
    const KvCacheView cache = model_.kv_cache(layer);
    EXPECT_NE(cache.data, nullptr);
    const KvCacheGeometry& g = cache.geometry;
    std::vector<uint16_t> data(g.total_bytes() / 2);
    model_.backend().copy_to_host(data.data(), cache.data, g.total_bytes());
    KvTensorStats k, v;
    for (int64_t t = 0; t < length_; ++t) {
      const int64_t block = table_.blocks[size_t(t / g.block_size)];
      const int64_t in_block = t % g.block_size;
      k.observe(data.data() + g.elem_offset(block, 0, in_block, 0), g.row_elems());
      v.observe(data.data() + g.elem_offset(block, 1, in_block, 0), g.row_elems());
    }
    return {k, v};
  }

 private:
  Model& model_;
  BlockAllocator& allocator_;
  Result<ScopedSequence> held_;
  BlockTable table_;
  int64_t length_ = 0;
};

inline std::vector<int32_t> kv_statistics_ids(int32_t n, int32_t salt) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < n; ++i) out.push_back((i * 37 + salt * 11 + 5) % 200);
  return out;
}

inline void check_kv_statistics(SynthFamily family, Backend& backend) {
  testing_support::TempDir tmp;
  SynthCheckpointOptions synth;
  synth.family = family;
  synth.n_layers = 4;
  synth.head_dim = 64;  // the CUDA attention routes start at 64
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  ModelOptions options;
  options.block_size = 16;
  options.n_blocks = 16;
  options.max_model_len = 96;
  options.max_seqs = 2;
  Result<std::unique_ptr<Model>> loaded = load_model(*ckpt, backend, options);
  ASSERT_TRUE(loaded.ok()) << loaded.message();
  Model& model = **loaded;
  EXPECT_FALSE(model.kv_statistics().ok());  // not started
  ASSERT_TRUE(model.start_kv_statistics().ok());

  BlockAllocator allocator(options.n_blocks, options.block_size);
  KvStatisticsSequence served(model, allocator);
  served.run(kv_statistics_ids(21, 1), ForwardPurpose::kServe);  // prefill in two chunks, then decode
  served.run(kv_statistics_ids(19, 2), ForwardPurpose::kServe);
  for (int32_t t = 0; t < 3; ++t) served.run({t + 7}, ForwardPurpose::kServe);
  {
    // Forwards that must not reach the statistics, on a second sequence.
    KvStatisticsSequence other(model, allocator);
    other.run(kv_statistics_ids(17, 3), ForwardPurpose::kWarmup);
    other.run(kv_statistics_ids(5, 4), ForwardPurpose::kMemoryProfile);
    other.run({9}, ForwardPurpose::kGraphCapture);
  }

  Result<std::vector<LayerKvStats>> stats = model.kv_statistics();
  ASSERT_TRUE(stats.ok()) << stats.message();
  const std::vector<int64_t> kv_layers = model.config().kv_cache_layers();
  ASSERT_EQ(stats->size(), kv_layers.size());
  for (size_t i = 0; i < kv_layers.size(); ++i) {
    const LayerKvStats& got = (*stats)[i];
    EXPECT_EQ(got.layer, kv_layers[i]);
    const auto [k, v] = served.cache_stats(got.layer);
    EXPECT_EQ(got.k.count(), (21 + 19 + 3) * model.kv_cache(got.layer).geometry.row_elems());
    EXPECT_GT(got.k.nonzero(), 0);
    EXPECT_TRUE(got.k == k) << "layer " << got.layer << " K";
    EXPECT_TRUE(got.v == v) << "layer " << got.layer << " V";
  }
  model.stop_kv_statistics();
  EXPECT_FALSE(model.kv_statistics().ok());
}

}  // namespace e4kv::test
