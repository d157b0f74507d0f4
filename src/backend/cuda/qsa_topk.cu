// QSA top-k selection: exact top-k of each query row's group scores with the deterministic
// tie-break of the CPU reference (qsa/selection.h), then expansion to token indices with the causal
// tail and -1 padding, and the count.
//
// One CTA of 1024 threads per row. Scores (fp32, never NaN) map to order-preserving uint32 keys
// (+0 and -0 both to the key of +0, so that equal floats are equal keys). The k-th largest key T
// is found by a radix select: 4 passes of 8 bits from the top; each pass histograms the digit of
// the keys that match the digits found so far into 256 shared-memory bins (warp-aggregated with
// __match_any_sync, since most scores share their top byte), then one warp scans the bins from the
// highest digit and picks the digit where the running count reaches the remaining rank. After the
// 4 passes the remaining rank is the number of keys equal to T to take, k - rank are strictly
// above T. A final ordered pass over 1024-group chunks scans (above, equal) counts packed into one
// 32-bit word per thread (one block scan per chunk) and writes each selected group's tokens at its
// rank, so groups come out in increasing index and ties go to the lowest indices; the pass stops
// once k groups are out. Rows with visible <= k take every group without reading scores.
//
// One CTA per row leaves most SMs idle and was measured latency-bound (2026-11-29: 74 us at 32K
// groups, batch 4). So long rows first go through a chunk phase: one CTA of 256 threads per 4096
// groups loads its chunk's keys into shared memory, finds the chunk's k-th largest key by the same
// radix select (on shared memory), and writes its exact local top-k (ties to the lowest index) as
// (key, group) candidates in group order, padded with key 0, which is below every float's key. A
// group in the row's top-k is beaten by fewer than k groups of the row, so by fewer than k of its
// chunk: the union of the chunks' candidates holds the row's top-k under the same order, and the
// row kernel then runs on S * k candidates instead of the whole row (8x fewer at 32K groups and
// k = 512), emitting candidate groups, which are already in increasing group order.
//
// The filtered method (the default up to 131072 groups, described before its kernel below) needs
// no workspace and reads little more than the row's largest scores: 18.3-19.0 us against 28.6 us
// for the two phases at 32K groups on the H200 (2026-12-01; 17.0 us given the run maxima). One
// CTA of 1024 threads is issue-bound: 32 warps share 4 schedulers, so every instruction a thread
// executes costs the SM 8 cycles (ncu: 2.4K instructions per warp, half the kernel's cycles
// issuing), and the steps were made short in instructions rather than in barriers: a bound from
// per-warp ballots instead of a block-wide radix select (11K -> 6K cycles), candidates gathered
// in one visit, kernel instances sized to the row (16 run slots per thread held 4x the code the
// 32K-group rows need; ncu showed the slot loops as the hottest code). Next: spread a row over
// several CTAs, which divides the issue work.
// Limits: visible groups and selection width < 2^31. Static shared memory: about 1.2 KB (the
// filtered kernel: 48 KB dynamic, opted in). Instructions: __match_any_sync (sm_70+).
#include "backend/cuda/qsa_topk.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "backend/cuda/cluster.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/timeline.cuh"

E4KV_TIMELINE_UNIT(top_k)

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr int kUnroll = 8;  // score loads in flight per thread in a histogram pass
constexpr unsigned kFullMask = 0xFFFFFFFFu;

struct TopKKernelParams {
  const int32_t* row_seq;   // [n_rows]
  const int32_t* row_pos;   // [n_rows]
  const int32_t* seq_lens;  // [n_seqs]
  int32_t ratio;
  int32_t k;            // budget / ratio
  int32_t width;        // budget + ratio - 1
  const float* scores;  // [n_rows, max_groups]
  int64_t max_groups;
  int32_t* sel_tokens;  // [n_rows, width]
  int32_t* sel_counts;  // [n_rows]
  // Candidate mode (cand_keys != nullptr): the radix select and the emission run over n_cand
  // candidates per row instead of the row's scores.
  const uint32_t* cand_keys;   // [n_rows, n_cand] order keys, 0 = padding
  const int32_t* cand_groups;  // [n_rows, n_cand] group index of each candidate
  int32_t n_cand;
};

constexpr int kChunk = 4096;  // groups per CTA in the chunk phase
constexpr int kChunkThreads = 256;

struct ChunkKernelParams {
  const int32_t* row_seq;
  const int32_t* row_pos;
  const int32_t* seq_lens;
  int32_t ratio;
  int32_t k;
  const float* scores;  // [n_rows, max_groups]
  int64_t max_groups;
  int32_t n_chunks;      // per row
  uint32_t* cand_keys;   // [n_rows, n_chunks * k]
  int32_t* cand_groups;  // [n_rows, n_chunks * k]
};

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

