// The pool of per-sequence state slots a model owns (vLLM's mamba cache index, llama.cpp's
// sequence cells): each live sequence holds one slot, and every per-sequence state (DeltaNet conv
// and recurrent states, PLE conv window and n-gram history, QSA indexer ring) lives at that slot
// of its pool. The pool also tracks how many tokens each slot's state has seen, so a forward that
// skips or repeats positions of a recurrent sequence is refused instead of corrupting it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"

namespace e4kv {

class SequenceSlots {
 public:
  explicit SequenceSlots(int64_t n_slots = 0);

  int64_t capacity() const { return int64_t(tokens_.size()); }
  int64_t in_use() const { return n_in_use_; }

  // The lowest free slot, marked in use with 0 tokens seen. Errors when every slot is taken.
  Result<int32_t> allocate();
  // Marks the free slot `slot` in use with 0 tokens seen (the engine's scheduler chooses slots).
  // Errors for a slot out of range or in use.
  Status acquire(int32_t slot);
  // Returns `slot` to the pool. Errors for a slot that is not in use.
  Status release(int32_t slot);

  bool valid(int32_t slot) const;  // in range and in use
  // Checks a state copy from `src` to `dst` (both in use, distinct, src not poisoned) and gives
  // dst the tokens src has seen; the caller copies the state buffers.
  Status copy(int32_t src, int32_t dst);
  int64_t tokens(int32_t slot) const { return tokens_[size_t(slot)]; }
  void set_tokens(int32_t slot, int64_t tokens) { tokens_[size_t(slot)] = tokens; }
  // A forward that failed part-way may have updated a slot's state: it must be freed.
  bool poisoned(int32_t slot) const { return poisoned_[size_t(slot)] != 0; }
  void poison(int32_t slot) { poisoned_[size_t(slot)] = 1; }

 private:
  std::vector<int64_t> tokens_;  // -1: free
  std::vector<uint8_t> poisoned_;
  int64_t n_in_use_ = 0;
};

}  // namespace e4kv
