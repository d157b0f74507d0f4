// Whole-block copies inside one pool of equal blocks on the GPU (Backend::copy_blocks): a forked
// sequence's shared last cache block before it writes into it (copy on write), a parent's state
// slot into a forked child's. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kv/block_allocator.h"

namespace e4kv::cuda {

// Pairs one launch copies at most (they travel in the kernel's parameters).
inline constexpr int kBlockCopiesPerLaunch = 64;

// The launches copy_blocks makes, as [begin, end) ranges of `copies`: runs of at most
// kBlockCopiesPerLaunch pairs in which no block is written by one pair and read or written by
// another, so the pairs of a launch may run in any order and the whole gives the in-order result.
// Exposed for its test.
std::vector<std::pair<size_t, size_t>> plan_block_copy_launches(std::span<const BlockCopy> copies);

// pool: [n_blocks, block_bytes] bytes on the device; copies: host pairs (ids checked by the
// caller). Asynchronous on `stream`; launch failures are fatal.
void copy_blocks(void* pool, size_t block_bytes, std::span<const BlockCopy> copies,
                 cudaStream_t stream);

}  // namespace e4kv::cuda
