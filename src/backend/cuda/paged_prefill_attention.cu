// Paged prefill / chunked attention: FP16 or E4M3 KV, dense causal or QSA-selected keys, GQA group
// up to 16, on tensor cores.
//
// Work: one CTA (4 warps) per (item, KV head). An item is up to 64 / group query rows of one
// sequence; the CTA's 64 query-head slots (slot = row * group + head in group) are the M dimension,
// 16 per warp, so the K/V bytes of a tile are read once for all rows and heads that share them.
// The CTA walks key tiles of kKeyTile consecutive positions:
//   1. every thread loads its share of the tile's K and V rows (16-byte loads through the block
//      table) and stores them to shared memory as FP16; E4M3 pages are converted here, once per
//      element per CTA (not once per fragment), value * 2^-8 on the software path with 2^8 folded
//      into the scales;
//   2. S = Q . K^T with mma.m16n8k8 from ldmatrix fragments (Q stays in shared memory);
//   3. mask (causal: key <= row position; QSA: the key is in the row's selection) and online
//      softmax in fp32, base 2;
//   4. O += P . V with mma.m16n8k8, V fragments through ldmatrix.trans, P straight from the S
//      registers.
// Dense tiles run from position 0 to the item's last position. QSA tiles are only those that hold
// a selected key of some row: each row keeps a cursor into its ascending selection, and the next
// tile starts at the smallest unconsumed selected position, so unselected stretches are skipped
// without a workspace. Shared memory rows are XOR-swizzled in 16-byte chunks so ldmatrix is free of
// bank conflicts.
//
// Limits: head_dim 64/128/256, GQA group <= 16, block_size % 8 == 0. Instructions: mma.m16n8k8 and
// ldmatrix (sm_75+); the software E4M3 decoder uses only sm_70 integer instructions.
#include "backend/cuda/paged_prefill_attention.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/e4m3_vec.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/paged_rows_device.cuh"

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kSlots = int(kPrefillQuerySlots);  // query-head slots per CTA, 16 per warp

struct PrefillKernelParams {
  PagedKvDevice kv;
  PagedRowsDevice rows;
  int32_t n_heads;
  int32_t group;                     // n_heads / n_kv_heads
  const uint16_t* q;                 // [n_rows, n_heads, head_dim] FP16
  const uint16_t* gate;              // [n_rows, n_heads, head_dim] FP16 or nullptr
  float qk_scale_log2;               // k_scale * decode factor / sqrt(head_dim) * log2(e)
  float out_scale;                   // v_scale * decode factor
  const PrefillAttentionItem* items; // [n_items]
  float* out;                        // [n_rows, n_heads, head_dim]
};

template <class Elem>
constexpr float decode_factor() {
  if constexpr (Elem::kBytes == 2) {
    return 1.0f;
  } else {
    return Elem::Decoder::kValueFactor;
  }
}

// Offset (in FP16 elements) of 16-byte chunk `chunk` of row `row` in a swizzled tile whose rows
// hold kChunks chunks.
template <int kChunks>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return (row * kChunks + (chunk ^ (row & 7))) * 8;
}

// Converts 16 bytes of cache (8 FP16 or 16 E4M3 values) and stores them as FP16 chunk(s).
template <class Elem, int kChunks>
__device__ __forceinline__ void store_piece(uint16_t* tile, int row, int piece, const uint4& raw) {
  if constexpr (Elem::kBytes == 2) {
    *reinterpret_cast<uint4*>(tile + swizzled<kChunks>(row, piece)) = raw;
  } else {
    uint4 a, b;
    Elem::Decoder::decode4(raw.x, a.x, a.y);
    Elem::Decoder::decode4(raw.y, a.z, a.w);
    Elem::Decoder::decode4(raw.z, b.x, b.y);
    Elem::Decoder::decode4(raw.w, b.z, b.w);
    *reinterpret_cast<uint4*>(tile + swizzled<kChunks>(row, 2 * piece)) = a;
    *reinterpret_cast<uint4*>(tile + swizzled<kChunks>(row, 2 * piece + 1)) = b;
  }
}