__global__ void __launch_bounds__(kThreads)
    qsa_top_k_select_kernel(const __grid_constant__ TopKKernelParams p) {
  enter_dependent_grid();
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t warp_totals[kWarps];
  __shared__ uint32_t chunk_total;
  __shared__ uint32_t found_prefix;
  __shared__ uint32_t found_rank;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const RowGroups rg = row_groups(p, row);
  const int32_t visible = rg.visible;
  const int32_t ratio = p.ratio;
  int32_t* out = p.sel_tokens + row * p.width;

  int32_t n_groups;
  if (visible <= p.k) {
    // Every visible group: tokens 0 .. ratio * visible - 1.
    n_groups = visible;
    for (int32_t j = tid; j < n_groups * ratio; j += kThreads) out[j] = j;
  } else {
    n_groups = p.k;
    const float* scores = p.scores + row * p.max_groups;
    const bool cand = p.cand_keys != nullptr;
    const uint32_t* cand_keys = cand ? p.cand_keys + row * p.n_cand : nullptr;
    const int32_t* cand_groups = cand ? p.cand_groups + row * p.n_cand : nullptr;
    const int32_t n_items = cand ? p.n_cand : visible;  // what the select runs over
    auto key_at = [&](int32_t c) {
      return cand ? __ldg(cand_keys + c) : order_key(__ldg(scores + c));
    };

    // Radix select of the k-th largest key.
    uint32_t prefix = 0u;
    uint32_t mask = 0u;
    uint32_t rank = uint32_t(p.k);  // rank of the wanted key among those matching prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
      if (tid < kBins) hist[tid] = 0u;
      __syncthreads();
      for (int32_t base = 0; base < n_items; base += kThreads * kUnroll) {
        uint32_t digits[kUnroll];  // kBins: a sentinel, not counted
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {  // all loads in flight before the first match
          const int32_t c = base + u * kThreads + tid;
          digits[u] = kBins;
          if (c < n_items) {
            const uint32_t key = key_at(c);
            if ((key & mask) == prefix) digits[u] = (key >> shift) & 0xFFu;
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const unsigned peers = __match_any_sync(kFullMask, digits[u]);
          if (digits[u] != kBins && lane == __ffs(peers) - 1) {
            atomicAdd(&hist[digits[u]], uint32_t(__popc(peers)));
          }
        }
      }
      __syncthreads();
      if (warp == 0) find_digit(hist, prefix, rank, shift, lane, found_prefix, found_rank);
      __syncthreads();
      prefix = found_prefix;
      rank = found_rank;
      mask |= 0xFFu << shift;
    }
    const uint32_t threshold = prefix;
    const uint32_t ties = rank;  // keys equal to the threshold to take, >= 1

    // Ordered emission: (above, equal) counts packed as above | equal << 16 (a chunk holds at
    // most 1024 of each), one block-wide exclusive scan per chunk.
    uint32_t run_above = 0u;
    uint32_t run_equal = 0u;
    for (int32_t base = 0; base < n_items; base += kThreads) {
      const int32_t c = base + tid;
      uint32_t above = 0u;
      uint32_t equal = 0u;
      if (c < n_items) {
        const uint32_t key = key_at(c);
        above = key > threshold ? 1u : 0u;
        equal = key == threshold ? 1u : 0u;
      }
      const uint32_t packed = above | (equal << 16);
      const uint32_t inclusive = warp_inclusive_scan(packed, lane);
      if (lane == 31) warp_totals[warp] = inclusive;
      __syncthreads();
      if (warp == 0) {
        const uint32_t total = warp_totals[lane];
        const uint32_t warp_inclusive = warp_inclusive_scan(total, lane);
        warp_totals[lane] = warp_inclusive - total;
        if (lane == 31) chunk_total = warp_inclusive;
      }
      __syncthreads();
      const uint32_t exclusive = inclusive - packed + warp_totals[warp];
      const uint32_t equal_before = run_equal + (exclusive >> 16);
      if (above != 0u || (equal != 0u && equal_before < ties)) {
        const uint32_t taken_equal = equal_before < ties ? equal_before : ties;
        const int32_t slot = int32_t(run_above + (exclusive & 0xFFFFu) + taken_equal);
        const int32_t group = cand ? cand_groups[c] : c;
        for (int32_t i = 0; i < ratio; ++i) out[slot * ratio + i] = group * ratio + i;
      }
      const uint32_t total = chunk_total;
      run_above += total & 0xFFFFu;
      run_equal += total >> 16;
      __syncthreads();  // warp_totals and chunk_total are rewritten by the next chunk
      if (run_above + (run_equal < ties ? run_equal : ties) >= uint32_t(p.k)) break;  // uniform
    }
  }

  write_tail<kThreads>(p, row, rg, n_groups, out);  // causal tail, then -1 padding
}

// Chunk phase: the exact top-k of one chunk of kChunk groups (ties to the lowest index) as
// candidates in group order, padded with key 0 to k entries. Rows with visible <= k write nothing
// (the row kernel takes every group without candidates).
__global__ void __launch_bounds__(kChunkThreads)
    qsa_top_k_chunk_kernel(const __grid_constant__ ChunkKernelParams p) {
  enter_dependent_grid();
  constexpr int kChunkWarps = kChunkThreads / 32;
  constexpr int kPerThread = kChunk / kChunkThreads;
  static_assert(kChunkThreads == kBins);
  __shared__ uint32_t keys[kChunk];
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t warp_totals[kChunkWarps];
  __shared__ uint32_t found_prefix;
  __shared__ uint32_t found_rank;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const int32_t first = int32_t(blockIdx.y) * kChunk;
  const int32_t visible = row_groups(p, row).visible;
  if (visible <= p.k) return;
  int32_t n_valid = visible - first;
  n_valid = n_valid < 0 ? 0 : (n_valid > kChunk ? kChunk : n_valid);
  const int64_t out_base = (row * p.n_chunks + blockIdx.y) * int64_t(p.k);
  uint32_t* out_keys = p.cand_keys + out_base;
  int32_t* out_groups = p.cand_groups + out_base;

  const float* scores = p.scores + row * p.max_groups + first;
  for (int i = tid; i < n_valid; i += kChunkThreads) keys[i] = order_key(__ldg(scores + i));
  if (n_valid <= p.k) {
    __syncthreads();
    for (int i = tid; i < p.k; i += kChunkThreads) {
      out_keys[i] = i < n_valid ? keys[i] : 0u;
      out_groups[i] = i < n_valid ? first + i : -1;
    }
    return;
  }

  uint32_t prefix = 0u;
  uint32_t mask = 0u;
  uint32_t rank = uint32_t(p.k);
  for (int shift = 24; shift >= 0; shift -= 8) {
    hist[tid] = 0u;
    __syncthreads();
    for (int i = tid; i < n_valid; i += kChunkThreads) {
      const uint32_t key = keys[i];
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    if (warp == 0) find_digit(hist, prefix, rank, shift, lane, found_prefix, found_rank);
    __syncthreads();
    prefix = found_prefix;
    rank = found_rank;
    mask |= 0xFFu << shift;
  }
  const uint32_t threshold = prefix;
  const uint32_t ties = rank;

  // Ordered emission: thread t owns groups [t * kPerThread, (t + 1) * kPerThread) of the chunk.
  uint32_t above = 0u;
  uint32_t equal = 0u;
  for (int j = 0; j < kPerThread; ++j) {
    const int i = tid * kPerThread + j;
    if (i < n_valid) {
      above += keys[i] > threshold ? 1u : 0u;
      equal += keys[i] == threshold ? 1u : 0u;
    }
  }
  const uint32_t packed = above | (equal << 16);
  const uint32_t inclusive = warp_inclusive_scan(packed, lane);
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const uint32_t total = lane < kChunkWarps ? warp_totals[lane] : 0u;
    const uint32_t warp_inclusive = warp_inclusive_scan(total, lane);
    if (lane < kChunkWarps) warp_totals[lane] = warp_inclusive - total;
  }
  __syncthreads();
  const uint32_t exclusive = inclusive - packed + warp_totals[warp];
  uint32_t above_before = exclusive & 0xFFFFu;
  uint32_t equal_before = exclusive >> 16;
  for (int j = 0; j < kPerThread; ++j) {
    const int i = tid * kPerThread + j;
    if (i >= n_valid) break;
    const uint32_t key = keys[i];
    if (key > threshold) {
      const uint32_t slot = above_before + (equal_before < ties ? equal_before : ties);
      out_keys[slot] = key;
      out_groups[slot] = first + i;
      ++above_before;
    } else if (key == threshold) {
      if (equal_before < ties) {
        const uint32_t slot = above_before + equal_before;
        out_keys[slot] = key;
        out_groups[slot] = first + i;
      }
      ++equal_before;
    }
  }
}

