// Device code of the paged decode attention kernel (paged_decode_attention.cu, which describes it):
// its parameters, sizes, helpers and body, which a kernel may also run over a key list it selects
// itself (bench/experimental/ holds one). Experiments: bench/notes/paged_decode_attention.md.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/cluster.cuh"
#include "backend/cuda/e4m3_vec.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/paged_decode_attention.cuh"
#include "backend/cuda/paged_rows_device.cuh"
#include "backend/cuda/timeline.cuh"

namespace e4kv::cuda::decode_device {

constexpr int kWarpsPerCta = int(kDecodeWarpsPerCta);
constexpr int kTileTokens = int(kDecodeTileTokens);
constexpr unsigned kFullMask = 0xFFFFFFFFu;

struct DecodeKernelParams {
  PagedKvDevice kv;
  PagedRowsDevice rows;
  int32_t n_heads;
  int32_t group;        // n_heads / n_kv_heads
  const uint16_t* q;    // [n_rows, n_heads, head_dim] FP16
  float qk_scale_log2;  // k_scale * decode factor / sqrt(head_dim) * log2(e)
  int32_t keys_per_split;
  int32_t n_splits;
  float* m;    // [n_rows, n_splits, n_heads] (base-2 logits)
  float* l;    // [n_rows, n_splits, n_heads]
  float* acc;  // [n_rows, n_splits, n_heads, head_dim]
  // Cluster merge only (the kernel writes the output itself): as MergeKernelParams.
  const uint16_t* gate;
  float out_scale;
  float* out;
};

struct MergeKernelParams {
  int32_t n_heads;
  int32_t n_splits;
  const float* m;
  const float* l;
  const float* acc;
  const uint16_t* gate;  // [n_rows, n_heads, head_dim] FP16 or nullptr
  float out_scale;       // v_scale * decode factor
  float* out;            // [n_rows, n_heads, head_dim]
};

// Loads kWords 32-bit words (16 or 8 bytes, or 4) from global memory, read-only path.
template <int kWords>
__device__ __forceinline__ void load_words(const uint8_t* ptr, uint32_t (&w)[kWords]) {
  if constexpr (kWords == 4) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(ptr));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (kWords == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(ptr));
    w[0] = v.x, w[1] = v.y;
  } else {
    static_assert(kWords == 1);
    w[0] = __ldg(reinterpret_cast<const uint32_t*>(ptr));
  }
}

