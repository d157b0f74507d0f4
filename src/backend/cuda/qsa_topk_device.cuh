// Device code of the QSA top-k (qsa_topk.cu, which describes the methods): the order keys, the
// row geometry, the block-wide selects and the ordered emission, and the cluster method's select
// and emission as device functions, so that a kernel that selects a row's keys and goes on to use
// them in the same cluster can share them (bench/experimental/ holds one).
// Experiments: bench/notes/qsa_topk.md.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/cluster.cuh"
#include "backend/cuda/qsa_topk.cuh"
#include "backend/cuda/timeline.cuh"

namespace e4kv::cuda::top_k_device {

constexpr int kBins = 256;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// Order-preserving map of a float to uint32: a > b as floats <=> key(a) > key(b) (no NaN).
__device__ __forceinline__ uint32_t order_key(float score) {
  uint32_t bits = __float_as_uint(score);
  if ((bits << 1) == 0u) bits = 0u;  // -0 == +0
  return (bits & 0x80000000u) != 0u ? ~bits : (bits | 0x80000000u);
}

// A query row's position and visible groups: min((pos + 1) / ratio, seq_len / ratio), cut to
// [0, max_groups]. P: any of the kernels' parameter structs.
struct RowGroups {
  int32_t pos;
  int32_t causal;  // (pos + 1) / ratio: the complete groups up to pos
  int32_t visible;
};
template <class P>
__device__ __forceinline__ RowGroups row_groups(const P& p, int64_t row) {
  RowGroups g;
  g.pos = p.row_pos[row];
  g.causal = (g.pos + 1) / p.ratio;
  const int32_t written = p.seq_lens[p.row_seq[row]] / p.ratio;
  g.visible = g.causal < written ? g.causal : written;
  if (g.visible > p.max_groups) g.visible = int32_t(p.max_groups);
  if (g.visible < 0) g.visible = 0;
  return g;
}

// After the row's n_groups selected groups (n_groups * ratio tokens in out): the causal tail
// ratio * causal .. pos, then -1 up to `width`, and the count. Every thread of the block
// (kThreads) calls it.
template <int kThreads, class P>
__device__ __forceinline__ void write_tail(const P& p, int64_t row, const RowGroups& g,
                                           int32_t n_groups, int32_t* out) {
  const int32_t tail_begin = p.ratio * g.causal;
  const int32_t group_tokens = n_groups * p.ratio;
  const int32_t count = group_tokens + (g.pos + 1 - tail_begin);
  for (int32_t j = group_tokens + int32_t(threadIdx.x); j < p.width; j += kThreads) {
    out[j] = j < count ? tail_begin + (j - group_tokens) : -1;
  }
  if (threadIdx.x == 0) p.sel_counts[row] = count;
}

// Streams the order keys of groups [begin, end) of a row's scores (thread t: begin + t, then
// + kThreads, ...), 8 loads in flight; calls f(key, valid, group) warp-uniformly.
template <int kThreads, class F>
__device__ __forceinline__ void stream_keys(const float* scores, int32_t begin, int32_t end,
                                            F&& f) {
  constexpr int kUnrollKeys = 8;
  const int32_t tid = int32_t(threadIdx.x);
  for (int32_t base = begin; base < end; base += kThreads * kUnrollKeys) {
    uint32_t keys[kUnrollKeys];
#pragma unroll
    for (int u = 0; u < kUnrollKeys; ++u) {
      const int32_t c = base + u * kThreads + tid;
      keys[u] = c < end ? order_key(__ldg(scores + c)) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kUnrollKeys; ++u) {
      const int32_t c = base + u * kThreads + tid;
      f(keys[u], c < end, c);
    }
  }
}

__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t value, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const uint32_t other = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

constexpr int kFilterThreads = 1024;
constexpr int kFilterWarps = kFilterThreads / 32;
constexpr int kRun = int(kQsaRunGroups);
constexpr int kFilterMaxWords = int(kQsaTopKFilteredMaxGroups / 32);  // per bitmap
constexpr int kFilterCandidates = 4096;
constexpr int kFilterShortRuns = 4;  // run slots per thread: rows up to 32768 groups
constexpr int kFilterLongRuns = kFilterMaxWords * 32 / kRun / kFilterThreads;  // 131072 groups
constexpr int kBoundBits = 12;  // leading bits of L (after those every run maximum shares)
// Dynamic shared memory: candidate groups, then a region that holds the candidate keys during
// the select and the two bitmaps after it.
constexpr size_t kFilterSmemBytes =
    kFilterCandidates * sizeof(int32_t) + 2 * kFilterMaxWords * sizeof(uint32_t);
static_assert(kFilterCandidates <= 2 * kFilterMaxWords);

struct FilterKernelParams {
  const int32_t* row_seq;
  const int32_t* row_pos;
  const int32_t* seq_lens;
  int32_t ratio;
  int32_t k;
  int32_t width;
  const float* scores;      // [n_rows, max_groups]
  const float* run_maxima;  // [n_rows, run_stride] or nullptr
  int64_t max_groups;
  int64_t run_stride;
  int32_t* sel_tokens;
  int32_t* sel_counts;
};

// One warp: the digit of the rank-th largest key among those counted in `hist` (256 bins of the
// digit at `shift`), scanning from the highest digit; lane l owns digits 255 - 8l down to 248 - 8l.
// Writes the prefix extended by that digit and the rank left within the digit's bin.
__device__ __forceinline__ void find_digit(const uint32_t* hist, uint32_t prefix, uint32_t rank,
                                           int shift, int lane, uint32_t& found_prefix,
                                           uint32_t& found_rank) {
  uint32_t counts[8];
  uint32_t lane_total = 0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    counts[j] = hist[kBins - 1 - 8 * lane - j];
    lane_total += counts[j];
  }
  const uint32_t inclusive = warp_inclusive_scan(lane_total, lane);
  const unsigned reached = __ballot_sync(kFullMask, inclusive >= rank);
  if (lane == __ffs(reached) - 1) {
    uint32_t before = inclusive - lane_total;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (before + counts[j] >= rank) {
        found_prefix = prefix | (uint32_t(kBins - 1 - 8 * lane - j) << shift);
        found_rank = rank - before;
        break;
      }
      before += counts[j];
    }
  }
}

