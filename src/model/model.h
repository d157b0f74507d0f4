// The model interface the engine runs on, whatever the family: load a checkpoint onto a Backend,
// forward a batch of any mix of prefill chunks and decode rows of several sequences, and say what
// memory a token and a sequence take. A family is a weight-name map and a composition of shared
// layers (model/layers/): today the dense decoders (model/families/dense.h); Qwen4Exp's QSA,
// GatedDeltaNet, MoE and hyper-connection layers join the same interface.
//
// Memory kinds a layer may own:
//   paged KV       per token, in blocks shared by all sequences (the block tables of ForwardBatch)
//   indexer rows   per token / compress ratio, paged with the main block table (QSA layers)
//   per sequence   a fixed size per sequence: recurrent and conv states, the indexer's raw ring,
//                  PLE history (allocated from the model's pools by sequence slot)
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/profiler.h"
#include "core/status.h"
#include "io/checkpoint.h"
#include "kv/block_allocator.h"
#include "kv/scale_gate.h"
#include "model/ple_ngram.h"
#include "model/tp_shard.h"

namespace e4kv {

struct ModelOptions {
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kF16;
  KvScalesMode kv_scales_mode = KvScalesMode::kCalibrated;
  int64_t block_size = 64;  // tokens per cache block, a multiple of 16
  int64_t n_blocks = 0;     // cache blocks shared by all sequences (> 0)
  // Longest sequence (positions 0..max_model_len-1); 0: the config's max_position_embeddings.
  int64_t max_model_len = 0;
  // The most rows one forward takes (vLLM's max_num_batched_tokens); 0: min(max_model_len, 8192).
  // Every workspace is sized from these limits at load: a forward never allocates.
  int64_t max_batch_tokens = 0;
  // The most sequences one forward takes; 0: 64 (capped at max_batch_tokens).
  int64_t max_seqs = 0;
  // The most rows one forward returns logits for; 0: max_seqs (the last row of each sequence).
  int64_t max_logit_rows = 0;
  // How PLE n-gram tables are held in host memory (model/ple_ngram.h); ignored by a model without
  // PLE. ple_cache (optional) shares the E4M3 tables among models of one checkpoint.
  PleDtype ple_dtype = PleDtype::kAuto;
  std::shared_ptr<PleE4m3Cache> ple_cache;
  // This model's share under tensor parallelism (model/tensor_parallel.h loads one per rank);
  // the default is the whole model.
  TpShard tp;
  // Called as the weights load: the checkpoint's tensor bytes taken so far and in all
  // (WeightLoader::set_progress: every further 1% and at the end). Null: none.
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> load_progress;
};

// The PLE n-gram tables a model holds (Qwen4Exp), for the load line and `e4kv compare`.
struct PleTablesSummary {
  struct Layer {
    int64_t layer = 0;  // the model layer
    int64_t n_rows = 0;
    PleTableError error;  // zeros unless E4M3
  };
  PleDtype dtype = PleDtype::kAuto;
  DType checkpoint_dtype = DType::kF32;
  int64_t dim = 0;               // values per row
  int64_t checkpoint_bytes = 0;  // the tables in the checkpoint (memory-mapped)
  int64_t host_bytes = 0;        // the E4M3 copies' codes and scales (0: read in place)
  std::vector<Layer> layers;     // empty: no PLE

