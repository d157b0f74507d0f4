// The continuous-batching scheduler (engine/scheduler.h) against a fake model: a "forward" records
// which positions of which sequence it computed, and the next token of a sequence is a hash of all
// its tokens so far, so a sequence that was preempted and recomputed must continue with exactly
// the tokens it would have produced alone.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <vector>

namespace e4kv {
namespace {

int32_t next_token(const std::vector<int32_t>& tokens) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : tokens) h = (h ^ uint64_t(uint32_t(t))) * 1099511628211ull;
  return int32_t(h % 1000);
}

std::vector<int32_t> prompt_of(int64_t n, int seed) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(int32_t((i * 31 + seed * 17) % 1000));
  return p;
}

// The tokens a request gets alone: its prompt, then max_new hashes of the prefix.
std::vector<int32_t> alone(std::vector<int32_t> tokens, int64_t max_new) {
  const size_t n_prompt = tokens.size();
  while (int64_t(tokens.size() - n_prompt) < max_new) tokens.push_back(next_token(tokens));
  return {tokens.begin() + std::ptrdiff_t(n_prompt), tokens.end()};
}

SchedulerConfig small_config() {
  SchedulerConfig c;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 4;
  c.n_blocks = 8;
  c.block_size = 16;
  c.n_state_slots = 4;
  c.max_model_len = 128;
  return c;
}

TEST(Scheduler, PrefillChunksAndDecodeRowsShareOneBudget) {
  Scheduler s(small_config());
  ASSERT_TRUE(s.add(1, prompt_of(40, 1), 44).ok());
  ASSERT_TRUE(s.add(2, prompt_of(50, 2), 54).ok());
  // Step 1: all of sequence 1 (40 rows) and the first 24 rows of sequence 2.
  StepPlan p = s.schedule();
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(p.n_tokens, 64);
  EXPECT_EQ(p.chunks[0].id, 1);
  EXPECT_EQ(p.chunks[0].n_tokens, 40);
  EXPECT_TRUE(p.chunks[0].samples);
  EXPECT_TRUE(p.chunks[0].fresh_state);
  EXPECT_EQ(p.chunks[1].id, 2);
  EXPECT_EQ(p.chunks[1].start, 0);
  EXPECT_EQ(p.chunks[1].n_tokens, 24);
  EXPECT_FALSE(p.chunks[1].samples);
  EXPECT_NE(p.chunks[0].state_slot, p.chunks[1].state_slot);
  s.append_token(1, 7);
  // Step 2: sequence 1's decode row and the remaining 26 prompt rows of sequence 2.
  p = s.schedule();
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(p.chunks[0].start, 40);
  EXPECT_EQ(p.chunks[0].n_tokens, 1);
  EXPECT_FALSE(p.chunks[0].fresh_state);
  EXPECT_EQ(p.chunks[1].start, 24);
  EXPECT_EQ(p.chunks[1].n_tokens, 26);
  EXPECT_FALSE(p.chunks[1].fresh_state);
  EXPECT_TRUE(p.chunks[1].samples);
  EXPECT_EQ(s.find(1)->table.n_tokens, 41);
  EXPECT_TRUE(s.remove(1));
  EXPECT_TRUE(s.remove(2));
  EXPECT_EQ(s.n_used_blocks(), 0);
  EXPECT_EQ(s.n_free_slots(), 4);
  EXPECT_FALSE(s.has_work());
}

TEST(Scheduler, RefusesWhatCouldNeverRun) {
  Scheduler s(small_config());
  EXPECT_NE(s.add(1, {}, 4).message().find("empty"), std::string::npos);
  // Longer than the max model length (128), and longer than the pool (8 x 16 = 128 tokens).
  EXPECT_NE(s.add(2, prompt_of(100, 0), 129).message().find("max model length is 128"),
            std::string::npos);
  SchedulerConfig c = small_config();
  c.max_model_len = 1000;
  Scheduler t(c);
  EXPECT_NE(t.add(3, prompt_of(100, 0), 200).message().find("the KV pool holds 128"),
            std::string::npos);
  ASSERT_TRUE(t.add(4, prompt_of(10, 0), 20).ok());
  EXPECT_NE(t.add(4, prompt_of(10, 0), 20).message().find("already in use"), std::string::npos);
  EXPECT_FALSE(s.has_work());
  EXPECT_EQ(t.n_waiting(), 1);
}