// ---- Filtered method --------------------------------------------------------------------------
// One CTA of 1024 threads per row. The row's groups fall into runs of kRun consecutive groups
// (run j = groups kRun*j .. kRun*j + kRun - 1); thread t owns runs t, t + 1024, ...
//  1. The maximum of every run: read from `run_maxima` when the score kernel wrote them, else
//     computed here by reading the row. Each warp finds the q-th largest of its runs' maxima
//     (q = ceil(k / 32), cut to its leading bits by a bitwise radix over ballots, which only
//     lowers it); L = the smallest of the 32 is a lower bound of the row's k-th largest score T:
//     every warp has q runs with a maximum >= L, so 32q >= k distinct groups score >= L. L is
//     looser than the exact k-th largest maximum (more runs open), but costs no block-wide select.
//  2. Candidates: the groups scoring >= L, read only from the runs whose maximum is >= L, go to
//     shared memory (key, group) in one visit, each warp taking its slots with one atomic (order
//     does not matter below). T and the number of ties to take come from a radix select over
//     them. Heavy ties or a loose L can overflow kFilterCandidates: then the select, and step 3,
//     stream the whole row from global memory instead (same result, slower).
//  3. Two bitmaps over the row's groups (score > T, score == T), set from the candidates; one
//     block scan of their popcounts gives each thread the rank of its first selected group, and
//     each thread writes its groups' tokens in increasing group order, ties at T taken from the
//     lowest index.
constexpr int kFilterThreads = 1024;
constexpr int kFilterWarps = kFilterThreads / 32;
constexpr int kRun = int(kQsaRunGroups);
constexpr int kFilterMaxWords = 4096;  // per bitmap: 131072 groups
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

// kRunsPerThread: the most runs a thread owns (rows up to kFilterThreads * kRunsPerThread * kRun
// groups). The kernel is issue-bound (32 warps share 4 schedulers, so each instruction of a
// thread costs 8 cycles), so short rows take an instance with fewer run slots to skip.
template <int kRunsPerThread>
__global__ void __launch_bounds__(kFilterThreads)
    qsa_top_k_filtered_kernel(const __grid_constant__ FilterKernelParams p) {
  enter_dependent_grid();
  static_assert(kFilterThreads * kRunsPerThread * kRun <= kFilterMaxWords * 32);
  static_assert(kFilterThreads >= kBins);
  extern __shared__ __align__(16) uint32_t filter_smem[];
  int32_t* cand_groups = reinterpret_cast<int32_t*>(filter_smem);
  uint32_t* cand_keys = filter_smem + kFilterCandidates;
  uint32_t* above_bits = filter_smem + kFilterCandidates;  // after the select
  uint32_t* equal_bits = above_bits + kFilterMaxWords;
  __shared__ SelectShared sel;
  __shared__ uint2 warp_totals[kFilterWarps];
  __shared__ uint32_t n_cand_s;
  __shared__ uint32_t warp_bound[kFilterWarps];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const RowGroups rg = row_groups(p, row);
  const int32_t visible = rg.visible;
  const int32_t ratio = p.ratio;
  int32_t* out = p.sel_tokens + row * p.width;
  const float* scores = p.scores + row * p.max_groups;

  int32_t n_groups;
  if (visible <= p.k) {
    n_groups = visible;
    for (int32_t j = tid; j < n_groups * ratio; j += kFilterThreads) out[j] = j;
  } else {
    n_groups = p.k;
    if (tid == 0) n_cand_s = 0u;
    const int32_t n_runs = (visible + kRun - 1) / kRun;
    const bool aligned = (reinterpret_cast<uintptr_t>(scores) & 15u) == 0u;  // uniform

    // 1. Run maxima (key 0, below every score's key, for runs past the row) and the bound L.
    uint32_t run_max[kRunsPerThread];
    if (p.run_maxima != nullptr) {
      const float* maxima = p.run_maxima + row * p.run_stride;
#pragma unroll
      for (int u = 0; u < kRunsPerThread; ++u) {
        const int32_t j = u * kFilterThreads + tid;
        run_max[u] = j < n_runs ? order_key(__ldg(maxima + j)) : 0u;
      }
    } else {
#pragma unroll
      for (int u = 0; u < kRunsPerThread; ++u) {
        const int32_t j = u * kFilterThreads + tid;
        uint32_t m = 0u;
        if (j < n_runs) {
          uint32_t keys[kRun];
          load_run(scores, j, visible, aligned, keys);
#pragma unroll
          for (int i = 0; i < kRun; ++i) m = keys[i] > m ? keys[i] : m;
        }
        run_max[u] = m;
      }
    }
    // L = the smallest of the warps' q-th largest run maxima (q = ceil(k / warps)): every warp
    // holds q maxima >= L, so the block holds >= k and L <= T. No block-wide select: one warp's
    // ballots and one block minimum.
    // With fewer runs than k, L = 0 (every key is >= 0).
    const uint32_t warp_q =
        n_runs < p.k ? 0u
                     : warp_rank_prefix<kRunsPerThread>(
                           run_max, (n_runs + kFilterThreads - 1) / kFilterThreads,
                           uint32_t((p.k + kFilterWarps - 1) / kFilterWarps), kBoundBits);
    if (lane == 0) warp_bound[warp] = warp_q;
    __syncthreads();  // also orders n_cand_s = 0 before step 2
    uint32_t floor_key = lane < kFilterWarps ? warp_bound[lane] : ~0u;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const uint32_t other = __shfl_xor_sync(kFullMask, floor_key, offset);
      floor_key = other < floor_key ? other : floor_key;
    }

    // 2. Candidates: the keys >= L of the open runs go to shared memory in one visit, slots taken
    //    by one atomic per warp and batch (the order does not matter: the select counts and the
    //    bitmaps place). The count goes on past the capacity.
    {
      constexpr int kBatch = 4;  // runs whose loads are in flight together
#pragma unroll
      for (int u0 = 0; u0 < kRunsPerThread; u0 += kBatch) {
        if (u0 * kFilterThreads >= n_runs) break;  // uniform
        uint32_t keys[kBatch][kRun];
#pragma unroll
        for (int du = 0; du < kBatch; ++du) {
          const int32_t j = (u0 + du) * kFilterThreads + tid;
          if (j < n_runs && run_max[u0 + du] >= floor_key) {
            load_run(scores, j, visible, aligned, keys[du]);
          } else {
#pragma unroll
            for (int i = 0; i < kRun; ++i) keys[du][i] = 0u;
          }
        }
        // Key 0 is no score's key: it marks loads that were not made.
        append_candidates<kBatch>(
            keys, floor_key, [&](int du) { return ((u0 + du) * kFilterThreads + tid) * kRun; },
            &n_cand_s, cand_keys, cand_groups, uint32_t(kFilterCandidates));
      }
    }
    __syncthreads();
    const uint32_t n_cand = n_cand_s;
    const bool in_shared = n_cand <= uint32_t(kFilterCandidates);  // uniform

    uint32_t threshold;
    uint32_t ties;
    if (in_shared) {
      block_radix_select(
          [&](auto&& f) {
            for (uint32_t base = 0; base < n_cand; base += kFilterThreads) {
              const uint32_t i = base + uint32_t(tid);
              f(i < n_cand ? cand_keys[i] : 0u, i < n_cand);
            }
          },
          uint32_t(p.k), 0, sel, threshold, ties);
    } else {
      block_radix_select(
          [&](auto&& f) {
            stream_keys<kFilterThreads>(scores, 0, visible, [&](uint32_t key, bool valid, int32_t) {
              f(key, valid && key >= floor_key);
            });
          },
          uint32_t(p.k), 0, sel, threshold, ties);
    }

    // 3. Bitmaps: word w holds groups 32w .. 32w + 31.
    const int32_t n_words = (visible + 31) / 32;
    if (in_shared) {
      // Candidate keys are read into registers before the region becomes bitmaps.
      uint32_t mine[kFilterCandidates / kFilterThreads];
      int32_t mine_group[kFilterCandidates / kFilterThreads];
#pragma unroll
      for (int u = 0; u < kFilterCandidates / kFilterThreads; ++u) {
        const uint32_t i = uint32_t(u * kFilterThreads + tid);
        mine[u] = i < n_cand ? cand_keys[i] : 0u;
        mine_group[u] = i < n_cand ? cand_groups[i] : -1;
      }
      __syncthreads();
      for (int32_t w = tid; w < n_words; w += kFilterThreads) above_bits[w] = equal_bits[w] = 0u;
      __syncthreads();
#pragma unroll
      for (int u = 0; u < kFilterCandidates / kFilterThreads; ++u) {
        const int32_t g = mine_group[u];
        if (g >= 0 && mine[u] >= threshold) {
          uint32_t* bits = mine[u] > threshold ? above_bits : equal_bits;
          atomicOr(&bits[g / 32], 1u << (g % 32));
        }
      }
    } else {
      __syncthreads();  // the candidate region becomes the bitmaps
      // Thread t of a 1024-group slab is bit t % 32 of word slab * 32 + t / 32.
      for (int32_t base = 0; base < visible; base += kFilterThreads) {
        const int32_t c = base + tid;
        const uint32_t key = c < visible ? order_key(__ldg(scores + c)) : 0u;
        const unsigned above = __ballot_sync(kFullMask, c < visible && key > threshold);
        const unsigned equal = __ballot_sync(kFullMask, c < visible && key == threshold);
        if (lane == 0 && base / 32 + warp < n_words) {
          above_bits[base / 32 + warp] = above;
          equal_bits[base / 32 + warp] = equal;
        }
      }
    }
    __syncthreads();
    emit_from_bitmaps(above_bits, equal_bits, n_words, 0, 0u, 0u, ties, ratio, warp_totals, out);
  }

  write_tail<kFilterThreads>(p, row, rg, n_groups, out);  // causal tail, then -1 padding
}