// Shared state of the block-wide radix select.
struct SelectShared {
  uint32_t hist[kBins];
  uint32_t warp_any[kFilterWarps];  // OR of the valid keys of each warp
  uint32_t warp_all[kFilterWarps];  // AND of the valid keys of each warp
  uint32_t found_prefix;
  uint32_t found_rank;
};

// The rank-th largest key (rank >= 1) among the keys that `for_each_key` hands to its callback,
// and how many keys equal to it are within the top `rank`, digit by digit from the top down to
// the digit at `last_shift` (24: the top byte only; 0: exact). `for_each_key(f)` must call
// f(key, valid) the same number of times in every lane of a warp (invalid keys are not counted).
// With last_shift > 0 the result is the key's prefix (lower bits zero), which is <= the key.
// A digit that every valid key shares (found from the OR and AND of all keys first) takes no
// histogram pass: scores near one another share their top bytes, and a pass where all keys fall
// into one bin is the slowest kind (every warp's atomic lands on the same word).
// Contains block barriers: every thread of the block (kThreads, 256..1024) must call it.
template <int kThreads = kFilterThreads, class ForEachKey>
__device__ void block_radix_select(ForEachKey for_each_key, uint32_t rank, int last_shift,
                                   SelectShared& sh, uint32_t& threshold, uint32_t& ties) {
  static_assert(kThreads >= kBins && kThreads <= kFilterThreads && kThreads % 32 == 0);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  uint32_t any = 0u;
  uint32_t all = ~0u;
  for_each_key([&](uint32_t key, bool valid) {
    if (valid) {
      any |= key;
      all &= key;
    }
  });
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    any |= __shfl_xor_sync(kFullMask, any, offset);
    all &= __shfl_xor_sync(kFullMask, all, offset);
  }
  if (lane == 0) {
    sh.warp_any[tid >> 5] = any;
    sh.warp_all[tid >> 5] = all;
  }
  __syncthreads();
  any = lane < kThreads / 32 ? sh.warp_any[lane] : 0u;
  all = lane < kThreads / 32 ? sh.warp_all[lane] : ~0u;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    any |= __shfl_xor_sync(kFullMask, any, offset);
    all &= __shfl_xor_sync(kFullMask, all, offset);
  }
  const uint32_t agree = ~(any ^ all);  // bits every valid key has alike (none if no keys)

  uint32_t prefix = 0u;
  uint32_t mask = 0u;
  for (int shift = 24; shift >= last_shift; shift -= 8) {
    if (((agree >> shift) & 0xFFu) == 0xFFu) {  // uniform: the digit is known
      prefix |= all & (0xFFu << shift);
      mask |= 0xFFu << shift;
      continue;
    }
    if (tid < kBins) sh.hist[tid] = 0u;
    __syncthreads();
    for_each_key([&](uint32_t key, bool valid) {
      const uint32_t digit = valid && (key & mask) == prefix ? (key >> shift) & 0xFFu : kBins;
      // Lanes with the most common digits are added up by ballots (two rounds: scores near one
      // another share digits), the rest one atomic each (15% faster than __match_any_sync).
      unsigned pending = __ballot_sync(kFullMask, digit != kBins);
#pragma unroll
      for (int round = 0; round < 2; ++round) {
        if (pending == 0u) break;  // uniform
        const int leader = __ffs(pending) - 1;
        const uint32_t common = __shfl_sync(kFullMask, digit, leader);
        const unsigned same = __ballot_sync(kFullMask, digit == common) & pending;
        if (lane == leader) atomicAdd(&sh.hist[common], uint32_t(__popc(same)));
        pending &= ~same;
      }
      if ((pending >> lane) & 1u) atomicAdd(&sh.hist[digit], 1u);
    });
    __syncthreads();
    if (tid < 32) find_digit(sh.hist, prefix, rank, shift, lane, sh.found_prefix, sh.found_rank);
    __syncthreads();
    prefix = sh.found_prefix;
    rank = sh.found_rank;
    mask |= 0xFFu << shift;
  }
  threshold = prefix;
  ties = rank;
}

