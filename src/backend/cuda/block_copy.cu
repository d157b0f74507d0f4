// Whole-block copies inside one pool (Backend::copy_blocks; the CPU backend's memcpy loop is the
// oracle). One launch copies up to kBlockCopiesPerLaunch pairs: blockIdx.y picks the pair, a
// grid-stride loop over blockIdx.x and the threads covers the block in the widest unit that the
// pool's alignment and the block size allow (16, 4 or 1 bytes). The pairs travel in the kernel's
// parameters, so nothing is uploaded first and a copy costs one launch per pool, not one
// cudaMemcpyAsync per pair. Pairs that depend on each other (a block written by one and read or
// written by a later one) go to separate launches, which the stream orders.
#include "backend/cuda/block_copy.cuh"

#include <algorithm>
#include <cstdint>

#include "backend/cuda/launch.cuh"

namespace e4kv::cuda {
namespace {

struct BlockCopyParams {
  unsigned char* pool = nullptr;
  int64_t block_units = 0;  // units of the kernel's copy type per block
  int32_t n_copies = 0;
  int32_t src[kBlockCopiesPerLaunch];
  int32_t dst[kBlockCopiesPerLaunch];
};

template <class Unit>
__global__ void __launch_bounds__(256)
    copy_blocks_kernel(const __grid_constant__ BlockCopyParams p) {
  enter_dependent_grid();
  const int c = int(blockIdx.y);
  const Unit* src = reinterpret_cast<const Unit*>(p.pool) + int64_t(p.src[c]) * p.block_units;
  Unit* dst = reinterpret_cast<Unit*>(p.pool) + int64_t(p.dst[c]) * p.block_units;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.block_units; i += stride) {
    dst[i] = src[i];
  }
}

template <class Unit>
void launch(BlockCopyParams& p, size_t block_bytes, cudaStream_t stream) {
  constexpr unsigned kThreads = 256;
  p.block_units = int64_t(block_bytes / sizeof(Unit));
  // Enough CTAs per pair to cover a block in one pass up to 32 of them (a 64-token FP16 block of
  // 8 x 128 heads is 256 KiB: 16 units of 16 bytes per thread then).
  const int64_t ctas = std::clamp<int64_t>((p.block_units + kThreads - 1) / kThreads, 1, 32);
  LaunchDims dims;
  dims.grid = dim3(unsigned(ctas), unsigned(p.n_copies));
  dims.block = dim3(kThreads);
  launch_kernel(copy_blocks_kernel<Unit>, dims, stream, p);
  E4KV_CUDA_CHECK_LAUNCH();
}

}  // namespace

std::vector<std::pair<size_t, size_t>> plan_block_copy_launches(std::span<const BlockCopy> copies) {
  std::vector<std::pair<size_t, size_t>> launches;
  size_t begin = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    bool depends = i - begin == size_t(kBlockCopiesPerLaunch);
    for (size_t j = begin; j < i && !depends; ++j) {
      depends = copies[i].src == copies[j].dst || copies[i].dst == copies[j].dst ||
                copies[i].dst == copies[j].src;
    }
    if (depends) {
      launches.emplace_back(begin, i);
      begin = i;
    }
  }
  if (begin < copies.size()) launches.emplace_back(begin, copies.size());
  return launches;
}

void copy_blocks(void* pool, size_t block_bytes, std::span<const BlockCopy> copies,
                 cudaStream_t stream) {
  if (copies.empty() || block_bytes == 0) return;
  const auto address = reinterpret_cast<uintptr_t>(pool);
  for (const auto& [begin, end] : plan_block_copy_launches(copies)) {
    BlockCopyParams p{};
    p.pool = static_cast<unsigned char*>(pool);
    p.n_copies = int32_t(end - begin);
    for (size_t i = begin; i < end; ++i) {
      p.src[i - begin] = copies[i].src;
      p.dst[i - begin] = copies[i].dst;
    }
    if (address % 16 == 0 && block_bytes % 16 == 0) {
      launch<uint4>(p, block_bytes, stream);
    } else if (address % 4 == 0 && block_bytes % 4 == 0) {
      launch<uint32_t>(p, block_bytes, stream);
    } else {
      launch<unsigned char>(p, block_bytes, stream);
    }
  }
}

}  // namespace e4kv::cuda
