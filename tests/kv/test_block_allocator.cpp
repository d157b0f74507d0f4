// Block allocator, block tables and slot mapping. The random test drives the allocator with a
// seeded sequence of new / append / fork / free against a plain model of what every sequence holds,
// and also simulates cache contents so that a missing copy-on-write shows up as a corrupted token.
#include "kv/block_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

namespace e4kv {
namespace {

TEST(BlockAllocator, BlocksForTokens) {
  EXPECT_EQ(blocks_for_tokens(0, 16), 0);
  EXPECT_EQ(blocks_for_tokens(1, 16), 1);
  EXPECT_EQ(blocks_for_tokens(16, 16), 1);
  EXPECT_EQ(blocks_for_tokens(17, 16), 2);
  EXPECT_EQ(blocks_for_tokens(128001, 64), 2001);
}

TEST(BlockAllocator, AllocatesInOrderAndRecyclesFreedBlocks) {
  BlockAllocator allocator(4, 16);
  EXPECT_EQ(allocator.n_free(), 4);
  EXPECT_TRUE(allocator.can_allocate(4));
  EXPECT_FALSE(allocator.can_allocate(5));
  EXPECT_EQ(allocator.allocate(3), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(allocator.n_free(), 1);
  EXPECT_EQ(allocator.ref_count(1), 1);
  allocator.add_ref(1);
  EXPECT_EQ(allocator.ref_count(1), 2);
  allocator.release(1);
  EXPECT_EQ(allocator.n_free(), 1);  // still referenced once
  allocator.release(1);
  EXPECT_EQ(allocator.ref_count(1), 0);
  EXPECT_EQ(allocator.n_free(), 2);
  EXPECT_EQ(allocator.allocate(1), (std::vector<int32_t>{1}));  // the freed block comes back first
  EXPECT_EQ(allocator.allocate(1), (std::vector<int32_t>{3}));
  EXPECT_FALSE(allocator.can_allocate(1));
  EXPECT_TRUE(allocator.can_allocate(0));
}

TEST(BlockAllocator, AppendGrowsTheTableByWholeBlocks) {
  BlockAllocator allocator(8, 16);
  BlockTable table;
  EXPECT_EQ(allocator.blocks_to_append(table, 0), 0);
  EXPECT_EQ(allocator.blocks_to_append(table, 17), 2);
  EXPECT_TRUE(allocator.append(table, 17).empty());
  EXPECT_EQ(table.n_tokens, 17);
  EXPECT_EQ(table.blocks, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(allocator.blocks_to_append(table, 15), 0);  // fills block 1
  EXPECT_EQ(allocator.blocks_to_append(table, 16), 1);
  allocator.append(table, 15);
  EXPECT_EQ(table.blocks.size(), 2u);
  allocator.append(table, 1);
  EXPECT_EQ(table.blocks, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FALSE(allocator.can_append(table, 6 * 16));
  EXPECT_TRUE(allocator.can_append(table, 15 + 5 * 16));
  allocator.free(table);
  EXPECT_TRUE(table.blocks.empty());
  EXPECT_EQ(table.n_tokens, 0);
  EXPECT_EQ(allocator.n_free(), 8);
}

TEST(BlockAllocator, ForkSharesAndAppendCopiesTheSharedPartialBlock) {
  BlockAllocator allocator(8, 16);
  BlockTable parent;
  allocator.append(parent, 20);  // blocks 0 (full) and 1 (4 tokens)
  BlockTable child = allocator.fork(parent);
  EXPECT_EQ(child.blocks, parent.blocks);
  EXPECT_EQ(allocator.ref_count(0), 2);
  EXPECT_EQ(allocator.ref_count(1), 2);
  EXPECT_EQ(allocator.n_free(), 6);

  // The child writes into shared block 1: it gets its own copy, block 0 stays shared.
  EXPECT_EQ(allocator.blocks_to_append(child, 1), 1);
  const std::vector<BlockCopy> copies = allocator.append(child, 1);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, 1);
  EXPECT_EQ(copies[0].dst, 2);
  EXPECT_EQ(child.blocks, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(allocator.ref_count(1), 1);
  EXPECT_EQ(allocator.ref_count(0), 2);

  // Now the parent owns block 1 alone: no copy.
  EXPECT_EQ(allocator.blocks_to_append(parent, 12), 0);
  EXPECT_TRUE(allocator.append(parent, 12).empty());

  // A fork at a block boundary never copies: the new tokens go to a fresh block.
  BlockTable grandchild = allocator.fork(parent);  // parent: 32 tokens, blocks 0 and 1 full
  EXPECT_EQ(allocator.blocks_to_append(grandchild, 1), 1);
  EXPECT_TRUE(allocator.append(grandchild, 1).empty());
  EXPECT_EQ(grandchild.blocks.size(), 3u);

  allocator.free(parent);
  allocator.free(child);
  allocator.free(grandchild);
  EXPECT_EQ(allocator.n_free(), 8);
  for (int32_t b = 0; b < 8; ++b) EXPECT_EQ(allocator.ref_count(b), 0);
}

// The model: every live sequence's token values; the "cache" is one int per slot.
struct ModelSeq {
  BlockTable table;
  std::vector<int64_t> tokens;
};

void check_invariants(const BlockAllocator& allocator, const std::map<int, ModelSeq>& seqs,
                      const std::vector<int64_t>& cache, int64_t step) {
  const int64_t block_size = allocator.block_size();
  std::vector<int32_t> refs(static_cast<size_t>(allocator.n_blocks()), 0);
  for (const auto& [id, seq] : seqs) {
    ASSERT_EQ(seq.table.n_tokens, static_cast<int64_t>(seq.tokens.size())) << "step " << step;
    ASSERT_EQ(static_cast<int64_t>(seq.table.blocks.size()),
              blocks_for_tokens(seq.table.n_tokens, block_size))
        << "step " << step;
    std::set<int32_t> distinct(seq.table.blocks.begin(), seq.table.blocks.end());
    ASSERT_EQ(distinct.size(), seq.table.blocks.size()) << "a block twice in one table";
    for (int32_t b : seq.table.blocks) {
      ASSERT_GE(b, 0);
      ASSERT_LT(b, allocator.n_blocks());
      ++refs[static_cast<size_t>(b)];
    }
    // Every token reads back through the table: no sequence wrote into a block another one reads.
    for (int64_t pos = 0; pos < seq.table.n_tokens; ++pos) {
      ASSERT_EQ(cache[static_cast<size_t>(slot_for_position(seq.table, pos, block_size))],
                seq.tokens[static_cast<size_t>(pos)])
          << "step " << step << " seq " << id << " pos " << pos;
    }
  }
  int64_t used = 0;
  for (int32_t b = 0; b < allocator.n_blocks(); ++b) {
    ASSERT_EQ(allocator.ref_count(b), refs[static_cast<size_t>(b)])
        << "step " << step << " block " << b;
    used += refs[static_cast<size_t>(b)] > 0 ? 1 : 0;
  }
  ASSERT_EQ(allocator.n_used(), used) << "step " << step;
  ASSERT_EQ(allocator.n_free(), allocator.n_blocks() - used);
}

TEST(BlockAllocator, RandomOperationsKeepTheInvariants) {
  for (const int64_t block_size : {16, 32}) {
    const int64_t n_blocks = 40;
    BlockAllocator allocator(n_blocks, block_size);
    std::vector<int64_t> cache(static_cast<size_t>(n_blocks * block_size), -1);
    std::map<int, ModelSeq> seqs;
    std::mt19937_64 rng(1234 + static_cast<uint64_t>(block_size));
    int next_id = 0;
    int64_t next_value = 0;
    int64_t copies_seen = 0;
    int64_t refusals = 0;

    auto random_seq = [&]() -> int {
      auto it = seqs.begin();
      std::advance(it, static_cast<long>(rng() % seqs.size()));
      return it->first;
    };
    // Appends n new tokens to a sequence, performing the copies and writing the values.
    auto append = [&](ModelSeq& seq, int64_t n) {
      // The model's own count of the blocks needed: new blocks plus a copy of a shared partial
      // last block.
      int64_t expected = blocks_for_tokens(seq.table.n_tokens + n, block_size) -
                         static_cast<int64_t>(seq.table.blocks.size());
      if (n > 0 && seq.table.n_tokens % block_size != 0) {
        int sharers = 0;
        for (const auto& [other_id, other] : seqs) {
          sharers += std::count(other.table.blocks.begin(), other.table.blocks.end(),
                                seq.table.blocks.back()) > 0
                         ? 1
                         : 0;
        }
        if (sharers > 1) ++expected;
      }
      EXPECT_EQ(allocator.blocks_to_append(seq.table, n), expected);
      if (!allocator.can_append(seq.table, n)) {
        EXPECT_GT(expected, allocator.n_free());
        ++refusals;
        return false;
      }
      const int64_t start = seq.table.n_tokens;
      for (const BlockCopy& copy : allocator.append(seq.table, n)) {
        ++copies_seen;
        std::copy_n(cache.begin() + copy.src * block_size, block_size,
                    cache.begin() + copy.dst * block_size);
      }
      for (int64_t i = 0; i < n; ++i) {
        seq.tokens.push_back(next_value);
        cache[static_cast<size_t>(slot_for_position(seq.table, start + i, block_size))] =
            next_value++;
      }
      return true;
    };

    for (int64_t step = 0; step < 4000; ++step) {
      const uint64_t op = rng() % 10;
      const int64_t n = static_cast<int64_t>(rng() % 3 == 0 ? rng() % (3 * block_size) : rng() % 5);
      if (seqs.empty() || op < 2) {  // new sequence
        ModelSeq seq;
        if (append(seq, n + 1)) seqs[next_id++] = std::move(seq);
      } else if (op < 6) {  // append to a sequence
        append(seqs[random_seq()], n);
      } else if (op < 8) {  // fork
        const ModelSeq& parent = seqs[random_seq()];
        ModelSeq child;
        child.table = allocator.fork(parent.table);
        child.tokens = parent.tokens;
        seqs[next_id++] = std::move(child);
      } else {  // free
        const int id = random_seq();
        allocator.free(seqs[id].table);
        seqs.erase(id);
      }
      check_invariants(allocator, seqs, cache, step);
      if (HasFatalFailure()) return;
    }
    EXPECT_GT(copies_seen, 10) << "the random walk should exercise copy on write";
    EXPECT_GT(refusals, 10) << "the random walk should run out of blocks sometimes";
    for (auto& [id, seq] : seqs) allocator.free(seq.table);
    EXPECT_EQ(allocator.n_free(), n_blocks);
  }
}

TEST(SlotMapping, FollowsTheBlockTable) {
  BlockTable table;
  table.blocks = {5, 2, 9};
  table.n_tokens = 40;
  EXPECT_EQ(slot_for_position(table, 0, 16), 80);    // block 5, row 0
  EXPECT_EQ(slot_for_position(table, 15, 16), 95);   // block 5, row 15
  EXPECT_EQ(slot_for_position(table, 16, 16), 32);   // block 2, row 0
  EXPECT_EQ(slot_for_position(table, 39, 16), 151);  // block 9, row 7
}

}  // namespace
}  // namespace e4kv