// The order keys of run j (groups kRun*j ..), key 0 for groups at or past `visible`. Two 16-byte
// loads when the row is 16-byte aligned and the run is whole, else one load per group.
__device__ __forceinline__ void load_run(const float* scores, int32_t j, int32_t visible,
                                         bool aligned, uint32_t (&keys)[kRun]) {
  static_assert(kRun == 8);
  const int32_t first = j * kRun;
  if (aligned && first + kRun <= visible) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(scores + first));
    const float4 b = __ldg(reinterpret_cast<const float4*>(scores + first) + 1);
    const float v[kRun] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < kRun; ++i) keys[i] = order_key(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      keys[i] = first + i < visible ? order_key(__ldg(scores + first + i)) : 0u;
    }
  }
}

// The rank-th largest (rank >= 1) of the warp's keys (slots 0 .. n_slots - 1 of every lane; the
// same n_slots in every lane; key 0 is no key), cut to its leading bits: a bitwise radix over
// ballots, from the highest bit where the warp's keys differ, for at most `bits` bits; the lower
// bits are zero, which only lowers the result. The warp must hold at least `rank` nonzero keys.
template <int kSlots>
__device__ __forceinline__ uint32_t warp_rank_prefix(const uint32_t (&keys)[kSlots], int n_slots,
                                                     uint32_t rank, int bits) {
  uint32_t any = 0u;
  uint32_t all = ~0u;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (s < n_slots && keys[s] != 0u) {  // absent keys would widen the bits that differ
      any |= keys[s];
      all &= keys[s];
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    any |= __shfl_xor_sync(kFullMask, any, offset);
    all &= __shfl_xor_sync(kFullMask, all, offset);
  }
  if (any == 0u) return 0u;  // no keys
  const uint32_t differ = any ^ all;
  if (differ == 0u) return all;  // every key is the same
  const int top = 31 - __clz(int(differ));
  uint32_t mask = top == 31 ? 0u : ~0u << (top + 1);
  uint32_t prefix = all & mask;
  const int last = top - bits + 1 > 0 ? top - bits + 1 : 0;
  for (int bit = top; bit >= last; --bit) {
    const uint32_t probe = prefix | 1u << bit;
    mask |= 1u << bit;
    uint32_t count = 0u;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      if (s < n_slots)
        count += uint32_t(__popc(__ballot_sync(kFullMask, (keys[s] & mask) == probe)));
    }
    if (count >= rank) {
      prefix = probe;
    } else {
      rank -= count;
    }
  }
  return prefix;
}

// Appends the lane's keys >= floor_key (key 0: none) of kN runs (keys[u][i] is group
// first_group(u) + i) to a shared list: one shared atomic per warp, so the list's order is the
// warps' arrival order. Writes below `capacity` only; *count counts on past it.
template <int kN, class FirstGroup>
__device__ __forceinline__ void append_candidates(const uint32_t (&keys)[kN][kRun],
                                                  uint32_t floor_key, FirstGroup first_group,
                                                  uint32_t* count, uint32_t* list_keys,
                                                  int32_t* list_groups, uint32_t capacity) {
  const int lane = int(threadIdx.x) & 31;
  uint32_t n_take = 0u;
#pragma unroll
  for (int u = 0; u < kN; ++u) {
#pragma unroll
    for (int i = 0; i < kRun; ++i) n_take += keys[u][i] != 0u && keys[u][i] >= floor_key ? 1u : 0u;
  }
  const uint32_t inclusive = warp_inclusive_scan(n_take, lane);
  uint32_t base = 0u;
  if (lane == 31 && inclusive > 0u) base = atomicAdd(count, inclusive);
  uint32_t slot = __shfl_sync(kFullMask, base, 31) + inclusive - n_take;
#pragma unroll
  for (int u = 0; u < kN; ++u) {
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      if (keys[u][i] != 0u && keys[u][i] >= floor_key) {
        if (slot < capacity) {
          list_keys[slot] = keys[u][i];
          list_groups[slot] = first_group(u) + i;
        }
        ++slot;
      }
    }
  }
}

// Exclusive block-wide scan of two counters at once (totals < 2^32 each) over kThreads threads.
template <int kThreads = kFilterThreads>
__device__ __forceinline__ void block_exclusive_scan2(uint32_t& a, uint32_t& b,
                                                      uint2* warp_totals) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const uint32_t ia = warp_inclusive_scan(a, lane);
  const uint32_t ib = warp_inclusive_scan(b, lane);
  if (lane == 31) warp_totals[warp] = make_uint2(ia, ib);
  __syncthreads();
  if (warp == 0) {
    const uint2 t = lane < kWarps ? warp_totals[lane] : make_uint2(0u, 0u);
    const uint32_t sa = warp_inclusive_scan(t.x, lane);
    const uint32_t sb = warp_inclusive_scan(t.y, lane);
    if (lane < kWarps) warp_totals[lane] = make_uint2(sa - t.x, sb - t.y);
  }
  __syncthreads();
  a = ia - a + warp_totals[warp].x;
  b = ib - b + warp_totals[warp].y;
}

