// QSA index scores: s[c] = sum_h max(index_q_h . khat_c, 0) / sqrt(index_dim) for every visible
// complete group c of every query row, read through the block table from the paged compressed
// indexer cache (DESIGN.md section 4, step 5).
//
// Two kernels. The default computes the head dot products on tensor cores (described before it,
// at the end of this file's kernels): FP16 products are exact, the fp32 sums follow the tensor
// core's order. QsaIndexScoresArgs::exact selects the FFMA kernel described here, for comparisons
// with the CPU bit for bit.
//
// Exact kernel: bit-identical to the CPU reference (qsa/selection.h): each (row, group) is scored
// by one lane running the reference's loops in the reference's order: each head's dot product is a
// chain over d = 0..index_dim-1 starting from 0.0f, the heads are summed in order, then one IEEE
// division by the host's sqrtf(index_dim). The top-k that follows can therefore be compared exactly
// with the CPU selection. The reference rounds each product, then each sum; here one FFMA does
// both, and the results are the same bits: both factors are FP16 values widened to fp32 (11
// significant bits each), so the product has at most 22 significant bits and lies in [2^-48, 2^32]
// or is 0: fp32 holds it exactly, so round(a * b) = a * b and fma(a, b, c) = round(a * b + c) = the
// reference's round(round(a * b) + c). The partial sums are multiples of 2^-48, so never fp32
// subnormals either (no flush-to-zero difference). Half the FP32 instructions of a multiply and an
// add (the kernel issued 61-66% of its cycles with the pair). Tensor cores would be faster still
// but not bit-exact (their accumulation order and rounding differ).
//
// Work: persistent warps. A warp tile is 64 consecutive groups of one row, two per lane (groups
// lane and lane + 32), so each broadcast read of the query from shared memory serves two groups.
// The virtual tiles (n_rows x ceil(max_groups / 64)) are split into equal contiguous ranges, one
// per warp, with no more warps than fit on the device at once (occupancy queried once per device
// and shape): no partial wave, and a warp keeps its row's query and row metadata across the tiles
// of a row. Tiles past a row's visible groups, and rows with visible <= skip_visible_at_most, are
// skipped a row at a time.
//   Pipeline: each warp owns a ring of kStages shared-memory stages; a stage holds 32 dims of the
// tile's 64 compressed rows (4 KB). The warp issues stage u + kStages - 1 with cp.async (16-byte,
// .cg, sm_80+) before computing stage u, across tile boundaries, so the HBM reads of later stages
// are in flight during the math and no block barrier couples the warps (__syncwarp orders the
// ring). Four lanes copy one row's 64-byte segment (two full sectors); 16-byte vectors are
// XOR-swizzled within a row so that the copies and the per-lane row reads are conflict-free.
// Below sm_80 the same ring is filled with plain loads.
//   Math: the row's query is widened to fp32 once per warp per row, in shared memory laid out
// [index_dim / 8][n_heads][8] so a lane reads the 8 dims of every head at fixed offsets; the head
// count is a template parameter, so the 2 * n_heads FADD chains of a lane have no predicates.
// Per lane and 8 dims: 16 * n_heads FFMA (the floor), 16 FP16 -> fp32 widenings, 2 * n_heads
// broadcast 16-byte query reads and 2 row reads.
//   Groups whose block is unreadable, and groups past the row's visible count, are zero-filled
// by the copy itself (cp.async with source size 0, so the copy loop has no branch); the latter
// are never written. For an unreadable group every product is then +-0 or NaN, so the chain stays
// +0 or becomes NaN, fmaxf makes it +0 and the score is exactly +0.0f, as the contract says.
//   note: where every warp gets one tile (the QSA step's 4 x 32K groups), the start of a warp
// (row metadata -> block table -> first stage, dependent loads) is exposed once, and the static
// assignment leaves a ragged tail. Cold, the kernel waits on its stages; from L2 it is issue-bound.
// Its register allocation is fragile (unused code moved it and cost 0.5 us): compare any change
// against the unmodified build in the same call.
//
// Limits: n_index_heads 1..8, index_dim a multiple of 8 and <= 256, any block_size that is a
// multiple of ratio, fewer than 2^31 compressed rows. Shared memory per warp: kStages x 4 KB + the
// fp32 query (n_heads * index_dim * 4 bytes); up to 4 warps per CTA. Instructions: sm_75+ (cp.async
// on sm_80+ only).
// Experiments: bench/notes/qsa_index_scores.md (the profiles, the rings, register rows, L2 hints
// and tensor-core variants tried, with their figures).
#include "backend/cuda/qsa_index_scores.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "backend/cuda/arch.cuh"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/paged_rows_device.cuh"
#include "backend/cuda/qsa_topk.cuh"
#include "backend/cuda/timeline.cuh"

E4KV_TIMELINE_UNIT(scores)

