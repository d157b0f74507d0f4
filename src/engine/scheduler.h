// The continuous-batching scheduler: which rows of which sequences the next forward runs.
//
// There is no prefill or decode phase (vLLM v1's rule). A sequence holds tokens (prompt, then every
// sampled token) of which the first n_computed have their K/V in the cache and their effect in the
// sequence's state; each step gives every running sequence its next uncomputed tokens, a decode row
// (one token) and a prefill chunk alike, under one token budget (max_num_batched_tokens) and at
// most max_num_seqs sequences. A sequence whose step reaches its last token samples the next one.
//
// The scheduler owns the block pool (KV blocks, kv/block_allocator.h) and the pool of state slots
// (a hybrid model's per-sequence DeltaNet/PLE/QSA state, held by the model at that slot index).
// When the pool runs out, the youngest running sequence is preempted by recompute: it gives back
// its blocks and its slot, goes to the front of the waiting queue, and on resuming recomputes its
// tokens (prompt and output so far) before it samples again, so nothing is lost or duplicated.
//
// Forks (n completions of one prompt): a sequence whose prompt is computed forks into sequences
// that share its blocks (reference counts, kv/block_allocator.h) and continue with their own
// tokens. Whichever first writes into a shared, partly filled last block gets its own copy of it
// (StepPlan::block_copies); full blocks stay shared until the last of them ends. A fork is an
// ordinary sequence from then on: preempting it frees its references and it recomputes from its
// own tokens, the shared prompt included.
//
// Plain C++: no backend or model header; tests drive it with a fake model.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "kv/block_allocator.h"

namespace e4kv {

using SequenceId = int64_t;

struct SchedulerConfig {
  int64_t max_num_batched_tokens = 8192;  // rows of one forward
  int64_t max_num_seqs = 64;              // sequences of one forward (and running at once)
  int64_t n_blocks = 0;                   // KV blocks of the pool
  int64_t block_size = 64;
  // State slots of the model's per-sequence pools; 0: the model has none, and max_num_seqs alone
  // bounds the running sequences.
  int64_t n_state_slots = 0;
  int64_t max_model_len = 0;  // longest sequence, prompt plus output
};

enum class SequenceStatus { kWaiting, kRunning, kFinished };

// What the scheduler knows of one sequence.
struct Sequence {
  SequenceId id = 0;
  std::vector<int32_t> tokens;  // the prompt, then the sampled tokens
  int64_t n_prompt = 0;
  int64_t n_computed = 0;  // tokens whose K/V and state are in the cache (== table.n_tokens)
  BlockTable table;
  int32_t state_slot = -1;  // -1 while waiting
  SequenceStatus status = SequenceStatus::kWaiting;
  int64_t n_preemptions = 0;
};

// One sequence's rows in a step: tokens [start, start + n_tokens) of it.
struct ScheduledChunk {
  SequenceId id = 0;
  int64_t start = 0;
  int64_t n_tokens = 0;
  int32_t state_slot = -1;
  // True on the chunk that starts the sequence's state afresh (its first chunk after admission or
  // after a preemption): the runner resets the slot's state before the forward.
  bool fresh_state = false;
  // True when the chunk reaches the sequence's last token: the step samples its next token.
  bool samples = false;
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;  // running sequences first, in admission order
  std::vector<BlockCopy> block_copies;  // to perform on every cache before the forward
  std::vector<SequenceId> preempted;    // sent back to the waiting queue by this step
  int64_t n_tokens = 0;                 // rows of the forward
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);

  const SchedulerConfig& config() const { return config_; }

  // Queues a new sequence of `prompt` that may grow to `max_total_tokens` (prompt plus the most it
  // may generate). Refused (and nothing queued): an empty prompt, an id in use, or a total longer
  // than max_model_len or the pool (a sequence alone must always fit, or it could never finish).
  Status add(SequenceId id, std::vector<int32_t> prompt, int64_t max_total_tokens);

  // The next step's rows. Running sequences first (preempting the youngest while the pool lacks
  // blocks), then waiting ones in order while the budget, the sequence limit, a state slot and the
  // pool allow; none is admitted in a step that preempted. Updates every scheduled sequence's
  // block table (the rows' slots) and marks its chunk computed: the caller must run the forward
  // (a failed forward is the caller's to handle by aborting the sequences it ran).
  StepPlan schedule();

  // Appends the token a step sampled for `id` (a running sequence whose chunk sampled).
  void append_token(SequenceId id, int32_t token);

  // Forks the running sequence `parent`, whose step just sampled (every token computed), into new
  // sequences children[i] that continue with tokens[i] after the parent's tokens. Each shares the
  // parent's blocks and, while a state slot and max_num_seqs allow, runs at once in its own slot
  // (find(child)->state_slot: the caller copies the parent's state there before the next step);
  // otherwise it waits, first in the queue, with nothing computed and recomputes its tokens when
  // admitted, as a preempted sequence does. The parent is unchanged (append_token gives it its
  // own next token). Asserts unused child ids.
  void fork(SequenceId parent, std::span<const SequenceId> children,
            std::span<const int32_t> tokens);

  // Ends a sequence (finished or aborted, waiting or running): its blocks and slot return to the
  // pools and it is forgotten. False for an unknown id.
  bool remove(SequenceId id);

  const Sequence* find(SequenceId id) const;
  int64_t n_waiting() const { return int64_t(waiting_.size()); }
  int64_t n_running() const { return int64_t(running_.size()); }
  int64_t n_free_blocks() const { return allocator_.n_free(); }
  int64_t n_used_blocks() const { return allocator_.n_used(); }
  int64_t n_free_slots() const { return int64_t(free_slots_.size()); }
  int64_t n_preemptions() const { return n_preemptions_; }
  bool has_work() const { return !waiting_.empty() || !running_.empty(); }

 private:
  int64_t slot_capacity() const;
  void preempt(Sequence& seq);

  SchedulerConfig config_;
  BlockAllocator allocator_;
  std::vector<int32_t> free_slots_;  // a stack, lowest slot on top
  std::unordered_map<SequenceId, Sequence> sequences_;
  std::deque<SequenceId> waiting_;
  std::vector<SequenceId> running_;  // admission order: the back is the youngest
  int64_t n_preemptions_ = 0;
};

}  // namespace e4kv