// ---- Cluster method (sm_90+) ------------------------------------------------------------------
// The filtered method's steps spread over a thread-block cluster of kClusterCtas CTAs per row
// (512 threads each), which share their candidates through distributed shared memory. The
// filtered kernel is issue-bound on one SM; here every step that loops over the row's runs or
// groups divides by the cluster's SMs, and the exact select runs over the candidates only.
// Global warp g = rank * 16 + warp owns runs [g * rpw, (g + 1) * rpw), rpw = ceil(n_runs / 128),
// lane l the runs g * rpw + l + 32 s; CTA `rank` owns the contiguous slice of its warps' runs.
//  1. Bound: the run maxima go to shared memory; 4 "bound warps" per CTA each take a quarter of
//     the CTA's slice (4 rpw runs). Each of the P = min(32, floor(n_runs / (4 rpw))) bound warps
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
constexpr int kClusterThreads = 512;
constexpr int kClusterWarps = kClusterThreads / 32;
constexpr int kClusterWarpsTotal = kClusterCtas * kClusterWarps;  // 128
constexpr int kBoundWarps = 4;                                    // per CTA
constexpr int kClusterCandidates = 4096;
constexpr int kClusterBins = 2048;
[[maybe_unused]] constexpr int kClusterBinBits = 11;  // bits of a histogram bin index
constexpr int kClusterDirectRank = kClusterThreads;
constexpr int kClusterShortSlots = 1;  // runs per lane: rows up to 32768 groups
constexpr int kClusterLongSlots = 4;   // rows up to 131072 groups
constexpr int kClusterMaxSliceRuns = kClusterWarps * 32 * kClusterLongSlots;  // 2048
constexpr int kClusterSliceWords = kClusterMaxSliceRuns * kRun / 32;          // 512
// Dynamic shared memory: own candidates (keys, groups), all candidates (keys, groups; the run
// maxima of step 1 before them), the histogram (later the keys of the last bin), the slice's two
// bitmaps.
constexpr size_t kClusterSmemBytes =
    (4 * size_t(kClusterCandidates) + kClusterBins + 2 * kClusterSliceWords) * sizeof(uint32_t);
static_assert(kClusterBins % kClusterThreads == 0 && kClusterDirectRank <= kClusterBins);
static_assert(kClusterMaxSliceRuns <= kClusterCandidates);
static_assert(kClusterThreads >= kBins && kClusterWarps >= kBoundWarps);
static_assert(kClusterWarps * 32 * kClusterShortSlots * kRun * kClusterCtas == 32768);

