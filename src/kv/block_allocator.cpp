#include "kv/block_allocator.h"

#include <algorithm>
#include <limits>

#include "core/check.h"
#include "core/status.h"

namespace e4kv {

Status validate_block_size(int64_t block_size) {
  if (block_size <= 0 || block_size % 16 != 0 || block_size > kMaxBlockSize) {
    return Status::error(cat("block size ", block_size,
                             " is not a positive multiple of 16 no larger than ", kMaxBlockSize,
                             " (try 16, 32 or 64)"));
  }
  return ok_status();
}

int64_t blocks_for_tokens(int64_t n_tokens, int64_t block_size) {
  E4KV_ASSERT(n_tokens >= 0 && block_size > 0, "blocks_for_tokens: bad arguments");
  return n_tokens / block_size + (n_tokens % block_size != 0 ? 1 : 0);
}

BlockAllocator::BlockAllocator(int64_t n_blocks, int64_t block_size) : block_size_(block_size) {
  E4KV_ASSERT(block_size > 0 && block_size % 16 == 0,
              cat("block_size must be a positive multiple of 16, got ", block_size));
  E4KV_ASSERT(n_blocks >= 0 && n_blocks <= std::numeric_limits<int32_t>::max(),
              cat("n_blocks out of range: ", n_blocks));
  ref_counts_.assign(static_cast<size_t>(n_blocks), 0);
  // Block 0 is handed out first, then 1, 2, ... (deterministic order for tests and traces).
  free_list_.reserve(static_cast<size_t>(n_blocks));
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_list_.push_back(static_cast<int32_t>(b));
}

int32_t BlockAllocator::ref_count(int32_t block) const {
  E4KV_ASSERT(block >= 0 && block < n_blocks(), cat("block id out of range: ", block));
  return ref_counts_[static_cast<size_t>(block)];
}

std::vector<int32_t> BlockAllocator::allocate(int64_t n) {
  E4KV_ASSERT(can_allocate(n), cat("allocate(", n, ") with ", n_free(), " free blocks"));
  std::vector<int32_t> blocks;
  blocks.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t block = free_list_.back();
    free_list_.pop_back();
    E4KV_ASSERT(ref_counts_[static_cast<size_t>(block)] == 0, "a free block has references");
    ref_counts_[static_cast<size_t>(block)] = 1;
    blocks.push_back(block);
  }
  return blocks;
}

void BlockAllocator::add_ref(int32_t block) {
  E4KV_ASSERT(ref_count(block) > 0, cat("add_ref on free block ", block));
  ++ref_counts_[static_cast<size_t>(block)];
}

void BlockAllocator::release(int32_t block) {
  E4KV_ASSERT(ref_count(block) > 0, cat("release of free block ", block));
  if (--ref_counts_[static_cast<size_t>(block)] == 0) free_list_.push_back(block);
}

int64_t BlockAllocator::blocks_to_append(const BlockTable& table, int64_t n_new_tokens) const {
  E4KV_ASSERT(n_new_tokens >= 0, "blocks_to_append: negative token count");
  const int64_t have = static_cast<int64_t>(table.blocks.size());
  const int64_t need = blocks_for_tokens(table.n_tokens + n_new_tokens, block_size_);
  int64_t n = need - have;
  const bool partial_last = table.n_tokens % block_size_ != 0;
  if (n_new_tokens > 0 && partial_last && ref_count(table.blocks.back()) > 1) ++n;
  return n;
}

std::vector<BlockCopy> BlockAllocator::append(BlockTable& table, int64_t n_new_tokens) {
  E4KV_ASSERT(
      static_cast<int64_t>(table.blocks.size()) == blocks_for_tokens(table.n_tokens, block_size_),
      "append: block table does not match its token count");
  E4KV_ASSERT(can_append(table, n_new_tokens),
              cat("append(", n_new_tokens, " tokens) needs ", blocks_to_append(table, n_new_tokens),
                  " blocks, ", n_free(), " free"));
  std::vector<BlockCopy> copies;
  if (n_new_tokens == 0) return copies;
  if (table.n_tokens % block_size_ != 0 && ref_count(table.blocks.back()) > 1) {
    // The new tokens land in a block another sequence still reads: give this sequence its own copy.
    const int32_t shared = table.blocks.back();
    const int32_t own = allocate(1)[0];
    release(shared);
    table.blocks.back() = own;
    copies.push_back({shared, own});
  }
  const int64_t need = blocks_for_tokens(table.n_tokens + n_new_tokens, block_size_);
  const std::vector<int32_t> fresh = allocate(need - static_cast<int64_t>(table.blocks.size()));
  table.blocks.insert(table.blocks.end(), fresh.begin(), fresh.end());
  table.n_tokens += n_new_tokens;
  return copies;
}

BlockTable BlockAllocator::fork(const BlockTable& table) {
  for (int32_t block : table.blocks) add_ref(block);
  return table;
}

void BlockAllocator::free(BlockTable& table) {
  // Release in reverse so the free stack hands the blocks out again in their original order.
  for (auto it = table.blocks.rbegin(); it != table.blocks.rend(); ++it) release(*it);
  table.blocks.clear();
  table.n_tokens = 0;
}

int64_t slot_for_position(const BlockTable& table, int64_t pos, int64_t block_size) {
  E4KV_ASSERT(pos >= 0 && pos / block_size < static_cast<int64_t>(table.blocks.size()),
              cat("position ", pos, " is outside the sequence's ", table.blocks.size(), " blocks"));
  return static_cast<int64_t>(table.blocks[static_cast<size_t>(pos / block_size)]) * block_size +
         pos % block_size;
}

}  // namespace e4kv