// Ordered emission from two bitmaps over groups group_base + 32w + bit (w < n_words): `above`
// (score > T) and `equal` (score == T). above_base / equal_base: the groups above T / equal to T
// before group_base (other CTAs' slices). Thread t scans a contiguous range of words; one block
// scan of their popcounts gives the rank of its first group; each selected group's ratio tokens go
// to out at its rank, ties at T taken from the lowest index (the first `ties` equal groups of the
// row). Contains block barriers: every thread of the block (kThreads) must call it.
// staging (shared memory, uniform): when it holds k * ratio ints, the tokens are put there at
// their ranks first and then written to out by the whole block at once, rather than by each
// thread for its own groups one store after another.
template <int kThreads = kFilterThreads>
__device__ __forceinline__ void emit_from_bitmaps(const uint32_t* above_bits,
                                                  const uint32_t* equal_bits, int32_t n_words,
                                                  int32_t group_base, uint32_t above_base,
                                                  uint32_t equal_base, uint32_t ties, int32_t ratio,
                                                  uint2* warp_totals, int32_t* out,
                                                  int32_t* staging = nullptr) {
  __shared__ uint32_t staged_end;
  const int tid = threadIdx.x;
  const int32_t words_per_thread = (n_words + kThreads - 1) / kThreads;
  const int32_t w_begin = tid * words_per_thread;
  const int32_t w_end = w_begin + words_per_thread < n_words ? w_begin + words_per_thread : n_words;
  uint32_t above_before = 0u;
  uint32_t equal_before = 0u;
  for (int32_t w = w_begin; w < w_end; ++w) {
    above_before += uint32_t(__popc(above_bits[w]));
    equal_before += uint32_t(__popc(equal_bits[w]));
  }
  block_exclusive_scan2<kThreads>(above_before, equal_before, warp_totals);
  above_before += above_base;
  equal_before += equal_base;
  uint32_t slot = above_before + (equal_before < ties ? equal_before : ties);
  const uint32_t first_slot = above_base + (equal_base < ties ? equal_base : ties);
  int32_t* dst = staging != nullptr ? staging - int32_t(first_slot) * ratio : out;
  if (staging != nullptr && tid == 0) staged_end = first_slot;
  for (int32_t w = w_begin; w < w_end; ++w) {
    const uint32_t equal = equal_bits[w];
    uint32_t taken = 0u;
    if (equal_before < ties) {
      const uint32_t need = ties - equal_before;
      taken = equal;
      if (uint32_t(__popc(equal)) > need) {  // the lowest `need` set bits
        uint32_t rest = equal;
        for (uint32_t i = 0; i < need; ++i) rest &= rest - 1u;
        taken = equal ^ rest;
      }
    }
    equal_before += uint32_t(__popc(equal));
    uint32_t chosen = above_bits[w] | taken;
    while (chosen != 0u) {
      const int bit = __ffs(chosen) - 1;
      chosen &= chosen - 1u;
      const int32_t group = group_base + w * 32 + bit;
      for (int32_t i = 0; i < ratio; ++i) dst[int32_t(slot) * ratio + i] = group * ratio + i;
      ++slot;
    }
  }
  if (staging == nullptr) return;
  __syncthreads();  // staged_end initialised
  if (w_end > w_begin) atomicMax(&staged_end, slot);
  __syncthreads();
  const int32_t n = int32_t(staged_end - first_slot) * ratio;
  int32_t* out_first = out + int32_t(first_slot) * ratio;
  for (int32_t j = tid; j < n; j += kThreads) out_first[j] = staging[j];
}

// ---- Cluster method (sm_90+) ------------------------------------------------------------------
// The filtered method's steps spread over a thread-block cluster of kClusterCtas CTAs per row
// (512 threads each in qsa_topk.cu; the CTA size is a template parameter), which share their
// candidates through distributed shared memory. The filtered kernel is issue-bound on one SM; here
// every step that loops over the row's runs or groups divides by the cluster's SMs, and the exact
// select runs over the candidates only. Global warp g = rank * 16 + warp owns runs
// [g * rpw, (g + 1) * rpw), rpw = ceil(n_runs / 128), lane l the runs g * rpw + l + 32 s; CTA
// `rank` owns the contiguous slice of its warps' runs.
//  1. Bound: the run maxima go to shared memory; 4 "bound warps" per CTA each take a quarter of
//     the CTA's slice (4 rpw runs; W / 4 rpw with W warps per CTA). Each of the
//     P = min(32, floor(n_runs / (4 rpw))) bound warps
//     whose quarter lies wholly inside the row finds the q-th largest of its maxima (q =
//     ceil(k / P), 12 leading bits, warp_rank_prefix); L = the smallest over the cluster, so P * q
//     >= k runs, hence >= k distinct groups, have a maximum >= L, and L <= T. (q > 4 rpw: L = 0,
//     every group is a candidate.) Fewer, larger samples than one bound per warp: the smallest of
//     32 estimates of the top-k/n_runs quantile of ~128 maxima each is much closer to T than the
//     smallest of 128 estimates from 32 maxima each (14.2 -> 10.9 us with the move to 512
//     threads). Each CTA sends its smallest bound and its largest run maximum to every CTA.
//  2. Candidates: the groups >= L of the CTA's open runs go to its shared memory (key, group);
//     each CTA sends its count to every CTA, then every candidate to every CTA at its place in
//     CTA order (m <= kClusterCandidates in all), so each CTA holds all of them.
//  The exchanges are st.async stores into the receiver's shared memory, counted by an mbarrier
//  of the receiver, which waits for the bytes it expects: no cluster barrier has to publish data
//  (a release arrive costs a GPU-scope MEMBAR, about 1.5K cycles each under ncu). One relaxed
//  cluster barrier at the start makes the mbarriers' initialisation visible; one at the end keeps
//  every CTA's shared memory alive until all sends into it have landed.
//  3. Exact select, in every CTA alike (no further exchange): a 2048-bin histogram of the keys in
//     [lo, hi] (first L .. the largest maximum) finds the bin of the rank-th largest key; a bin of
//     one key value, or of at most kClusterDirectRank keys (ranked by direct comparison), ends it,
//     else the bin becomes the next [lo, hi] with 11 fewer bits per bin.
//  4. Emission: the candidates of earlier CTAs above T and equal to T give the CTA's base ranks;
//     bitmaps of the CTA's slice from its own candidates; emit_from_bitmaps.
// More than kClusterCandidates candidates (heavy ties at L, or L = 0 on long rows): every CTA runs
// the filtered kernel's streaming select over the whole row and streams its slice and the groups
// before it (same results, slower).
#ifndef E4KV_TOPK_STAGING
#define E4KV_TOPK_STAGING 1
#endif
constexpr int kClusterCtas = 8;
constexpr int kBoundWarps = 4;  // per CTA
constexpr int kClusterCandidates = 4096;
constexpr int kClusterBins = 2048;
constexpr int kClusterBinBits = 11;  // bits of a histogram bin index