TEST(Scheduler, PreemptsTheYoungestAndItResumesWhereItWas) {
  SchedulerConfig c = small_config();
  c.n_blocks = 4;  // 64 tokens in all
  c.max_model_len = 64;
  Scheduler s(c);
  ASSERT_TRUE(s.add(1, prompt_of(30, 1), 40).ok());
  ASSERT_TRUE(s.add(2, prompt_of(30, 2), 40).ok());
  StepPlan p = s.schedule();  // both prompts: 2 blocks each, the pool is full
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(s.n_free_blocks(), 0);
  s.append_token(1, 5);
  s.append_token(2, 6);
  // Positions 30 and 31 still fit the second block of each sequence.
  for (int step = 0; step < 2; ++step) {
    p = s.schedule();
    ASSERT_EQ(p.chunks.size(), 2u);
    ASSERT_TRUE(p.preempted.empty());
    s.append_token(1, 5);
    s.append_token(2, 6);
  }
  // Now both need a third block: sequence 2 (the youngest) gives its blocks and slot back.
  p = s.schedule();
  ASSERT_EQ(p.preempted, std::vector<SequenceId>{2});
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].id, 1);
  EXPECT_EQ(s.n_running(), 1);
  EXPECT_EQ(s.n_waiting(), 1);
  const Sequence* two = s.find(2);
  EXPECT_EQ(two->n_computed, 0);
  EXPECT_EQ(two->tokens.size(), 33u);  // its output so far is kept
  EXPECT_EQ(two->n_preemptions, 1);
  EXPECT_EQ(s.n_preemptions(), 1);
  // Once sequence 1 ends, sequence 2 recomputes all 33 tokens afresh and samples.
  s.append_token(1, 5);
  ASSERT_TRUE(s.remove(1));
  p = s.schedule();
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].id, 2);
  EXPECT_EQ(p.chunks[0].start, 0);
  EXPECT_EQ(p.chunks[0].n_tokens, 33);
  EXPECT_TRUE(p.chunks[0].fresh_state);
  EXPECT_TRUE(p.chunks[0].samples);
}

// A fork shares every block; the first writer into the shared partly filled last block gets a
// copy (a BlockCopy in the plan), the last one writes in place; a fork without a free slot waits
// with nothing computed; removing everything returns every block.
TEST(Scheduler, ForksShareBlocksAndCopyTheLastOnWrite) {
  SchedulerConfig c = small_config();
  c.max_num_seqs = 3;
  c.n_state_slots = 3;
  Scheduler s(c);
  ASSERT_TRUE(s.add(1, prompt_of(20, 1), 40).ok());
  StepPlan p = s.schedule();
  ASSERT_EQ(p.chunks.size(), 1u);
  ASSERT_TRUE(p.chunks[0].samples);
  EXPECT_EQ(s.n_used_blocks(), 2);
  const std::vector<SequenceId> children{2, 3, 4};
  const std::vector<int32_t> tokens{7, 8, 9};
  s.fork(1, children, tokens);
  s.append_token(1, 6);
  EXPECT_EQ(s.n_running(), 3);  // 1, 2, 3; the sequence limit sends 4 to wait
  EXPECT_EQ(s.n_waiting(), 1);
  EXPECT_EQ(s.n_used_blocks(), 2);  // nothing allocated by the fork
  const Sequence* two = s.find(2);
  EXPECT_EQ(two->n_computed, 20);
  EXPECT_EQ(two->table.blocks, s.find(1)->table.blocks);
  EXPECT_EQ(two->tokens.back(), 7);
  EXPECT_EQ(two->tokens.size(), 21u);
  EXPECT_NE(two->state_slot, s.find(1)->state_slot);
  EXPECT_EQ(s.find(4)->n_computed, 0);
  EXPECT_TRUE(s.find(4)->table.blocks.empty());
  const int32_t shared = s.find(1)->table.blocks[1];

  p = s.schedule();
  ASSERT_EQ(p.chunks.size(), 3u);  // three decode rows; 4 still waits (no slot)
  for (const ScheduledChunk& chunk : p.chunks) {
    EXPECT_EQ(chunk.n_tokens, 1);
    EXPECT_FALSE(chunk.fresh_state);
  }
  // 1 and 2 copy the shared block; 3, its last holder, writes into it.
  ASSERT_EQ(p.block_copies.size(), 2u);
  EXPECT_EQ(p.block_copies[0].src, shared);
  EXPECT_EQ(p.block_copies[1].src, shared);
  EXPECT_EQ(s.find(1)->table.blocks[1], p.block_copies[0].dst);
  EXPECT_EQ(s.find(2)->table.blocks[1], p.block_copies[1].dst);
  EXPECT_EQ(s.find(3)->table.blocks[1], shared);
  EXPECT_EQ(s.find(1)->table.blocks[0], s.find(3)->table.blocks[0]);  // the full block stays shared
  EXPECT_EQ(s.n_used_blocks(), 4);

  // Sequence 4 is admitted when a slot frees and recomputes its 21 tokens.
  ASSERT_TRUE(s.remove(3));
  for (SequenceId id : {1, 2}) s.append_token(id, 5);
  p = s.schedule();
  ASSERT_EQ(p.chunks.size(), 3u);
  EXPECT_EQ(p.chunks[2].id, 4);
  EXPECT_EQ(p.chunks[2].start, 0);
  EXPECT_EQ(p.chunks[2].n_tokens, 21);
  EXPECT_TRUE(p.chunks[2].fresh_state);
  EXPECT_TRUE(p.block_copies.empty());
  for (SequenceId id : {1, 2, 4}) ASSERT_TRUE(s.remove(id));
  EXPECT_EQ(s.n_used_blocks(), 0);
  EXPECT_EQ(s.n_free_slots(), 3);
}