// The same from shared memory.
template <int kWords>
__device__ __forceinline__ void load_shared_words(const uint8_t* ptr, uint32_t (&w)[kWords]) {
  if constexpr (kWords == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(ptr);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (kWords == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(ptr);
    w[0] = v.x, w[1] = v.y;
  } else {
    static_assert(kWords == 1);
    w[0] = *reinterpret_cast<const uint32_t*>(ptr);
  }
}

// A per-head value held in S layout (row g of the lane's fragment: head g, + 8 for the second
// tile) -> the values for the lane's two O^T columns (heads 2t and 2t + 1), which live in the lanes
// whose row group is that head.
__device__ __forceinline__ void to_columns(float v, int t, float& a0, float& a1) {
  a0 = __shfl_sync(kFullMask, v, 8 * t);
  a1 = __shfl_sync(kFullMask, v, 8 * t + 4);
}

// One output element of a merged row and head: the weighted sum over the splits divided by their
// weighted l, times out_scale (v_scale and the decode factor), times sigmoid(gate) where a gate
// is given; 0 for a row without keys.
__device__ __forceinline__ void store_merged(float acc, float l_sum, float out_scale,
                                             const uint16_t* gate, float* out, int64_t index) {
  float value = l_sum > 0.0f ? acc * out_scale / l_sum : 0.0f;
  if (gate != nullptr) {
    __half_raw raw;
    raw.x = gate[index];
    value *= 1.0f / (1.0f + expf(-__half2float(__half(raw))));
  }
  out[index] = value;
}

// Registers of raw K/V bytes per thread that one iteration may take, and bytes of shared-memory
// ring per warp (async copy). Overridable at build time for tuning runs on the device. Chosen by
// interleaved A/B runs (see notes): a 12 KB ring beats 16 KB (4 FP16 CTAs per SM instead of 3);
// E4M3 d 256 takes 16-token iterations (both products on m16n8k16); a fixed split cost of 64 keys
// keeps batches of many rows from being cut into many small splits; forcing 4 resident CTAs on
// the async path makes d 256 spill registers.
#ifndef E4KV_DECODE_REGISTER_RAW_BUDGET
#define E4KV_DECODE_REGISTER_RAW_BUDGET 64
#endif
#ifndef E4KV_DECODE_ASYNC_RAW_BUDGET
#define E4KV_DECODE_ASYNC_RAW_BUDGET 32
#endif
#ifndef E4KV_DECODE_ASYNC_RAW_BUDGET_E4M3_D256
#define E4KV_DECODE_ASYNC_RAW_BUDGET_E4M3_D256 64
#endif
#ifndef E4KV_DECODE_RING_BYTES
#define E4KV_DECODE_RING_BYTES 12288
#endif
// The async path (sm_80+ only) uses mma.m16n8k16 where a pair of k8 steps allows it.
#ifndef E4KV_DECODE_MMA_K16
#define E4KV_DECODE_MMA_K16 1
#endif

// Every size the kernel and its launcher derive from the template arguments.
template <int kHeadDim, int kEB, int kHeadTiles, bool kAsync, int kWarps = kWarpsPerCta,
          int kCluster = 0>
struct DecodeShape {
  static constexpr bool kClusterMerge = kCluster > 0;  // CTAs per cluster, 0: no cluster merge
  // K: each thread loads kKElems contiguous dims of its token per load (always 16 bytes).
  static constexpr int kKElems = (16 / kEB) < (kHeadDim / 4) ? (16 / kEB) : (kHeadDim / 4);
  static constexpr int kKLoads = kHeadDim / (4 * kKElems);
  static constexpr int kKWords = kKElems * kEB / 4;
  static constexpr int kStepsPerLoad = kKElems / 2;
  static constexpr int kKSteps = kHeadDim / 8;
  // V: each thread loads kVElems contiguous dims of each of its two tokens per load.
  static constexpr int kVDimsPerThread = kHeadDim / 8;
  static constexpr int kVElems = (16 / kEB) < kVDimsPerThread ? (16 / kEB) : kVDimsPerThread;
  static constexpr int kVLoads = kVDimsPerThread / kVElems;
  static constexpr int kVWords = kVElems * kEB / 4;
  static constexpr int kMTiles = kHeadDim / 16;
  // Tiles of 8 tokens per iteration: raw K/V registers per thread within the budget (half of it
  // with two head tiles, whose Q and O fragments take the room), 1 to 4 tiles.
  static constexpr int kRawRegsPerTile = kKLoads * kKWords + 2 * kVLoads * kVWords;
  static constexpr int kRawBudget =
      (!kAsync                       ? E4KV_DECODE_REGISTER_RAW_BUDGET
       : kHeadDim == 256 && kEB == 1 ? E4KV_DECODE_ASYNC_RAW_BUDGET_E4M3_D256
                                     : E4KV_DECODE_ASYNC_RAW_BUDGET) /
      (kHeadTiles == 2 ? 2 : 1);
  static constexpr int kSub = kRawBudget / kRawRegsPerTile < 1   ? 1
                              : kRawBudget / kRawRegsPerTile > 4 ? 4
                                                                 : kRawBudget / kRawRegsPerTile;
  static constexpr int kIterTokens = kTileTokens * kSub;
  // Async copy: a stage holds one iteration, K rows then V rows, one head's row per token.
  static constexpr int kRowBytes = kHeadDim * kEB;
  static constexpr int kRowChunks = kRowBytes / 16;  // 4 to 32, a power of two
  static constexpr int kStageBytes = 2 * kIterTokens * kRowBytes;
  // d 256 instances hold ~200 registers, so at most 2 CTAs fit per SM anyway: they get twice the
  // ring (more iterations in flight) at no cost in residency.
  static constexpr int kRingBytes = E4KV_DECODE_RING_BYTES * (kHeadDim == 256 ? 2 : 1);
  static constexpr int kStages = kRingBytes / kStageBytes < 2   ? 2
                                 : kRingBytes / kStageBytes > 4 ? 4
                                                                : kRingBytes / kStageBytes;
  // Async path: after the loop the ring holds every warp's results for the CTA combine (m, l and
  // the O fragments of each lane, [warp][value][lane] fp32).
  static constexpr int kCombineValues = 4 + kHeadTiles * kMTiles * 4;
  static constexpr int kCombineBytes = kWarps * kCombineValues * 32 * 4;
  static constexpr int kRingsBytes = kWarps * kStages * kStageBytes;
  // Cluster merge: CTA j of the cluster merges the m-tiles j + kCluster i; it receives them from
  // each of the cluster's CTAs (kMTiles / kCluster per lane, 4 values each) with each head's
  // (m, l), into memory apart from the ring, which a slower CTA may still use when they arrive.
  static constexpr int kClusterDivisor = kClusterMerge ? kCluster : 1;
  static constexpr int kMergeTiles = kClusterMerge ? kMTiles / kClusterDivisor : 1;
  static constexpr int kReceiveValues = kMergeTiles * 4;  // per lane and sender
  static constexpr int kReceiveBytes =
      kClusterMerge ? kCluster * (32 * kReceiveValues + 2 * 8) * 4 : 0;
  static constexpr int kReceiveOffset = kRingsBytes > kCombineBytes ? kRingsBytes : kCombineBytes;
  static constexpr int kBarrierOffset = kReceiveOffset + kReceiveBytes;  // its mbarrier
  static constexpr int kSmemBytes =
      !kAsync ? 0 : kBarrierOffset + (kClusterMerge ? int(sizeof(uint64_t)) : 0);
  static constexpr bool kK16 = kAsync && E4KV_DECODE_MMA_K16;
  static_assert(kKWords == 4, "K fragments are loaded 16 bytes at a time");
  static_assert(kRowChunks >= 4 && kRowChunks <= 32 && 32 % kRowChunks == 0);
  static_assert(kIterTokens % (32 / kRowChunks) == 0);
  static_assert(!kAsync || 32 % kIterTokens == 0, "an iteration lies inside one 32-key window");
  static_assert(kMTiles % kWarps == 0, "the CTA combine gives each warp whole m-tiles");
  static_assert(!kClusterMerge ||
                    (kAsync && kHeadTiles == 1 && kCluster <= 16 && kMTiles % kClusterDivisor == 0),
                "cluster merge: async path, groups of at most 8, whole m-tiles per CTA");

  // Shared-memory row swizzles (chunk index within a token's row). K is read as (token g,
  // chunk t + 4c) and V as (token 2t + b, chunk g + 8c): flipping bit 2 of the chunk on odd
  // tokens spreads a K read over all 8 bank groups, and flipping bits 1-2 by token / 2 does the
  // same for V. Rows shorter than 8 chunks keep the bits that exist.
  __device__ static constexpr int k_chunk(int token, int chunk) {
    return chunk ^ (((token & 1) << 2) & (kRowChunks - 1));
  }
  __device__ static constexpr int v_chunk(int token, int chunk) {
    return chunk ^ ((((token >> 1) & 3) << 1) & (kRowChunks - 1));
  }
};

// note: the explicit minimum of 1 resident CTA changes ptxas' register allocation and scheduling
// for this kernel: FP16 decode at d 128 is 10-12% faster with it (see notes), E4M3 unchanged.
// Forcing 4 or 5 resident CTAs spills registers and is slower.
#ifndef E4KV_DECODE_ASYNC_MIN_CTAS
#define E4KV_DECODE_ASYNC_MIN_CTAS 1
#endif
// The key list of a row for decode_attention_body: at(key) is entry `key` (< the count),
// clamped(key) the entry at min(key, width - 1) (read ahead past the count), count(p, row) the
// number of keys. KeyList: the row's selection in global memory (QSA), or, without one, every key
// 0 .. row_pos (dense).
struct KeyList {
  const int32_t* sel;  // [sel_width] or nullptr
  int32_t width;

  __device__ static KeyList for_row(const DecodeKernelParams& p, int row) {
    return KeyList{p.rows.sel_tokens != nullptr
                       ? p.rows.sel_tokens + int64_t(row) * p.rows.sel_width
                       : nullptr,
                   int32_t(p.rows.sel_width)};
  }
  __device__ bool selected() const { return sel != nullptr; }
  __device__ int at(int key) const { return sel[key]; }
  __device__ int clamped(int key) const { return __ldg(sel + min(key, int(width) - 1)); }
  __device__ int count(const DecodeKernelParams& p, int row) const {
    return sel != nullptr ? p.rows.sel_counts[row] : p.rows.row_pos[row] + 1;
  }
};

// The decode kernel's work for the CTA (row blockIdx.x / n_kv_heads, KV head blockIdx.x %
// n_kv_heads, splits blockIdx.y * kWarps ..): its caller has passed griddepcontrol.wait. Keys
// gives the row's key list (KeyList: the selection in global memory, or every key; or a caller's
// own type with the same members). decode_smem: the instance's dynamic shared memory
// (Shape::kSmemBytes).
template <int kHeadDim, class Elem, int kHeadTiles, bool kAsync, int kWarps, int kCluster,
          class Keys, int kTimelineKernel = kTlDecode>
__device__ __forceinline__ void decode_attention_body(const DecodeKernelParams& p, const Keys& keys,
                                                      uint8_t* decode_smem) {
  using Shape = DecodeShape<kHeadDim, Elem::kBytes, kHeadTiles, kAsync, kWarps, kCluster>;
  constexpr bool kClusterMerge = Shape::kClusterMerge;
#if E4KV_DEVICE_ARCH >= 900
  // Cluster merge: the receive barrier expects every CTA's bytes; the relaxed arrive here and the
  // wait before the first send make its initialisation visible to the senders.
  if constexpr (kClusterMerge) {
    uint64_t* bar = reinterpret_cast<uint64_t*>(decode_smem + Shape::kBarrierOffset);
    if (threadIdx.x == 0) {
      mbarrier_init(bar);
      mbarrier_expect(bar, uint32_t(Shape::kReceiveBytes));
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_arrive_relaxed();
  }
#endif
  constexpr int kEB = Elem::kBytes;
  constexpr int kKElems = Shape::kKElems;
  constexpr int kKLoads = Shape::kKLoads;
  constexpr int kKWords = Shape::kKWords;
  constexpr int kStepsPerLoad = Shape::kStepsPerLoad;
  constexpr int kKSteps = Shape::kKSteps;
  constexpr int kVElems = Shape::kVElems;
  constexpr int kVLoads = Shape::kVLoads;
  constexpr int kVWords = Shape::kVWords;
  constexpr int kMTiles = Shape::kMTiles;
  constexpr int kSub = Shape::kSub;
  constexpr int kIterTokens = Shape::kIterTokens;
  constexpr int kRowBytes = Shape::kRowBytes;
  constexpr int kStages = Shape::kStages;

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // fragment row group
  const int t = lane & 3;   // thread in group
  const int row = blockIdx.x / p.kv.n_kv_heads;
  const int kv_head = blockIdx.x % p.kv.n_kv_heads;
  const int split = blockIdx.y * kWarps + warp;  // < n_splits (a multiple of kWarps)

  const int k_begin = split * p.keys_per_split;
  // Async path: the cache offsets of a split's keys are resolved 32 keys (a window) at a time,
  // lane L holding key k_begin + 32 w + L's. The selection entries of the first two windows are
  // read here, before the key count is known (entries past the count still lie inside the row), so
  // the count, the selection and the block table cost two dependent loads, not three.
  // note: the d 256 instances of two head tiles are at the 255-register limit, and the window state
  // (4 registers) made them spill (140 bytes): they resolve every token's address when they copy
  // it.
  constexpr bool kWindows = kAsync && !(kHeadDim == 256 && kHeadTiles == 2);
  int window_raw[2] = {0, 0};  // selection entries (QSA) or keys (dense)
  if constexpr (kWindows) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const int key = k_begin + 32 * w + lane;
      window_raw[w] = keys.selected() ? keys.clamped(key) : key;
    }
  }
  const int n_keys = keys.count(p, row);
  // Cluster merge: the row's last split also takes every key past the others (a selection of
  // budget + tail keys: 64 splits of budget / 64 keys and the tail in the last).
  const int k_end =
      kClusterMerge && split == p.n_splits - 1 ? n_keys : min(n_keys, k_begin + p.keys_per_split);
  const int head0 = kv_head * p.group;
  const int seq = p.rows.row_seq[row];
  const int32_t* table = p.rows.block_table + int64_t(seq) * p.rows.max_blocks_per_seq;
  const int64_t row_bytes = int64_t(p.kv.n_kv_heads) * kHeadDim * kEB;
  const int64_t head_offset = int64_t(kv_head) * kHeadDim * kEB;

  // Q as A fragments, dims permuted like the K loads: step (c, m) covers, for thread t, dims
  // kKElems * (t + 4c) + 2m + {0, 1}. The steps of one c are kKElems contiguous dims (16 or 32
  // bytes): 16-byte loads (q is 16-byte aligned, checked on the host).
  uint32_t q_lo[kKSteps];                        // heads head0 + g
  uint32_t q_hi[kHeadTiles == 2 ? kKSteps : 1];  // heads head0 + g + 8
  {
    static_assert(kStepsPerLoad % 4 == 0);
    const uint16_t* q_row = p.q + int64_t(row) * p.n_heads * kHeadDim;
    const bool lo_ok = g < p.group;
    const bool hi_ok = kHeadTiles == 2 && g + 8 < p.group;
    auto load_q = [&](bool ok, int head, int dim, uint32_t* dst) {
      const uint4 v =
          ok ? __ldg(reinterpret_cast<const uint4*>(q_row + int64_t(head) * kHeadDim + dim))
             : make_uint4(0u, 0u, 0u, 0u);
      dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    };
#pragma unroll
    for (int c = 0; c < kKLoads; ++c) {
#pragma unroll
      for (int m = 0; m < kStepsPerLoad; m += 4) {
        const int dim = kKElems * (t + 4 * c) + 2 * m;
        const int step = c * kStepsPerLoad + m;
        load_q(lo_ok, head0 + g, dim, q_lo + step);
        if constexpr (kHeadTiles == 2) load_q(hi_ok, head0 + g + 8, dim, q_hi + step);
      }
    }
  }

  float m_run[2] = {-INFINITY, -INFINITY};  // rows g, g + 8 of S (heads)
  float l_run[2] = {0.0f, 0.0f};
  float o[kHeadTiles][kMTiles][4];
#pragma unroll
  for (int h = 0; h < kHeadTiles; ++h) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
      o[h][mt][0] = o[h][mt][1] = o[h][mt][2] = o[h][mt][3] = 0.0f;
  }

  auto token_ptr = [&](int key, int kv) -> const uint8_t* {
    const int pos = keys.selected() ? keys.at(key) : key;
    int64_t block;
    int slot;
    if (p.kv.block_shift >= 0) {
      block = table[pos >> p.kv.block_shift];
      slot = pos & (p.kv.block_size - 1);
    } else {
      block = table[pos / p.kv.block_size];
      slot = pos % p.kv.block_size;
    }
    return p.kv.cache + ((block * 2 + kv) * p.kv.block_size + slot) * row_bytes + head_offset;
  };

  // The raw fragments of one iteration (kSub tiles of 8 tokens).
  struct Raw {
    uint32_t k[kSub][kKLoads][kKWords];
    uint32_t v0[kSub][kVLoads][kVWords];
    uint32_t v1[kSub][kVLoads][kVWords];
  };

  // Registers path: every fragment straight from global memory, all loads issued before any math.
  // Keys past k_end read a valid token (k_begin) and are masked below.
  auto load_iteration = [&](int tile, Raw& raw) {
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      const int base = tile + kTileTokens * sub;
      const int k_key = base + g < k_end ? base + g : k_begin;
      const int v_key0 = base + 2 * t < k_end ? base + 2 * t : k_begin;
      const int v_key1 = base + 2 * t + 1 < k_end ? base + 2 * t + 1 : k_begin;
      const uint8_t* k_ptr = token_ptr(k_key, 0);
      const uint8_t* v_ptr0 = token_ptr(v_key0, 1);
      const uint8_t* v_ptr1 = token_ptr(v_key1, 1);
#pragma unroll
      for (int c = 0; c < kKLoads; ++c) {
        load_words(k_ptr + kKElems * (t + 4 * c) * kEB, raw.k[sub][c]);
      }
#pragma unroll
      for (int c = 0; c < kVLoads; ++c) {
        load_words(v_ptr0 + kVElems * (g + 8 * c) * kEB, raw.v0[sub][c]);
        load_words(v_ptr1 + kVElems * (g + 8 * c) * kEB, raw.v1[sub][c]);
      }
    }
  };

  // Async path, key windows: a window's block-table entry is loaded one window before its
  // copies are issued, so a long split waits at most on a selection load (QSA) once per 32 keys,
  // and a short one (two windows, resolved together here) never. Keys past k_end take the
  // window's first key (masked below); windows past the split are read speculatively (indices
  // clamped) and never used.
  auto window_block = [&](int raw, int w, int& block, int& slot) {
    const int key = k_begin + 32 * w + lane;
    const bool valid = key < k_end;
    const int pos = keys.selected() ? __shfl_sync(kFullMask, raw, valid ? lane : 0)
                                    : (valid ? raw : key - lane);
    int index;
    if (p.kv.block_shift >= 0) {
      index = pos >> p.kv.block_shift;
      slot = pos & (p.kv.block_size - 1);
    } else {
      index = pos / p.kv.block_size;
      slot = pos % p.kv.block_size;
    }
    block = __ldg(table + min(max(index, 0), int(p.rows.max_blocks_per_seq) - 1));
  };
  auto window_offset = [&](int block, int slot) {
    return (int64_t(block) * 2 * p.kv.block_size + slot) * row_bytes + head_offset;
  };
  int64_t window_off = 0;             // the current window (K row of this lane's key)
  int next_block = 0, next_slot = 0;  // the next window: block-table load in flight
  if constexpr (kWindows) {
    int block0, slot0;
    window_block(window_raw[0], 0, block0, slot0);
    window_block(window_raw[1], 1, next_block, next_slot);
    window_off = window_offset(block0, slot0);
  }

  // Async path: the warp's ring of kStages stages; a stage is K rows [kIterTokens][kRowBytes]
  // then V rows, chunks swizzled. A lane copies one fixed chunk of every (32 / kRowChunks)-th
  // token, whose offset it takes from the window by shuffle (keys past k_end copy a valid token).
  uint8_t* ring = decode_smem + warp * (kStages * Shape::kStageBytes);
  const int64_t v_bytes_offset = int64_t(p.kv.block_size) * row_bytes;  // K row -> V row of a slot
  auto issue_iteration = [&](int tile, uint8_t* stage, int first_lane) {
    constexpr int kTokensPerRound = 32 / Shape::kRowChunks;
    const int chunk = lane % Shape::kRowChunks;
#pragma unroll
    for (int token = lane / Shape::kRowChunks; token < kIterTokens; token += kTokensPerRound) {
      const uint8_t* src;
      if constexpr (kWindows) {
        src = p.kv.cache + __shfl_sync(kFullMask, window_off, first_lane + token) + chunk * 16;
      } else {
        src = token_ptr(tile + token < k_end ? tile + token : k_begin, 0) + chunk * 16;
      }
      cp_async_16(stage + token * kRowBytes + Shape::k_chunk(token, chunk) * 16, src);
      cp_async_16(stage + (kIterTokens + token) * kRowBytes + Shape::v_chunk(token, chunk) * 16,
                  src + v_bytes_offset);
    }
  };
  // Iterations are issued in order, so a window starts when the first iteration inside it does.
  auto issue = [&](int i) {
    const int first = i * kIterTokens;  // key index within the split
    if (kWindows && first > 0 && first % 32 == 0) {
      const int window = first / 32;
      window_off = window_offset(next_block, next_slot);
      const int key = k_begin + 32 * (window + 1) + lane;
      window_block(keys.selected() ? keys.clamped(key) : key, window + 1, next_block, next_slot);
    }
    issue_iteration(k_begin + first, ring + (i % kStages) * Shape::kStageBytes, first % 32);
  };
  auto fetch_iteration = [&](const uint8_t* stage, Raw& raw) {
    const uint8_t* v_rows = stage + kIterTokens * kRowBytes;
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      const int k_token = kTileTokens * sub + g;
#pragma unroll
      for (int c = 0; c < kKLoads; ++c) {
        load_shared_words(stage + k_token * kRowBytes + Shape::k_chunk(k_token, t + 4 * c) * 16,
                          raw.k[sub][c]);
      }
#pragma unroll
      for (int c = 0; c < kVLoads; ++c) {
        const int byte = kVElems * (g + 8 * c) * kEB;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int v_token = kTileTokens * sub + 2 * t + b;
          const uint8_t* src =
              v_rows + v_token * kRowBytes + Shape::v_chunk(v_token, byte / 16) * 16 + byte % 16;
          load_shared_words(src, b == 0 ? raw.v0[sub][c] : raw.v1[sub][c]);
        }
      }
    }
  };

  const int n_iters = k_end > k_begin ? (k_end - k_begin + kIterTokens - 1) / kIterTokens : 0;
  if constexpr (kAsync) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_iters) issue(s);
      cp_async_commit();
    }
  }

  for (int it = 0; it < n_iters; ++it) {
    const int tile = k_begin + it * kIterTokens;
    Raw cur;
    if constexpr (kAsync) {
      // Stage `it` has landed (at most kStages - 2 younger groups pending); the stage refilled
      // next was read in the previous iteration, which every lane finished before the barrier.
      cp_async_wait<kStages - 2>();
      __syncwarp();
      const int ahead = it + kStages - 1;
      if (ahead < n_iters) issue(ahead);
      cp_async_commit();
      fetch_iteration(ring + (it % kStages) * Shape::kStageBytes, cur);
    } else {
      load_iteration(tile, cur);
    }
    const auto& k_raw = cur.k;
    const auto& v_raw0 = cur.v0;
    const auto& v_raw1 = cur.v1;
    // S = Q . K^T: s[sub][0..1] = heads g (tokens 2t, 2t+1), s[sub][2..3] = heads g + 8. On the
    // async path even and odd loads accumulate apart and are added at the end: two chains of
    // dependent mma instead of one, which matters when a warp has its scheduler to itself (short
    // splits). (The register path's d 256 instance of two head tiles spilled with it.)
    float s[kSub][4];
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      float s_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      s[sub][0] = s[sub][1] = s[sub][2] = s[sub][3] = 0.0f;
#pragma unroll
      for (int c = 0; c < kKLoads; ++c) {
        float(&acc)[4] = !kAsync || c % 2 == 0 ? s[sub] : s_odd;
        uint32_t b[kStepsPerLoad];
        if constexpr (kEB == 2) {
#pragma unroll
          for (int m = 0; m < kStepsPerLoad; ++m) b[m] = k_raw[sub][c][m];
        } else {
#pragma unroll
          for (int w = 0; w < kKWords; ++w) {
            Elem::Decoder::decode4(k_raw[sub][c][w], b[2 * w], b[2 * w + 1]);
          }
        }
        if constexpr (Shape::kK16) {
#pragma unroll
          for (int m = 0; m < kStepsPerLoad; m += 2) {
            const int step = c * kStepsPerLoad + m;
            mma_m16n8k16(acc, q_lo[step], kHeadTiles == 2 ? q_hi[step] : 0u, q_lo[step + 1],
                         kHeadTiles == 2 ? q_hi[step + 1] : 0u, b[m], b[m + 1]);
          }
        } else {
#pragma unroll
          for (int m = 0; m < kStepsPerLoad; ++m) {
            const int step = c * kStepsPerLoad + m;
            mma_m16n8k8(acc, q_lo[step], kHeadTiles == 2 ? q_hi[step] : 0u, b[m]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) s[sub][i] += s_odd[i];
    }

    // Online softmax over the whole iteration (base 2; scales folded into qk_scale_log2).
    float alpha[2];
    uint32_t p_frag[kSub][2];
#pragma unroll
    for (int r = 0; r < kHeadTiles; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int sub = 0; sub < kSub; ++sub) {
        const int base = tile + kTileTokens * sub;
        s[sub][2 * r] = base + 2 * t < k_end ? s[sub][2 * r] * p.qk_scale_log2 : -INFINITY;
        s[sub][2 * r + 1] =
            base + 2 * t + 1 < k_end ? s[sub][2 * r + 1] * p.qk_scale_log2 : -INFINITY;
        tile_max = fmaxf(tile_max, fmaxf(s[sub][2 * r], s[sub][2 * r + 1]));
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float m_new = fmaxf(m_run[r], tile_max);  // finite: token `tile` is valid
      alpha[r] = exp2f(m_run[r] - m_new);
      float l_add = 0.0f;
#pragma unroll
      for (int sub = 0; sub < kSub; ++sub) {
        const float p0 = exp2f(s[sub][2 * r] - m_new);
        const float p1 = exp2f(s[sub][2 * r + 1] - m_new);
        l_add += p0 + p1;
        p_frag[sub][r] = pack_half2(p0, p1);
      }
      l_run[r] = l_run[r] * alpha[r] + l_add;
      m_run[r] = m_new;
    }

#pragma unroll
    for (int r = 0; r < kHeadTiles; ++r) {
      float a0, a1;
      to_columns(alpha[r], t, a0, a1);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        o[r][mt][0] *= a0;
        o[r][mt][2] *= a0;
        o[r][mt][1] *= a1;
        o[r][mt][3] *= a1;
      }
    }

    // O^T += V^T . P^T. M-tile mt takes the thread's dims j = 2mt (row g) and 2mt + 1 (row g + 8)
    // of its list: dim(j) = kVElems * (g + 8 * (j / kVElems)) + j % kVElems. With k16, two tiles
    // of 8 tokens make one 16-token step (A: the two tiles' fragments; B: their P fragments).
    auto v_fragments = [&](int sub, int mt, uint32_t& a0, uint32_t& a1) {
      const int c = (2 * mt) / kVElems;
      const int e = (2 * mt) % kVElems;
      if constexpr (kEB == 2) {
        const uint32_t x = v_raw0[sub][c][e / 2];
        const uint32_t y = v_raw1[sub][c][e / 2];
        a0 = __byte_perm(x, y, 0x5410);
        a1 = __byte_perm(x, y, 0x7632);
      } else {
        const uint32_t x = v_raw0[sub][c][e / 4];
        const uint32_t y = v_raw1[sub][c][e / 4];
        if (e % 4 == 0) {
          a0 = Elem::Decoder::template decode_pair<0>(x, y);
          a1 = Elem::Decoder::template decode_pair<1>(x, y);
        } else {
          a0 = Elem::Decoder::template decode_pair<2>(x, y);
          a1 = Elem::Decoder::template decode_pair<3>(x, y);
        }
      }
    };
    if constexpr (Shape::kK16 && kSub % 2 == 0) {
#pragma unroll
      for (int sub = 0; sub < kSub; sub += 2) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          uint32_t a0, a1, a2, a3;
          v_fragments(sub, mt, a0, a1);
          v_fragments(sub + 1, mt, a2, a3);
#pragma unroll
          for (int r = 0; r < kHeadTiles; ++r) {
            mma_m16n8k16(o[r][mt], a0, a1, a2, a3, p_frag[sub][r], p_frag[sub + 1][r]);
          }
        }
      }
    } else {
#pragma unroll
      for (int sub = 0; sub < kSub; ++sub) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          uint32_t a0, a1;
          v_fragments(sub, mt, a0, a1);
#pragma unroll
          for (int r = 0; r < kHeadTiles; ++r) mma_m16n8k8(o[r][mt], a0, a1, p_frag[sub][r]);
        }
      }
    }
  }

  // A kernel that runs this body under its own timeline index (one that selects its keys first,
  // bench/experimental/) gets phase marks (timeline.cuh) after the keys and after the merge.
  [[maybe_unused]] const bool marker =
      kTimelineKernel != kTlDecode && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
  if (marker) E4KV_TL_PHASE(9);

    // Row sums live spread over the four threads of a group.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(kFullMask, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(kFullMask, l_run[r], 2);
  }

  // Async path: the CTA's 4 splits (consecutive key ranges of one row and KV head) are combined by
  // log-sum-exp in shared memory, so one partial per CTA goes to the merge (4x less partial
  // traffic, which matters when short splits fill the GPU for one long sequence or a QSA
  // selection). Every lane holds the same fragment positions in every warp, so the combine goes
  // lane by lane: every warp publishes its (m, l, O), takes the CTA's maxima and sums, and combines
  // and writes the O fragments of a quarter of the m-tiles (mt = warp mod 4), a quarter of the
  // serial work one warp would otherwise do alone at the end of short splits. No copy is in flight:
  // the last iteration waited for its stage and later groups are empty.
  int partial = split;
  if constexpr (kAsync) {
    __syncthreads();  // every warp is done with its ring
    float* xs = reinterpret_cast<float*>(decode_smem);
    auto slot = [&](int w, int value) -> float& {
      return xs[(w * Shape::kCombineValues + value) * 32 + lane];
    };
    slot(warp, 0) = m_run[0];
    slot(warp, 1) = m_run[1];
    slot(warp, 2) = l_run[0];
    slot(warp, 3) = l_run[1];
#pragma unroll
    for (int r = 0; r < kHeadTiles; ++r) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) slot(warp, 4 + (r * kMTiles + mt) * 4 + i) = o[r][mt][i];
      }
    }
    __syncthreads();
    // Factor of warp w's sums for S-row r (head g + 8r): 0 for an empty split or row.
    float f[kWarps][2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m_all = slot(0, r);
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m_all = fmaxf(m_all, slot(w, r));
      l_run[r] = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float m = slot(w, r);
        f[w][r] = m == -INFINITY ? 0.0f : exp2f(m - m_all);
        l_run[r] += f[w][r] * slot(w, 2 + r);
      }
      m_run[r] = m_all;
    }