namespace e4kv::cuda {
namespace {

constexpr int kTileGroups = 64;                 // groups per warp tile, two per lane
constexpr int kRunGroups = int(kQsaRunGroups);  // groups per run maximum
static_assert(kTileGroups % kRunGroups == 0 && kRunGroups <= 32);
constexpr int kChunkVecs = 4;               // 16-byte vectors (8 dims) per row
constexpr int kChunkDims = 8 * kChunkVecs;  // dims per stage
// Ring depth 2 (one stage in flight while one is computed): a smaller first burst of copies, and
// deeper rings lower the occupancy (108 registers and 4 warps per CTA already hold it to 16 warps
// per SM). 2 / 3 / 4 stages: 15.3 / 16.3 / 16.4 us cold at 4 x 32K groups (see notes).
constexpr int kStages = 2;
constexpr int kStageVecs = kTileGroups * kChunkVecs;        // 256 x 16 bytes
constexpr int kStageBytes = kStageVecs * 16;                // 4 KB
constexpr int kCopyRounds = kTileGroups * kChunkVecs / 32;  // copies per lane per stage: 8
constexpr int kMaxHeads = 8;
constexpr int kMaxDim = 256;
constexpr int kMaxWarpsPerCta = 4;
constexpr int64_t kMaxGroupsLimit = (int64_t(1) << 31) - 128;

struct ScoresKernelParams {
  const uint16_t* compressed;  // [n_blocks, rows_per_block, index_dim] FP16
  int64_t n_blocks;
  int32_t rows_per_block;
  int32_t rows_per_block_shift;  // log2(rows_per_block) when a power of two, else -1
  int32_t ratio;
  int32_t index_dim;
  PagedRowsDevice rows;     // the selection fields unused
  const int32_t* seq_lens;  // [n_seqs]
  const uint16_t* index_q;  // [n_rows, n_heads, index_dim] FP16
  int32_t n_heads;
  int64_t max_groups;
  int64_t skip_visible_at_most;
  float sqrt_index_dim;  // sqrtf(float(index_dim)), as the CPU computes it
  float* scores;         // [n_rows, max_groups]
  float* run_maxima;     // [n_rows, run_stride] or nullptr
  int64_t run_stride;
  int64_t tiles_per_row;   // ceil(max_groups / kTileGroups)
  int64_t n_tiles;         // n_rows * tiles_per_row (virtual: most rows see fewer groups)
  int64_t tiles_per_warp;  // warp w owns virtual tiles [w * tiles_per_warp, ... + tiles_per_warp)
  int64_t n_warps;         // warps with a non-empty range
};

__device__ __forceinline__ float half_bits_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

__device__ __forceinline__ void widen8(const uint4 raw, float (&out)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    out[2 * w] = half_bits_to_float(words[w] & 0xFFFFu);
    out[2 * w + 1] = half_bits_to_float(words[w] >> 16);
  }
}

// 16-byte global -> shared copy that reads `src_bytes` (16 or 0) bytes and zero-fills the rest:
// cp.async.cg on sm_80+ (no branch for rows that are not read), plain load and store below.
__device__ __forceinline__ void copy_16_or_zero(uint4* smem, const uint16_t* gmem,
                                                uint32_t src_bytes) {
#if E4KV_DEVICE_ARCH >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes)
               : "memory");
#else
  *smem = src_bytes != 0 ? __ldg(reinterpret_cast<const uint4*>(gmem)) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

// Tiles started by the producer side of a warp and not yet started by its consumer side. The
// producer runs kStages - 1 stages ahead, so at most kStages - 1 tiles wait here (one stage per
// tile when index_dim <= 32; see the main loop).
struct TileQueue {
  static constexpr int kCapacity = kStages - 1 > 0 ? kStages - 1 : 1;
  int32_t row[kCapacity];
  uint32_t tile[kCapacity];  // tile index within the row
  int32_t valid[kCapacity];  // groups of the tile below the row's visible count (1..64)
  int size = 0;

  __device__ __forceinline__ void push(int32_t r, uint32_t t, int32_t v) {
#pragma unroll
    for (int i = 0; i < kCapacity; ++i) {
      if (i == size) row[i] = r, tile[i] = t, valid[i] = v;
    }
    ++size;
  }
  __device__ __forceinline__ void pop(int32_t& r, uint32_t& t, int32_t& v) {
    r = row[0], t = tile[0], v = valid[0];
#pragma unroll
    for (int i = 0; i + 1 < kCapacity; ++i) {
      row[i] = row[i + 1], tile[i] = tile[i + 1], valid[i] = valid[i + 1];
    }
    --size;
  }
};

// The copying side of a warp: walks the warp's range of virtual tiles, skips what is not visible,
// and fills ring stages. Lane l copies vector (l % 4) of rows l / 4 + 8 i, i = 0..7.
struct Producer {
  int64_t tile;      // next candidate virtual tile
  int64_t tile_end;  // end of the warp's range
  int32_t row;       // row of `tile`
  uint32_t tile_in_row;
  int32_t meta_row = -1;  // row whose metadata is cached below
  int32_t seq = 0;
  int32_t visible = 0;  // 0 when the row is skipped
  int chunk = 0;        // next stage of the current tile
  bool active = false;  // a tile is being copied
  // Compressed row of each copied group (row 0 for groups that are not read) and a bit per group
  // that is read: unreadable blocks and groups past visible are zero-filled instead.
  uint32_t src_row[kCopyRounds];
  uint32_t read_mask = 0;