  PleTableError error() const {
    PleTableError all;
    for (const Layer& l : layers) all += l.error;
    return all;
  }
};

// The limits a loaded model was sized for (ModelOptions with the defaults filled in).
struct ModelLimits {
  int64_t max_model_len = 0;
  int64_t max_batch_tokens = 0;
  int64_t max_seqs = 0;
  int64_t max_logit_rows = 0;
  // The longest sequence the cache can hold: min(max_model_len, n_blocks * block_size). Every
  // per-sequence and per-position table (block-table stride, RoPE rows, QSA groups) is sized by
  // this, not by max_model_len, so a large --max-model-len costs nothing until the pool holds it.
  int64_t max_seq_tokens = 0;
  int64_t max_blocks_per_seq = 0;  // ceil(max_seq_tokens / block_size), at most n_blocks
};

// Fills the defaults of `options` for a model whose config allows `max_position_embeddings`
// positions; errors name the option that is out of range.
Result<ModelLimits> model_limits(const ModelOptions& options, int64_t max_position_embeddings,
                                 const std::string& config_path);

// Why a forward runs. Only kServe forwards reach the calibration statistics (DESIGN.md sections 6
// and 11): warm-up, memory-profiling and graph-capture forwards run the same ops on made-up or
// repeated tokens, whose K/V must not shape the scales.
enum class ForwardPurpose { kServe, kWarmup, kMemoryProfile, kGraphCapture };

// What a forward shows a probe (e4kv compare): host copies of intermediate tensors, taken after the
// op that makes them. A probe makes the forward copy and wait; only tools use it.
class ForwardProbe {
 public:
  virtual ~ForwardProbe() = default;
  // An attention or QSA layer's output before o_proj (after the QSA output gate), every row:
  // out [n_rows, q_dim] fp32 row-major.
  virtual void attention_output(int64_t layer, std::span<const float> out, int64_t q_dim) = 0;
  // A QSA layer's selected token positions, every row: tokens [n_rows, width] of which the first
  // counts[r] are valid (in the kernel's order), counts [n_rows].
  virtual void qsa_selection(int64_t layer, std::span<const int32_t> tokens,
                             std::span<const int32_t> counts, int64_t width) = 0;
  // An attention or QSA layer's input (what its projections read: the normalized or mixed hidden
  // state), every row: in [n_rows, hidden] in the backend's activation dtype, as bytes. Handed
  // over only when wants_attention_input(). A probe that returns true has replaced the bytes, and
  // the layer reads the replacement: `e4kv compare --isolated` measures every layer of an E4M3
  // run on the FP16 run's inputs, so that no error is carried from one layer to the next.
  virtual bool wants_attention_input() const { return false; }
  virtual bool attention_input(int64_t /*layer*/, std::span<std::byte> /*in*/) { return false; }
};

// One forward: rows of tokens, any mix of prefill chunks and decode rows of several sequences.
// Row r is token token_ids[r] of sequence row_seq[r] at position row_pos[r]. Sequence s has
// block table *seqs[s] whose n_tokens is its length after this forward (positions already in
// the cache plus the rows of this batch); every position 0..row_pos[r] must be in the cache before
// the forward or among its rows (the caller's bookkeeping; not checked). Logits are returned for
// the rows in logit_rows, in that order.
struct ForwardBatch {
  std::span<const int32_t> token_ids;  // [n_rows]
  std::span<const int32_t> row_seq;    // [n_rows] index into seqs
  std::span<const int32_t> row_pos;    // [n_rows]
  std::vector<const BlockTable*> seqs;
  std::span<const int32_t> logit_rows;  // [n_logits] row indices
  // [seqs.size()] the state slot of each sequence (Model::allocate_sequence). Required by models
  // with per-sequence state (ModelMemory::bytes_per_sequence > 0): their rows of one sequence must
  // be contiguous, at consecutive positions starting at the tokens its state has seen. May be
  // empty for a model without per-sequence state.
  std::span<const int32_t> seq_slots;
  ForwardPurpose purpose = ForwardPurpose::kServe;
  ForwardProbe* probe = nullptr;  // optional
  // Decode steps replayed from a graph (engine/step_graphs.h) have a fixed row count per bucket:
  // with pad_to > the rows, the model appends pad_to - rows padding rows, one per padding sequence
  // after the batch's sequences: token 0 at position 0, written into a scratch cache block and a
  // scratch state slot the model keeps outside the pool (Model::reset_padding_state), their logits
  // computed after the rows asked for and not returned. Only for a batch of decode rows: one row
  // per sequence, every row a logit row, in order. 0: no padding.
  int64_t pad_to = 0;
};

// A forward's logits in backend memory (Model::forward_device).
struct DeviceLogits {
  const float* data = nullptr;  // [rows, vocab] fp32
  int64_t rows = 0;
  int64_t vocab = 0;
};

// The calibration statistics of one KV-cache layer: what its cache writes received.
struct LayerKvStats {
  int64_t layer = 0;
  KvTensorStats k, v;
};

// What the model's memory kinds take: paged memory per token (every layer's KV and indexer rows)
// and fixed memory per sequence (states, rings). Capacity planning divides free memory by these.
struct ModelMemory {
  int64_t bytes_per_token = 0;
  int64_t bytes_per_sequence = 0;
};

class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const ModelLimits& limits() const = 0;
  virtual const KvScales& kv_scales() const = 0;
  virtual KvCacheDtype kv_cache_dtype() const = 0;
  virtual int64_t block_size() const = 0;
  virtual int64_t n_blocks() const = 0;
  virtual ModelMemory memory() const = 0;
  virtual Backend& backend() const = 0;

