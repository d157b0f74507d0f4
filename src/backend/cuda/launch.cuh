// Kernel launches as programmatic dependents (PDL, sm_90+): a kernel launched through
// launch_kernel is set up by the runtime while the kernel before it in the stream still runs, and
// waits for it at its first instruction (enter_dependent_grid). What that hides is the launch
// latency between two dependent kernels.
//
// The contract, for every kernel launched here: enter_dependent_grid() runs before the kernel
// touches global memory. griddepcontrol.wait returns once the grid before it has completed and
// its memory is visible, so the kernel's reads and writes are ordered after the previous kernel's
// exactly as with a plain launch. Below sm_90 the instruction is left out and launches are plain.
//
// Every kernel of the CUDA backend launches through here (the model's small ops, cache write,
// indexer write, index scores, top-k, prefill and decode attention and its merge), so a model step
// overlaps each launch with the kernel before it; cuBLAS GEMMs launch plainly in between.
//
// No kernel here signals its dependents early (griddepcontrol.launch_dependents): they launch when
// it completes. Signalling at each kernel's start made the QSA step slower than plain launches
// (the early dependents probably hold SM slots meanwhile), and signalling at each CTA's exit did
// not move it (see notes). Launching at completion takes the QSA step at 128K from 39.7 to 35.0 us
// from stream launches.
// Experiments: bench/notes/launch.md.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"

namespace e4kv::cuda {

// First statement of every kernel launched through launch_kernel.
__device__ __forceinline__ void enter_dependent_grid() {
#if E4KV_DEVICE_ARCH >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

struct LaunchDims {
  dim3 grid;
  dim3 block;
  size_t smem_bytes = 0;
  unsigned cluster_x = 1;  // CTAs per thread-block cluster along x and y (sm_90+); 1, 1: none
  unsigned cluster_y = 1;
};

// Launches `kernel` on `stream`, as a programmatic dependent where programmatic_launch_enabled().
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), const LaunchDims& dims, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dims.grid;
  config.blockDim = dims.block;
  config.dynamicSmemBytes = dims.smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  unsigned n = 0;
  if (dims.cluster_x > 1 || dims.cluster_y > 1) {
    attributes[n].id = cudaLaunchAttributeClusterDimension;
    attributes[n].val.clusterDim.x = dims.cluster_x;
    attributes[n].val.clusterDim.y = dims.cluster_y;
    attributes[n].val.clusterDim.z = 1;
    ++n;
  }
  if (programmatic_launch_enabled()) {
    attributes[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attributes;
  config.numAttrs = n;
  E4KV_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Sets a kernel attribute once per (kernel, device, attribute): the shared-memory and cluster-size
// opt-ins, called on launch paths.
template <class... Params>
void set_attribute_once(void (*kernel)(Params...), cudaFuncAttribute attribute, int value) {
  int device = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::vector<std::tuple<void (*)(Params...), int, cudaFuncAttribute>> done;
  const std::lock_guard<std::mutex> lock(mutex);
  const std::tuple key{kernel, device, attribute};
  if (std::find(done.begin(), done.end(), key) != done.end()) return;
  E4KV_CUDA_CHECK(cudaFuncSetAttribute(kernel, attribute, value));
  done.push_back(key);
}

// How many clusters of `cluster_y` CTAs of `threads` threads and `smem_bytes` of dynamic shared
// memory (the opt-in already made) run at once on the current device.
template <class... Params>
int max_active_clusters(void (*kernel)(Params...), unsigned threads, size_t smem_bytes,
                        unsigned cluster_y) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1, cluster_y);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = cluster_y;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  E4KV_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  return clusters;
}

// How many CTAs of `kernel` (`threads` threads, no dynamic shared memory) are resident at once on
// the current device: its occupancy per SM times the SMs. Computed once per kernel and device
// (host calls outside the stream: allowed while a graph is captured).
template <class... Params>
int resident_ctas(void (*kernel)(Params...), unsigned threads) {
  int device = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::vector<std::tuple<void (*)(Params...), int, int>> known;
  const std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [k, d, ctas] : known) {
    if (k == kernel && d == device) return ctas;
  }
  int per_sm = 0;
  E4KV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, int(threads), 0));
  int sms = 0;
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int ctas = std::max(1, per_sm * sms);
  known.emplace_back(kernel, device, ctas);
  return ctas;
}

}  // namespace e4kv::cuda