#pragma unroll
    for (int r = 0; r < kHeadTiles; ++r) {
      float a0[kWarps], a1[kWarps];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) to_columns(f[w][r], t, a0[w], a1[w]);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if (mt % kWarps != warp) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float sum = 0.0f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) {
            sum += (i % 2 == 0 ? a0[w] : a1[w]) * slot(w, 4 + (r * kMTiles + mt) * 4 + i);
          }
          o[r][mt][i] = sum;
        }
      }
    }
    partial = blockIdx.y;
  }

#if E4KV_DEVICE_ARCH >= 900
  if constexpr (kClusterMerge) {
    // The cluster is the row and KV head's kCluster CTAs (rank = blockIdx.y). CTA j merges the
    // m-tiles j + kCluster i: after the CTA combine each warp sends each of its m-tiles (and, with
    // the first one a CTA gets, each head's m, l) to the CTA that merges it, which waits for all of
    // them, then weighs each partial by exp2(m - max m), sums, divides by the weighted l and writes
    // the output (the merge kernel's arithmetic).
    constexpr int kValues = Shape::kReceiveValues;
    float* received = reinterpret_cast<float*>(decode_smem + Shape::kReceiveOffset);
    float* received_ml = received + kCluster * 32 * kValues;  // [sender][head (8)][m, l]
    uint64_t* bar = reinterpret_cast<uint64_t*>(decode_smem + Shape::kBarrierOffset);
    const uint32_t rank = cluster_rank();
    cluster_wait();
    float* to = received + (rank * 32 + lane) * kValues;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if (mt % kWarps != warp) continue;  // another warp's m-tile
      const uint32_t merger = uint32_t(mt % kCluster);
      send_async4(to + 4 * (mt / kCluster), merger, o[0][mt][0], o[0][mt][1], o[0][mt][2],
                  o[0][mt][3], bar);
      if (mt < kCluster && t == 0) {
        send_async(received_ml + (rank * 8 + g) * 2, merger, __float_as_uint(m_run[0]),
                   __float_as_uint(l_run[0]), bar);
      }
    }
    mbarrier_wait(bar, 0u);
    if (marker) E4KV_TL_PHASE(10);
    for (int e = int(threadIdx.x); e < 32 * kValues; e += kWarps * 32) {
      const int src = e % 32;  // the sending lane: (g, t) of the fragment
      const int v = e / 32;
      const int c = v % 4;
      const int mt = int(rank) + kCluster * (v / 4);
      const int head = 2 * (src % 4) + c % 2;
      if (head >= p.group) continue;
      const int j = 2 * mt;
      const int dim = kVElems * (src / 4 + 8 * (j / kVElems)) + j % kVElems + c / 2;
      float m_max = -INFINITY;
#pragma unroll
      for (int s = 0; s < kCluster; ++s) m_max = fmaxf(m_max, received_ml[(s * 8 + head) * 2]);
      float acc = 0.0f;
      float l_sum = 0.0f;
      if (m_max != -INFINITY) {
#pragma unroll
        for (int s = 0; s < kCluster; ++s) {
          const float m = received_ml[(s * 8 + head) * 2];
          const float w = m == -INFINITY ? 0.0f : exp2f(m - m_max);
          l_sum += w * received_ml[(s * 8 + head) * 2 + 1];
          acc += w * received[(s * 32 + src) * kValues + v];
        }
      }
      store_merged(acc, l_sum, p.out_scale, p.gate, p.out,
                   (int64_t(row) * p.n_heads + head0 + head) * kHeadDim + dim);
    }
    E4KV_TL_EXIT(kTimelineKernel, lane == 0);
    return;
  }
