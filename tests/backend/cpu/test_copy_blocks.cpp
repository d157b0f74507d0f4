// Backend::copy_blocks on the CPU backend: against a copy made here by hand over a host mirror of
// the pool, with copies that depend on each other (a block written, then read; written twice), and
// its refusals.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"

namespace e4kv {
namespace {

TEST(CpuCopyBlocks, EqualsTheInOrderHandCopy) {
  std::unique_ptr<Backend> backend = make_cpu_backend({1});
  std::mt19937_64 rng{3};
  for (const size_t block_bytes : {size_t(1), size_t(6), size_t(64), size_t(4096 + 3)}) {
    SCOPED_TRACE(block_bytes);
    const int64_t n_blocks = 9;
    std::vector<unsigned char> host(size_t(n_blocks) * block_bytes);
    for (unsigned char& b : host) b = static_cast<unsigned char>(rng());
    Result<BackendBuffer> pool = backend->allocate(host.size());
    ASSERT_TRUE(pool.ok());
    backend->copy_from_host(pool->data(), host.data(), host.size());
    // 2 -> 5, then 5 -> 0 (reads the copy just made), 7 -> 2 (overwrites a source already
    // read), 1 -> 0 (overwrites a destination), 8 -> 3.
    const std::vector<BlockCopy> copies{{2, 5}, {5, 0}, {7, 2}, {1, 0}, {8, 3}};
    ASSERT_TRUE(backend->copy_blocks(pool->data(), n_blocks, block_bytes, copies).ok());
    for (const BlockCopy& c : copies) {
      std::memcpy(&host[size_t(c.dst) * block_bytes], &host[size_t(c.src) * block_bytes],
                  block_bytes);
    }
    std::vector<unsigned char> got(host.size());
    backend->copy_to_host(got.data(), pool->data(), got.size());
    EXPECT_EQ(got, host);
  }
}

TEST(CpuCopyBlocks, RefusesIdsOutsideThePoolAndSelfCopies) {
  std::unique_ptr<Backend> backend = make_cpu_backend({1});
  Result<BackendBuffer> pool = backend->allocate(4 * 16);
  ASSERT_TRUE(pool.ok());
  for (const BlockCopy bad : {BlockCopy{0, 4}, BlockCopy{-1, 1}, BlockCopy{2, 2}}) {
    const BlockCopy one[1] = {bad};
    const Status st = backend->copy_blocks(pool->data(), 4, 16, one);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("copy_blocks"), std::string::npos) << st.message();
  }
  EXPECT_TRUE(backend->copy_blocks(pool->data(), 4, 16, {}).ok());
}

}  // namespace
}  // namespace e4kv
