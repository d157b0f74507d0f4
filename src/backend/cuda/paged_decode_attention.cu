// Paged decode attention: FP16 or E4M3 KV, dense or QSA-selected keys, any GQA group up to 16.
//
// Work: one warp per (query row, KV head, split of the row's key list); a CTA holds 4 warps (4
// consecutive splits). Each warp walks its keys in tiles of 8 tokens:
//   S = Q . K^T  with mma.m16n8k8: M = the group's query heads (16 rows, padded), N = 8 tokens,
//                K = head dims. K arrives straight from global memory into B fragments: each
//                thread loads 16 contiguous bytes of one token and the head dims are permuted
//                consistently between Q (loaded once) and K, so no shared memory and no shuffles.
//   online softmax over the tile (fp32, base-2, k_scale and the decode factor folded in).
//   O^T += V^T . P^T with mma.m16n8k8: M = 16 head dims, N = 8 heads, K = 8 tokens. The C
//                fragment of S is exactly the B fragment of P^T, so P never leaves registers; V^T
//                fragments pair the same dims of two tokens (one byte permute per pair).
// E4M3 pages are decoded in registers (software: byte permute + shift + masks, value * 2^-8 with
// 2^8 folded into the scales; or cvt.rn.f16x2.e4m3x2 on sm_89+). Each K/V byte is read once.
// A second kernel merges the splits by log-sum-exp and applies v_scale, 1/l and the gate; or, on
// sm_90 for short key lists (a QSA selection) whose rows fit one wave of clusters, the kernel
// merges them itself: a thread-block cluster per row and KV head whose CTAs exchange their
// partials through distributed shared memory (cluster merge, below the CTA combine).
//
// Two ways to move the bytes (DecodeLoadPath):
//   registers:  each iteration's fragments are loaded straight from global memory, then used
//               (sm_75+). A warp has one iteration of bytes in flight and none while it computes.
//   async copy: cp.async moves whole token rows into a per-warp ring of shared-memory stages,
//               kStages - 1 iterations ahead of the math (sm_80+); fragments are then read from
//               shared memory with the same per-thread layout. Rows are XOR-swizzled by 16-byte
//               chunk so both fragment reads are free of bank conflicts. No block barrier: each
//               warp owns its ring, so __syncwarp orders it.
//
// The kernel's body, sizes and parameters are in decode_attention_device.cuh, so that a kernel
// that selects its own key list can run the same body (bench/experimental/ holds one); this file
// holds the kernel instances, the merge kernel, the planners and the launcher.
//
// Limits: head_dim 64/128/256, GQA group <= 16, block_size % 8 == 0. Instructions: mma.m16n8k8
// (sm_75+); the software decoder uses only sm_70 integer instructions; cp.async sm_80+.
// Experiments: bench/notes/paged_decode_attention.md (this kernel, its merge, and the tuning
// constants of decode_attention_device.cuh).
#include "backend/cuda/paged_decode_attention.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decode_attention_device.cuh"
#include "backend/cuda/device.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/timeline.cuh"

E4KV_TIMELINE_UNIT(decode)