template <int kHeadDim, int kKeyTile, class Elem>
__global__ void __launch_bounds__(kThreads)
    paged_prefill_attention_kernel(const __grid_constant__ PrefillKernelParams p) {
  enter_dependent_grid();
  constexpr int kChunks = kHeadDim / 8;                    // FP16 chunks per row
  constexpr int kPiecesPerRow = kHeadDim * Elem::kBytes / 16;  // 16-byte loads per cache row
  constexpr int kLoads = 2 * kKeyTile * kPiecesPerRow / kThreads;
  static_assert(2 * kKeyTile * kPiecesPerRow % kThreads == 0);
  constexpr int kNTiles = kKeyTile / 8;  // key n-tiles of S
  constexpr int kDTiles = kHeadDim / 8;  // dim n-tiles of O

  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* s_q = smem;                       // [kSlots][kHeadDim], swizzled
  uint16_t* s_k = s_q + kSlots * kHeadDim;    // [kKeyTile][kHeadDim], swizzled
  uint16_t* s_v = s_k + kKeyTile * kHeadDim;  // [kKeyTile][kHeadDim], swizzled
  __shared__ unsigned long long s_mask[kSlots];  // QSA: bit i = key tile_start + i selected
  __shared__ int s_next[2];                      // QSA: smallest unconsumed selected position
  __shared__ int s_max_pos;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const PrefillAttentionItem item = p.items[blockIdx.x];
  const int kv_head = blockIdx.y;
  const int head0 = kv_head * p.group;
  const int n_slots = item.n_rows * p.group;
  const int seq = p.rows.row_seq[item.first_row];
  const int32_t* table = p.rows.block_table + int64_t(seq) * p.rows.max_blocks_per_seq;
  const bool qsa = p.rows.sel_tokens != nullptr;
  const int64_t row_bytes = int64_t(p.kv.n_kv_heads) * kHeadDim * Elem::kBytes;
  const int64_t head_offset = int64_t(kv_head) * kHeadDim * Elem::kBytes;

  for (int i = tid; i < kSlots * kChunks; i += kThreads) {
    const int slot = i / kChunks;
    const int chunk = i % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (slot < n_slots) {
      const int64_t row = item.first_row + slot / p.group;
      const int head = head0 + slot % p.group;
      v = *reinterpret_cast<const uint4*>(p.q + (row * p.n_heads + head) * kHeadDim + chunk * 8);
    }
    *reinterpret_cast<uint4*>(s_q + swizzled<kChunks>(slot, chunk)) = v;
  }
  if (tid == 0) {
    s_max_pos = -1;
    s_next[0] = INT_MAX;
    s_next[1] = INT_MAX;
  }
  __syncthreads();
  const int32_t* sel = nullptr;
  int cursor = 0;
  int count = 0;
  if (tid < item.n_rows) {
    const int row = item.first_row + tid;
    atomicMax(&s_max_pos, p.rows.row_pos[row]);
    if (qsa) {
      sel = p.rows.sel_tokens + int64_t(row) * p.rows.sel_width;
      count = p.rows.sel_counts[row];
      if (count > 0) atomicMin(&s_next[0], sel[0]);
    }
  }
  __syncthreads();
  const int max_pos = s_max_pos;

  // This thread's two S rows (slots) and their rows' positions; -1 for unused slots.
  const int slot_lo = warp * 16 + g;
  const int slot_hi = slot_lo + 8;
  const int row_lo = slot_lo / p.group;  // item row
  const int row_hi = slot_hi / p.group;
  const int pos_lo = slot_lo < n_slots ? p.rows.row_pos[item.first_row + row_lo] : -1;
  const int pos_hi = slot_hi < n_slots ? p.rows.row_pos[item.first_row + row_hi] : -1;

  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.0f, 0.0f};  // this thread's partial sums; the group's 4 are added at the end
  float o[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;

  int tile_start = 0;
  for (int it = 0;; ++it) {
    if (qsa) {
      const int next = s_next[it & 1];
      if (next == INT_MAX) break;
      tile_start = next / kKeyTile * kKeyTile;
      // Safe to reset: every thread read this slot at the top of the previous iteration and has
      // passed that iteration's barriers since.
      if (tid == 0) s_next[(it + 1) & 1] = INT_MAX;
    } else if (tile_start > max_pos) {
      break;
    }

    // 1. Gather the tile's K and V rows into registers.
    uint4 raw[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = tid + j * kThreads;
      const int kv = i / (kKeyTile * kPiecesPerRow);
      const int key = (i / kPiecesPerRow) % kKeyTile;
      const int piece = i % kPiecesPerRow;
      const int pos = tile_start + key;
      raw[j] = make_uint4(0u, 0u, 0u, 0u);
      if (pos <= max_pos) {
        const int64_t block = table[pos / p.kv.block_size];
        const int slot = pos % p.kv.block_size;
        const uint8_t* src = p.kv.cache + ((block * 2 + kv) * p.kv.block_size + slot) * row_bytes +
                             head_offset + piece * 16;
        raw[j] = __ldg(reinterpret_cast<const uint4*>(src));
      }
    }
    __syncthreads();  // the previous tile's fragments and masks have been read
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = tid + j * kThreads;
      const int kv = i / (kKeyTile * kPiecesPerRow);
      const int key = (i / kPiecesPerRow) % kKeyTile;
      const int piece = i % kPiecesPerRow;
      store_piece<Elem, kChunks>(kv == 0 ? s_k : s_v, key, piece, raw[j]);
    }
    if (qsa) {
      if (tid < item.n_rows) {
        const int tile_end = tile_start + kKeyTile;
        unsigned long long mask = 0;
        while (cursor < count) {
          const int pos = sel[cursor];
          if (pos >= tile_end) break;
          mask |= 1ull << (pos - tile_start);
          ++cursor;
        }
        s_mask[tid] = mask;
        if (cursor < count) atomicMin(&s_next[(it + 1) & 1], sel[cursor]);
      }
    }
    __syncthreads();

    // 2. S = Q . K^T for the warp's 16 slots.
    float s[kNTiles][4];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kChunks / 2; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, s_q + swizzled<kChunks>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
      for (int n = 0; n < kNTiles; n += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, s_k + swizzled<kChunks>((n + (lane >> 4)) * 8 + (lane & 7),
                                               2 * kk + ((lane >> 3) & 1)));
        mma_m16n8k8(s[n], a[0], a[1], b[0]);
        mma_m16n8k8(s[n], a[2], a[3], b[1]);
        mma_m16n8k8(s[n + 1], a[0], a[1], b[2]);
        mma_m16n8k8(s[n + 1], a[2], a[3], b[3]);
      }
    }

    // 3. Mask and online softmax (base 2).
    const unsigned long long mask_lo = qsa && slot_lo < n_slots ? s_mask[row_lo] : 0ull;
    const unsigned long long mask_hi = qsa && slot_hi < n_slots ? s_mask[row_hi] : 0ull;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n * 8 + 2 * t + (e & 1);
        const bool hi = e >= 2;
        const bool keep = qsa ? (((hi ? mask_hi : mask_lo) >> key) & 1ull) != 0
                              : tile_start + key <= (hi ? pos_hi : pos_lo);
        s[n][e] = keep ? s[n][e] * p.qk_scale_log2 : -INFINITY;
        tile_max[hi] = fmaxf(tile_max[hi], s[n][e]);
      }
    }
    float alpha[2];
    float m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 2));
      const float m_new = fmaxf(m_run[h], tile_max[h]);
      m_use[h] = m_new == -INFINITY ? 0.0f : m_new;  // rows with nothing kept yet stay at zero
      alpha[h] = exp2f(m_run[h] - m_use[h]);
      m_run[h] = m_new;
      l_run[h] *= alpha[h];
    }
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      o[d][0] *= alpha[0];
      o[d][1] *= alpha[0];
      o[d][2] *= alpha[1];
      o[d][3] *= alpha[1];
    }

    // 4. O += P . V, eight keys (one S n-tile) per mma k-step.
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
      const float p0 = exp2f(s[n][0] - m_use[0]);
      const float p1 = exp2f(s[n][1] - m_use[0]);
      const float p2 = exp2f(s[n][2] - m_use[1]);
      const float p3 = exp2f(s[n][3] - m_use[1]);
      l_run[0] += p0 + p1;
      l_run[1] += p2 + p3;
      const uint32_t a0 = pack_half2(p0, p1);
      const uint32_t a1 = pack_half2(p2, p3);
