// Experimental (nothing in src/ selects it): QSA sparse decode, a row's top-k selection and the
// decode attention over it in one kernel, for each (row, KV head) a thread-block cluster of 8 CTAs
// of 8 warps (sm_90+).
//
// Why: the QSA decode step is scores -> top-k -> attention, three kernels. Each kernel boundary
// costs about 1 us (the next kernel's griddepcontrol.wait returns only once the whole previous
// grid has finished and flushed), and the attention then starts with dependent loads of the
// selection it has just been handed through global memory. Here the cluster that selects a row's
// keys attends over them:
//   1. cluster_select (qsa_topk_device.cuh) with CTAs of 256 threads: the bound from the run
//      maxima, the candidates exchanged through distributed shared memory, T and the ties.
//   2. The key list in shared memory, in every CTA alike: every CTA holds all candidates in the
//      same order, so each takes the selected ones (above T, or equal to T and among the `ties`
//      lowest groups equal to it) in that order, each group expanded to ratio tokens, then the
//      causal tail. The attention needs no order, and the list is the same set as the top-k's.
//      Where the candidates did not fit in shared memory, or more than 256 equal T with some left
//      out, the CTAs emit the selection in group order to sel_tokens as the top-k kernel does,
//      pass a cluster barrier (release / acquire) and read it back (same result, slower).
//   3. decode_attention_body (decode_attention_device.cuh), the cluster-merge instance: 64 splits
//      over the list, the last also taking the tail; the CTAs merge through distributed shared
//      memory and write the output.
// Both KV heads' clusters of a row select the same keys: the duplicate work is a few hundred KB
// from L2 on SMs that would otherwise idle (one wave of clusters is the condition for the plan).
// The selection's scratch lies in the attention's rings (used only after it), the key list behind
// the attention's shared memory.
//
// Status: correct (test_qsa_sparse_decode.cu), but slower than the top-k and the cluster-merge
// decode as two kernels (at 4 x 128K on the H200, the step 32.0-34.2 against 30.1-31.1 us), so
// nothing picks it.
//
// Limits: those of the cluster-merge decode instance (head_dim 128/256, GQA group <= 8, the async
// path) and of the cluster select with 2 runs per lane (rows up to 32768 groups); selection width
// <= kDecodeClusterMaxKeys.
// Experiments: bench/notes/qsa_sparse_decode.md (the measurements, the timeline and ncu profile,
// the variants tried; the benchmark rows it had in bench_qsa_decode.cu).
#include "experimental/qsa_sparse_decode.cuh"

#include <cuda_runtime.h>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/cluster.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decode_attention_device.cuh"
#include "backend/cuda/device.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/qsa_topk_device.cuh"
#include "backend/cuda/timeline.cuh"

E4KV_TIMELINE_UNIT(sparse_decode)

namespace e4kv::cuda {
namespace {

using decode_device::DecodeKernelParams;
using decode_device::DecodeShape;
using top_k_device::ClusterSelection;
using top_k_device::ClusterShape;
using top_k_device::ClusterShared;
using top_k_device::FilterKernelParams;

constexpr int kWarps = int(kDecodeClusterWarps);
constexpr int kThreads = kWarps * 32;
constexpr int kCluster = 8;
constexpr int kSlots = 2;  // runs per lane of the select
using Select = ClusterShape<kThreads, kSlots>;
static_assert(Select::kMaxGroups == kQsaSparseDecodeMaxGroups);
static_assert(kCluster == top_k_device::kClusterCtas);
constexpr int kKeysCapacity = int(kDecodeClusterMaxKeys);
[[maybe_unused]] constexpr int kTlSparseDecode = kTlMerge + 1;  // this kernel's timeline index (timeline.cuh)

struct SparseDecodeParams {
  FilterKernelParams select;
  DecodeKernelParams decode;
};


template <int kHeadDim, class Elem>
using SparseShape = DecodeShape<kHeadDim, Elem::kBytes, 1, true, kWarps, kCluster>;

// Dynamic shared memory: the attention's (the select's scratch inside its rings), then the list.
template <int kHeadDim, class Elem>
constexpr int keys_offset() {
  return (SparseShape<kHeadDim, Elem>::kSmemBytes + 15) / 16 * 16;
}
template <int kHeadDim, class Elem>
constexpr int smem_bytes() {
  return keys_offset<kHeadDim, Elem>() + kKeysCapacity * int(sizeof(int32_t));
}

#if E4KV_DEVICE_ARCH >= 900
// The row's key list for decode_attention_body: entries in shared memory.
struct SharedKeys {
  const int32_t* sel;
  int32_t width;
  int32_t n;