  // Finds the next visible tile at or after `tile`; computes its source rows and queues it. On a
  // new row the block-table entries are loaded beside the sequence length (both need only the
  // row's sequence), so a warp's first tile waits for three dependent loads, not four.
  __device__ __forceinline__ bool start_tile(const ScoresKernelParams& p, int lane,
                                             TileQueue& queue) {
    const uint32_t rpb = uint32_t(p.rows_per_block);
    while (tile < tile_end) {
      const bool fresh = row != meta_row;
      int64_t pos = 0;
      if (fresh) {
        seq = __ldg(p.rows.row_seq + row);
        pos = __ldg(p.rows.row_pos + row);
      }
      // Logical block and slot of each copied group, stepping 8 groups at a time (one division
      // per tile).
      const int32_t base = int32_t(tile_in_row) * kTileGroups;
      const uint32_t c = uint32_t(base) + uint32_t(lane >> 2);
      uint32_t logical[kCopyRounds];
      uint32_t slot[kCopyRounds];
      if (p.rows_per_block_shift >= 0) {
#pragma unroll
        for (int i = 0; i < kCopyRounds; ++i) {
          logical[i] = (c + 8 * i) >> p.rows_per_block_shift;
          slot[i] = (c + 8 * i) & (rpb - 1);
        }
      } else {
        logical[0] = c / rpb;
        slot[0] = c - logical[0] * rpb;
#pragma unroll
        for (int i = 1; i < kCopyRounds; ++i) {
          logical[i] = logical[i - 1];
          slot[i] = slot[i - 1] + 8;
          while (slot[i] >= rpb) slot[i] -= rpb, ++logical[i];
        }
      }
      const int32_t* table_row = p.rows.block_table + int64_t(seq) * p.rows.max_blocks_per_seq;
      int32_t block[kCopyRounds];
#pragma unroll
      for (int i = 0; i < kCopyRounds; ++i) {
        block[i] =
            int64_t(logical[i]) < p.rows.max_blocks_per_seq ? __ldg(table_row + logical[i]) : -1;
      }
      if (fresh) {
        meta_row = row;
        const int64_t seq_len = __ldg(p.seq_lens + seq);
        const int64_t causal = (pos + 1) / p.ratio;
        const int64_t written = seq_len / p.ratio;
        int64_t vis = causal < written ? causal : written;
        if (vis > p.max_groups) vis = p.max_groups;
        visible = vis > p.skip_visible_at_most ? int32_t(vis) : 0;
      }
      if (base < visible) {
        queue.push(row, tile_in_row, min(kTileGroups, visible - base));
        read_mask = 0;
#pragma unroll
        for (int i = 0; i < kCopyRounds; ++i) {
          const bool read =
              int32_t(c) + 8 * i < visible && block[i] >= 0 && int64_t(block[i]) < p.n_blocks;
          src_row[i] = read ? uint32_t(block[i]) * rpb + slot[i] : 0u;
          read_mask |= read ? 1u << i : 0u;
        }
        chunk = 0;
        // The cursor moves past this tile.
        ++tile;
        if (int64_t(++tile_in_row) == p.tiles_per_row) tile_in_row = 0, ++row;
        return true;
      }
      // The rest of this row is not visible (or the row is skipped): on to the next row.
      tile += p.tiles_per_row - int64_t(tile_in_row);
      ++row;
      tile_in_row = 0;
    }
    return false;
  }