#pragma unroll
      for (int dq = 0; dq < kDTiles; dq += 4) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, s_v + swizzled<kChunks>(n * 8 + (lane & 7), dq + (lane >> 3)));
        mma_m16n8k8(o[dq], a0, a1, b[0]);
        mma_m16n8k8(o[dq + 1], a0, a1, b[1]);
        mma_m16n8k8(o[dq + 2], a0, a1, b[2]);
        mma_m16n8k8(o[dq + 3], a0, a1, b[3]);
      }
    }
    if (!qsa) tile_start += kKeyTile;
  }

  // Output: out = O / l * v_scale * factor (* sigmoid(gate)); zero for an empty key list.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xFFFFFFFFu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xFFFFFFFFu, l_run[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int slot = h == 0 ? slot_lo : slot_hi;
    if (slot >= n_slots) continue;
    const int64_t row = item.first_row + slot / p.group;
    const int head = head0 + slot % p.group;
    const float scale = l_run[h] > 0.0f ? p.out_scale / l_run[h] : 0.0f;
    const int64_t base = (row * p.n_heads + head) * kHeadDim;
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      const int dim = d * 8 + 2 * t;
      float2 v = make_float2(o[d][2 * h] * scale, o[d][2 * h + 1] * scale);
      if (p.gate != nullptr) {
        const __half2 gh = *reinterpret_cast<const __half2*>(p.gate + base + dim);
        const float2 gf = __half22float2(gh);
        v.x *= 1.0f / (1.0f + expf(-gf.x));
        v.y *= 1.0f / (1.0f + expf(-gf.y));
      }
      *reinterpret_cast<float2*>(p.out + base + dim) = v;
    }
  }
}

