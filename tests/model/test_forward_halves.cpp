// The two halves of a forward (DESIGN.md section 11) on the CPU backend: after prepare() the
// device half (run_layers) reads nothing of the batch's host arrays. A model runs a step as
// prepare(), then the batch's token ids, positions and block tables are overwritten, then
// run_layers(); its caches equal those of a second model that ran the same step with forward().
// (A layer that still hashed, gathered or planned from the batch inside run_layers, as the PLE
// layer did, would read the overwritten ids.)
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "model/families/dense.h"
#include "model/families/qwen4exp.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

std::vector<float> cache_values(Model& model, int64_t layer) {
  const KvCacheView cache = model.kv_cache(layer);
  std::vector<float> out;
  if (cache.data == nullptr) return out;
  std::vector<uint16_t> bits(size_t(cache.geometry.total_bytes() / 2));
  model.backend().copy_to_host(bits.data(), cache.data, bits.size() * 2);
  out.assign(bits.begin(), bits.end());
  return out;
}

// One prefill step of two sequences (11 and 5 tokens) on `eager` with forward() and on `split`
// with prepare(), overwritten host arrays, run_layers().
template <class M>
void check_halves(M& eager, M& split) {
  std::vector<int32_t> slots;
  for (int s = 0; s < 2; ++s) {
    Result<int32_t> a = eager.allocate_sequence();
    Result<int32_t> b = split.allocate_sequence();
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(*a, *b);
    slots.push_back(*a);
  }
  BlockAllocator allocator(eager.n_blocks(), eager.block_size());
  BlockTable tables[2];
  std::vector<int32_t> ids, row_seq, row_pos, logit_rows;
  const int64_t lens[2] = {11, 5};
  for (int s = 0; s < 2; ++s) {
    allocator.append(tables[s], lens[s]);
    for (int64_t p = 0; p < lens[s]; ++p) {
      ids.push_back(int32_t((p * 29 + 13 * s + 5) % 200));
      row_seq.push_back(s);
      row_pos.push_back(int32_t(p));
    }
    logit_rows.push_back(int32_t(ids.size() - 1));
  }
  ForwardBatch batch;
  batch.token_ids = ids;
  batch.row_seq = row_seq;
  batch.row_pos = row_pos;
  batch.seqs = {&tables[0], &tables[1]};
  batch.logit_rows = logit_rows;
  batch.seq_slots = slots;
  ASSERT_TRUE(eager.forward(batch).ok());

  ASSERT_TRUE(split.prepare(batch).ok());
  std::fill(ids.begin(), ids.end(), 7);
  std::fill(row_pos.begin(), row_pos.end(), 0);
  std::fill(row_seq.begin(), row_seq.end(), 1);
  for (BlockTable& table : tables) std::fill(table.blocks.begin(), table.blocks.end(), 0);
  ASSERT_TRUE(split.run_layers(batch).ok());

  int64_t compared = 0;
  for (int64_t l = 0; l < eager.config().n_layers; ++l) {
    const std::vector<float> a = cache_values(eager, l);
    if (a.empty()) continue;
    EXPECT_TRUE(a == cache_values(split, l)) << "layer " << l;
    ++compared;
  }
  EXPECT_GT(compared, 0);
}

ModelOptions options() {
  ModelOptions o;
  o.block_size = 16;
  o.n_blocks = 8;
  o.max_model_len = 64;
  o.max_seqs = 2;
  return o;
}

TEST(ForwardHalves, DenseRunLayersReadsNoHostDataOfTheBatch) {
  testing_support::TempDir tmp;
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kLlama;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  auto backend = make_cpu_backend({1});
  Result<std::unique_ptr<DenseModel>> eager = DenseModel::load(*ckpt, *backend, options());
  Result<std::unique_ptr<DenseModel>> split = DenseModel::load(*ckpt, *backend, options());
  ASSERT_TRUE(eager.ok() && split.ok());
  check_halves(**eager, **split);
}

TEST(ForwardHalves, Qwen4ExpRunLayersReadsNoHostDataOfTheBatch) {
  testing_support::TempDir tmp;
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kQwen4Exp;
  synth.n_layers = 4;
  synth.ple_layer = 1;  // before the QSA layer 3, whose cache is compared
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  auto backend = make_cpu_backend({1});
  Result<std::unique_ptr<Qwen4ExpModel>> eager = Qwen4ExpModel::load(*ckpt, *backend, options());
  Result<std::unique_ptr<Qwen4ExpModel>> split = Qwen4ExpModel::load(*ckpt, *backend, options());
  ASSERT_TRUE(eager.ok()) << eager.message();
  ASSERT_TRUE(split.ok()) << split.message();
  check_halves(**eager, **split);
}

}  // namespace
}  // namespace e4kv