  __device__ bool selected() const { return true; }
  __device__ int at(int key) const { return sel[key]; }
  __device__ int clamped(int key) const { return sel[min(key, int(width) - 1)]; }
  __device__ int count(const DecodeKernelParams&, int) const { return n; }
};

// Step 2's fast path: the selected candidates of all_pairs as tokens into keys, in the same order
// in every CTA: thread t takes candidates t, t + kThreads, .. (conflict-free reads), and its
// selected ones go after those of threads 0 .. t - 1. Returns false (every CTA alike) where some
// equal to T are left out and more than kThreads are equal to T: their ranks by group would need
// more than one comparison pass.
__device__ __forceinline__ bool keys_from_candidates(const FilterKernelParams& p,
                                                     const ClusterSelection& r, const uint2* pairs,
                                                     ClusterShared<kThreads>& sh,
                                                     int32_t* equal_groups, uint32_t* n_equal,
                                                     int32_t* keys) {
  const int tid = threadIdx.x;
  const uint32_t threshold = r.threshold;
  if (tid == 0) *n_equal = 0u;
  __syncthreads();
  uint32_t n_taken = 0u;
  bool any_equal = false;
  for (uint32_t i = uint32_t(tid); i < r.n_cand; i += kThreads) {
    const uint2 pair = pairs[i];
    n_taken += pair.x > threshold ? 1u : 0u;
    if (pair.x == threshold) {
      any_equal = true;
      const uint32_t slot = atomicAdd(n_equal, 1u);
      if (slot < uint32_t(kThreads)) equal_groups[slot] = int32_t(pair.y);
    }
  }
  __syncthreads();
  const uint32_t equal = *n_equal;
  const bool all_ties = equal == r.ties;
  if (!all_ties && equal > uint32_t(kThreads)) return false;
  auto taken_equal = [&](int32_t group) {
    if (all_ties) return true;
    uint32_t lower = 0u;  // groups equal to T below this one
    for (uint32_t j = 0; j < equal; ++j) lower += equal_groups[j] < group ? 1u : 0u;
    return lower < r.ties;
  };
  if (any_equal) {
    for (uint32_t i = uint32_t(tid); i < r.n_cand; i += kThreads) {
      const uint2 pair = pairs[i];
      n_taken += pair.x == threshold && taken_equal(int32_t(pair.y)) ? 1u : 0u;
    }
  }
  uint32_t before = n_taken;
  uint32_t unused = 0u;
  top_k_device::block_exclusive_scan2<kThreads>(before, unused, sh.warp_totals);
  const int32_t ratio = p.ratio;
  for (uint32_t i = uint32_t(tid); i < r.n_cand; i += kThreads) {
    const uint2 pair = pairs[i];
    if (pair.x < threshold || (pair.x == threshold && !taken_equal(int32_t(pair.y)))) continue;
    const int32_t group = int32_t(pair.y);
    for (int32_t j = 0; j < ratio; ++j) keys[int32_t(before) * ratio + j] = group * ratio + j;
    ++before;
  }
  return true;
}

// Step 2's other path, out of line: rare, and kept apart from the common path's code.
__device__ __noinline__ void emit_slow(const FilterKernelParams& p, int64_t row,
                                       const ClusterSelection& r, uint32_t* smem,
                                       ClusterShared<kThreads>& sh, int32_t* out) {
  top_k_device::cluster_emit<kThreads, kSlots>(p, row, r, smem, sh, out);
}

#endif

template <int kHeadDim, class Elem>
__global__ void __launch_bounds__(kThreads, 1)
    qsa_sparse_decode_kernel(const __grid_constant__ SparseDecodeParams p) {
#if E4KV_DEVICE_ARCH >= 900
  E4KV_TL_ENTER_DEPENDENT_GRID(kTlSparseDecode);
  using Shape = SparseShape<kHeadDim, Elem>;
  static_assert(Select::kSmemBytes <= size_t(Shape::kReceiveOffset),
                "the select's scratch lies in the attention's rings");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ ClusterShared<kThreads> sh;
  __shared__ int32_t equal_groups[kThreads];
  __shared__ uint32_t n_equal;
  int32_t* keys = reinterpret_cast<int32_t*>(smem + keys_offset<kHeadDim, Elem>());
  const FilterKernelParams& sp = p.select;
  const uint32_t rank = cluster_rank();
  const int row = int(blockIdx.x) / p.decode.kv.n_kv_heads;
  const int kv_head = int(blockIdx.x) % p.decode.kv.n_kv_heads;
  const bool marker = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
  if (marker) E4KV_TL_PHASE(0);
  const int tid = threadIdx.x;
  int32_t* out = sp.sel_tokens + int64_t(row) * sp.width;
  {
    // The attention's q rows (the KV head's group) to L2 while the select runs.
    const int64_t q_bytes = int64_t(p.decode.group) * kHeadDim * 2;
    const char* q =
        reinterpret_cast<const char*>(p.decode.q) +
        (int64_t(row) * p.decode.n_heads + int64_t(kv_head) * p.decode.group) * kHeadDim * 2;
    for (int64_t b = int64_t(tid) * 128; b < q_bytes; b += int64_t(kThreads) * 128) {
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(q + b));
    }
  }

