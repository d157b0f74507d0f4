// QSA indexer cache update: for every group of `ratio` positions completed by a batch, pool the raw
// FP16 index keys in fp32, round to FP16, RMSNorm with (1 + w) in fp32, round, partial NeoX RoPE at
// the group's first position with the host's fp32 cos/sin table, round, and write the compressed
// row through the block table; then refresh the raw rings (clear at position 0, keep the last cap
// positions).
//
// Bit-identical to the CPU reference (qsa/indexer_cache.h): every fp32 operation is the reference's
// own, in its order, with __fadd_rn / __fmul_rn / __fdiv_rn / __fsqrt_rn (no FMA contraction). The
// sum of squares of the norm is the reference's sequential chain over the dims: every thread runs
// it over the pooled row in shared memory (broadcast reads) instead of a tree reduction, which
// would differ in the last fp32 bit. That chain (index_dim dependent adds) is the kernel's latency;
// the kernel is tiny next to attention, and the rows it writes are exact.
//
// Work: one CTA of 128 threads per (sequence, completed group); a second kernel, one CTA per
// sequence, updates the rings after every group has read them (stream order).
// Limits: index_dim even and <= 512, rotary_dim even and <= index_dim, ring cap >= ratio. Static
// shared memory 2 KB. Instructions: sm_70+.
#include "backend/cuda/qsa_indexer_write.cuh"

#include <cuda_fp16.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"

namespace e4kv::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxDim = 512;

struct IndexerWriteKernelParams {
  uint16_t* compressed;  // [n_blocks, rows_per_block, index_dim] FP16
  int32_t block_size;
  int32_t rows_per_block;
  int32_t ratio;
  int32_t index_dim;
  uint16_t* rings;  // [n_rings, cap, index_dim] FP16
  int32_t cap;
  const uint16_t* index_k;       // [n_tokens, index_dim] FP16
  const int32_t* token_offsets;  // [n_seqs + 1]
  const int64_t* start_pos;      // [n_seqs]
  const int32_t* ring_index;     // [n_seqs]
  const int32_t* block_table;    // [n_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const uint16_t* norm_weight;  // [index_dim] FP16
  float eps;
  int32_t rotary_dim;
  const float* rope_table;  // [n_rope_positions, rotary_dim]: cos then sin
};

__device__ __forceinline__ float f16_bits_to_float(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ uint16_t float_to_f16_bits(float value) {
  return __half_as_ushort(__float2half_rn(value));
}

__global__ void __launch_bounds__(kThreads)
    qsa_indexer_groups_kernel(const __grid_constant__ IndexerWriteKernelParams p) {
  enter_dependent_grid();
  __shared__ uint16_t pooled[kMaxDim];  // FP16 bits
  __shared__ uint16_t normed[kMaxDim];  // FP16 bits

  const int s = blockIdx.y;
  const int64_t first_row = p.token_offsets[s];
  const int64_t n = p.token_offsets[s + 1] - first_row;
  const int64_t start = p.start_pos[s];
  const int64_t c = start / p.ratio + blockIdx.x;
  if (n <= 0 || c >= (start + n) / p.ratio) return;  // uniform: not completed in this batch
  const int dim = p.index_dim;
  const int64_t group_start = c * p.ratio;
  const uint16_t* ring = p.rings + int64_t(p.ring_index[s]) * p.cap * dim;

  // 1. pool: positions in increasing order, from this batch or (earlier ones) from the ring.
  for (int j = threadIdx.x; j < dim; j += kThreads) {
    float sum = 0.0f;
    for (int64_t pos = group_start; pos < group_start + p.ratio; ++pos) {
      const uint16_t* key =
          pos >= start ? p.index_k + (first_row + pos - start) * dim : ring + (pos % p.cap) * dim;
      sum = __fadd_rn(sum, f16_bits_to_float(key[j]));
    }
    pooled[j] = float_to_f16_bits(__fdiv_rn(sum, float(p.ratio)));
  }
  __syncthreads();

  // 2. norm: the reference's sequential sum of squares, run by every thread (broadcast reads).
  float sum_squares = 0.0f;
  for (int j = 0; j < dim; ++j) {
    const float value = f16_bits_to_float(pooled[j]);
    sum_squares = __fadd_rn(sum_squares, __fmul_rn(value, value));
  }
  const float mean_square = __fdiv_rn(sum_squares, float(dim));
  const float inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, p.eps)));
  for (int j = threadIdx.x; j < dim; j += kThreads) {
    const float gain = __fadd_rn(1.0f, f16_bits_to_float(p.norm_weight[j]));
    normed[j] =
        float_to_f16_bits(__fmul_rn(__fmul_rn(f16_bits_to_float(pooled[j]), inv_rms), gain));
  }
  __syncthreads();

  // 3. rope at group_start, written to the compressed row.
  const int32_t block =
      p.block_table[int64_t(s) * p.max_blocks_per_seq + c * p.ratio / p.block_size];
  uint16_t* out = p.compressed + (int64_t(block) * p.rows_per_block + c % p.rows_per_block) * dim;
  const int half = p.rotary_dim / 2;
  const float* cos = p.rope_table + group_start * p.rotary_dim;
  const float* sin = cos + half;
  for (int i = threadIdx.x; i < half; i += kThreads) {
    const float a = f16_bits_to_float(normed[i]);
    const float b = f16_bits_to_float(normed[i + half]);
    out[i] = float_to_f16_bits(__fsub_rn(__fmul_rn(a, cos[i]), __fmul_rn(b, sin[i])));
    out[i + half] = float_to_f16_bits(__fadd_rn(__fmul_rn(b, cos[i]), __fmul_rn(a, sin[i])));
  }
  for (int j = p.rotary_dim + threadIdx.x; j < dim; j += kThreads) out[j] = normed[j];
}