  // Issues the copies of the next stage of the current tile (starting a tile when needed) into
  // `stage`, then commits one cp.async group (empty when the warp's range is exhausted).
  __device__ __forceinline__ void produce(const ScoresKernelParams& p, int lane, int n_vecs,
                                          uint4* stage, TileQueue& queue) {
    if (!active) active = start_tile(p, lane, queue);
    if (active) {
      const int v = lane & (kChunkVecs - 1);
      const int chunk_vecs = min(kChunkVecs, n_vecs - chunk * kChunkVecs);
      if (v < chunk_vecs) {
        // Row lane / 4 + 8 i, vector v, swizzled by (row / 2) % 4 = (lane / 8) % 4.
        uint4* dst = stage + (lane >> 2) * kChunkVecs + (v ^ ((lane >> 3) & 3));
        const uint16_t* col = p.compressed + chunk * kChunkDims + v * 8;
#pragma unroll
        for (int i = 0; i < kCopyRounds; ++i) {
          copy_16_or_zero(dst + i * 8 * kChunkVecs,
                          col + size_t(src_row[i]) * uint32_t(p.index_dim),
                          (read_mask >> i) & 1u ? 16u : 0u);
        }
      }
      if (++chunk * kChunkVecs >= n_vecs) active = false;
    }
    cp_async_commit();
  }
};

// acc[h] += q_h[d..d+8) . k[d..d+8), one FFMA per element (exact product, see the head
// comment), in dim order.
// q: [n_heads][8] fp32 of these 8 dims.
template <int kHeads>
__device__ __forceinline__ void accumulate8(const uint4 k_a, const uint4 k_b, const float* q,
                                            float (&acc_a)[kHeads], float (&acc_b)[kHeads]) {
  float ka[8];
  float kb[8];
  widen8(k_a, ka);
  widen8(k_b, kb);
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    const float4 q_lo = *reinterpret_cast<const float4*>(q + 8 * h);
    const float4 q_hi = *reinterpret_cast<const float4*>(q + 8 * h + 4);
    const float q8[8] = {q_lo.x, q_lo.y, q_lo.z, q_lo.w, q_hi.x, q_hi.y, q_hi.z, q_hi.w};
    float a = acc_a[h];
    float b = acc_b[h];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      a = __fmaf_rn(q8[e], ka[e], a);
      b = __fmaf_rn(q8[e], kb[e], b);
    }
    acc_a[h] = a;
    acc_b[h] = b;
  }
}

template <int kHeads>
__device__ __forceinline__ float finish_score(const float (&acc)[kHeads], float sqrt_index_dim) {
  float sum = 0.0f;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) sum = __fadd_rn(sum, fmaxf(acc[h], 0.0f));
  return __fdiv_rn(sum, sqrt_index_dim);
}

