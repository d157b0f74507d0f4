// Paged KV cache bookkeeping (DESIGN.md section 3): the block allocator, per-sequence block tables
// and slot mappings. Plain C++, no CUDA header, no storage: the caches themselves are KvCacheView /
// IndexerCompressedView, indexed by the physical block ids handed out here.
//
// One physical block id names the same block in every KV layer's main cache and in every QSA
// layer's compressed indexer cache: a block holds block_size tokens of every KV layer.
//
// Sharing: fork() lets a second sequence reference all blocks of the first (reference counts). A
// block is writable by a sequence only while its reference count is 1; appending tokens into a
// shared, partly filled last block copies it first (copy on write), and append() returns the
// (src, dst) block copies that the caller must perform on every cache before the next write.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "kv/kv_cache_view.h"

namespace e4kv {

// The blocks of one sequence in logical order and the number of tokens they hold. Block i holds
// positions [i * block_size, (i + 1) * block_size); blocks.size() == ceil(n_tokens / block_size).
struct BlockTable {
  std::vector<int32_t> blocks;
  int64_t n_tokens = 0;
};

// A whole-block copy the caller performs on every cache (main K/V of every KV layer, compressed
// indexer rows of every QSA layer): block `dst` becomes a copy of block `src`.
struct BlockCopy {
  int32_t src = -1;
  int32_t dst = -1;
};

// The largest block e4kv accepts. Blocks are pages of the paged cache: vLLM uses 16-128 tokens, and
// a block larger than this only wastes the tail of every sequence.
inline constexpr int64_t kMaxBlockSize = 1024;

// ok when block_size is a positive multiple of 16 no larger than kMaxBlockSize; otherwise an error
// that says so ("block size X is not ...").
Status validate_block_size(int64_t block_size);

// Blocks needed for n_tokens tokens: ceil(n_tokens / block_size), for any n_tokens >= 0.
int64_t blocks_for_tokens(int64_t n_tokens, int64_t block_size);

class BlockAllocator {
 public:
  // n_blocks physical blocks of block_size tokens, all free. block_size is a multiple of 16.
  BlockAllocator(int64_t n_blocks, int64_t block_size);

  int64_t n_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t n_free() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t n_used() const { return n_blocks() - n_free(); }
  int32_t ref_count(int32_t block) const;

  // ---- block level ----
  bool can_allocate(int64_t n) const { return n >= 0 && n <= n_free(); }
  // Takes n blocks off the free list, each with reference count 1. Asserts can_allocate(n): the
  // caller (the scheduler) checks first.
  std::vector<int32_t> allocate(int64_t n);
  // One more reference to an allocated block.
  void add_ref(int32_t block);
  // Drops one reference; the block returns to the free list when none is left.
  void release(int32_t block);

  // ---- sequence level ----
  // New blocks that append(table, n_new_tokens) would take: the blocks for the new tokens plus one
  // copy-on-write block when the last block is shared and partly filled.
  int64_t blocks_to_append(const BlockTable& table, int64_t n_new_tokens) const;
  bool can_append(const BlockTable& table, int64_t n_new_tokens) const {
    return can_allocate(blocks_to_append(table, n_new_tokens));
  }
  // Grows the table by n_new_tokens (a new sequence starts from an empty table). Asserts
  // can_append. Returns the block copies to perform (at most one: the shared last block).
  std::vector<BlockCopy> append(BlockTable& table, int64_t n_new_tokens);
  // A table that shares every block of `table` (each gains a reference).
  BlockTable fork(const BlockTable& table);
  // Releases every block of the table and leaves it empty.
  void free(BlockTable& table);

 private:
  int64_t block_size_;
  std::vector<int32_t> ref_counts_;  // [n_blocks]; 0 = free
  std::vector<int32_t> free_list_;   // a stack; the back is handed out next
};

// Slot of position `pos` of a sequence: block_table[pos / block_size] * block_size
// + pos % block_size, the token row index into [n_blocks * block_size] of a cache.
int64_t slot_for_position(const BlockTable& table, int64_t pos, int64_t block_size);

}  // namespace e4kv