// The cluster method's sizes for CTAs of kThreads threads whose lanes own up to kSlots runs each.
template <int kThreads, int kSlots>
struct ClusterShape {
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kWarpsTotal = kClusterCtas * kWarps;
  static constexpr int kMaxGroups = kWarpsTotal * 32 * kSlots * kRun;  // longest row
  static constexpr int kDirectRank = kThreads;
  static constexpr int kMaxSliceRuns = kWarps * 32 * kSlots;
  static constexpr int kSliceWords = kMaxSliceRuns * kRun / 32;
  // Dynamic shared memory: own candidates (keys, groups), all candidates (keys, groups; the run
  // maxima of step 1 before them), the histogram (later the keys of the last bin, or the staged
  // tokens), the slice's two bitmaps.
  static constexpr size_t kSmemBytes =
      (4 * size_t(kClusterCandidates) + kClusterBins + 2 * kSliceWords) * sizeof(uint32_t);
  static_assert(kClusterBins % kThreads == 0 && kDirectRank <= kClusterBins);
  static_assert(kMaxSliceRuns <= kClusterCandidates);
  static_assert(kThreads >= kBins && kWarps >= kBoundWarps && kThreads <= kFilterThreads);
};

// The cluster method's shared-memory regions in the dynamic shared memory `smem`.
struct ClusterScratch {
  uint32_t* own_keys;
  int32_t* own_groups;
  uint2* all_pairs;  // every CTA's candidates (key, group), in CTA order, as the CTAs send them
  uint32_t* maxima;  // step 1 only (in all_pairs' place): the slice's run maxima
  uint32_t* hist;    // kClusterBins words
  uint32_t* above_bits;
  uint32_t* equal_bits;

  template <class Shape>
  __device__ static ClusterScratch at(uint32_t* smem) {
    ClusterScratch s;
    s.own_keys = smem;
    s.own_groups = reinterpret_cast<int32_t*>(smem + kClusterCandidates);
    s.all_pairs = reinterpret_cast<uint2*>(smem + 2 * kClusterCandidates);
    s.maxima = smem + 2 * kClusterCandidates;
    s.hist = smem + 4 * kClusterCandidates;
    s.above_bits = s.hist + kClusterBins;
    s.equal_bits = s.above_bits + Shape::kSliceWords;
    return s;
  }
};

// The cluster method's static shared state (one per CTA).
template <int kThreads>
struct ClusterShared {
  uint2 sent_bounds[kClusterCtas];  // from CTA c: its bound, its largest run maximum
  uint2 sent_counts[kClusterCtas];  // from CTA c: its candidate count, 0
  alignas(8) uint64_t bars[3];      // bounds, counts, candidates
  uint32_t warp_bound[kBoundWarps];
  uint32_t warp_top[kThreads / 32];
  SelectShared sel;
  uint2 warp_totals[kThreads / 32];
  uint32_t n_own;
  uint32_t n_bin;
  uint32_t base[2];   // groups above T / equal to T in earlier slices
  uint32_t found[3];  // bin, rank within it, its count (then T, ties)
};

// What cluster_select found for the CTA's row: its groups, and short_row: visible <= k, every
// visible group is taken and nothing else is set (no cluster barrier ran). Otherwise threshold T
// and ties (keys equal to T to take, the lowest groups first); in_shared: every CTA holds all
// n_cand candidates in all_pairs (this CTA's n_own at own_offset), else the select streamed the
// row.
struct ClusterSelection {
  RowGroups rows;  // the row's position, causal and visible groups
  bool short_row;
  bool in_shared;
  uint32_t threshold;
  uint32_t ties;
  uint32_t n_cand;
  uint32_t n_own;
  uint32_t own_offset;
  int32_t slice_group_begin;
  int32_t slice_group_end;
};

