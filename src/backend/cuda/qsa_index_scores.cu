// QSA index scores: s[c] = sum_h max(index_q_h . khat_c, 0) / sqrt(index_dim) for every visible
// complete group c of every query row, read through the block table from the paged compressed
// indexer cache (DESIGN.md section 4, step 5).
//
// Bit-identical to the CPU reference (qsa/selection.h): one thread owns one (row, group) and runs
// the reference's loops in the reference's order with __fmul_rn / __fadd_rn (no FMA contraction):
// each head's dot product is a chain over d = 0..index_dim-1, the heads are summed in order, then
// one IEEE division by the host's sqrtf(index_dim). The top-k that follows can therefore be
// compared exactly with the CPU selection.
//
// Work: a CTA of 128 threads scores 128 consecutive groups of one row. The index query of the row
// is widened to fp32 once per CTA into shared memory (read as warp-wide broadcasts); the 128
// compressed rows are staged 64 dims at a time into shared memory with coalesced 16-byte loads
// (8 threads per 128-byte row segment), padded by 16 bytes per row so that each thread's 16-byte
// reads of its own row are conflict-free. The heads' chains are independent, so each thread keeps
// up to 8 FADD chains in flight and the SM hides their latency with other warps. The cost is
// n_heads * index_dim FMUL+FADD per group, about the same time as reading the 256-byte row at
// HBM bandwidth on an H200; tensor cores would be faster but not bit-exact.
//
// Limits: n_index_heads 1..8, index_dim a multiple of 8 and <= 256, any block_size that is a
// multiple of ratio. Shared memory: 8 KB (q) + 18 KB (tile) + 1 KB (row pointers), static.
// Instructions: sm_70+ (nothing architecture-specific).
#include "backend/cuda/qsa_index_scores.cuh"

#include <cuda_fp16.h>

#include <cmath>

#include "backend/cuda/cuda_check.h"

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 128;  // one group per thread
constexpr int kChunkDims = 64;
constexpr int kChunkVecs = kChunkDims / 8;  // 16-byte vectors per row per chunk
constexpr int kMaxHeads = 8;
constexpr int kMaxDim = 256;

struct ScoresKernelParams {
  const uint16_t* compressed;  // [n_blocks, rows_per_block, index_dim] FP16
  int64_t n_blocks;
  int32_t block_size;
  int32_t rows_per_block;
  int32_t ratio;
  int32_t index_dim;
  const int32_t* block_table;  // [n_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const int32_t* row_seq;   // [n_rows]
  const int32_t* row_pos;   // [n_rows]
  const int32_t* seq_lens;  // [n_seqs]
  const uint16_t* index_q;  // [n_rows, n_heads, index_dim] FP16
  int32_t n_heads;
  int64_t max_groups;
  int64_t skip_visible_at_most;
  float sqrt_index_dim;  // sqrtf(float(index_dim)), as the CPU computes it
  float* scores;         // [n_rows, max_groups]
};

__device__ __forceinline__ float half_bits_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

__global__ void __launch_bounds__(kThreads)
    qsa_index_scores_kernel(const __grid_constant__ ScoresKernelParams p) {
  __shared__ __align__(16) float q_s[kMaxHeads * kMaxDim];  // [n_heads, index_dim] fp32
  __shared__ uint4 tile[kThreads][kChunkVecs + 1];          // +1: conflict-free row reads
  __shared__ const uint4* row_ptr[kThreads];                // nullptr: group not readable

  const int tid = threadIdx.x;
  const int64_t row = blockIdx.y;
  const int32_t seq = p.row_seq[row];
  const int64_t pos = p.row_pos[row];
  const int64_t seq_len = p.seq_lens[seq];
  const int64_t causal = (pos + 1) / p.ratio;
  const int64_t written = seq_len / p.ratio;
  int64_t visible = causal < written ? causal : written;
  if (visible > p.max_groups) visible = p.max_groups;
  if (visible <= p.skip_visible_at_most) return;
  const int64_t group_base = int64_t(blockIdx.x) * kThreads;
  if (group_base >= visible) return;  // uniform over the CTA

  const int dim = p.index_dim;
  const int q_elems = p.n_heads * dim;
  const uint16_t* q_row = p.index_q + row * q_elems;
  for (int i = tid; i < q_elems; i += kThreads) q_s[i] = half_bits_to_float(q_row[i]);

  const int64_t c = group_base + tid;
  const uint4* src = nullptr;
  if (c < visible) {
    const int64_t logical = c * p.ratio / p.block_size;
    if (logical < p.max_blocks_per_seq) {
      const int64_t block = p.block_table[int64_t(seq) * p.max_blocks_per_seq + logical];
      if (block >= 0 && block < p.n_blocks) {
        src = reinterpret_cast<const uint4*>(
            p.compressed + (block * p.rows_per_block + c % p.rows_per_block) * dim);
      }
    }
  }
  row_ptr[tid] = src;
  __syncthreads();

  float dot[kMaxHeads];
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) dot[h] = 0.0f;

  for (int d0 = 0; d0 < dim; d0 += kChunkDims) {
    const int vecs = (dim - d0) / 8 < kChunkVecs ? (dim - d0) / 8 : kChunkVecs;
    // Coalesced staging: 8 consecutive threads read one row's 128-byte segment.
#pragma unroll
    for (int it = 0; it < kChunkVecs; ++it) {
      const int j = it * kThreads + tid;
      const int g = j / kChunkVecs;
      const int v = j % kChunkVecs;
      const uint4* from = row_ptr[g];
      uint4 value = make_uint4(0u, 0u, 0u, 0u);
      if (from != nullptr && v < vecs) value = __ldg(from + d0 / 8 + v);
      tile[g][v] = value;
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < kChunkVecs; ++v) {
      if (v < vecs) {
        const uint4 raw = tile[tid][v];
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        float k[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          k[2 * w] = half_bits_to_float(words[w] & 0xFFFFu);
          k[2 * w + 1] = half_bits_to_float(words[w] >> 16);
        }
        const int d = d0 + 8 * v;
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h) {
          if (h < p.n_heads) {  // uniform branch
            const float4* qh = reinterpret_cast<const float4*>(q_s + h * dim + d);
            const float4 qa = qh[0];
            const float4 qb = qh[1];
            const float q8[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
            float acc = dot[h];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = __fadd_rn(acc, __fmul_rn(q8[e], k[e]));
            dot[h] = acc;
          }
        }
      }
    }
    __syncthreads();  // the tile is overwritten by the next chunk
  }

  if (c < visible) {
    float sum = 0.0f;
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      if (h < p.n_heads) sum = __fadd_rn(sum, fmaxf(dot[h], 0.0f));
    }
    p.scores[row * p.max_groups + c] = src != nullptr ? __fdiv_rn(sum, p.sqrt_index_dim) : 0.0f;
  }
}

}  // namespace