template <int kSlots>
__global__ void __launch_bounds__(kClusterThreads)
    qsa_top_k_cluster_kernel(const __grid_constant__ FilterKernelParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  E4KV_TL_ENTER_DEPENDENT_GRID(kTlTopK);
  const bool marker = blockIdx.x == 0 && threadIdx.x == 0;
  if (marker) E4KV_TL_PHASE(0);
  constexpr int kBoundSlots = 4 * kSlots;  // a bound warp's runs per lane: 4 rpw / 32
  extern __shared__ __align__(16) uint32_t cluster_smem[];
  uint32_t* own_keys = cluster_smem;
  int32_t* own_groups = reinterpret_cast<int32_t*>(own_keys + kClusterCandidates);
  // Every CTA's candidates (key, group), in CTA order, as the CTAs send them.
  uint2* all_pairs = reinterpret_cast<uint2*>(own_keys + 2 * kClusterCandidates);
  uint32_t* maxima_s = own_keys + 2 * kClusterCandidates;  // step 1 only: the slice's run maxima
  uint32_t* hist = own_keys + 4 * kClusterCandidates;
  uint32_t* above_bits = hist + kClusterBins;
  uint32_t* equal_bits = above_bits + kClusterSliceWords;
  __shared__ uint2 sent_bounds[kClusterCtas];  // from CTA c: its bound, its largest run maximum
  __shared__ uint2 sent_counts[kClusterCtas];  // from CTA c: its candidate count, 0
  __shared__ __align__(8) uint64_t bars[3];    // bounds, counts, candidates
  __shared__ uint32_t warp_bound[kBoundWarps];
  __shared__ uint32_t warp_top[kClusterWarps];
  __shared__ SelectShared sel;
  __shared__ uint2 warp_totals[kClusterWarps];
  __shared__ uint32_t n_own_s;
  __shared__ uint32_t n_bin_s;
  __shared__ uint32_t base_s[2];  // groups above T / equal to T in earlier slices
  __shared__ uint32_t found[3];   // bin, rank within it, its count (then T, ties)

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const uint32_t rank = cluster_rank();
  const int64_t row = blockIdx.x / kClusterCtas;
  const RowGroups rg = row_groups(p, row);
  const int32_t visible = rg.visible;
  const int32_t ratio = p.ratio;
  int32_t* out = p.sel_tokens + row * p.width;
  const float* scores = p.scores + row * p.max_groups;

  int32_t n_groups;
  if (visible <= p.k) {  // the same in every CTA of the cluster: no cluster barrier on this path
    if (rank != 0) return;
    n_groups = visible;
    for (int32_t j = tid; j < n_groups * ratio; j += kClusterThreads) out[j] = j;
  } else {
    n_groups = p.k;
    if (tid == 0) {
      n_own_s = 0u;
      base_s[0] = base_s[1] = 0u;
      for (uint64_t& bar : bars) mbarrier_init(&bar);
      mbarrier_expect(&bars[0], kClusterCtas * 8);
      mbarrier_expect(&bars[1], kClusterCtas * 8);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // Waited on before the first send: then every CTA's barriers are initialised.
    cluster_arrive_relaxed();
    const int32_t n_runs = (visible + kRun - 1) / kRun;
    const int32_t rpw = (n_runs + kClusterWarpsTotal - 1) / kClusterWarpsTotal;
    const int32_t slice_runs = kClusterWarps * rpw;
    const int32_t slice_first = int32_t(rank) * slice_runs;  // first run of the CTA
    const int32_t slice_group_begin = min(slice_first * kRun, visible);
    const int32_t slice_group_end = min((slice_first + slice_runs) * kRun, visible);
    const bool aligned = (reinterpret_cast<uintptr_t>(scores) & 15u) == 0u;  // uniform
    // Local run (within the slice) of the lane's slot s, and whether it is a run of the row.
    auto local_run = [&](int s) { return warp * rpw + lane + 32 * s; };
    auto run_valid = [&](int s) {
      return lane + 32 * s < rpw && slice_first + local_run(s) < n_runs;
    };

    // 1. Run maxima (to shared memory and registers), the bound warps' bounds, the CTA's
    //    (bound, largest maximum), then the cluster's.
    uint32_t run_max[kSlots];
    uint32_t top = 0u;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int32_t j = slice_first + local_run(s);
      uint32_t m = 0u;
      if (run_valid(s)) {
        if (p.run_maxima != nullptr) {
          m = order_key(__ldg(p.run_maxima + row * p.run_stride + j));
        } else {
          uint32_t keys[kRun];
          load_run(scores, j, visible, aligned, keys);
#pragma unroll
          for (int i = 0; i < kRun; ++i) m = keys[i] > m ? keys[i] : m;
        }
      }
      run_max[s] = m;
      if (lane + 32 * s < rpw) maxima_s[local_run(s)] = m;
      top = m > top ? m : top;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const uint32_t other = __shfl_xor_sync(kFullMask, top, offset);
      top = other > top ? other : top;
    }
    if (lane == 0) warp_top[warp] = top;
    const int32_t quarter = 4 * rpw;  // runs of a bound warp
    const int32_t n_full = min(kClusterCtas * kBoundWarps, n_runs / quarter);
    const int32_t q = n_full > 0 ? (p.k + n_full - 1) / n_full : 0;
    const bool bounded = n_full > 0 && q <= quarter;  // uniform over the cluster
    __syncthreads();
    if (warp < kBoundWarps) {
      uint32_t bound = ~0u;  // a quarter that is not wholly inside the row has no say in L
      if (bounded && int32_t(rank) * kBoundWarps + warp < n_full) {
        uint32_t keys[kBoundSlots];
#pragma unroll
        for (int s = 0; s < kBoundSlots; ++s) {
          const int32_t i = lane + 32 * s;
          keys[s] = i < quarter ? maxima_s[warp * quarter + i] : 0u;
        }
        bound = warp_rank_prefix<kBoundSlots>(keys, kBoundSlots, uint32_t(q), kBoundBits);
      }
      if (lane == 0) warp_bound[warp] = bound;
    }
    __syncthreads();
    cluster_wait();
    if (warp == 0) {
      uint32_t b = lane < kBoundWarps ? warp_bound[lane] : ~0u;
      uint32_t t = lane < kClusterWarps ? warp_top[lane] : 0u;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        const uint32_t ob = __shfl_xor_sync(kFullMask, b, offset);
        const uint32_t ot = __shfl_xor_sync(kFullMask, t, offset);
        b = ob < b ? ob : b;
        t = ot > t ? ot : t;
      }
      if (lane < kClusterCtas) send_async(&sent_bounds[rank], uint32_t(lane), b, t, &bars[0]);
    }
    if (marker) E4KV_TL_PHASE(1);
    mbarrier_wait(&bars[0], 0u);
    if (marker) E4KV_TL_PHASE(2);
    uint32_t floor_key = ~0u;
    uint32_t top_key = 0u;
    if (lane < kClusterCtas) {
      floor_key = sent_bounds[lane].x;
      top_key = sent_bounds[lane].y;
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
      for (int s = 0; s < kSlots; ++s) {
        if (run_valid(s) && run_max[s] >= floor_key) {
          load_run(scores, slice_first + local_run(s), visible, aligned, keys[s]);
        } else {
#pragma unroll
          for (int i = 0; i < kRun; ++i) keys[s][i] = 0u;
        }
      }
      append_candidates<kSlots>(
          keys, floor_key, [&](int u) { return (slice_first + local_run(u)) * kRun; }, &n_own_s,
          own_keys, own_groups, uint32_t(kClusterCandidates));
    }
    __syncthreads();
    if (marker) E4KV_TL_PHASE(3);
    const uint32_t n_own = n_own_s;
    if (warp == 0 && lane < kClusterCtas) {
      send_async(&sent_counts[rank], uint32_t(lane), n_own, 0u, &bars[1]);
    }
    mbarrier_wait(&bars[1], 0u);
    // Every warp: the CTAs' counts (lane c < 8 holds CTA c's) and offsets.
    const uint32_t count = lane < kClusterCtas ? sent_counts[lane].x : 0u;
    const uint32_t count_end = warp_inclusive_scan(count, lane);
    const uint32_t n_cand = __shfl_sync(kFullMask, count_end, kClusterCtas - 1);
    const uint32_t own_offset = __shfl_sync(kFullMask, count_end - count, int(rank));
    const bool in_shared = n_cand <= uint32_t(kClusterCandidates);  // uniform over the cluster
    if (in_shared) {
      // Each candidate to every CTA (this one included), at its place in CTA order.
      if (tid == 0) mbarrier_expect(&bars[2], n_cand * 8u);
      for (uint32_t i = uint32_t(tid); i < n_own; i += kClusterThreads) {
        const uint32_t key = own_keys[i];
        const uint32_t group = uint32_t(own_groups[i]);
#pragma unroll
        for (uint32_t c = 0; c < uint32_t(kClusterCtas); ++c) {
          send_async(&all_pairs[own_offset + i], c, key, group, &bars[2]);
        }
      }
      if (marker) E4KV_TL_PHASE(4);
      mbarrier_wait(&bars[2], 0u);
    }
    if (marker) E4KV_TL_PHASE(5);
    // Everything sent to this CTA has landed; the exit waits until that holds for every CTA (a
    // CTA's shared memory must outlive the sends into it).
    cluster_arrive_relaxed();

    // 3. T and the ties to take.
    uint32_t threshold;
    uint32_t ties;
    if (in_shared) {
      constexpr int kBinsPerThread = kClusterBins / kClusterThreads;
      uint32_t lo = floor_key;
      uint32_t hi = top_key;
      uint32_t want = uint32_t(p.k);  // rank of T among the keys in [lo, hi]
      int shift = 32 - __clz(int(hi - lo)) - kClusterBinBits;
      shift = shift > 0 ? shift : 0;
      for (;;) {
#pragma unroll
        for (int b = 0; b < kBinsPerThread; ++b) hist[b * kClusterThreads + tid] = 0u;
        __syncthreads();
        for (uint32_t i = uint32_t(tid); i < n_cand; i += kClusterThreads) {
          const uint32_t key = all_pairs[i].x;
          if (key >= lo && key <= hi) atomicAdd(&hist[(key - lo) >> shift], 1u);
        }
        __syncthreads();
        // Thread t: kBinsPerThread bins from the top, the highest first.
        uint32_t counts[kBinsPerThread];
        uint32_t mine = 0u;
#pragma unroll
        for (int j = 0; j < kBinsPerThread; ++j) {
          counts[j] = hist[kClusterBins - 1 - kBinsPerThread * tid - j];
          mine += counts[j];
        }
        uint32_t before = mine;
        uint32_t unused = 0u;
        block_exclusive_scan2<kClusterThreads>(before, unused, warp_totals);
        if (before < want && before + mine >= want) {
#pragma unroll
          for (int j = 0; j < kBinsPerThread; ++j) {
            if (before < want && before + counts[j] >= want) {
              found[0] = uint32_t(kClusterBins - 1 - kBinsPerThread * tid - j);
              found[1] = want - before;
              found[2] = counts[j];
              n_bin_s = 0u;
            }
            before += counts[j];
          }
        }
        __syncthreads();
        const uint32_t bin = found[0];
        want = found[1];
        const uint32_t in_bin = found[2];
        lo += bin << shift;
        const uint64_t bin_hi = uint64_t(lo) + ((uint64_t(1) << shift) - 1u);
        hi = bin_hi < uint64_t(hi) ? uint32_t(bin_hi) : hi;
        if (shift == 0) {  // one key value
          threshold = lo;
          ties = want;
          break;
        }
        if (in_bin <= uint32_t(kClusterDirectRank)) {
          // The bin's keys side by side (in the histogram's place), each ranked by comparison.
          for (uint32_t i = uint32_t(tid); i < n_cand; i += kClusterThreads) {
            const uint32_t key = all_pairs[i].x;
            if (key >= lo && key <= hi) hist[atomicAdd(&n_bin_s, 1u)] = key;
          }
          __syncthreads();
          if (uint32_t(tid) < in_bin) {
            const uint32_t key = hist[tid];
            uint32_t greater = 0u;
            uint32_t equal = 0u;
            for (uint32_t j = 0; j < in_bin; ++j) {
              const uint32_t other = hist[j];
              greater += other > key ? 1u : 0u;
              equal += other == key ? 1u : 0u;
            }
            if (greater < want && want <= greater + equal) {  // key is T (same values if many)
              found[0] = key;
              found[1] = want - greater;
            }
          }
          __syncthreads();
          threshold = found[0];
          ties = found[1];
          break;
        }
        shift = shift > kClusterBinBits ? shift - kClusterBinBits : 0;
      }
    } else {
      block_radix_select<kClusterThreads>(
          [&](auto&& f) {
            stream_keys<kClusterThreads>(
                scores, 0, visible,
                [&](uint32_t key, bool valid, int32_t) { f(key, valid && key >= floor_key); });
          },
          uint32_t(p.k), 0, sel, threshold, ties);
    }

    if (marker) E4KV_TL_PHASE(6);
    // 4. Base ranks from the earlier slices, the slice's bitmaps, emission.
    uint32_t above = 0u;
    uint32_t equal = 0u;
    if (in_shared) {
      for (uint32_t i = uint32_t(tid); i < own_offset; i += kClusterThreads) {
        above += all_pairs[i].x > threshold ? 1u : 0u;
        equal += all_pairs[i].x == threshold ? 1u : 0u;
      }
    } else {
      stream_keys<kClusterThreads>(scores, 0, slice_group_begin,
                                   [&](uint32_t key, bool valid, int32_t) {
                                     above += valid && key > threshold ? 1u : 0u;
                                     equal += valid && key == threshold ? 1u : 0u;
                                   });
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      above += __shfl_xor_sync(kFullMask, above, offset);
      equal += __shfl_xor_sync(kFullMask, equal, offset);
    }
    if (lane == 0 && (above | equal) != 0u) {
      atomicAdd(&base_s[0], above);
      atomicAdd(&base_s[1], equal);
    }
    const int32_t n_words =
        slice_group_end > slice_group_begin ? (slice_group_end - slice_group_begin + 31) / 32 : 0;
    for (int32_t w = tid; w < n_words; w += kClusterThreads) above_bits[w] = equal_bits[w] = 0u;
    __syncthreads();
    if (in_shared) {
      for (uint32_t i = uint32_t(tid); i < n_own; i += kClusterThreads) {
        const uint32_t key = own_keys[i];
        if (key >= threshold) {
          const int32_t bit = own_groups[i] - slice_group_begin;
          atomicOr(&(key > threshold ? above_bits : equal_bits)[bit / 32], 1u << (bit % 32));
        }
      }
    } else {
      for (int32_t base = slice_group_begin; base < slice_group_end; base += kClusterThreads) {
        const int32_t c = base + tid;
        const bool valid = c < slice_group_end;
        const uint32_t key = valid ? order_key(__ldg(scores + c)) : 0u;
        const unsigned a = __ballot_sync(kFullMask, valid && key > threshold);
        const unsigned e = __ballot_sync(kFullMask, valid && key == threshold);
        const int32_t w = (base - slice_group_begin) / 32 + warp;
        if (lane == 0 && w < n_words) above_bits[w] = a, equal_bits[w] = e;
      }
    }
    __syncthreads();
    if (marker) E4KV_TL_PHASE(7);
    // The histogram's room (kClusterBins words) stages the slice's tokens when k * ratio fit.
    emit_from_bitmaps<kClusterThreads>(above_bits, equal_bits, n_words, slice_group_begin,
                                       base_s[0], base_s[1], ties, ratio, warp_totals, out,
                                       E4KV_TOPK_STAGING && p.k * ratio <= kClusterBins
                                           ? reinterpret_cast<int32_t*>(hist)
                                           : nullptr);
    if (marker) E4KV_TL_PHASE(8);
    cluster_wait();
    if (marker) E4KV_TL_PHASE(9);
    if (rank != 0) {
      E4KV_TL_EXIT(kTlTopK, threadIdx.x == 0);
      return;
    }
  }

  write_tail<kClusterThreads>(p, row, rg, n_groups, out);  // the first CTA of the cluster
  if (marker) E4KV_TL_PHASE(10);
  E4KV_TL_EXIT(kTlTopK, threadIdx.x == 0);