#endif

  const int64_t split_index = int64_t(row) * (kAsync ? p.n_splits / kWarps : p.n_splits) + partial;
  if (t == 0 && (!kAsync || warp == 0)) {
#pragma unroll
    for (int r = 0; r < kHeadTiles; ++r) {
      const int head = g + 8 * r;
      if (head < p.group) {
        p.m[split_index * p.n_heads + head0 + head] = m_run[r];
        p.l[split_index * p.n_heads + head0 + head] = l_run[r];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kHeadTiles; ++r) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if (kAsync && mt % kWarps != warp) continue;  // another warp's m-tile
      const int c = (2 * mt) / kVElems;
      const int e = (2 * mt) % kVElems;
      const int dim = kVElems * (g + 8 * c) + e;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int head = 8 * r + 2 * t + j;
        if (head < p.group) {
          float* dst = p.acc + ((split_index * p.n_heads) + head0 + head) * kHeadDim + dim;
          *reinterpret_cast<float2*>(dst) = make_float2(o[r][mt][j], o[r][mt][2 + j]);
        }
      }
    }
  }
  E4KV_TL_EXIT(kTimelineKernel, lane == 0);
}

// f.template operator()<Elem>() for the cache element type of (dtype, native E4M3 decode): FP16,
// or E4M3 through the native or the software decoder (host; picks kernel instances).
template <class F>
auto with_cache_elem(KvCacheDtype dtype, bool native_e4m3, F&& f) {
  if (dtype != KvCacheDtype::kE4m3) return f.template operator()<ElemF16>();
  if (native_e4m3) return f.template operator()<ElemE4m3<E4m3Decode::kNative>>();
  return f.template operator()<ElemE4m3<E4m3Decode::kSoftware>>();
}