#if E4KV_DEVICE_ARCH >= 900
// Steps 1-3 for row `row` in the CTA of cluster rank `rank`; every thread of every CTA of the
// cluster calls it. Unless short_row, it returns with the CTA's arrival on the cluster barrier
// made (after every send into this CTA has landed): the caller waits on it (cluster_wait) before
// the CTA exits. marker: the thread that records the timeline's phases.
template <int kThreads, int kSlots>
__device__ __forceinline__ ClusterSelection cluster_select(const FilterKernelParams& p, int64_t row,
                                                           uint32_t rank, uint32_t* smem,
                                                           ClusterShared<kThreads>& sh,
                                                           bool marker) {
  using Shape = ClusterShape<kThreads, kSlots>;
  constexpr int kWarps = Shape::kWarps;
  // A bound warp takes a quarter of the slice, kQuarter rpw runs: kBoundSlots per lane.
  constexpr int kQuarter = kWarps / kBoundWarps;
  constexpr int kBoundSlots = kQuarter * kSlots;
  static_assert(kWarps % kBoundWarps == 0);
  const ClusterScratch s = ClusterScratch::at<Shape>(smem);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const RowGroups rg = row_groups(p, row);
  const int32_t visible = rg.visible;
  const float* scores = p.scores + row * p.max_groups;
  ClusterSelection r{};
  r.rows = rg;
  if (visible <= p.k) {  // the same in every CTA of the cluster
    r.short_row = true;
    return r;
  }
  if (tid == 0) {
    sh.n_own = 0u;
    sh.base[0] = sh.base[1] = 0u;
    for (uint64_t& bar : sh.bars) mbarrier_init(&bar);
    mbarrier_expect(&sh.bars[0], kClusterCtas * 8);
    mbarrier_expect(&sh.bars[1], kClusterCtas * 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Waited on before the first send: then every CTA's barriers are initialised.
  cluster_arrive_relaxed();
  const int32_t n_runs = (visible + kRun - 1) / kRun;
  const int32_t rpw = (n_runs + Shape::kWarpsTotal - 1) / Shape::kWarpsTotal;
  const int32_t slice_runs = kWarps * rpw;
  const int32_t slice_first = int32_t(rank) * slice_runs;  // first run of the CTA
  r.slice_group_begin = min(slice_first * kRun, visible);
  r.slice_group_end = min((slice_first + slice_runs) * kRun, visible);
  const bool aligned = (reinterpret_cast<uintptr_t>(scores) & 15u) == 0u;  // uniform
  // Local run (within the slice) of the lane's slot s, and whether it is a run of the row.
  auto local_run = [&](int slot) { return warp * rpw + lane + 32 * slot; };
  auto run_valid = [&](int slot) {
    return lane + 32 * slot < rpw && slice_first + local_run(slot) < n_runs;
  };

  // 1. Run maxima (to shared memory and registers), the bound warps' bounds, the CTA's
  //    (bound, largest maximum), then the cluster's.
  uint32_t run_max[kSlots];
  uint32_t top = 0u;
#pragma unroll
  for (int slot = 0; slot < kSlots; ++slot) {
    const int32_t j = slice_first + local_run(slot);
    uint32_t m = 0u;
    if (run_valid(slot)) {
      if (p.run_maxima != nullptr) {
        m = order_key(__ldg(p.run_maxima + row * p.run_stride + j));
      } else {
        uint32_t keys[kRun];
        load_run(scores, j, visible, aligned, keys);
#pragma unroll
        for (int i = 0; i < kRun; ++i) m = keys[i] > m ? keys[i] : m;
      }
    }
    run_max[slot] = m;
    if (lane + 32 * slot < rpw) s.maxima[local_run(slot)] = m;
    top = m > top ? m : top;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint32_t other = __shfl_xor_sync(kFullMask, top, offset);
    top = other > top ? other : top;
  }
  if (lane == 0) sh.warp_top[warp] = top;
  const int32_t quarter = kQuarter * rpw;  // runs of a bound warp
  const int32_t n_full = min(kClusterCtas * kBoundWarps, n_runs / quarter);
  const int32_t q = n_full > 0 ? (p.k + n_full - 1) / n_full : 0;
  const bool bounded = n_full > 0 && q <= quarter;  // uniform over the cluster
  __syncthreads();
  if (warp < kBoundWarps) {
    uint32_t bound = ~0u;  // a quarter that is not wholly inside the row has no say in L
    if (bounded && int32_t(rank) * kBoundWarps + warp < n_full) {
      uint32_t keys[kBoundSlots];
#pragma unroll
      for (int slot = 0; slot < kBoundSlots; ++slot) {
        const int32_t i = lane + 32 * slot;
        keys[slot] = i < quarter ? s.maxima[warp * quarter + i] : 0u;
      }
      bound = warp_rank_prefix<kBoundSlots>(keys, kBoundSlots, uint32_t(q), kBoundBits);
    }
    if (lane == 0) sh.warp_bound[warp] = bound;
  }
  __syncthreads();
  cluster_wait();
  if (warp == 0) {
    uint32_t b = lane < kBoundWarps ? sh.warp_bound[lane] : ~0u;
    uint32_t t = lane < kWarps ? sh.warp_top[lane] : 0u;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const uint32_t ob = __shfl_xor_sync(kFullMask, b, offset);
      const uint32_t ot = __shfl_xor_sync(kFullMask, t, offset);
      b = ob < b ? ob : b;
      t = ot > t ? ot : t;
    }
    if (lane < kClusterCtas) send_async(&sh.sent_bounds[rank], uint32_t(lane), b, t, &sh.bars[0]);
  }
  if (marker) E4KV_TL_PHASE(1);
  mbarrier_wait(&sh.bars[0], 0u);
  if (marker) E4KV_TL_PHASE(2);
  uint32_t floor_key = ~0u;
  uint32_t top_key = 0u;
  if (lane < kClusterCtas) {
    floor_key = sh.sent_bounds[lane].x;
    top_key = sh.sent_bounds[lane].y;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint32_t ob = __shfl_xor_sync(kFullMask, floor_key, offset);
    const uint32_t ot = __shfl_xor_sync(kFullMask, top_key, offset);
    floor_key = ob < floor_key ? ob : floor_key;
    top_key = ot > top_key ? ot : top_key;
  }
  if (!bounded) floor_key = 0u;

  // 2. The CTA's candidates, then everyone's.
  {
    uint32_t keys[kSlots][kRun];
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) {
      if (run_valid(slot) && run_max[slot] >= floor_key) {
        load_run(scores, slice_first + local_run(slot), visible, aligned, keys[slot]);
      } else {
#pragma unroll
        for (int i = 0; i < kRun; ++i) keys[slot][i] = 0u;
      }
    }
    append_candidates<kSlots>(
        keys, floor_key, [&](int u) { return (slice_first + local_run(u)) * kRun; }, &sh.n_own,
        s.own_keys, s.own_groups, uint32_t(kClusterCandidates));
  }
  __syncthreads();
  if (marker) E4KV_TL_PHASE(3);
  r.n_own = sh.n_own;
  if (warp == 0 && lane < kClusterCtas) {
    send_async(&sh.sent_counts[rank], uint32_t(lane), r.n_own, 0u, &sh.bars[1]);
  }
  mbarrier_wait(&sh.bars[1], 0u);
  // Every warp: the CTAs' counts (lane c < 8 holds CTA c's) and offsets.
  const uint32_t count = lane < kClusterCtas ? sh.sent_counts[lane].x : 0u;
  const uint32_t count_end = warp_inclusive_scan(count, lane);
  r.n_cand = __shfl_sync(kFullMask, count_end, kClusterCtas - 1);
  r.own_offset = __shfl_sync(kFullMask, count_end - count, int(rank));
  r.in_shared = r.n_cand <= uint32_t(kClusterCandidates);  // uniform over the cluster
  if (r.in_shared) {
    // Each candidate to every CTA (this one included), at its place in CTA order.
    if (tid == 0) mbarrier_expect(&sh.bars[2], r.n_cand * 8u);
    for (uint32_t i = uint32_t(tid); i < r.n_own; i += kThreads) {
      const uint32_t key = s.own_keys[i];
      const uint32_t group = uint32_t(s.own_groups[i]);
#pragma unroll
      for (uint32_t c = 0; c < uint32_t(kClusterCtas); ++c) {
        send_async(&s.all_pairs[r.own_offset + i], c, key, group, &sh.bars[2]);
      }
    }
    if (marker) E4KV_TL_PHASE(4);
    mbarrier_wait(&sh.bars[2], 0u);
  }
  if (marker) E4KV_TL_PHASE(5);
  // Everything sent to this CTA has landed; the caller's wait keeps every CTA alive until that
  // holds for all of them (a CTA's shared memory must outlive the sends into it).
  cluster_arrive_relaxed();

  // 3. T and the ties to take.
  if (r.in_shared) {
    constexpr int kBinsPerThread = kClusterBins / kThreads;
    uint32_t lo = floor_key;
    uint32_t hi = top_key;
    uint32_t want = uint32_t(p.k);  // rank of T among the keys in [lo, hi]
    int shift = 32 - __clz(int(hi - lo)) - kClusterBinBits;
    shift = shift > 0 ? shift : 0;
    for (;;) {
#pragma unroll
      for (int b = 0; b < kBinsPerThread; ++b) s.hist[b * kThreads + tid] = 0u;
      __syncthreads();
      for (uint32_t i = uint32_t(tid); i < r.n_cand; i += kThreads) {
        const uint32_t key = s.all_pairs[i].x;
        if (key >= lo && key <= hi) atomicAdd(&s.hist[(key - lo) >> shift], 1u);
      }
      __syncthreads();
      // Thread t: kBinsPerThread bins from the top, the highest first.
      uint32_t counts[kBinsPerThread];
      uint32_t mine = 0u;
#pragma unroll
      for (int j = 0; j < kBinsPerThread; ++j) {
        counts[j] = s.hist[kClusterBins - 1 - kBinsPerThread * tid - j];
        mine += counts[j];
      }
      uint32_t before = mine;
      uint32_t unused = 0u;
      block_exclusive_scan2<kThreads>(before, unused, sh.warp_totals);
      if (before < want && before + mine >= want) {
#pragma unroll
        for (int j = 0; j < kBinsPerThread; ++j) {
          if (before < want && before + counts[j] >= want) {
            sh.found[0] = uint32_t(kClusterBins - 1 - kBinsPerThread * tid - j);
            sh.found[1] = want - before;
            sh.found[2] = counts[j];
            sh.n_bin = 0u;
          }
          before += counts[j];
        }
      }
      __syncthreads();
      const uint32_t bin = sh.found[0];
      want = sh.found[1];
      const uint32_t in_bin = sh.found[2];
      lo += bin << shift;
      const uint64_t bin_hi = uint64_t(lo) + ((uint64_t(1) << shift) - 1u);
      hi = bin_hi < uint64_t(hi) ? uint32_t(bin_hi) : hi;
      if (shift == 0) {  // one key value
        r.threshold = lo;
        r.ties = want;
        break;
      }
      if (in_bin <= uint32_t(Shape::kDirectRank)) {
        // The bin's keys side by side (in the histogram's place), each ranked by comparison.
        for (uint32_t i = uint32_t(tid); i < r.n_cand; i += kThreads) {
          const uint32_t key = s.all_pairs[i].x;
          if (key >= lo && key <= hi) s.hist[atomicAdd(&sh.n_bin, 1u)] = key;
        }
        __syncthreads();
        if (uint32_t(tid) < in_bin) {
          const uint32_t key = s.hist[tid];
          uint32_t greater = 0u;
          uint32_t equal = 0u;
          for (uint32_t j = 0; j < in_bin; ++j) {
            const uint32_t other = s.hist[j];
            greater += other > key ? 1u : 0u;
            equal += other == key ? 1u : 0u;
          }
          if (greater < want && want <= greater + equal) {  // key is T (same values if many)
            sh.found[0] = key;
            sh.found[1] = want - greater;
          }
        }
        __syncthreads();
        r.threshold = sh.found[0];
        r.ties = sh.found[1];
        break;
      }
      shift = shift > kClusterBinBits ? shift - kClusterBinBits : 0;
    }
  } else {
    block_radix_select<kThreads>(
        [&](auto&& f) {
          stream_keys<kThreads>(scores, 0, visible, [&](uint32_t key, bool valid, int32_t) {
            f(key, valid && key >= floor_key);
          });
        },
        uint32_t(p.k), 0, sh.sel, r.threshold, r.ties);
  }
  if (marker) E4KV_TL_PHASE(6);
  return r;
}