  const ClusterSelection r = top_k_device::cluster_select<kThreads, kSlots>(
      sp, row, rank, reinterpret_cast<uint32_t*>(smem), sh, marker);
  const top_k_device::RowGroups& rg = r.rows;
  const int32_t n_groups = r.short_row ? rg.visible : sp.k;
  const int32_t tail_begin = sp.ratio * rg.causal;
  const int32_t group_tokens = n_groups * sp.ratio;
  const int32_t count = group_tokens + (rg.pos + 1 - tail_begin);
  bool in_global = false;  // the list is read back from sel_tokens
  if (r.short_row) {
    for (int32_t j = tid; j < group_tokens; j += kThreads) keys[j] = j;
  } else {
    bool fast = r.in_shared;
    if (fast) {
      const auto scratch =
          top_k_device::ClusterScratch::at<Select>(reinterpret_cast<uint32_t*>(smem));
      fast = keys_from_candidates(sp, r, scratch.all_pairs, sh, equal_groups, &n_equal, keys);
    }
    if (!fast) {  // uniform over the cluster
      emit_slow(sp, row, r, reinterpret_cast<uint32_t*>(smem), sh, out);
      in_global = true;
    }
    if (marker) E4KV_TL_PHASE(7);
    cluster_wait();  // the select's arrival: every send into this CTA has landed
  }
  if (in_global) {
    // The tail after the emitted groups, then a release / acquire cluster barrier so every CTA
    // reads what the others wrote.
    if (rank == 0) {
      for (int32_t j = group_tokens + tid; j < count; j += kThreads) {
        out[j] = tail_begin + (j - group_tokens);
      }
    }
    __threadfence();
    asm volatile("barrier.cluster.arrive.aligned;\n" ::: "memory");
    cluster_wait();
    for (int32_t j = tid; j < count; j += kThreads) keys[j] = __ldcg(out + j);
  } else {
    for (int32_t j = group_tokens + tid; j < count; j += kThreads) {
      keys[j] = tail_begin + (j - group_tokens);
    }
  }
  for (int32_t j = count + tid; j < sp.width; j += kThreads) keys[j] = 0;
  __syncthreads();
  if (marker) E4KV_TL_PHASE(8);
  // The selection for the caller: the first KV head's cluster, each CTA a share of the row.
  if (kv_head == 0) {
    const int32_t share = (sp.width + kCluster - 1) / kCluster;
    const int32_t first = int32_t(rank) * share;
    const int32_t last = min(first + share, int32_t(sp.width));
    if (!in_global) {
      for (int32_t j = first + tid; j < last; j += kThreads) out[j] = j < count ? keys[j] : -1;
    } else {
      for (int32_t j = max(first, count) + tid; j < last; j += kThreads) out[j] = -1;
    }
    if (rank == 0 && tid == 0) sp.sel_counts[row] = count;
  }
  decode_device::decode_attention_body<kHeadDim, Elem, 1, true, kWarps, kCluster, SharedKeys,
                                       kTlSparseDecode>(p.decode, SharedKeys{keys, sp.width, count},
                                                        smem);
#endif
}

struct SparseInstance {
  void (*kernel)(SparseDecodeParams) = nullptr;
  int smem_bytes = 0;
};

template <int kHeadDim, class Elem>
SparseInstance instance() {
  static_assert(smem_bytes<kHeadDim, Elem>() <= 227 * 1024);
  return SparseInstance{&qsa_sparse_decode_kernel<kHeadDim, Elem>, smem_bytes<kHeadDim, Elem>()};
}

template <class Elem>
SparseInstance instance_for_dim(int64_t head_dim) {
  if (head_dim == 128) return instance<128, Elem>();
  if (head_dim == 256) return instance<256, Elem>();
  return SparseInstance{};
}

SparseInstance select_instance(int64_t head_dim, int64_t group, KvCacheDtype dtype,
                               const DecodeAttentionConfig& config) {
  if (group > 8 || config.load != DecodeLoadPath::kAsyncCopy) return SparseInstance{};
  return decode_device::with_cache_elem(dtype, config.native_e4m3, [&]<class Elem>() {
    return instance_for_dim<Elem>(head_dim);
  });
}

// The dynamic shared-memory opt-in, once per (kernel, device).
void allow_shared_memory(const SparseInstance& inst) {
  set_attribute_once(inst.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, inst.smem_bytes);
}

}  // namespace