template <int kHeadDim, int kKeyTile>
constexpr int prefill_smem_bytes() {
  return (kSlots + 2 * kKeyTile) * kHeadDim * 2;
}

template <int kHeadDim, int kKeyTile, class Elem>
void launch_prefill(const PrefillKernelParams& kp, int64_t n_items, int n_kv_heads,
                    cudaStream_t stream) {
  auto* kernel = paged_prefill_attention_kernel<kHeadDim, kKeyTile, Elem>;
  constexpr int smem = prefill_smem_bytes<kHeadDim, kKeyTile>();
  static const bool configured = [&] {
    E4KV_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)configured;
  const dim3 grid(static_cast<unsigned>(n_items), static_cast<unsigned>(n_kv_heads));
  launch_kernel(kernel, LaunchDims{grid, dim3(kThreads), size_t(smem)}, stream, kp);
}

template <int kHeadDim, class Elem>
void dispatch_key_tile(PrefillKernelParams kp, int64_t n_items, int n_kv_heads, int max_smem,
                       cudaStream_t stream) {
  kp.qk_scale_log2 *= decode_factor<Elem>();
  kp.out_scale *= decode_factor<Elem>();
  // Static shared memory (masks, cursors) needs about 600 bytes beside the dynamic tiles.
  if constexpr (kHeadDim == 256) {
    if (max_smem >= prefill_smem_bytes<256, 32>() + 1024) {
      launch_prefill<256, 32, Elem>(kp, n_items, n_kv_heads, stream);
    } else {
      launch_prefill<256, 16, Elem>(kp, n_items, n_kv_heads, stream);
    }
  } else {
    launch_prefill<kHeadDim, 64, Elem>(kp, n_items, n_kv_heads, stream);
  }
}