// Step 4 for a row that cluster_select selected (not short_row): the CTA writes the tokens of its
// slice's selected groups to `out` (the row's sel_tokens) at their ranks in group order. Every
// thread of the CTA calls it; it holds block barriers. The histogram's room stages the slice's
// tokens when k * ratio fit in it.
template <int kThreads, int kSlots>
__device__ __forceinline__ void cluster_emit(const FilterKernelParams& p, int64_t row,
                                             const ClusterSelection& r, uint32_t* smem,
                                             ClusterShared<kThreads>& sh, int32_t* out) {
  using Shape = ClusterShape<kThreads, kSlots>;
  const ClusterScratch s = ClusterScratch::at<Shape>(smem);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const float* scores = p.scores + row * p.max_groups;
  uint32_t above = 0u;
  uint32_t equal = 0u;
  if (r.in_shared) {
    for (uint32_t i = uint32_t(tid); i < r.own_offset; i += kThreads) {
      above += s.all_pairs[i].x > r.threshold ? 1u : 0u;
      equal += s.all_pairs[i].x == r.threshold ? 1u : 0u;
    }
  } else {
    stream_keys<kThreads>(scores, 0, r.slice_group_begin, [&](uint32_t key, bool valid, int32_t) {
      above += valid && key > r.threshold ? 1u : 0u;
      equal += valid && key == r.threshold ? 1u : 0u;
    });
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    above += __shfl_xor_sync(kFullMask, above, offset);
    equal += __shfl_xor_sync(kFullMask, equal, offset);
  }
  if (lane == 0 && (above | equal) != 0u) {
    atomicAdd(&sh.base[0], above);
    atomicAdd(&sh.base[1], equal);
  }
  const int32_t n_words = r.slice_group_end > r.slice_group_begin
                              ? (r.slice_group_end - r.slice_group_begin + 31) / 32
                              : 0;
  for (int32_t w = tid; w < n_words; w += kThreads) s.above_bits[w] = s.equal_bits[w] = 0u;
  __syncthreads();
  if (r.in_shared) {
    for (uint32_t i = uint32_t(tid); i < r.n_own; i += kThreads) {
      const uint32_t key = s.own_keys[i];
      if (key >= r.threshold) {
        const int32_t bit = s.own_groups[i] - r.slice_group_begin;
        atomicOr(&(key > r.threshold ? s.above_bits : s.equal_bits)[bit / 32], 1u << (bit % 32));
      }
    }
  } else {
    const int warp = tid >> 5;
    for (int32_t base = r.slice_group_begin; base < r.slice_group_end; base += kThreads) {
      const int32_t c = base + tid;
      const bool valid = c < r.slice_group_end;
      const uint32_t key = valid ? order_key(__ldg(scores + c)) : 0u;
      const unsigned a = __ballot_sync(kFullMask, valid && key > r.threshold);
      const unsigned e = __ballot_sync(kFullMask, valid && key == r.threshold);
      const int32_t w = (base - r.slice_group_begin) / 32 + warp;
      if (lane == 0 && w < n_words) s.above_bits[w] = a, s.equal_bits[w] = e;
    }
  }
  __syncthreads();
  emit_from_bitmaps<kThreads>(s.above_bits, s.equal_bits, n_words, r.slice_group_begin, sh.base[0],
                              sh.base[1], r.ties, p.ratio, sh.warp_totals, out,
                              E4KV_TOPK_STAGING && p.k * p.ratio <= kClusterBins
                                  ? reinterpret_cast<int32_t*>(s.hist)
                                  : nullptr);
}
#endif

}  // namespace e4kv::cuda::top_k_device