// The decode kernel's parameters for a launch (host). workspace: the split partials, or nullptr
// for a cluster-merge plan.
inline DecodeKernelParams decode_kernel_params(const PagedAttentionParams& params,
                                               const DecodeAttentionPlan& plan,
                                               const DecodeAttentionWorkspace* workspace,
                                               const DecodeAttentionConfig& config) {
  const KvCacheGeometry& geo = params.cache.geometry;
  const bool e4m3 = geo.dtype == KvCacheDtype::kE4m3;
  const float factor = !e4m3                ? 1.0f
                       : config.native_e4m3 ? E4m3Decoder<E4m3Decode::kNative>::kValueFactor
                                            : E4m3Decoder<E4m3Decode::kSoftware>::kValueFactor;
  DecodeKernelParams kp{};
  kp.kv = paged_kv_device(params.cache);
  kp.rows = paged_rows_device(params.block_table, params.rows);
  kp.n_heads = int32_t(params.n_heads);
  kp.group = int32_t(params.n_heads / geo.n_kv_heads);
  kp.q = params.q;
  kp.qk_scale_log2 = float(double(params.cache.k_scale) * factor / std::sqrt(double(geo.head_dim)) *
                           1.4426950408889634);
  kp.keys_per_split = int32_t(plan.keys_per_split);
  kp.n_splits = int32_t(plan.n_splits);
  if (workspace != nullptr) {
    kp.m = workspace->m;
    kp.l = workspace->l;
    kp.acc = workspace->acc;
  }
  kp.gate = params.gate;
  kp.out_scale = params.cache.v_scale * factor;
  kp.out = params.out;
  return kp;
}

}  // namespace e4kv::cuda::decode_device