template <int kHeads>
// No minimum of CTAs per SM: asking for 5 or 6 made ptxas spill and was slower (15.9 and 18.1
// against 15.7 us, see notes): more resident warps do not hide what the extra instructions cost.
__global__ void __launch_bounds__(kMaxWarpsPerCta * 32)
    qsa_index_scores_kernel(const __grid_constant__ ScoresKernelParams p) {
  enter_dependent_grid();
  extern __shared__ __align__(16) unsigned char scores_smem[];
  const int lane = int(threadIdx.x) & 31;
  const int warp_in_cta = int(threadIdx.x) >> 5;
  const int64_t warp = int64_t(blockIdx.x) * (blockDim.x >> 5) + warp_in_cta;
  if (warp >= p.n_warps) return;  // whole warps only; no block barrier below

  const int dim = p.index_dim;
  const int n_vecs = dim / 8;
  // Per warp: the ring [kStages][64 rows][4 vectors], then the query [n_vecs][kHeads][8] fp32.
  unsigned char* warp_smem =
      scores_smem + size_t(warp_in_cta) * (kStages * kStageBytes + size_t(kHeads) * dim * 4);
  uint4* ring = reinterpret_cast<uint4*>(warp_smem);
  float* q_s = reinterpret_cast<float*>(warp_smem + kStages * kStageBytes);

  Producer producer;
  producer.tile = warp * p.tiles_per_warp;
  producer.tile_end = min(producer.tile + p.tiles_per_warp, p.n_tiles);
  // A 32-bit division when it suffices (always, in practice).
  if (p.n_tiles <= int64_t(UINT32_MAX)) {
    producer.row = int32_t(uint32_t(producer.tile) / uint32_t(p.tiles_per_row));
  } else {
    producer.row = int32_t(producer.tile / p.tiles_per_row);
  }
  producer.tile_in_row = uint32_t(producer.tile - int64_t(producer.row) * p.tiles_per_row);
  TileQueue queue;

  // A row's query goes through registers (lane j < n_vecs holds vector j of every head) into
  // shared memory as [index_dim / 8][n_heads][8] fp32. The first row's is requested before
  // anything else (its row is known without a load; ncu showed 15% of the kernel's stall samples
  // on it when it was requested after the first copies, behind the block-table loads); a later
  // row's is requested before the copies of the iteration that starts it and stored after them.
  auto load_q = [&](int32_t row, uint4(&raw)[kHeads]) {
    const uint4* src = reinterpret_cast<const uint4*>(p.index_q + int64_t(row) * kHeads * dim);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      raw[h] = lane < n_vecs ? __ldg(src + h * n_vecs + lane) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  const int32_t first_row = producer.row;
  uint4 first_q[kHeads];
  if (producer.tile < producer.tile_end) load_q(first_row, first_q);

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    producer.produce(p, lane, n_vecs, ring + s * kStageVecs, queue);
  }

  // Lane's rows in a stage: groups lane and lane + 32, vectors swizzled by (row / 2) % 4.
  const int swizzle = (lane >> 1) & 3;
  auto store_q = [&](const uint4(&raw)[kHeads]) {
    if (lane < n_vecs) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        float q8[8];
        widen8(raw[h], q8);
        float4* dst = reinterpret_cast<float4*>(q_s + (lane * kHeads + h) * 8);
        dst[0] = make_float4(q8[0], q8[1], q8[2], q8[3]);
        dst[1] = make_float4(q8[4], q8[5], q8[6], q8[7]);
      }
    }
  };
  int32_t q_row = -1;  // row whose query is in q_s
  if (queue.size > 0) {
    if (queue.row[0] != first_row) load_q(queue.row[0], first_q);  // the first row was skipped
    store_q(first_q);  // made visible by the loop's first barrier
    q_row = queue.row[0];
  }

  int32_t cur_row = 0;
  uint32_t cur_tile = 0;
  int32_t cur_valid = 0;
  int chunk = 0;
  int stage = 0;
  float acc_a[kHeads];
  float acc_b[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) acc_a[h] = acc_b[h] = 0.0f;

  for (;;) {
    // Stage `stage` has landed (at most kStages - 2 younger groups pending); the stage refilled
    // below was read in the previous iteration, which every lane finished before this barrier.
    cp_async_wait<kStages - 2>();
    __syncwarp();
    bool new_q = false;
    uint4 q_raw[kHeads];
    if (chunk == 0) {
      if (queue.size == 0) break;  // the producer found no further tile: the range is done
      queue.pop(cur_row, cur_tile, cur_valid);
      if (cur_row != q_row) {
        new_q = true;
        load_q(cur_row, q_raw);
      }
    }
    const int refill = stage == 0 ? kStages - 1 : stage - 1;
    producer.produce(p, lane, n_vecs, ring + refill * kStageVecs, queue);
    if (new_q) {
      // The previous row's query was last read before the barrier above.
      store_q(q_raw);
      q_row = cur_row;
      __syncwarp();
    }

    const uint4* rows_a = ring + stage * kStageVecs + lane * kChunkVecs;
    const uint4* rows_b = rows_a + 32 * kChunkVecs;
    const float* q_chunk = q_s + chunk * kChunkVecs * kHeads * 8;
    const int chunk_vecs = min(kChunkVecs, n_vecs - chunk * kChunkVecs);
    if (chunk_vecs == kChunkVecs) {
#pragma unroll
      for (int v = 0; v < kChunkVecs; ++v) {
        accumulate8<kHeads>(rows_a[v ^ swizzle], rows_b[v ^ swizzle], q_chunk + v * kHeads * 8,
                            acc_a, acc_b);
      }
    } else {
#pragma unroll 1
      for (int v = 0; v < chunk_vecs; ++v) {
        accumulate8<kHeads>(rows_a[v ^ swizzle], rows_b[v ^ swizzle], q_chunk + v * kHeads * 8,
                            acc_a, acc_b);
      }
    }

    if (++chunk * kChunkVecs >= n_vecs) {
      float* out = p.scores + int64_t(cur_row) * p.max_groups + int64_t(cur_tile) * kTileGroups;
      const float score_a = finish_score<kHeads>(acc_a, p.sqrt_index_dim);
      const float score_b = finish_score<kHeads>(acc_b, p.sqrt_index_dim);
      if (lane < cur_valid) out[lane] = score_a;
      if (lane + 32 < cur_valid) out[lane + 32] = score_b;
      if (p.run_maxima != nullptr) {  // uniform
        // Runs r < 4 are lanes 8r .. 8r + 7 of score_a, runs r >= 4 the same lanes of score_b.
        float max_a = lane < cur_valid ? score_a : -INFINITY;
        float max_b = lane + 32 < cur_valid ? score_b : -INFINITY;
#pragma unroll
        for (int offset = 1; offset < kRunGroups; offset <<= 1) {
          max_a = fmaxf(max_a, __shfl_xor_sync(0xFFFFFFFFu, max_a, offset));
          max_b = fmaxf(max_b, __shfl_xor_sync(0xFFFFFFFFu, max_b, offset));
        }
        if (lane % kRunGroups == 0) {
          float* maxima = p.run_maxima + int64_t(cur_row) * p.run_stride +
                          int64_t(cur_tile) * (kTileGroups / kRunGroups) + lane / kRunGroups;
          if (lane < cur_valid) maxima[0] = max_a;
          if (lane + 32 < cur_valid) maxima[32 / kRunGroups] = max_b;
        }
      }
#pragma unroll
      for (int h = 0; h < kHeads; ++h) acc_a[h] = acc_b[h] = 0.0f;
      chunk = 0;
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  cp_async_wait<0>();
}

// ---- Tensor-core scores (the default) ----------------------------------------------------------
// One warp per tile of 32 consecutive groups of one row; CTAs of 4 warps, grid (tiles / 4, rows).
// The tile's head dot products are C = A . B with mma.m16n8k8 (FP16 in, fp32 accumulation): A =
// the compressed rows (two m-tiles of 16 groups), B = the row's query transposed (dims x heads,
// the heads as the 8 columns, zero past n_heads). Head dims are permuted alike in A and B so that
// every fragment comes from one 16-byte load straight into registers: in slab z (128 dims), lane
// (g = lane / 4, t = lane % 4) loads vector 16 z + 4 j + t (j < 4) of its four rows (groups 8 i +
// g of the tile) and of head g's query; word w of that vector is the lane's pair of k columns
// (2 t, 2 t + 1) in k-step (j, w). A lane's C holds heads 2 t, 2 t + 1 of groups g, g + 8 per
// m-tile: ReLU, a sum over the lane's two heads and two shuffles give each group's head sum, one
// IEEE division by sqrt(index_dim) the score, and lane l stores group l's.
// Products of two FP16 values are exact in fp32; the tensor core sums them in its own order, so a
// score can differ from the CPU reference's sequential chain in the last bits (tests: a bound on
// the summation error, and the top-k checked against the CPU's on the kernel's own scores).
// QsaIndexScoresArgs::exact selects the FFMA kernel above, which is bit-identical.
// Why fast: a slab's row loads go straight into registers, all in flight together, with no
// shared-memory round trip; the tensor core does the head products. At 4 x 32K groups, cold, it
// takes 12.4 us where the FFMA kernel takes 14.2 us and a plain read of the same bytes 9.7 us.
constexpr int kMmaTileGroups = 32;
constexpr int kMmaWarps = 4;
constexpr int kSlabVecs = 16;              // 16-byte vectors per slab: 128 dims
constexpr int kSlabSteps = kSlabVecs / 4;  // vectors per lane per row and slab
static_assert(kMmaTileGroups == 32 && kRunGroups == 8);

// A minimum of one CTA per SM in the launch bounds lets ptxas keep a slab's 16 row loads in flight
// together (110 registers, 16 warps per SM). Without it ptxas chose 62 registers (32 warps per
// SM) and spread the loads over three round trips between the mma's: 13.0 against 12.5 us at
// 4 x 32K groups (see notes).
__global__ void __launch_bounds__(kMmaWarps * 32, 1)
    qsa_index_scores_mma_kernel(const __grid_constant__ ScoresKernelParams p) {
  E4KV_TL_ENTER_DEPENDENT_GRID(kTlScores);
  const int lane = int(threadIdx.x) & 31;
  const int32_t row = int32_t(blockIdx.y);
  const int64_t base = (int64_t(blockIdx.x) * kMmaWarps + (threadIdx.x >> 5)) * kMmaTileGroups;
  if (base >= p.max_groups) return;
  const int32_t seq = __ldg(p.rows.row_seq + row);
  const int64_t pos = __ldg(p.rows.row_pos + row);
  const int64_t seq_len = __ldg(p.seq_lens + seq);
  const int64_t causal = (pos + 1) / p.ratio;
  const int64_t written = seq_len / p.ratio;
  int64_t visible = causal < written ? causal : written;
  if (visible > p.max_groups) visible = p.max_groups;
  if (visible <= p.skip_visible_at_most || base >= visible) return;
  const int g = lane >> 2;
  const int t = lane & 3;
  const uint32_t rpb = uint32_t(p.rows_per_block);
  const int32_t* table_row = p.rows.block_table + int64_t(seq) * p.rows.max_blocks_per_seq;
  // Compressed row of the lane's groups base + 8 i + g. Groups past visible and unreadable blocks
  // are not read: their rows are zeros, so the score is exactly +0.
  uint32_t src[4];
  bool read[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t c = uint32_t(base) + uint32_t(8 * i + g);
    uint32_t logical;
    uint32_t slot;
    if (p.rows_per_block_shift >= 0) {
      logical = c >> p.rows_per_block_shift;
      slot = c & (rpb - 1u);
    } else {
      logical = c / rpb;
      slot = c - logical * rpb;
    }
    int32_t block = -1;
    if (int64_t(c) < visible && int64_t(logical) < p.rows.max_blocks_per_seq) {
      block = __ldg(table_row + logical);
    }
    read[i] = block >= 0 && int64_t(block) < p.n_blocks;
    src[i] = read[i] ? uint32_t(block) * rpb + slot : 0u;
  }
  const int n_vecs = p.index_dim / 8;
  const uint16_t* q_head = p.index_q + (int64_t(row) * p.n_heads + g) * p.index_dim;
  const bool head_live = g < p.n_heads;
  float acc[2][4] = {};
  for (int slab = 0; slab * kSlabVecs < n_vecs; ++slab) {
    uint4 a[4][kSlabSteps];
    uint4 b[kSlabSteps];
#pragma unroll
    for (int j = 0; j < kSlabSteps; ++j) {
      const int v = slab * kSlabVecs + 4 * j + t;
      const bool dim_live = v < n_vecs;
      b[j] = head_live && dim_live ? __ldg(reinterpret_cast<const uint4*>(q_head + v * 8))
                                   : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i][j] = read[i] && dim_live
                      ? __ldg(reinterpret_cast<const uint4*>(
                            p.compressed + size_t(src[i]) * uint32_t(p.index_dim) + v * 8))
                      : make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int j = 0; j < kSlabSteps; ++j) {
        mma_m16n8k8(acc[m], a[2 * m][j].x, a[2 * m + 1][j].x, b[j].x);
        mma_m16n8k8(acc[m], a[2 * m][j].y, a[2 * m + 1][j].y, b[j].y);
        mma_m16n8k8(acc[m], a[2 * m][j].z, a[2 * m + 1][j].z, b[j].z);
        mma_m16n8k8(acc[m], a[2 * m][j].w, a[2 * m + 1][j].w, b[j].w);
      }
    }
  }
  // sum[i]: group 8 i + g (rows g and g + 8 of m-tile i / 2), the lane's two heads; after the
  // shuffles over t, all heads. Lane l then takes group l's, from lane 4 (l % 8), entry l / 8.
  float sum[4];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    sum[2 * m] = fmaxf(acc[m][0], 0.0f) + fmaxf(acc[m][1], 0.0f);
    sum[2 * m + 1] = fmaxf(acc[m][2], 0.0f) + fmaxf(acc[m][3], 0.0f);
  }
  float mine = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sum[i] += __shfl_xor_sync(0xFFFFFFFFu, sum[i], 1);
    sum[i] += __shfl_xor_sync(0xFFFFFFFFu, sum[i], 2);
    const float v = __shfl_sync(0xFFFFFFFFu, sum[i], 4 * (lane & 7));
    if ((lane >> 3) == i) mine = v;
  }
  const float score = __fdiv_rn(mine, p.sqrt_index_dim);
  const bool valid = base + lane < visible;
  if (valid) p.scores[int64_t(row) * p.max_groups + base + lane] = score;
  if (p.run_maxima != nullptr) {  // uniform; run r of the tile is lanes 8 r .. 8 r + 7
    float run_max = valid ? score : -INFINITY;
#pragma unroll
    for (int offset = 1; offset < kRunGroups; offset <<= 1) {
      run_max = fmaxf(run_max, __shfl_xor_sync(0xFFFFFFFFu, run_max, offset));
    }
    if (lane % kRunGroups == 0 && valid) {
      p.run_maxima[int64_t(row) * p.run_stride + base / kRunGroups + lane / kRunGroups] = run_max;
    }
  }
  E4KV_TL_EXIT(kTlScores, lane == 0);
}

