#include "model/sequence_slots.h"

namespace e4kv {

SequenceSlots::SequenceSlots(int64_t n_slots)
    : tokens_(size_t(n_slots), -1), poisoned_(size_t(n_slots), 0) {}

Result<int32_t> SequenceSlots::allocate() {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i] < 0) {
      tokens_[i] = 0;
      poisoned_[i] = 0;
      ++n_in_use_;
      return int32_t(i);
    }
  }
  return Status::option_error(
      "max_seqs", cat("all ", tokens_.size(),
                      " sequence state slots are in use; free a sequence or load the model with "
                      "more sequences"));
}

Status SequenceSlots::acquire(int32_t slot) {
  if (slot < 0 || size_t(slot) >= tokens_.size()) {
    return Status::error(cat("sequence slot ", slot, " is outside [0, ", tokens_.size(), ")"));
  }
  if (tokens_[size_t(slot)] >= 0) return Status::error(cat("sequence slot ", slot, " is in use"));
  tokens_[size_t(slot)] = 0;
  poisoned_[size_t(slot)] = 0;
  ++n_in_use_;
  return ok_status();
}

Status SequenceSlots::release(int32_t slot) {
  if (!valid(slot)) return Status::error(cat("sequence slot ", slot, " is not in use"));
  tokens_[size_t(slot)] = -1;
  poisoned_[size_t(slot)] = 0;
  --n_in_use_;
  return ok_status();
}

Status SequenceSlots::copy(int32_t src, int32_t dst) {
  if (!valid(src) || !valid(dst) || src == dst) {
    return Status::error(
        cat("sequence state copy ", src, " -> ", dst, ": both slots must be in use and distinct"));
  }
  if (poisoned(src)) {
    return Status::error(cat("sequence slot ", src,
                             " was left half-written by a failed forward; "
                             "its state cannot be copied"));
  }
  tokens_[size_t(dst)] = tokens_[size_t(src)];
  return ok_status();
}

bool SequenceSlots::valid(int32_t slot) const {
  return slot >= 0 && size_t(slot) < tokens_.size() && tokens_[size_t(slot)] >= 0;
}

}  // namespace e4kv