namespace e4kv::cuda {
namespace {

using namespace decode_device;

template <int kHeadDim, class Elem, int kHeadTiles, bool kAsync, int kWarps = kWarpsPerCta,
          int kCluster = 0>
__global__ void __launch_bounds__(kWarps * 32, kAsync ? E4KV_DECODE_ASYNC_MIN_CTAS : 1)
    paged_decode_attention_kernel(const __grid_constant__ DecodeKernelParams p) {
  E4KV_TL_ENTER_DEPENDENT_GRID(kTlDecode);
  extern __shared__ __align__(16) uint8_t decode_smem[];
  decode_attention_body<kHeadDim, Elem, kHeadTiles, kAsync, kWarps, kCluster>(
      p, KeyList::for_row(p, int(blockIdx.x) / p.kv.n_kv_heads), decode_smem);
}

// One CTA per (row, head, 32-dim chunk) with kMergeWarps warps: warp w merges the splits
// s = w (mod kMergeWarps), one lane per dim, then the warps combine through shared memory. A row
// cut into hundreds of splits (one long sequence) is merged by many CTAs with many loads in flight.
// note: for a QSA selection this kernel is about a quarter of the attention's time; where it
// applies, the merge inside a thread-block cluster (the cluster-merge instance) replaces it. The
// merge by the decode kernel's last CTA to finish, and other forms of this kernel, were slower
// (see notes). Keep any such tail of the decode kernel in its own instance: the same merge code
// behind a runtime flag moved ptxas' allocation of the main loop and slowed dense FP16 decode.
constexpr int kMergeWarps = 8;

__global__ void __launch_bounds__(kMergeWarps * 32)
    decode_attention_merge_kernel(const __grid_constant__ MergeKernelParams p, int head_dim) {
  E4KV_TL_ENTER_DEPENDENT_GRID(kTlMerge);
  __shared__ float warp_max[kMergeWarps];
  __shared__ float warp_l[kMergeWarps];
  __shared__ float warp_acc[kMergeWarps][32];
  const int row = blockIdx.x;
  const int head = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int dim = blockIdx.z * 32 + lane;
  const int64_t base = int64_t(row) * p.n_splits;
  auto m_at = [&](int s) { return p.m[(base + s) * p.n_heads + head]; };

  // The largest split maximum.
  float m_max = -INFINITY;
  for (int s = threadIdx.x; s < p.n_splits; s += kMergeWarps * 32) m_max = fmaxf(m_max, m_at(s));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    m_max = fmaxf(m_max, __shfl_xor_sync(kFullMask, m_max, offset));
  }
  if (lane == 0) warp_max[warp] = m_max;
  __syncthreads();
  m_max = warp_max[0];
#pragma unroll
  for (int w = 1; w < kMergeWarps; ++w) m_max = fmaxf(m_max, warp_max[w]);

  float acc = 0.0f;
  float l_sum = 0.0f;
  if (m_max != -INFINITY) {
#pragma unroll 4
    for (int s = warp; s < p.n_splits; s += kMergeWarps) {
      const float m = m_at(s);
      const float w = m == -INFINITY ? 0.0f : exp2f(m - m_max);
      l_sum += w * p.l[(base + s) * p.n_heads + head];
      acc += w * p.acc[((base + s) * p.n_heads + head) * head_dim + dim];
    }
  }
  warp_acc[warp][lane] = acc;
  if (lane == 0) warp_l[warp] = l_sum;
  __syncthreads();
  if (warp != 0) return;
  acc = 0.0f;
  l_sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) {
    acc += warp_acc[w][lane];
    l_sum += warp_l[w];
  }
  store_merged(acc, l_sum, p.out_scale, p.gate, p.out,
               (int64_t(row) * p.n_heads + head) * head_dim + dim);
  E4KV_TL_EXIT(kTlMerge, lane == 0);
}

// One compiled instance of the decode kernel and the dynamic shared memory it takes.
struct DecodeInstance {
  void (*kernel)(DecodeKernelParams) = nullptr;
  int smem_bytes = 0;
  int cluster = 0;  // CTAs per cluster of a cluster-merge instance
};

template <int kHeadDim, class Elem, int kHeadTiles, bool kAsync>
DecodeInstance instance() {
  return DecodeInstance{&paged_decode_attention_kernel<kHeadDim, Elem, kHeadTiles, kAsync>,
                        DecodeShape<kHeadDim, Elem::kBytes, kHeadTiles, kAsync>::kSmemBytes};
}

template <int kHeadDim, class Elem>
DecodeInstance select_for(int group, bool async) {
  if (group <= 8) {
    return async ? instance<kHeadDim, Elem, 1, true>() : instance<kHeadDim, Elem, 1, false>();
  }
  return async ? instance<kHeadDim, Elem, 2, true>() : instance<kHeadDim, Elem, 2, false>();
}

