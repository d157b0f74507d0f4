// The device half of a forward is launch-only (DESIGN.md section 11): after prepare() (the host
// half: checks, metadata, attention plans, PLE rows, one upload) a model's run_layers() issues no
// allocation and no wait for the device, so a decode step's run_layers() can be captured in a CUDA
// graph (global capture mode: an allocation, a synchronisation or a copy from pageable memory
// would invalidate the capture) and replayed. Two copies of a model on one backend run the same
// decode steps, one eagerly (forward) and one from the graph (prepare, then replay; recaptured only
// when the step's attention plan changes its launches): their KV caches are bit-identical after
// every step, and a last eager forward on both gives identical logits. The backend's counters show
// no allocation and no host wait from prepare() through the capture and the replay. Workspace
// growth is forbidden throughout (Backend::allow_workspace_growth(false)): every workspace was
// sized at load.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "model/families/dense.h"
#include "model/families/qwen4exp.h"
#include "require_gpu.h"
#include "testing/files.h"
#include "testing/hf_qwen4exp.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

std::vector<std::byte> cache_bytes(Model& model, int64_t layer) {
  const KvCacheView cache = model.kv_cache(layer);
  std::vector<std::byte> bytes(cache.data != nullptr ? size_t(cache.geometry.total_bytes()) : 0);
  if (!bytes.empty()) model.backend().copy_to_host(bytes.data(), cache.data, bytes.size());
  return bytes;
}

void expect_same_caches(Model& a, Model& b, const char* when) {
  for (int64_t l = 0; l < a.config().n_layers; ++l) {
    EXPECT_TRUE(cache_bytes(a, l) == cache_bytes(b, l)) << when << ": layer " << l;
  }
}

// Two sequences on both models (the same block ids: each model has its own caches).
struct Sequences {
  BlockAllocator allocator;
  BlockTable tables[2];
  std::vector<int32_t> slots;

  Sequences(int64_t n_blocks, int64_t block_size) : allocator(n_blocks, block_size) {}
};

template <class M>
void run_decode_steps(M& eager, M& graphed, Backend& backend, int n_steps) {
  Sequences seqs(eager.n_blocks(), eager.block_size());
  std::vector<int32_t> slots;
  for (int s = 0; s < 2; ++s) {
    Result<int32_t> a = eager.allocate_sequence();
    Result<int32_t> b = graphed.allocate_sequence();
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(*a, *b);
    slots.push_back(*a);
  }
  // Prefill: 19 tokens of sequence 0, then 6 of sequence 1, eagerly on both.
  const int64_t lens[2] = {19, 6};
  std::vector<int32_t> ids, row_seq, row_pos;
  for (int s = 0; s < 2; ++s) {
    seqs.allocator.append(seqs.tables[s], lens[s]);
    for (int64_t p = 0; p < lens[s]; ++p) {
      ids.push_back(int32_t((p * 31 + 7 * s + 3) % std::min<int64_t>(eager.vocab_size(), 200)));
      row_seq.push_back(s);
      row_pos.push_back(int32_t(p));
    }
  }
  std::vector<int32_t> logit_rows{int32_t(lens[0] - 1), int32_t(lens[0] + lens[1] - 1)};
  ForwardBatch prefill;
  prefill.token_ids = ids;
  prefill.row_seq = row_seq;
  prefill.row_pos = row_pos;
  prefill.seqs = {&seqs.tables[0], &seqs.tables[1]};
  prefill.logit_rows = logit_rows;
  prefill.seq_slots = slots;
  Result<std::vector<float>> first = eager.forward(prefill);
  ASSERT_TRUE(first.ok()) << first.message();
  ASSERT_TRUE(graphed.forward(prefill).ok());
  expect_same_caches(eager, graphed, "after the prefill");

  const int64_t vocab = eager.vocab_size();
  std::vector<float> logits = *first;
  std::unique_ptr<CudaGraph> graph;
  uint64_t graph_signature = 0;
  int captures = 0;
  for (int step = 0; step < n_steps; ++step) {
    SCOPED_TRACE(testing::Message() << "decode step " << step);
    // Greedy tokens from the eager model's logits; one row per sequence.
    std::vector<int32_t> step_ids(2), step_seq{0, 1}, step_pos(2), step_logits{0, 1};
    for (int s = 0; s < 2; ++s) {
      const float* row = logits.data() + s * vocab;
      step_ids[size_t(s)] = int32_t(std::max_element(row, row + vocab) - row);
      step_pos[size_t(s)] = int32_t(seqs.tables[s].n_tokens);
      seqs.allocator.append(seqs.tables[s], 1);
    }
    ForwardBatch batch;
    batch.token_ids = step_ids;
    batch.row_seq = step_seq;
    batch.row_pos = step_pos;
    batch.seqs = {&seqs.tables[0], &seqs.tables[1]};
    batch.logit_rows = step_logits;
    batch.seq_slots = slots;
    Result<std::vector<float>> eager_logits = eager.forward(batch);
    ASSERT_TRUE(eager_logits.ok()) << eager_logits.message();
    logits = *eager_logits;

    const CudaBackendCounters before = cuda_backend_counters(backend);
    ASSERT_TRUE(graphed.prepare(batch).ok());
    const uint64_t signature = cuda_attention_plan_signature(backend);
    if (graph == nullptr || signature != graph_signature) {
      Result<std::unique_ptr<CudaGraph>> captured =
          capture_cuda_graph(backend, [&] { return graphed.run_layers(batch); });
      ASSERT_TRUE(captured.ok()) << captured.message();
      graph = std::move(captured).value();
      graph_signature = signature;
      ++captures;
    }
    ASSERT_TRUE(graph->replay().ok());
    const CudaBackendCounters after = cuda_backend_counters(backend);
    EXPECT_EQ(after.allocations, before.allocations);
    EXPECT_EQ(after.host_waits, before.host_waits);
    backend.synchronize();
    expect_same_caches(eager, graphed, "after a replay");
    if constexpr (std::is_same_v<M, Qwen4ExpModel>) {
      // The recurrent states advanced in the graph; only the slots' token counts (committed by
      // forward's tail) remain: one replayed step is compared, then the loop ends.
      break;
    }
  }
  // The decode steps stay within one plan for most steps: the graph was replayed after a refresh.
  if constexpr (!std::is_same_v<M, Qwen4ExpModel>) {
    EXPECT_LT(captures, n_steps);
    // Both models' states are the same: one more eager step gives the same logits.
    std::vector<int32_t> step_ids{1, 2}, step_seq{0, 1}, step_pos(2), step_logits{0, 1};
    for (int s = 0; s < 2; ++s) {
      step_pos[size_t(s)] = int32_t(seqs.tables[s].n_tokens);
      seqs.allocator.append(seqs.tables[s], 1);
    }
    ForwardBatch batch;
    batch.token_ids = step_ids;
    batch.row_seq = step_seq;
    batch.row_pos = step_pos;
    batch.seqs = {&seqs.tables[0], &seqs.tables[1]};
    batch.logit_rows = step_logits;
    batch.seq_slots = slots;
    Result<std::vector<float>> a = eager.forward(batch);
    Result<std::vector<float>> b = graphed.forward(batch);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(*a == *b);
  }
}