using ScoresKernel = void (*)(ScoresKernelParams);

ScoresKernel scores_kernel(int64_t n_heads) {
  switch (n_heads) {
    case 1:
      return qsa_index_scores_kernel<1>;
    case 2:
      return qsa_index_scores_kernel<2>;
    case 3:
      return qsa_index_scores_kernel<3>;
    case 4:
      return qsa_index_scores_kernel<4>;
    case 5:
      return qsa_index_scores_kernel<5>;
    case 6:
      return qsa_index_scores_kernel<6>;
    case 7:
      return qsa_index_scores_kernel<7>;
    default:
      return qsa_index_scores_kernel<8>;
  }
}

size_t warp_smem_bytes(int64_t n_heads, int64_t index_dim) {
  return size_t(kStages) * kStageBytes + size_t(n_heads * index_dim) * sizeof(float);
}

struct LaunchShape {
  int warps_per_cta = 1;
  int64_t resident_warps = 1;  // warps of this shape the device holds at once
};

// Warps per CTA and resident warps for (current device, n_heads, index_dim), memoised. The
// kernel's dynamic shared-memory limit is raised once per device to what its largest index_dim
// needs (capped by the device), and the CTA shrinks from 4 warps until it fits under that limit.
LaunchShape launch_shape(int64_t n_heads, int64_t index_dim) {
  struct Entry {
    int device;
    int64_t n_heads;
    int64_t index_dim;
    LaunchShape shape;
  };
  static std::mutex mutex;
  static std::vector<Entry> cache;
  static std::vector<std::pair<int, int64_t>> raised;  // (device, n_heads)
  int device = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  for (const Entry& e : cache) {
    if (e.device == device && e.n_heads == n_heads && e.index_dim == index_dim) return e.shape;
  }
  const ScoresKernel kernel = scores_kernel(n_heads);
  int optin = 0;
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t limit = std::min(size_t(optin), kMaxWarpsPerCta * warp_smem_bytes(n_heads, kMaxDim));
  if (std::find(raised.begin(), raised.end(), std::pair{device, n_heads}) == raised.end()) {
    E4KV_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
    raised.emplace_back(device, n_heads);
  }
  LaunchShape shape;
  const size_t per_warp = warp_smem_bytes(n_heads, index_dim);
  shape.warps_per_cta = kMaxWarpsPerCta;
  while (shape.warps_per_cta > 1 && shape.warps_per_cta * per_warp > limit) {
    shape.warps_per_cta /= 2;
  }
  int per_sm = 0;
  E4KV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, kernel, shape.warps_per_cta * 32, shape.warps_per_cta * per_warp));
  int n_sms = 0;
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  shape.resident_warps = int64_t(std::max(per_sm, 1)) * std::max(n_sms, 1) * shape.warps_per_cta;
  cache.push_back(Entry{device, n_heads, index_dim, shape});
  return shape;
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
  if (args.max_groups < 0 || args.max_groups > kMaxGroupsLimit) {
    return Status::error(cat("qsa_index_scores: max_groups ", args.max_groups, " out of range"));
  }
  // Compressed rows are addressed by a 32-bit row index.
  if (cv.n_blocks > (int64_t(1) << 31) / cv.rows_per_block()) {
    return Status::error(cat("qsa_index_scores: indexer cache of ", cv.n_blocks, " blocks x ",
                             cv.rows_per_block(), " rows is too large (fewer than 2^31 rows)"));
  }
  if (args.rows.n_rows == 0 || args.max_groups == 0) return ok_status();
  if (cv.data == nullptr || args.block_table.blocks == nullptr || args.rows.row_seq == nullptr ||
      args.rows.row_pos == nullptr || args.rows.seq_lens == nullptr || args.index_q == nullptr ||
      args.scores == nullptr) {
    return Status::error("qsa_index_scores: a required device pointer is null");
  }
  if (args.run_maxima != nullptr &&
      args.run_stride < (args.max_groups + kQsaRunGroups - 1) / kQsaRunGroups) {
    return Status::error(cat("qsa_index_scores: run_stride ", args.run_stride,
                             " is below ceil(max_groups / ", kQsaRunGroups, ")"));
  }
  if (reinterpret_cast<uintptr_t>(cv.data) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(args.index_q) % 16 != 0) {
    return Status::error(
        "qsa_index_scores: the indexer cache and index_q must be 16-byte aligned (read as "
        "16-byte vectors)");
  }
  ScoresKernelParams kp{};
  kp.compressed = cv.data;
  kp.n_blocks = cv.n_blocks;
  kp.rows_per_block = int32_t(cv.rows_per_block());
  kp.rows_per_block_shift = -1;
  for (int shift = 0; shift < 31; ++shift) {
    if ((int64_t(1) << shift) == cv.rows_per_block()) kp.rows_per_block_shift = shift;
  }
  kp.ratio = int32_t(cv.ratio);
  kp.index_dim = int32_t(cv.index_dim);
  kp.rows = paged_rows_device(args.block_table, args.rows);
  kp.seq_lens = args.rows.seq_lens;
  kp.index_q = args.index_q;
  kp.max_groups = args.max_groups;
  kp.skip_visible_at_most = args.skip_visible_at_most;
  kp.sqrt_index_dim = std::sqrt(float(cv.index_dim));
  kp.scores = args.scores;
  kp.run_maxima = args.run_maxima;
  kp.run_stride = args.run_stride;
  kp.n_heads = int32_t(args.n_index_heads);
  if (!args.exact) {
    const int64_t tiles = (args.max_groups + kMmaTileGroups - 1) / kMmaTileGroups;
    const int64_t ctas_per_row = (tiles + kMmaWarps - 1) / kMmaWarps;  // < 2^24
    launch_kernel(qsa_index_scores_mma_kernel,
                  LaunchDims{dim3(unsigned(ctas_per_row), unsigned(args.rows.n_rows)),
                             dim3(unsigned(kMmaWarps * 32))},
                  stream, kp);
    return ok_status();
  }
  kp.tiles_per_row = (args.max_groups + kTileGroups - 1) / kTileGroups;
  kp.n_tiles = args.rows.n_rows * kp.tiles_per_row;

  // Equal contiguous ranges, no more warps than are resident: ceil(n_tiles / resident) tiles per
  // warp, then as few warps as that needs (so every warp but the last has a full range). More
  // tiles per warp than that is slower (see notes): a warp's stages wait on memory one after
  // another, so the kernel wants the most warps.
  const LaunchShape shape = launch_shape(args.n_index_heads, cv.index_dim);
  kp.tiles_per_warp = (kp.n_tiles + shape.resident_warps - 1) / shape.resident_warps;
  kp.n_warps = (kp.n_tiles + kp.tiles_per_warp - 1) / kp.tiles_per_warp;
  const int64_t n_ctas = (kp.n_warps + shape.warps_per_cta - 1) / shape.warps_per_cta;
  const size_t smem =
      size_t(shape.warps_per_cta) * warp_smem_bytes(args.n_index_heads, cv.index_dim);
  launch_kernel(scores_kernel(args.n_index_heads),
                LaunchDims{dim3(unsigned(n_ctas)), dim3(unsigned(shape.warps_per_cta * 32)), smem},
                stream, kp);
  return ok_status();
}

}  // namespace e4kv::cuda