#endif
}

// The filtered kernel's dynamic shared memory is above the 48 KB default: opt in once per device.
void allow_filter_shared_memory() {
  int device = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::vector<int> done;
  const std::lock_guard<std::mutex> lock(mutex);
  if (std::find(done.begin(), done.end(), device) != done.end()) return;
  for (auto kernel :
       {qsa_top_k_filtered_kernel<kFilterShortRuns>, qsa_top_k_filtered_kernel<kFilterLongRuns>}) {
    E4KV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(kFilterSmemBytes)));
  }
  done.push_back(device);
}

// Whether the current device launches thread-block clusters (sm_90+), and the cluster kernels'
// shared-memory opt-in, once per device.
bool cluster_top_k_usable() {
  int device = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::vector<std::pair<int, bool>> known;
  const std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [d, usable] : known) {
    if (d == device) return usable;
  }
  int cluster_launch = 0;
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device));
  bool usable = cluster_launch != 0;
  if (usable) {
    // This binary may lack sm_90 code (the kernel compiled for an older architecture is an empty
    // shell): the code the device loads must come from compute_90 or later.
    cudaFuncAttributes attrs{};
    E4KV_CUDA_CHECK(cudaFuncGetAttributes(&attrs, qsa_top_k_cluster_kernel<kClusterShortSlots>));
    usable = attrs.ptxVersion >= 90;
  }
  if (usable) {
    for (auto kernel : {qsa_top_k_cluster_kernel<kClusterShortSlots>,
                        qsa_top_k_cluster_kernel<kClusterLongSlots>}) {
      E4KV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(kClusterSmemBytes)));
    }
  }
  known.emplace_back(device, usable);
  return usable;
}

}  // namespace