template <class Elem>
void dispatch_head_dim(const PrefillKernelParams& kp, int64_t head_dim, int64_t n_items,
                       int n_kv_heads, int max_smem, cudaStream_t stream) {
  switch (head_dim) {
    case 64: dispatch_key_tile<64, Elem>(kp, n_items, n_kv_heads, max_smem, stream); break;
    case 128: dispatch_key_tile<128, Elem>(kp, n_items, n_kv_heads, max_smem, stream); break;
    default: dispatch_key_tile<256, Elem>(kp, n_items, n_kv_heads, max_smem, stream); break;
  }
}

}  // namespace

Status paged_prefill_attention(const PagedAttentionParams& params,
                               const PrefillAttentionItem* items, int64_t n_items,
                               bool native_e4m3, cudaStream_t stream) {
  // The CPU validation reads only sizes and pointers' presence here: the row arrays are device
  // memory, so it must not look inside them.
  const KvCacheGeometry& geo = params.cache.geometry;
  if (geo.head_dim != 64 && geo.head_dim != 128 && geo.head_dim != 256) {
    return Status::error(cat("prefill attention: head_dim ", geo.head_dim,
                               " is not supported (64, 128 or 256)"));
  }
  if (geo.n_kv_heads <= 0 || params.n_heads % geo.n_kv_heads != 0 ||
      params.n_heads / geo.n_kv_heads > 16 || params.n_heads <= 0) {
    return Status::error(cat("prefill attention: ", params.n_heads, " query heads over ",
                               geo.n_kv_heads, " KV heads: the GQA group must be 1..16"));
  }
  if (geo.block_size <= 0 || geo.block_size % 8 != 0) {
    return Status::error(
        cat("prefill attention: block_size ", geo.block_size, " is not a multiple of 8"));
  }
  if (params.cache.data == nullptr || params.q == nullptr || params.out == nullptr ||
      params.block_table.blocks == nullptr || params.rows.row_seq == nullptr ||
      params.rows.row_pos == nullptr || (n_items > 0 && items == nullptr)) {
    return Status::error("prefill attention: a required device pointer is null");
  }
  if (params.rows.qsa() && params.rows.sel_counts == nullptr) {
    return Status::error("prefill attention: QSA rows need sel_counts");
  }
  if (!(params.cache.k_scale > 0.0f) || !(params.cache.v_scale > 0.0f) ||
      !std::isfinite(params.cache.k_scale) || !std::isfinite(params.cache.v_scale)) {
    return Status::error("prefill attention: k_scale and v_scale must be finite and > 0");
  }
  if (n_items == 0) return ok_status();
  if (n_items > 0x7FFFFFFF || geo.n_kv_heads > 65535) {
    return Status::error("prefill attention: too many items or KV heads for one launch");
  }

  PrefillKernelParams kp{};
  kp.kv = paged_kv_device(params.cache);
  kp.rows = paged_rows_device(params.block_table, params.rows);
  kp.n_heads = static_cast<int32_t>(params.n_heads);
  kp.group = static_cast<int32_t>(params.n_heads / geo.n_kv_heads);
  kp.q = params.q;
  kp.gate = params.gate;
  kp.qk_scale_log2 = static_cast<float>(params.cache.k_scale / std::sqrt(double(geo.head_dim)) *
                                        1.4426950408889634);
  kp.out_scale = params.cache.v_scale;
  kp.items = items;
  kp.out = params.out;

  int device = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  int max_smem = 0;
  E4KV_CUDA_CHECK(
      cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int n_kv_heads = static_cast<int>(geo.n_kv_heads);
  if (geo.dtype == KvCacheDtype::kF16) {
    dispatch_head_dim<ElemF16>(kp, geo.head_dim, n_items, n_kv_heads, max_smem, stream);
  } else if (native_e4m3) {
    dispatch_head_dim<ElemE4m3<E4m3Decode::kNative>>(kp, geo.head_dim, n_items, n_kv_heads,
                                                     max_smem, stream);
  } else {
    dispatch_head_dim<ElemE4m3<E4m3Decode::kSoftware>>(kp, geo.head_dim, n_items, n_kv_heads,
                                                       max_smem, stream);
  }
  return ok_status();
}

}  // namespace e4kv::cuda