// Slot j of the ring ends holding the latest batch position p with p % cap == j, or zeros when the
// sequence starts at 0 and has none, or what it held.
__global__ void __launch_bounds__(kThreads)
    qsa_indexer_rings_kernel(const __grid_constant__ IndexerWriteKernelParams p) {
  enter_dependent_grid();
  const int s = blockIdx.x;
  const int64_t first_row = p.token_offsets[s];
  const int64_t n = p.token_offsets[s + 1] - first_row;
  const int64_t start = p.start_pos[s];
  if (n <= 0) return;
  const int dim = p.index_dim;
  uint16_t* ring = p.rings + int64_t(p.ring_index[s]) * p.cap * dim;
  const int64_t last = start + n - 1;
  for (int e = threadIdx.x; e < p.cap * dim; e += kThreads) {
    const int slot = e / dim;
    const int j = e % dim;
    const int64_t pos = last - ((last % p.cap) - slot + p.cap) % p.cap;
    if (pos >= start) {
      ring[e] = p.index_k[(first_row + pos - start) * dim + j];
    } else if (start == 0) {
      ring[e] = 0;
    }
  }
}

}  // namespace

Status qsa_indexer_write(const QsaIndexerWriteArgs& args, cudaStream_t stream) {
  const IndexerCompressedView& cv = args.compressed;
  if (cv.ratio < 1 || cv.block_size < 1 || cv.block_size % cv.ratio != 0) {
    return Status::error(cat("qsa_indexer_write: block_size ", cv.block_size,
                             " is not a positive multiple of ratio ", cv.ratio));
  }
  if (cv.index_dim < 2 || cv.index_dim > kMaxDim || cv.index_dim % 2 != 0 ||
      args.rings.index_dim != cv.index_dim) {
    return Status::error(cat("qsa_indexer_write: index_dim ", cv.index_dim,
                             " is not supported (even, at most ", kMaxDim,
                             ", the same for rings and compressed rows)"));
  }
  if (args.rings.cap < cv.ratio) {
    return Status::error(
        cat("qsa_indexer_write: ring capacity ", args.rings.cap, " is below ratio ", cv.ratio));
  }
  if (args.rotary_dim <= 0 || args.rotary_dim % 2 != 0 || args.rotary_dim > cv.index_dim) {
    return Status::error(cat("qsa_indexer_write: rotary_dim ", args.rotary_dim,
                             " must be even and in (0, ", cv.index_dim, "]"));
  }
  if (args.batch.n_seqs < 0 || args.batch.n_seqs > 65535 || args.max_tokens_per_seq < 0) {
    return Status::error(cat("qsa_indexer_write: n_seqs ", args.batch.n_seqs,
                             " outside [0, 65535] or negative max_tokens_per_seq"));
  }
  if (args.batch.n_seqs == 0 || args.max_tokens_per_seq == 0) return ok_status();
  if (cv.data == nullptr || args.rings.data == nullptr || args.batch.index_k == nullptr ||
      args.batch.token_offsets == nullptr || args.batch.start_pos == nullptr ||
      args.batch.ring_index == nullptr || args.batch.block_tables.blocks == nullptr ||
      args.norm_weight == nullptr || args.rope_table == nullptr) {
    return Status::error("qsa_indexer_write: a required device pointer is null");
  }
  IndexerWriteKernelParams kp{};
  kp.compressed = cv.data;
  kp.block_size = int32_t(cv.block_size);
  kp.rows_per_block = int32_t(cv.rows_per_block());
  kp.ratio = int32_t(cv.ratio);
  kp.index_dim = int32_t(cv.index_dim);
  kp.rings = args.rings.data;
  kp.cap = int32_t(args.rings.cap);
  kp.index_k = args.batch.index_k;
  kp.token_offsets = args.batch.token_offsets;
  kp.start_pos = args.batch.start_pos;
  kp.ring_index = args.batch.ring_index;
  kp.block_table = args.batch.block_tables.blocks;
  kp.max_blocks_per_seq = args.batch.block_tables.max_blocks_per_seq;
  kp.norm_weight = args.norm_weight;
  kp.eps = args.eps;
  kp.rotary_dim = int32_t(args.rotary_dim);
  kp.rope_table = args.rope_table;
  // n tokens complete at most ceil(n / ratio) groups (multiples of ratio in (start, start + n]).
  const int64_t max_groups = (args.max_tokens_per_seq + cv.ratio - 1) / cv.ratio;
  // The rings kernel overwrites ring slots the groups kernel reads: it waits for it at entry.
  launch_kernel(qsa_indexer_groups_kernel,
                LaunchDims{dim3(unsigned(max_groups), unsigned(args.batch.n_seqs)), dim3(kThreads)},
                stream, kp);
  launch_kernel(qsa_indexer_rings_kernel,
                LaunchDims{dim3(unsigned(args.batch.n_seqs)), dim3(kThreads)}, stream, kp);
  return ok_status();
}

}  // namespace e4kv::cuda