bool qsa_top_k_cluster_available() {
  return cluster_top_k_usable();
}

int64_t qsa_top_k_filtered_max_groups() {
  return int64_t(kFilterMaxWords) * 32;
}

size_t qsa_top_k_workspace_bytes(int64_t n_rows, int64_t max_groups, int64_t budget,
                                 int64_t ratio) {
  if (ratio < 1 || budget < ratio || max_groups <= 0 || n_rows <= 0) return 0;
  const int64_t k = budget / ratio;
  const int64_t n_chunks = (max_groups + kChunk - 1) / kChunk;
  if (n_chunks * k >= max_groups || n_chunks > 65535) return 0;  // no shrink, or too many chunks
  return size_t(n_rows * n_chunks * k) * (sizeof(uint32_t) + sizeof(int32_t));
}

namespace {

// The fields every kernel's parameters share (TopKKernelParams, FilterKernelParams).
template <class P>
void fill_row_params(P& p, const QsaTopKArgs& args, int64_t width) {
  p.row_seq = args.rows.row_seq;
  p.row_pos = args.rows.row_pos;
  p.seq_lens = args.rows.seq_lens;
  p.ratio = int32_t(args.ratio);
  p.k = int32_t(args.budget / args.ratio);
  p.width = int32_t(width);
  p.scores = args.scores;
  p.max_groups = args.max_groups;
  p.sel_tokens = args.sel_tokens;
  p.sel_counts = args.sel_counts;
}

}  // namespace