  int64_t vocab_size() const { return config().vocab_size; }
  int64_t max_model_len() const { return limits().max_model_len; }

  // Runs the batch and leaves its logits in backend memory: [logit_rows.size(), vocab_size] fp32,
  // row-major, valid until the next forward (the engine samples them there, Backend::sample_rows).
  // Errors: bad batch metadata (ids out of range, positions beyond the block table or
  // max_model_len, more rows, sequences or logit rows than the limits), non-finite K/V values
  // reaching the cache, a backend op refusing a shape.
  virtual Result<DeviceLogits> forward_device(const ForwardBatch& batch) = 0;
  // forward_device, then the logits copied to the host (tools and tests).
  Result<std::vector<float>> forward(const ForwardBatch& batch) {
    E4KV_ASSIGN_OR_RETURN(const DeviceLogits logits, forward_device(batch));
    std::vector<float> host(size_t(logits.rows * logits.vocab));
    if (!host.empty())
      backend().copy_to_host(host.data(), logits.data, host.size() * sizeof(float));
    return host;
  }

  // What loading decided that a user should see once (one line each), e.g. checkpoint tensors
  // the text model skips.
  virtual std::vector<std::string> load_notes() const { return {}; }

  // The PLE n-gram tables (none for a model without PLE).
  virtual PleTablesSummary ple_tables() const { return {}; }

  // Why the model cannot take token `id` as input (an empty string when it can), for ids inside the
  // vocabulary: Qwen4Exp's image and video placeholders, which need the vision tower e4kv does not
  // run. The engine refuses such a prompt at admission and ends a request that samples such a
  // token, so no forward that runs other requests meets one.
  virtual std::string input_token_problem(int32_t /*id*/) const { return {}; }

  // Inf/NaN K/V values the cache writes met (each fails its forward), counted since load.
  virtual uint64_t kv_nonfinite_inputs() const { return 0; }

  // Marks each section of later forwards (embedding, each layer's mixer and ffn, the logits) on
  // `profiler`, which outlives its use here; nullptr (the default) marks nothing.
  virtual void set_step_profiler(StepProfiler* profiler) = 0;