ModelOptions small_options() {
  ModelOptions options;
  options.block_size = 16;
  options.n_blocks = 64;
  options.max_model_len = 512;
  options.max_batch_tokens = 64;
  options.max_seqs = 4;
  options.max_logit_rows = 4;
  return options;
}

TEST(ForwardGraphCuda, DenseDecodeStepReplaysFromAGraphAsEager) {
  E4KV_REQUIRE_GPU();
  testing_support::TempDir tmp;
  SynthCheckpointOptions synth;
  synth.family = SynthFamily::kQwen3;
  synth.head_dim = 64;
  synth.dtype = DType::kF16;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  ASSERT_TRUE(backend.ok()) << backend.message();
  (*backend)->allow_workspace_growth(false);
  for (const KvCacheDtype dtype : {KvCacheDtype::kF16, KvCacheDtype::kE4m3}) {
    SCOPED_TRACE(dtype == KvCacheDtype::kF16 ? "FP16 cache" : "E4M3 cache");
    ModelOptions options = small_options();
    options.kv_cache_dtype = dtype;
    options.kv_scales_mode = KvScalesMode::kUnit;
    Result<std::unique_ptr<DenseModel>> eager = DenseModel::load(*ckpt, **backend, options);
    Result<std::unique_ptr<DenseModel>> graphed = DenseModel::load(*ckpt, **backend, options);
    ASSERT_TRUE(eager.ok()) << eager.message();
    ASSERT_TRUE(graphed.ok()) << graphed.message();
    run_decode_steps(**eager, **graphed, **backend, 12);
  }
}

TEST(ForwardGraphCuda, Qwen4ExpDecodeStepReplaysFromAGraphAsEager) {
  E4KV_REQUIRE_GPU();
  const std::vector<fs::path> dirs = test::qwen4exp_cases();
  ASSERT_FALSE(dirs.empty());
  Result<Checkpoint> ckpt = Checkpoint::open(dirs.front());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<std::unique_ptr<Backend>> backend = make_cuda_backend();
  ASSERT_TRUE(backend.ok()) << backend.message();
  (*backend)->allow_workspace_growth(false);
  ModelOptions options = small_options();
  options.max_model_len = 256;
  Result<std::unique_ptr<Qwen4ExpModel>> eager = Qwen4ExpModel::load(*ckpt, **backend, options);
  Result<std::unique_ptr<Qwen4ExpModel>> graphed = Qwen4ExpModel::load(*ckpt, **backend, options);
  ASSERT_TRUE(eager.ok()) << eager.message();
  ASSERT_TRUE(graphed.ok()) << graphed.message();
  run_decode_steps(**eager, **graphed, **backend, 1);
}

}  // namespace
}  // namespace e4kv