Status qsa_top_k_select(const QsaTopKArgs& args, cudaStream_t stream) {
  if (args.ratio < 1 || args.budget < args.ratio) {
    return Status::error(cat("qsa_top_k_select: budget ", args.budget, " and ratio ", args.ratio,
                             ": ratio must be >= 1 and the budget at least one group"));
  }
  const int64_t width = args.budget + args.ratio - 1;
  if (width >= (int64_t(1) << 31) || args.max_groups < 0 ||
      args.max_groups * args.ratio >= (int64_t(1) << 31)) {
    return Status::error(cat("qsa_top_k_select: budget ", args.budget, " or max_groups ",
                             args.max_groups, " exceeds int32 token indices"));
  }
  if (args.rows.n_rows < 0 || args.rows.n_rows >= (int64_t(1) << 31)) {
    return Status::error(cat("qsa_top_k_select: n_rows ", args.rows.n_rows, " out of range"));
  }
  if (args.rows.n_rows == 0) return ok_status();
  if (args.rows.row_seq == nullptr || args.rows.row_pos == nullptr ||
      args.rows.seq_lens == nullptr || args.sel_tokens == nullptr || args.sel_counts == nullptr ||
      (args.scores == nullptr && args.max_groups > args.budget / args.ratio)) {
    return Status::error("qsa_top_k_select: a required device pointer is null");
  }
  QsaTopKMethod method = args.method;
  const bool filter_fits = args.max_groups <= qsa_top_k_filtered_max_groups();
  if (method == QsaTopKMethod::kAuto) {
    method = filter_fits && args.rows.n_rows < (int64_t(1) << 28) && cluster_top_k_usable()
                 ? QsaTopKMethod::kCluster
             : filter_fits               ? QsaTopKMethod::kFiltered
             : args.workspace != nullptr ? QsaTopKMethod::kTwoPhase
                                         : QsaTopKMethod::kScan;
  }
  if (method == QsaTopKMethod::kFiltered || method == QsaTopKMethod::kCluster) {
    if (!filter_fits) {
      return Status::error(cat("qsa_top_k_select: max_groups ", args.max_groups,
                               " exceeds the filtered and cluster methods' limit of ",
                               qsa_top_k_filtered_max_groups(),
                               " groups; use QsaTopKMethod::kAuto"));
    }
    if (method == QsaTopKMethod::kCluster && args.rows.n_rows >= (int64_t(1) << 28)) {
      return Status::error(cat("qsa_top_k_select: n_rows ", args.rows.n_rows,
                               " is too many for the cluster method (8 CTAs per row, < 2^28)"));
    }
    if (method == QsaTopKMethod::kCluster && !cluster_top_k_usable()) {
      return Status::error(
          "qsa_top_k_select: the cluster method needs an sm_90+ device and sm_90 code in this "
          "build; use QsaTopKMethod::kAuto");
    }
    if (args.run_maxima != nullptr &&
        args.run_stride < (args.max_groups + kQsaRunGroups - 1) / kQsaRunGroups) {
      return Status::error(cat("qsa_top_k_select: run_stride ", args.run_stride,
                               " is below ceil(max_groups / ", kQsaRunGroups, ")"));
    }
    if (method == QsaTopKMethod::kFiltered) allow_filter_shared_memory();
    FilterKernelParams fp{};
    fill_row_params(fp, args, width);
    fp.run_maxima = args.run_maxima;
    fp.run_stride = args.run_stride;
    if (method == QsaTopKMethod::kCluster) {
      const auto kernel =
          args.max_groups <= int64_t(kClusterWarpsTotal) * 32 * kClusterShortSlots * kRun
              ? qsa_top_k_cluster_kernel<kClusterShortSlots>
              : qsa_top_k_cluster_kernel<kClusterLongSlots>;
      launch_kernel(kernel,
                    LaunchDims{dim3(unsigned(args.rows.n_rows * kClusterCtas)),
                               dim3(kClusterThreads), kClusterSmemBytes, unsigned(kClusterCtas)},
                    stream, fp);
      return ok_status();
    }
    const auto kernel = args.max_groups <= int64_t(kFilterThreads) * kFilterShortRuns * kRun
                            ? qsa_top_k_filtered_kernel<kFilterShortRuns>
                            : qsa_top_k_filtered_kernel<kFilterLongRuns>;
    launch_kernel(
        kernel,
        LaunchDims{dim3(unsigned(args.rows.n_rows)), dim3(kFilterThreads), kFilterSmemBytes},
        stream, fp);
    return ok_status();
  }
  if (method == QsaTopKMethod::kTwoPhase && args.workspace == nullptr) {
    return Status::error(
        "qsa_top_k_select: the two-phase method needs a workspace "
        "(qsa_top_k_workspace_bytes)");
  }
  TopKKernelParams kp{};
  fill_row_params(kp, args, width);
  const size_t ws_bytes =
      qsa_top_k_workspace_bytes(args.rows.n_rows, args.max_groups, args.budget, args.ratio);
  if (method == QsaTopKMethod::kTwoPhase && ws_bytes > 0) {
    ChunkKernelParams cp{};
    cp.row_seq = kp.row_seq;
    cp.row_pos = kp.row_pos;
    cp.seq_lens = kp.seq_lens;
    cp.ratio = kp.ratio;
    cp.k = kp.k;
    cp.scores = kp.scores;
    cp.max_groups = kp.max_groups;
    cp.n_chunks = int32_t((args.max_groups + kChunk - 1) / kChunk);
    const int64_t n_cand = int64_t(cp.n_chunks) * cp.k;
    cp.cand_keys = static_cast<uint32_t*>(args.workspace);
    cp.cand_groups = reinterpret_cast<int32_t*>(cp.cand_keys + args.rows.n_rows * n_cand);
    launch_kernel(
        qsa_top_k_chunk_kernel,
        LaunchDims{dim3(unsigned(args.rows.n_rows), unsigned(cp.n_chunks)), dim3(kChunkThreads)},
        stream, cp);
    kp.cand_keys = cp.cand_keys;
    kp.cand_groups = cp.cand_groups;
    kp.n_cand = int32_t(n_cand);
  }
  launch_kernel(qsa_top_k_select_kernel,
                LaunchDims{dim3(unsigned(args.rows.n_rows)), dim3(kThreads)}, stream, kp);
  return ok_status();
}

}  // namespace e4kv::cuda