  // Per-sequence state: a slot of the model's pools (limits().max_seqs of them), initialised for
  // a new sequence (zero states, an EOS-filled n-gram history). Every sequence a forward runs
  // holds one; free it when the sequence ends. Errors when every slot is taken.
  virtual Result<int32_t> allocate_sequence() = 0;
  // The same for a slot the caller chose (the engine's scheduler owns the slot numbers). Errors for
  // a slot out of range or in use.
  virtual Status begin_sequence(int32_t slot) = 0;
  virtual Status free_sequence(int32_t slot) = 0;
  // A forked sequence (n completions of one prompt): `dst_slot`, begun with begin_sequence,
  // becomes a copy of `src_slot`'s state (every per-sequence buffer and the count of tokens seen),
  // so the fork continues from the parent's tokens without recomputing them. Errors for a slot
  // not in use, src == dst, or a source whose state a failed forward left half-written.
  virtual Status copy_sequence_state(int32_t src_slot, int32_t dst_slot) = 0;
  // ---- the halves of forward_device, for graphs of the decode step (engine/step_graphs.h) ----
  // Whether prepare / run_device / finish_step work (the families; not the tensor-parallel
  // wrapper).
  virtual bool supports_step_graphs() const { return false; }
  // The host half: checks the batch and builds, plans and uploads everything the step's ops read
  // (an error changes no sequence's state).
  virtual Status prepare(const ForwardBatch& /*batch*/) {
    return Status::error("this model does not split its forward for step graphs");
  }
  // The device half after prepare(): the layers and the logits, launches only (no allocation, no
  // wait for the device, no decision on host data), so it can be captured in a graph once and
  // replayed after each prepare() of a batch of the same shape. Reads only `purpose` of the batch
  // (and its probe, which step graphs never set).
  virtual Status run_device(const ForwardBatch& /*batch*/) {
    return Status::error("this model does not split its forward for step graphs");
  }
  // After run_device (or its replay) with status `device`: the sequences' states commit (or, on an
  // error, are marked undefined), the non-finite counters are read, and the logits of the rows
  // asked are returned (padding rows' logits excluded).
  virtual Result<DeviceLogits> finish_step(const ForwardBatch& /*batch*/, const Status& device) {
    if (!device.ok()) return device;
    return Status::error("this model does not split its forward for step graphs");
  }
  // Whether a step profiler marks the forwards (graphs stay off meanwhile).
  virtual bool step_profiling() const { return false; }
  // Whether calibration statistics are being collected (graphs stay off meanwhile).
  virtual bool collecting_kv_statistics() const { return false; }
  // Zeroes the scratch state slot the padding rows share (their writes race each other; the
  // engine calls this now and then so the scratch state stays small and finite).
  virtual void reset_padding_state() {}

  // Copy on write of shared cache blocks (kv/block_allocator.h's BlockCopy, the engine's
  // StepPlan::block_copies): in every layer's paged memory (main K/V, QSA compressed indexer
  // rows), block dst becomes a copy of block src, as if the copies ran in order. Run before the
  // forward that writes into the destinations.
  virtual Status copy_blocks(std::span<const BlockCopy> copies) = 0;

  // Calibration (DESIGN.md section 6). After start_kv_statistics(), the cache writes of every
  // kServe forward also accumulate the magnitude statistics of the FP16 K and V values they
  // receive, per KV-cache layer (where the backend runs them; nothing is read back per forward).
  // Errors: an E4M3 cache (scales are measured on the FP16 cache). kv_statistics() reads back
  // what was collected since the start, in config().kv_cache_layers() order (errors when not
  // started); stop_kv_statistics() ends collecting and frees the accumulators.
  virtual Status start_kv_statistics() = 0;
  // The main KV cache of `layer` (data in backend memory), for tools and tests that read it; an
  // empty view (data == nullptr) for a layer without one.
  virtual KvCacheView kv_cache(int64_t layer) const = 0;
  virtual Result<std::vector<LayerKvStats>> kv_statistics() = 0;
  virtual void stop_kv_statistics() = 0;
};

// A sequence slot held for a scope (one request of generate, one `logits` call), freed on exit.
class ScopedSequence {
 public:
  static Result<ScopedSequence> allocate(Model& model) {
    E4KV_ASSIGN_OR_RETURN(const int32_t slot, model.allocate_sequence());
    return ScopedSequence(model, slot);
  }
  ScopedSequence(ScopedSequence&& other) noexcept
      : model_(std::exchange(other.model_, nullptr)), slot_(other.slot_) {}
  ScopedSequence& operator=(ScopedSequence&&) = delete;
  ~ScopedSequence() {
    if (model_ != nullptr) (void)model_->free_sequence(slot_);
  }
  int32_t slot() const { return slot_; }

 private:
  ScopedSequence(Model& model, int32_t slot) : model_(&model), slot_(slot) {}
  Model* model_;
  int32_t slot_;
};

// Loads the family `ckpt` holds. Errors name the architecture when no family runs it.
Result<std::unique_ptr<Model>> load_model(const Checkpoint& ckpt, Backend& backend,
                                          const ModelOptions& options);

}  // namespace e4kv