template <class Elem>
DecodeInstance select_for_dim(int64_t head_dim, int group, bool async) {
  switch (head_dim) {
    case 64:
      return select_for<64, Elem>(group, async);
    case 128:
      return select_for<128, Elem>(group, async);
    default:
      return select_for<256, Elem>(group, async);
  }
}

// CTAs per cluster of the cluster merge at head_dim 256 (16 m-tiles: 8 or 16; 16 is a
// non-portable cluster size); head_dim 128 (8 m-tiles) takes 8. 8 at head_dim 256: of clusters of
// 16 CTAs (one CTA per SM at 240 registers) fewer than the QSA step's 8 (4 rows x 2 KV heads) fit
// at once on the H200, so the planner fell back to the merge kernel (see notes).
#ifndef E4KV_DECODE_CLUSTER_CTAS_D256
#define E4KV_DECODE_CLUSTER_CTAS_D256 8
#endif

// The cluster-merge instance (async path, one head tile, kDecodeClusterWarps warps per CTA), for
// head_dim 128 or 256 (whole m-tiles per CTA); kernel nullptr for head_dim 64.
template <int kHeadDim, class Elem>
DecodeInstance cluster_instance_for() {
  constexpr int kWarps = int(kDecodeClusterWarps);
  constexpr int kCluster = kHeadDim == 256 ? E4KV_DECODE_CLUSTER_CTAS_D256 : 8;
  return DecodeInstance{&paged_decode_attention_kernel<kHeadDim, Elem, 1, true, kWarps, kCluster>,
                        DecodeShape<kHeadDim, Elem::kBytes, 1, true, kWarps, kCluster>::kSmemBytes,
                        kCluster};
}
template <class Elem>
DecodeInstance cluster_instance_for_dim(int64_t head_dim) {
  if (head_dim == 128) return cluster_instance_for<128, Elem>();
  if (head_dim == 256) return cluster_instance_for<256, Elem>();
  return DecodeInstance{};
}
DecodeInstance select_cluster_instance(int64_t head_dim, int group, KvCacheDtype dtype,
                                       const DecodeAttentionConfig& config) {
  if (group > 8 || config.load != DecodeLoadPath::kAsyncCopy) return DecodeInstance{};
  return with_cache_elem(dtype, config.native_e4m3, [&]<class Elem>() {
    return cluster_instance_for_dim<Elem>(head_dim);
  });
}

// The instance for a validated shape (head_dim 64/128/256, group 1-16).
DecodeInstance select_instance(int64_t head_dim, int group, KvCacheDtype dtype,
                               const DecodeAttentionConfig& config) {
  const bool async = config.load == DecodeLoadPath::kAsyncCopy;
  return with_cache_elem(dtype, config.native_e4m3, [&]<class Elem>() {
    return select_for_dim<Elem>(head_dim, group, async);
  });
}

// Instances above the default 48 KB of dynamic shared memory must opt in, once per device.
void allow_shared_memory(const DecodeInstance& inst) {
  if (inst.smem_bytes <= 48 * 1024) return;
  set_attribute_once(inst.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, inst.smem_bytes);
}

// Clusters above 8 CTAs are non-portable: each such kernel opts in once per device.
void allow_cluster_size(const DecodeInstance& inst) {
  if (inst.cluster <= 8) return;
  set_attribute_once(inst.kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
}


}  // namespace

