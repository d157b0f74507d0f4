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
// Limits: visible groups and selection width < 2^31. Static shared memory: about 1.2 KB.
// Instructions: __match_any_sync (sm_70+).
#include "backend/cuda/qsa_topk.cuh"

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.h"

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

constexpr int kChunk = 4096;        // groups per CTA in the chunk phase
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
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t warp_totals[kWarps];
  __shared__ uint32_t chunk_total;
  __shared__ uint32_t found_prefix;
  __shared__ uint32_t found_rank;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const int32_t seq = p.row_seq[row];
  const int32_t pos = p.row_pos[row];
  const int32_t seq_len = p.seq_lens[seq];
  const int32_t ratio = p.ratio;
  const int32_t causal = (pos + 1) / ratio;
  const int32_t written = seq_len / ratio;
  int32_t visible = causal < written ? causal : written;
  if (visible > p.max_groups) visible = int32_t(p.max_groups);
  if (visible < 0) visible = 0;
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

  // Causal tail, then -1 padding.
  const int32_t tail_begin = ratio * causal;
  const int32_t group_tokens = n_groups * ratio;
  const int32_t count = group_tokens + (pos + 1 - tail_begin);
  for (int32_t j = group_tokens + tid; j < p.width; j += kThreads) {
    out[j] = j < count ? tail_begin + (j - group_tokens) : -1;
  }
  if (tid == 0) p.sel_counts[row] = count;
}

// Chunk phase: the exact top-k of one chunk of kChunk groups (ties to the lowest index) as
// candidates in group order, padded with key 0 to k entries. Rows with visible <= k write nothing
// (the row kernel takes every group without candidates).
__global__ void __launch_bounds__(kChunkThreads)
    qsa_top_k_chunk_kernel(const __grid_constant__ ChunkKernelParams p) {
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
  const int32_t seq = p.row_seq[row];
  const int32_t pos = p.row_pos[row];
  const int32_t causal = (pos + 1) / p.ratio;
  const int32_t written = p.seq_lens[seq] / p.ratio;
  int32_t visible = causal < written ? causal : written;
  if (visible > p.max_groups) visible = int32_t(p.max_groups);
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

}  // namespace

size_t qsa_top_k_workspace_bytes(int64_t n_rows, int64_t max_groups, int64_t budget,
                                 int64_t ratio) {
  if (ratio < 1 || budget < ratio || max_groups <= 0 || n_rows <= 0) return 0;
  const int64_t k = budget / ratio;
  const int64_t n_chunks = (max_groups + kChunk - 1) / kChunk;
  if (n_chunks * k >= max_groups || n_chunks > 65535) return 0;  // no shrink, or too many chunks
  return size_t(n_rows * n_chunks * k) * (sizeof(uint32_t) + sizeof(int32_t));
}

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
  TopKKernelParams kp{};
  kp.row_seq = args.rows.row_seq;
  kp.row_pos = args.rows.row_pos;
  kp.seq_lens = args.rows.seq_lens;
  kp.ratio = int32_t(args.ratio);
  kp.k = int32_t(args.budget / args.ratio);
  kp.width = int32_t(width);
  kp.scores = args.scores;
  kp.max_groups = args.max_groups;
  kp.sel_tokens = args.sel_tokens;
  kp.sel_counts = args.sel_counts;
  const size_t ws_bytes =
      qsa_top_k_workspace_bytes(args.rows.n_rows, args.max_groups, args.budget, args.ratio);
  if (args.workspace != nullptr && ws_bytes > 0) {
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
    qsa_top_k_chunk_kernel<<<dim3(unsigned(args.rows.n_rows), unsigned(cp.n_chunks)),
                             kChunkThreads, 0, stream>>>(cp);
    E4KV_CUDA_CHECK_LAUNCH();
    kp.cand_keys = cp.cand_keys;
    kp.cand_groups = cp.cand_groups;
    kp.n_cand = int32_t(n_cand);
  }
  qsa_top_k_select_kernel<<<unsigned(args.rows.n_rows), kThreads, 0, stream>>>(kp);
  E4KV_CUDA_CHECK_LAUNCH();
  return ok_status();
}

}  // namespace e4kv::cuda