Result<DecodeClusterMerge> qsa_sparse_decode_clusters(const KvCacheGeometry& geo, int64_t n_heads,
                                                      const DecodeAttentionConfig& config,
                                                      int device) {
  E4KV_RETURN_IF_ERROR(check_decode_attention_shape(geo, n_heads));
  if (compute_capability(device) < 90) return DecodeClusterMerge{};
  const SparseInstance inst =
      select_instance(geo.head_dim, n_heads / geo.n_kv_heads, geo.dtype, config);
  if (inst.kernel == nullptr) return DecodeClusterMerge{};
  int saved = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&saved));
  E4KV_CUDA_CHECK(cudaSetDevice(device));
  cudaFuncAttributes attr{};
  E4KV_CUDA_CHECK(cudaFuncGetAttributes(&attr, inst.kernel));
  int clusters = 0;
  if (attr.binaryVersion >= 90) {  // sm_90 code in this build
    allow_shared_memory(inst);
    clusters = max_active_clusters(inst.kernel, unsigned(kThreads), size_t(inst.smem_bytes),
                                   unsigned(kCluster));
  }
  E4KV_CUDA_CHECK(cudaSetDevice(saved));
  if (clusters <= 0) return DecodeClusterMerge{};
  return DecodeClusterMerge{int64_t(clusters), int64_t(kCluster) * kWarps};
}

DecodeAttentionPlan plan_qsa_sparse_decode(int64_t n_rows, int64_t n_kv_heads, int64_t max_groups,
                                           int64_t budget, int64_t ratio,
                                           const DecodeClusterMerge& clusters) {
  const int64_t width = budget + ratio - 1;
  if (clusters.splits <= 0 || n_rows * n_kv_heads > clusters.clusters ||
      max_groups > kQsaSparseDecodeMaxGroups || ratio < 1 || budget < ratio ||
      width > kDecodeClusterMaxKeys) {
    return DecodeAttentionPlan{};
  }
  return plan_decode_attention_cluster(width, clusters.splits);
}