Status qsa_index_scores(const QsaIndexScoresArgs& args, cudaStream_t stream) {
  const IndexerCompressedView& cv = args.compressed;
  if (cv.ratio < 1 || cv.block_size < 1 || cv.block_size % cv.ratio != 0 || cv.n_blocks < 1) {
    return Status::error(cat("qsa_index_scores: bad indexer geometry (n_blocks ", cv.n_blocks,
                             ", block_size ", cv.block_size, ", ratio ", cv.ratio,
                             "): block_size must be a positive multiple of ratio"));
  }
  if (cv.index_dim < 8 || cv.index_dim > kMaxDim || cv.index_dim % 8 != 0) {
    return Status::error(cat("qsa_index_scores: index_dim ", cv.index_dim,
                             " is not supported (a multiple of 8, at most ", kMaxDim, ")"));
  }
  if (args.n_index_heads < 1 || args.n_index_heads > kMaxHeads) {
    return Status::error(cat("qsa_index_scores: n_index_heads ", args.n_index_heads,
                             " is not supported (1..", kMaxHeads, ")"));
  }
  if (args.rows.n_rows < 0 || args.rows.n_rows > 65535) {
    return Status::error(cat("qsa_index_scores: n_rows ", args.rows.n_rows, " outside [0, 65535]"));
  }
  if (args.max_groups < 0 || args.max_groups > (int64_t(1) << 31) - kThreads) {
    return Status::error(cat("qsa_index_scores: max_groups ", args.max_groups, " out of range"));
  }
  if (args.rows.n_rows == 0 || args.max_groups == 0) return ok_status();
  if (cv.data == nullptr || args.block_table.blocks == nullptr || args.rows.row_seq == nullptr ||
      args.rows.row_pos == nullptr || args.rows.seq_lens == nullptr || args.index_q == nullptr ||
      args.scores == nullptr) {
    return Status::error("qsa_index_scores: a required device pointer is null");
  }
  ScoresKernelParams kp{};
  kp.compressed = cv.data;
  kp.n_blocks = cv.n_blocks;
  kp.block_size = int32_t(cv.block_size);
  kp.rows_per_block = int32_t(cv.rows_per_block());
  kp.ratio = int32_t(cv.ratio);
  kp.index_dim = int32_t(cv.index_dim);
  kp.block_table = args.block_table.blocks;
  kp.max_blocks_per_seq = args.block_table.max_blocks_per_seq;
  kp.row_seq = args.rows.row_seq;
  kp.row_pos = args.rows.row_pos;
  kp.seq_lens = args.rows.seq_lens;
  kp.index_q = args.index_q;
  kp.n_heads = int32_t(args.n_index_heads);
  kp.max_groups = args.max_groups;
  kp.skip_visible_at_most = args.skip_visible_at_most;
  kp.sqrt_index_dim = std::sqrt(float(cv.index_dim));
  kp.scores = args.scores;
  const dim3 grid(unsigned((args.max_groups + kThreads - 1) / kThreads),
                  unsigned(args.rows.n_rows));
  qsa_index_scores_kernel<<<grid, kThreads, 0, stream>>>(kp);
  E4KV_CUDA_CHECK_LAUNCH();
  return ok_status();
}

}  // namespace e4kv::cuda