// A sequence that shares its partly filled last block with the youngest: preempting that one
// drops the copy on write from the need, so the older sequence runs in the pool's last block.
TEST(Scheduler, PreemptingASharerRemovesTheCopyFromTheNeed) {
  SchedulerConfig c = small_config();
  c.n_blocks = 3;
  c.max_model_len = 48;
  Scheduler s(c);
  ASSERT_TRUE(s.add(1, prompt_of(20, 1), 40).ok());
  ASSERT_TRUE(s.add(2, prompt_of(10, 2), 12).ok());
  StepPlan p = s.schedule();  // 2 + 1 blocks: the pool is full
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(s.n_free_blocks(), 0);
  s.append_token(2, 4);
  const std::vector<SequenceId> child{3};
  const std::vector<int32_t> token{7};
  s.fork(1, child, token);
  s.append_token(1, 6);
  // 1 needs a copy of its shared block and there is none free: 3 (the youngest) is preempted,
  // after which 1 writes into the block in place: 2 is not preempted.
  p = s.schedule();
  EXPECT_EQ(p.preempted, std::vector<SequenceId>{3});
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_TRUE(p.block_copies.empty());
}

// Randomized arrivals, lengths and aborts over a pool small enough to preempt: every request
// finishes or is aborted exactly once with the tokens it gets alone, the limits hold in every step,
// and the pools are whole again at the end.
TEST(Scheduler, RandomWorkloadsKeepEveryInvariant) {
  int64_t preemptions = 0, chunked = 0;
  for (int trial = 0; trial < 40; ++trial) {
    std::mt19937_64 rng{uint64_t(trial)};
    auto uniform = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    SchedulerConfig c;
    c.block_size = 16;
    c.n_blocks = uniform(4, 24);
    c.max_num_batched_tokens = uniform(1, 96);
    c.max_num_seqs = uniform(1, 8);
    c.n_state_slots = trial % 3 == 0 ? 0 : uniform(1, 8);
    c.max_model_len = c.n_blocks * c.block_size;
    Scheduler s(c);
    struct Want {
      std::vector<int32_t> prompt;
      int64_t max_new = 0;
      std::vector<int32_t> output;
      bool done = false;
      int64_t computed = 0;  // positions computed since the sequence's state was last fresh
    };
    std::map<SequenceId, Want> requests;
    SequenceId next_id = 0;
    int64_t finished = 0, aborted = 0;
    for (int step = 0; step < 4000; ++step) {
      if (next_id < 30 && uniform(0, 3) == 0) {
        Want w;
        w.prompt = prompt_of(uniform(1, c.max_model_len / 2), int(next_id));
        w.max_new = uniform(1, c.max_model_len - int64_t(w.prompt.size()));
        ASSERT_TRUE(s.add(next_id, w.prompt, int64_t(w.prompt.size()) + w.max_new).ok());
        requests[next_id++] = w;
      }
      if (!requests.empty() && uniform(0, 40) == 0) {  // abort one still in flight
        auto it = requests.begin();
        std::advance(it, uniform(0, int64_t(requests.size()) - 1));
        if (!it->second.done && s.remove(it->first)) {
          it->second.done = true;
          ++aborted;
        }
      }
      const StepPlan p = s.schedule();
      ASSERT_LE(p.n_tokens, c.max_num_batched_tokens);
      ASSERT_LE(int64_t(p.chunks.size()), c.max_num_seqs);
      ASSERT_TRUE(p.block_copies.empty());  // nothing is shared without fork
      std::set<int32_t> slots;
      std::set<SequenceId> ids;
      std::set<int32_t> blocks;
      int64_t rows = 0;
      for (const SequenceId id : p.preempted) requests.at(id).computed = 0;
      for (const ScheduledChunk& ch : p.chunks) {
        ASSERT_TRUE(ids.insert(ch.id).second) << "a sequence twice in one step";
        Want& w = requests.at(ch.id);
        ASSERT_FALSE(w.done);
        // Rows continue exactly where the sequence's state stands: no gap, no repeat.
        if (ch.fresh_state) w.computed = 0;
        if (!ch.samples) ++chunked;
        ASSERT_EQ(ch.start, w.computed);
        ASSERT_EQ(ch.fresh_state, ch.start == 0);
        w.computed += ch.n_tokens;
        rows += ch.n_tokens;
        if (c.n_state_slots > 0) {
          ASSERT_GE(ch.state_slot, 0);
          ASSERT_LT(ch.state_slot, c.n_state_slots);
          ASSERT_TRUE(slots.insert(ch.state_slot).second) << "two sequences share a slot";
        }
        const Sequence* seq = s.find(ch.id);
        ASSERT_EQ(seq->table.n_tokens, ch.start + ch.n_tokens);
        for (int32_t b : seq->table.blocks) {
          ASSERT_TRUE(blocks.insert(b).second) << "two sequences share a block";
        }
        if (ch.samples) {
          std::vector<int32_t> all(seq->tokens);
          const int32_t token = next_token(all);
          w.output.push_back(token);
          if (int64_t(w.output.size()) == w.max_new) {
            ASSERT_TRUE(s.remove(ch.id));
            w.done = true;
            ++finished;
          } else {
            s.append_token(ch.id, token);
          }
        }
      }
      ASSERT_EQ(rows, p.n_tokens);
      if (next_id == 30 && !s.has_work()) break;
      // Progress: a step with work queued schedules something.
      if (s.has_work()) {
        ASSERT_FALSE(p.empty() && p.preempted.empty()) << "step " << step;
      }
    }
    ASSERT_FALSE(s.has_work()) << "trial " << trial;
    EXPECT_EQ(finished + aborted, 30);
    preemptions += s.n_preemptions();
    EXPECT_EQ(s.n_used_blocks(), 0);
    EXPECT_EQ(s.n_free_slots(), c.n_state_slots);
    for (const auto& [id, w] : requests) {
      ASSERT_TRUE(w.done);
      // A finished request has exactly the tokens it gets alone; an aborted one a prefix of them.
      const std::vector<int32_t> want = alone(w.prompt, w.max_new);
      ASSERT_LE(w.output.size(), want.size());
      EXPECT_TRUE(std::equal(w.output.begin(), w.output.end(), want.begin())) << "request " << id;
    }
  }
  // The workloads did exercise preemption and chunked prefill.
  EXPECT_GT(preemptions, 40);
  EXPECT_GT(chunked, 40);
  std::printf("%lld preemptions, %lld chunks that did not sample\n", (long long)preemptions,
              (long long)chunked);
}

}  // namespace
}  // namespace e4kv