Status check_decode_attention_shape(const KvCacheGeometry& geo, int64_t n_heads) {
  if (geo.head_dim != 64 && geo.head_dim != 128 && geo.head_dim != 256) {
    return Status::error(
        cat("decode attention: head_dim ", geo.head_dim, " is not supported (64, 128 or 256)"));
  }
  if (geo.n_kv_heads <= 0 || n_heads % geo.n_kv_heads != 0 || n_heads / geo.n_kv_heads > 16) {
    return Status::error(cat("decode attention: GQA group ", n_heads, "/", geo.n_kv_heads,
                             " is not supported (a whole group of at most 16)"));
  }
  if (geo.block_size <= 0 || geo.block_size % 8 != 0) {
    return Status::error(
        cat("decode attention: block_size ", geo.block_size, " is not a multiple of 8"));
  }
  return Status();
}

bool decode_attention_native_e4m3_usable(int device) {
  if (!e4m3_native_available(device)) return false;
  cudaFuncAttributes attr{};
  E4KV_CUDA_CHECK(cudaFuncGetAttributes(
      &attr, paged_decode_attention_kernel<128, ElemE4m3<E4m3Decode::kNative>, 1, false>));
  return attr.binaryVersion >= 89;
}

DecodeAttentionConfig decode_attention_config(int device, bool force_software_e4m3) {
  DecodeAttentionConfig config;
  config.native_e4m3 = !force_software_e4m3 && decode_attention_native_e4m3_usable(device);
  config.load =
      compute_capability(device) >= 80 ? DecodeLoadPath::kAsyncCopy : DecodeLoadPath::kRegisters;
  return config;
}

Result<int64_t> decode_attention_resident_ctas(const KvCacheGeometry& geo, int64_t n_heads,
                                               const DecodeAttentionConfig& config, int device) {
  E4KV_RETURN_IF_ERROR(check_decode_attention_shape(geo, n_heads));
  const DecodeInstance inst =
      select_instance(geo.head_dim, int(n_heads / geo.n_kv_heads), geo.dtype, config);
  int saved = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&saved));
  E4KV_CUDA_CHECK(cudaSetDevice(device));
  allow_shared_memory(inst);
  int per_sm = 0;
  E4KV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, inst.kernel, kWarpsPerCta * 32, inst.smem_bytes));
  int n_sms = 0;
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  E4KV_CUDA_CHECK(cudaSetDevice(saved));
  return int64_t(std::max(per_sm, 1)) * n_sms;
}

Result<DecodeClusterMerge> decode_attention_cluster_merge(const KvCacheGeometry& geo,
                                                          int64_t n_heads,
                                                          const DecodeAttentionConfig& config,
                                                          int device) {
  E4KV_RETURN_IF_ERROR(check_decode_attention_shape(geo, n_heads));
  if (!cluster_merge_enabled() || compute_capability(device) < 90) return DecodeClusterMerge{};
  const DecodeInstance inst =
      select_cluster_instance(geo.head_dim, int(n_heads / geo.n_kv_heads), geo.dtype, config);
  if (inst.kernel == nullptr) return DecodeClusterMerge{};
  cudaFuncAttributes attr{};
  E4KV_CUDA_CHECK(cudaFuncGetAttributes(&attr, inst.kernel));
  if (attr.binaryVersion < 90) return DecodeClusterMerge{};  // no sm_90 code in this build
  int saved = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&saved));
  E4KV_CUDA_CHECK(cudaSetDevice(device));
  allow_shared_memory(inst);
  allow_cluster_size(inst);
  const int clusters = max_active_clusters(inst.kernel, unsigned(kDecodeClusterWarps * 32),
                                           size_t(inst.smem_bytes), unsigned(inst.cluster));
  E4KV_CUDA_CHECK(cudaSetDevice(saved));
  return DecodeClusterMerge{int64_t(clusters), int64_t(inst.cluster) * kDecodeClusterWarps};
}

