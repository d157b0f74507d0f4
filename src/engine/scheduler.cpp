#include "engine/scheduler.h"

#include <algorithm>

#include "core/check.h"

namespace e4kv {

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config), allocator_(config.n_blocks, config.block_size) {
  E4KV_ASSERT(config.max_num_batched_tokens > 0 && config.max_num_seqs > 0 && config.n_blocks > 0,
              "scheduler: limits must be positive");
  for (int64_t s = config.n_state_slots - 1; s >= 0; --s) free_slots_.push_back(int32_t(s));
}

int64_t Scheduler::slot_capacity() const {
  return config_.n_state_slots > 0 ? int64_t(free_slots_.size()) : config_.max_num_seqs;
}

Status Scheduler::add(SequenceId id, std::vector<int32_t> prompt, int64_t max_total_tokens) {
  if (prompt.empty()) return Status::error("the prompt is empty; give at least one token");
  if (sequences_.contains(id)) return Status::error(cat("request id ", id, " is already in use"));
  const int64_t n_prompt = int64_t(prompt.size());
  const int64_t total = std::max(max_total_tokens, n_prompt);
  if (total > config_.max_model_len) {
    return Status::error(cat("the prompt has ", n_prompt, " tokens and may grow to ", total,
                             "; the max model length is ", config_.max_model_len));
  }
  const int64_t pool_tokens = config_.n_blocks * config_.block_size;
  if (total > pool_tokens) {
    return Status::error(cat("the request may grow to ", total, " tokens; the KV pool holds ",
                             pool_tokens, " (", config_.n_blocks, " blocks of ",
                             config_.block_size, ")"));
  }
  Sequence seq;
  seq.id = id;
  seq.tokens = std::move(prompt);
  seq.n_prompt = n_prompt;
  sequences_.emplace(id, std::move(seq));
  waiting_.push_back(id);
  return ok_status();
}

void Scheduler::preempt(Sequence& seq) {
  allocator_.free(seq.table);
  seq.n_computed = 0;
  if (seq.state_slot >= 0 && config_.n_state_slots > 0) free_slots_.push_back(seq.state_slot);
  seq.state_slot = -1;
  seq.status = SequenceStatus::kWaiting;
  seq.n_preemptions += 1;
  n_preemptions_ += 1;
  running_.erase(std::find(running_.begin(), running_.end(), seq.id));
  waiting_.push_front(seq.id);
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  int64_t budget = config_.max_num_batched_tokens;
  // Lowest slots first, so runs are reproducible whatever order slots came back in.
  std::sort(free_slots_.begin(), free_slots_.end(), std::greater<>());

  // Running sequences, oldest first; the youngest gives way when blocks run out.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& seq = sequences_.at(running_[i]);
    const int64_t n = std::min(int64_t(seq.tokens.size()) - seq.n_computed, budget);
    E4KV_ASSERT(n > 0, "scheduler: a running sequence has no token to compute");
    bool self_preempted = false;
    // The need is asked again after each preemption: a victim that shared this sequence's partly
    // filled last block takes the copy on write with it.
    while (!allocator_.can_allocate(allocator_.blocks_to_append(seq.table, n))) {
      Sequence& victim = sequences_.at(running_.back());
      plan.preempted.push_back(victim.id);
      const bool is_self = victim.id == seq.id;
      preempt(victim);
      if (is_self) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;  // it was the youngest: nothing after it runs
    for (const BlockCopy& copy : allocator_.append(seq.table, n)) plan.block_copies.push_back(copy);
    ScheduledChunk chunk;
    chunk.id = seq.id;
    chunk.start = seq.n_computed;
    chunk.n_tokens = n;
    chunk.state_slot = seq.state_slot;
    chunk.fresh_state = seq.n_computed == 0;
    seq.n_computed += n;
    chunk.samples = seq.n_computed == int64_t(seq.tokens.size());
    plan.chunks.push_back(chunk);
    plan.n_tokens += n;
    budget -= n;
    ++i;
  }

  // Waiting sequences in order (preempted ones were put at the front), none after a preemption:
  // the pool is short already.
  while (plan.preempted.empty() && budget > 0 && !waiting_.empty() &&
         int64_t(running_.size()) < config_.max_num_seqs && slot_capacity() > 0) {
    Sequence& seq = sequences_.at(waiting_.front());
    const int64_t n = std::min(int64_t(seq.tokens.size()), budget);
    const int64_t need = allocator_.blocks_to_append(seq.table, n);
    if (!allocator_.can_allocate(need)) break;
    waiting_.pop_front();
    if (config_.n_state_slots > 0) {
      seq.state_slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      seq.state_slot = -1;
    }
    seq.status = SequenceStatus::kRunning;
    running_.push_back(seq.id);
    for (const BlockCopy& copy : allocator_.append(seq.table, n)) plan.block_copies.push_back(copy);
    ScheduledChunk chunk;
    chunk.id = seq.id;
    chunk.start = 0;
    chunk.n_tokens = n;
    chunk.state_slot = seq.state_slot;
    chunk.fresh_state = true;
    seq.n_computed = n;
    chunk.samples = seq.n_computed == int64_t(seq.tokens.size());
    plan.chunks.push_back(chunk);
    plan.n_tokens += n;
    budget -= n;
  }
  return plan;
}

