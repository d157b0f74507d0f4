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
// One CTA per row leaves most SMs idle and is latency-bound (74 us at 32K groups, batch 4; see
// notes). So long rows first go through a chunk phase: one CTA of 256 threads per 4096
// groups loads its chunk's keys into shared memory, finds the chunk's k-th largest key by the same
// radix select (on shared memory), and writes its exact local top-k (ties to the lowest index) as
// (key, group) candidates in group order, padded with key 0, which is below every float's key. A
// group in the row's top-k is beaten by fewer than k groups of the row, so by fewer than k of its
// chunk: the union of the chunks' candidates holds the row's top-k under the same order, and the
// row kernel then runs on S * k candidates instead of the whole row (8x fewer at 32K groups and
// k = 512), emitting candidate groups, which are already in increasing group order.
//
// The filtered method (the default up to 131072 groups where clusters are not available,
// described before its kernel below) needs no workspace and reads little more than the row's
// largest scores, so it beats the two phases (18.3-19.0 against 28.6 us at 32K groups). One CTA of
// 1024 threads is issue-bound: 32 warps share 4 schedulers, so every instruction a thread executes
// costs the SM 8 cycles, and the steps are short in instructions rather than in barriers: a bound
// from per-warp ballots instead of a block-wide radix select, candidates gathered in one visit,
// kernel instances sized to the row (more run slots than a row needs are code the loops still
// walk). The cluster method (sm_90+, the default where available) spreads the filtered steps over
// the CTAs of a thread-block cluster, which divides the issue work.
// The device helpers and the cluster method's steps are in qsa_topk_device.cuh.
// Limits: visible groups and selection width < 2^31. Static shared memory: about 1.2 KB (the
// filtered kernel: 48 KB dynamic, opted in). Instructions: __match_any_sync (sm_70+).
// Experiments: bench/notes/qsa_topk.md.
#include "backend/cuda/qsa_topk.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/cluster.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/qsa_topk_device.cuh"
#include "backend/cuda/timeline.cuh"

E4KV_TIMELINE_UNIT(top_k)

namespace e4kv::cuda {
namespace {

using namespace top_k_device;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;  // score loads in flight per thread in a histogram pass

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

constexpr int kChunk = int(kQsaTopKChunkGroups);  // groups per CTA in the chunk phase
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
// cluster_select and cluster_emit (qsa_topk_device.cuh, which describes the steps) with CTAs of
// kClusterThreads threads; the first CTA of the cluster then writes the causal tail and count.
constexpr int kClusterThreads = 512;
constexpr int kClusterShortSlots = 1;  // runs per lane: rows up to 32768 groups
constexpr int kClusterLongSlots = 4;   // rows up to 131072 groups
static_assert(ClusterShape<kClusterThreads, kClusterShortSlots>::kMaxGroups == 32768);

template <int kSlots>
__global__ void __launch_bounds__(kClusterThreads)
    qsa_top_k_cluster_kernel(const __grid_constant__ FilterKernelParams p) {
#if E4KV_DEVICE_ARCH >= 900
  E4KV_TL_ENTER_DEPENDENT_GRID(kTlTopK);
  const bool marker = blockIdx.x == 0 && threadIdx.x == 0;
  if (marker) E4KV_TL_PHASE(0);
  extern __shared__ __align__(16) uint32_t cluster_smem[];
  __shared__ ClusterShared<kClusterThreads> sh;
  const uint32_t rank = cluster_rank();
  const int64_t row = blockIdx.x / kClusterCtas;
  int32_t* out = p.sel_tokens + row * p.width;
  const ClusterSelection r =
      cluster_select<kClusterThreads, kSlots>(p, row, rank, cluster_smem, sh, marker);
  const RowGroups rg = row_groups(p, row);
  int32_t n_groups;
  if (r.short_row) {  // the same in every CTA of the cluster: no cluster barrier on this path
    if (rank != 0) return;
    n_groups = rg.visible;
    for (int32_t j = threadIdx.x; j < n_groups * p.ratio; j += kClusterThreads) out[j] = j;
  } else {
    n_groups = p.k;
    if (marker) E4KV_TL_PHASE(7);
    cluster_emit<kClusterThreads, kSlots>(p, row, r, cluster_smem, sh, out);
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
  bool usable = cluster_launch != 0 && compute_capability(device) >= 90;
  if (usable) {
    // This binary may lack sm_90 code (the kernel compiled for an older architecture is an empty
    // shell): the code the device loads must come from compute_90 or later.
    cudaFuncAttributes attrs{};
    E4KV_CUDA_CHECK(cudaFuncGetAttributes(&attrs, qsa_top_k_cluster_kernel<kClusterShortSlots>));
    usable = attrs.ptxVersion >= 90;
  }
  if (usable) {
    using Entry = std::pair<void (*)(FilterKernelParams), size_t>;
    for (const auto& [kernel, smem] :
         {Entry{qsa_top_k_cluster_kernel<kClusterShortSlots>,
                ClusterShape<kClusterThreads, kClusterShortSlots>::kSmemBytes},
          Entry{qsa_top_k_cluster_kernel<kClusterLongSlots>,
                ClusterShape<kClusterThreads, kClusterLongSlots>::kSmemBytes}}) {
      E4KV_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    }
  }
  known.emplace_back(device, usable);
  return usable;
}

}  // namespace

bool qsa_top_k_cluster_available() {
  return cluster_top_k_usable();
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
  const bool filter_fits = args.max_groups <= kQsaTopKFilteredMaxGroups;
  if (method == QsaTopKMethod::kAuto) {
    method = choose_qsa_top_k_method(args.rows.n_rows, args.max_groups, cluster_top_k_usable(),
                                     args.workspace != nullptr);
  }
  if (method == QsaTopKMethod::kFiltered || method == QsaTopKMethod::kCluster) {
    if (!filter_fits) {
      return Status::error(cat("qsa_top_k_select: max_groups ", args.max_groups,
                               " exceeds the filtered and cluster methods' limit of ",
                               kQsaTopKFilteredMaxGroups, " groups; use QsaTopKMethod::kAuto"));
    }
    if (method == QsaTopKMethod::kCluster && args.rows.n_rows >= kQsaTopKClusterMaxRows) {
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
      using Short = ClusterShape<kClusterThreads, kClusterShortSlots>;
      using Long = ClusterShape<kClusterThreads, kClusterLongSlots>;
      const bool short_rows = args.max_groups <= Short::kMaxGroups;
      launch_kernel(
          short_rows ? qsa_top_k_cluster_kernel<kClusterShortSlots>
                     : qsa_top_k_cluster_kernel<kClusterLongSlots>,
          LaunchDims{dim3(unsigned(args.rows.n_rows * kClusterCtas)), dim3(kClusterThreads),
                     short_rows ? Short::kSmemBytes : Long::kSmemBytes, unsigned(kClusterCtas)},
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