Status paged_decode_attention(const PagedAttentionParams& params, const DecodeAttentionPlan& plan,
                              const DecodeAttentionWorkspace& workspace,
                              const DecodeAttentionConfig& config, cudaStream_t stream) {
  const KvCacheGeometry& geo = params.cache.geometry;
  const int64_t n_rows = params.rows.n_rows;
  E4KV_RETURN_IF_ERROR(check_decode_attention_shape(geo, params.n_heads));
  if (plan.keys_per_split <= 0 || plan.keys_per_split % kTileTokens != 0 || plan.n_splits <= 0 ||
      plan.n_splits % kWarpsPerCta != 0) {
    return Status::error("decode attention: bad plan");
  }
  DecodeInstance cluster_inst;
  if (plan.merge_in_cluster) {
    int device = 0;
    E4KV_CUDA_CHECK(cudaGetDevice(&device));
    cluster_inst = select_cluster_instance(geo.head_dim, int(params.n_heads / geo.n_kv_heads),
                                           geo.dtype, config);
    // Checked without the occupancy query of decode_attention_cluster_merge, which the planner
    // made: this runs on every launch.
    if (cluster_inst.kernel == nullptr || compute_capability(device) < 90) {
      return Status::error(
          "decode attention: a cluster-merge plan for a shape, config or device without the "
          "cluster-merge kernel (decode_attention_cluster_merge reports none): plan with "
          "plan_decode_attention");
    }
    if (plan.n_splits != cluster_inst.cluster * kDecodeClusterWarps) {
      return Status::error(cat("decode attention: a cluster-merge plan of ", plan.n_splits,
                               " splits; this shape's clusters take ",
                               cluster_inst.cluster * kDecodeClusterWarps));
    }
  } else if (n_rows > workspace.max_rows || plan.n_splits > workspace.max_splits ||
             params.n_heads > workspace.n_heads || geo.head_dim > workspace.head_dim) {
    return Status::error("decode attention: workspace too small for this launch");
  }
  if (reinterpret_cast<uintptr_t>(params.q) % 16 != 0) {
    return Status::error(
        "decode attention: q must be 16-byte aligned (it is read 16 bytes at a time)");
  }
  if (n_rows == 0) return Status();
  const int group = int(params.n_heads / geo.n_kv_heads);
  const DecodeKernelParams kp =
      decode_kernel_params(params, plan, plan.merge_in_cluster ? nullptr : &workspace, config);

  if (plan.merge_in_cluster) {
    allow_shared_memory(cluster_inst);
    allow_cluster_size(cluster_inst);
    LaunchDims dims{dim3(unsigned(n_rows * geo.n_kv_heads), unsigned(cluster_inst.cluster)),
                    dim3(unsigned(kDecodeClusterWarps * 32)), size_t(cluster_inst.smem_bytes)};
    dims.cluster_y = unsigned(cluster_inst.cluster);
    launch_kernel(cluster_inst.kernel, dims, stream, kp);
    return Status();
  }

  const DecodeInstance inst = select_instance(geo.head_dim, group, geo.dtype, config);
  allow_shared_memory(inst);
  const dim3 grid(unsigned(n_rows * geo.n_kv_heads),
                  unsigned((plan.n_splits + kWarpsPerCta - 1) / kWarpsPerCta));
  launch_kernel(inst.kernel, LaunchDims{grid, dim3(kWarpsPerCta * 32), size_t(inst.smem_bytes)},
                stream, kp);

  MergeKernelParams mp{};
  mp.n_heads = int32_t(params.n_heads);
  mp.n_splits = int32_t(config.load == DecodeLoadPath::kAsyncCopy ? plan.n_splits / kWarpsPerCta
                                                                  : plan.n_splits);
  mp.m = workspace.m;
  mp.l = workspace.l;
  mp.acc = workspace.acc;
  mp.gate = params.gate;
  mp.out_scale = kp.out_scale;
  mp.out = params.out;
  launch_kernel(
      decode_attention_merge_kernel,
      LaunchDims{dim3(unsigned(n_rows), unsigned(params.n_heads), unsigned(geo.head_dim / 32)),
                 dim3(kMergeWarps * 32)},
      stream, mp, int(geo.head_dim));
  return Status();
}

}  // namespace e4kv::cuda