void Scheduler::append_token(SequenceId id, int32_t token) {
  auto it = sequences_.find(id);
  E4KV_ASSERT(it != sequences_.end() && it->second.status == SequenceStatus::kRunning &&
                  it->second.n_computed == int64_t(it->second.tokens.size()),
              "scheduler: a token for a sequence that did not sample");
  it->second.tokens.push_back(token);
}

void Scheduler::fork(SequenceId parent_id, std::span<const SequenceId> children,
                     std::span<const int32_t> tokens) {
  E4KV_ASSERT(children.size() == tokens.size(), "scheduler: a fork needs one token per child");
  const Sequence& parent = sequences_.at(parent_id);
  E4KV_ASSERT(parent.status == SequenceStatus::kRunning &&
                  parent.n_computed == int64_t(parent.tokens.size()),
              "scheduler: forking a sequence that did not sample");
  size_t n_waiting = 0;
  for (size_t i = 0; i < children.size(); ++i) {
    E4KV_ASSERT(!sequences_.contains(children[i]), "scheduler: a fork's id is in use");
    Sequence child;
    child.id = children[i];
    child.tokens = parent.tokens;
    child.tokens.push_back(tokens[i]);
    child.n_prompt = parent.n_prompt;
    if (int64_t(running_.size()) < config_.max_num_seqs && slot_capacity() > 0) {
      child.table = allocator_.fork(parent.table);
      child.n_computed = parent.n_computed;
      if (config_.n_state_slots > 0) {
        std::sort(free_slots_.begin(), free_slots_.end(), std::greater<>());
        child.state_slot = free_slots_.back();
        free_slots_.pop_back();
      }
      child.status = SequenceStatus::kRunning;
      running_.push_back(child.id);
    } else {
      waiting_.insert(waiting_.begin() + std::ptrdiff_t(n_waiting++), child.id);
    }
    sequences_.emplace(child.id, std::move(child));
  }
}

bool Scheduler::remove(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return false;
  Sequence& seq = it->second;
  allocator_.free(seq.table);
  if (seq.status == SequenceStatus::kRunning) {
    if (seq.state_slot >= 0 && config_.n_state_slots > 0) free_slots_.push_back(seq.state_slot);
    running_.erase(std::find(running_.begin(), running_.end(), id));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
  }
  sequences_.erase(it);
  return true;
}

const Sequence* Scheduler::find(SequenceId id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : &it->second;
}

}  // namespace e4kv
