// KV cache capacity for a byte budget (DESIGN.md section 3): how many tokens fit in FP16 and in
// E4M3, and how many requests of a given length run at once.
//
// What is counted (all of it device memory of the KV cache pool):
//   - Whole blocks only. One block holds block_size tokens of every layer that owns a KV cache
//     (full, QSA and sliding attention layers alike: sliding layers are not trimmed to their window
//     here); linear-attention layers own no KV cache and cost nothing per token.
//   - Per block and KV layer: the main cache [2, block_size, n_kv_heads, head_dim], 2 bytes (FP16)
//     or 1 byte (E4M3) per element.
//   - Per block and QSA layer: the compressed indexer rows [block_size / ratio, index_dim] in FP16,
//     whatever the main cache dtype (the indexer is never quantised).
//   - Per sequence and QSA layer: the raw ring [ring_cap, index_dim] in FP16, ring_cap = ratio (4
//     for the seed's model; 2 * ratio with speculative tokens). Rings for `reserved_seqs`
//     sequences come off the budget before blocks are counted.
//   - Per sequence, for the Qwen4Exp family: the state of every GatedDeltaNet layer (conv window
//     [kernel - 1, conv channels] FP16 and recurrent state [value heads, key dim, value dim] fp32)
//     and of every PLE layer (conv window [(kernel - 1) * ngram_size, hc_count * hidden] FP16), as
//     the CUDA runtime holds them (the CPU backend holds the conv windows in fp32). Reserved with
//     the rings.
// Not counted: weights (kv/weight_memory.h counts them from the headers), activations, workspaces.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "io/model_config.h"
#include "kv/kv_cache_view.h"

namespace e4kv {

// Byte sizes of the paged KV cache of one model at one block size.
struct KvCacheLayout {
  int64_t block_size = 64;
  int64_t n_kv_layers = 0;   // layers with a main KV cache (full + QSA + sliding)
  int64_t n_qsa_layers = 0;  // of which QSA layers (also own indexer caches)
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t index_dim = 0;  // 0 without QSA layers
  int64_t ratio = 0;      // tokens per compressed row; 0 without QSA layers
  int64_t ring_cap = 0;   // raw ring keys per sequence; 0 without QSA layers
  int64_t state_bytes_per_seq = 0;  // recurrent and conv states of one sequence (all layers)

  // Main cache bytes per token of one KV layer: 2 (K and V) * n_kv_heads * head_dim * elem bytes.
  int64_t main_bytes_per_token_per_layer(KvCacheDtype dtype) const;
  // Compressed indexer bytes per block of one QSA layer: (block_size / ratio) * index_dim * 2.
  int64_t index_bytes_per_block_per_layer() const;
  // Bytes of one block across all layers (main caches of every KV layer + compressed rows of every
  // QSA layer).
  int64_t block_bytes(KvCacheDtype dtype) const;
  // block_bytes / block_size, exact when block_size is a multiple of ratio (it must be).
  double bytes_per_token(KvCacheDtype dtype) const;
  // Raw ring bytes of one sequence across all QSA layers: n_qsa_layers * ring_cap * index_dim * 2.
  int64_t ring_bytes_per_seq() const;
  // Everything one sequence holds besides its blocks: rings + states.
  int64_t bytes_per_seq() const { return ring_bytes_per_seq() + state_bytes_per_seq; }
};

// The layout of `config`'s cache; ring_cap 0 means one ring slot per key of a group (= ratio).
// Errors (for user input: the block size, a config without KV layers, sizes whose products do not
// fit in 64 bits) name the problem. Every byte count of a returned layout fits in int64.
Result<KvCacheLayout> kv_cache_layout(const ModelConfig& config, int64_t block_size,
                                      int64_t ring_cap = 0);

struct KvCapacity {
  int64_t n_blocks = 0;
  int64_t n_tokens = 0;    // n_blocks * block_size
  int64_t pool_bytes = 0;  // n_blocks * block_bytes
};

// Whole blocks that fit in budget_bytes (>= 0) after the per-sequence bytes (rings and states) of
// reserved_seqs (>= 0) sequences. Error when those alone need more than the budget.
Result<KvCapacity> kv_capacity(const KvCacheLayout& layout, KvCacheDtype dtype,
                               int64_t budget_bytes, int64_t reserved_seqs = 1);

struct RequestConcurrency {
  int64_t blocks_per_request = 0;  // ceil(request_tokens / block_size)
  int64_t bytes_per_request = 0;   // blocks * block_bytes + ring bytes of one sequence
  double max_concurrency = 0.0;    // budget / bytes_per_request (the "3.01x" figure)
  int64_t max_requests = 0;        // whole requests that fit: floor(max_concurrency)
};

// How many requests of request_tokens tokens (prompt + output) fit in the budget at once, each with
// its own blocks (no prefix sharing) and its own rings and states. Error when request_tokens is not
// positive or one request's bytes do not fit in int64.
Result<RequestConcurrency> request_concurrency(const KvCacheLayout& layout, KvCacheDtype dtype,
                                               int64_t budget_bytes, int64_t request_tokens);


// What a KV pool of n_blocks holds, for the start-up line of a serving run.
struct KvPoolSummary {
  int64_t n_blocks = 0;
  int64_t n_tokens = 0;  // n_blocks * block_size
  int64_t pool_bytes = 0;  // n_blocks * block_bytes(dtype)
  // What the same bytes hold as an FP16 cache: whole FP16 blocks, in tokens (the pool's own
  // n_tokens for an FP16 cache).
  int64_t fp16_equivalent_tokens = 0;
  // Sequences of max_model_len tokens the blocks hold at once: n_blocks / ceil(max_model_len /
  // block_size) (vLLM's "Maximum concurrency for N tokens per request"). Blocks only: the state
  // slots of a hybrid model are reserved for every running sequence anyway.
  double max_concurrency = 0.0;
};

// The summary of a pool of n_blocks (>= 0) for sequences of max_model_len (> 0) tokens. Error when
// the pool's bytes do not fit in int64.
Result<KvPoolSummary> kv_pool_summary(const KvCacheLayout& layout, KvCacheDtype dtype,
                                      int64_t n_blocks, int64_t max_model_len);

// A pool must hold one sequence of max_model_len tokens, or a request of that length could never
// finish (vLLM refuses such a configuration at start-up too). The error says both sizes and what
// to change; `source` names what sized the pool (a flag).
Status check_pool_holds_max_model_len(int64_t n_blocks, int64_t block_size, int64_t max_model_len,
                                      const std::string& source);

// The bytes the KV pool (blocks and per-sequence states) may take under a device-memory
// utilization target (vLLM's --gpu-memory-utilization): utilization * total_bytes minus what the
// process holds besides its pool. used_bytes is the device's used memory (total - free) after a
// memory-profiling forward at the largest step, with a provisional pool of pool_bytes_in_use
// (blocks and states) allocated: weights, workspaces and the activation peak are what remains.
// Errors: utilization outside (0, 1], sizes that are negative or inconsistent, and a target that
// the weights and activations alone already exceed (the message gives both figures).
Result<int64_t> kv_budget_for_utilization(int64_t total_bytes, double utilization,
                                          int64_t used_bytes, int64_t pool_bytes_in_use);

}  // namespace e4kv