Status qsa_sparse_decode(const QsaSparseDecodeArgs& args, const DecodeAttentionPlan& plan,
                         const DecodeAttentionConfig& config, cudaStream_t stream) {
  const QsaTopKArgs& sa = args.select;
  const PagedAttentionParams& pa = args.attention;
  const KvCacheGeometry& geo = pa.cache.geometry;
  const int64_t n_rows = sa.rows.n_rows;
  if (sa.ratio < 1 || sa.budget < sa.ratio) {
    return Status::error(cat("qsa sparse decode: budget ", sa.budget, " and ratio ", sa.ratio,
                             ": ratio must be >= 1 and the budget at least one group"));
  }
  const int64_t width = sa.budget + sa.ratio - 1;
  if (width > kDecodeClusterMaxKeys || sa.max_groups < 0 ||
      sa.max_groups > kQsaSparseDecodeMaxGroups) {
    return Status::error(cat("qsa sparse decode: selection width ", width, " (at most ",
                             kDecodeClusterMaxKeys, ") or max_groups ", sa.max_groups, " (at most ",
                             kQsaSparseDecodeMaxGroups,
                             ") outside the kernel's limits: use qsa_top_k_select and "
                             "paged_decode_attention"));
  }
  if (pa.rows.n_rows != n_rows || pa.rows.row_seq != sa.rows.row_seq ||
      pa.rows.row_pos != sa.rows.row_pos) {
    return Status::error("qsa sparse decode: the attention's rows are not the selection's rows");
  }
  if (n_rows < 0 || n_rows * geo.n_kv_heads >= (int64_t(1) << 31)) {
    return Status::error(cat("qsa sparse decode: n_rows ", n_rows, " out of range"));
  }
  if (sa.run_maxima != nullptr &&
      sa.run_stride < (sa.max_groups + kQsaRunGroups - 1) / kQsaRunGroups) {
    return Status::error(cat("qsa sparse decode: run_stride ", sa.run_stride,
                             " is below ceil(max_groups / ", kQsaRunGroups, ")"));
  }
  if (n_rows == 0) return Status();
  if (sa.rows.row_seq == nullptr || sa.rows.row_pos == nullptr || sa.rows.seq_lens == nullptr ||
      sa.sel_tokens == nullptr || sa.sel_counts == nullptr || sa.scores == nullptr ||
      pa.q == nullptr || pa.out == nullptr || pa.cache.data == nullptr ||
      pa.block_table.blocks == nullptr) {
    return Status::error("qsa sparse decode: a required device pointer is null");
  }
  if (reinterpret_cast<uintptr_t>(pa.q) % 16 != 0) {
    return Status::error(
        "qsa sparse decode: q must be 16-byte aligned (it is read 16 bytes at a time)");
  }
  E4KV_RETURN_IF_ERROR(check_decode_attention_shape(geo, pa.n_heads));
  const SparseInstance inst =
      select_instance(geo.head_dim, pa.n_heads / geo.n_kv_heads, geo.dtype, config);
  int device = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  if (inst.kernel == nullptr || compute_capability(device) < 90 || !plan.merge_in_cluster ||
      plan.n_splits != int64_t(kCluster) * kWarps ||
      plan.keys_per_split != plan_decode_attention_cluster(width, plan.n_splits).keys_per_split) {
    return Status::error(
        "qsa sparse decode: the plan is not plan_qsa_sparse_decode's for this shape, or this "
        "shape, config or device has no sparse decode kernel (qsa_sparse_decode_clusters reports "
        "none): run qsa_top_k_select and paged_decode_attention");
  }
  SparseDecodeParams kp{};
  kp.select.row_seq = sa.rows.row_seq;
  kp.select.row_pos = sa.rows.row_pos;
  kp.select.seq_lens = sa.rows.seq_lens;
  kp.select.ratio = int32_t(sa.ratio);
  kp.select.k = int32_t(sa.budget / sa.ratio);
  kp.select.width = int32_t(width);
  kp.select.scores = sa.scores;
  kp.select.run_maxima = sa.run_maxima;
  kp.select.max_groups = sa.max_groups;
  kp.select.run_stride = sa.run_stride;
  kp.select.sel_tokens = sa.sel_tokens;
  kp.select.sel_counts = sa.sel_counts;
  kp.decode = decode_device::decode_kernel_params(pa, plan, nullptr, config);
  allow_shared_memory(inst);
  LaunchDims dims{dim3(unsigned(n_rows * geo.n_kv_heads), unsigned(kCluster)),
                  dim3(unsigned(kThreads)), size_t(inst.smem_bytes)};
  dims.cluster_y = unsigned(kCluster);
  launch_kernel(inst.kernel, dims, stream, kp);
  return Status();
}

}  // namespace e4kv::cuda
