// Paged decode attention: FP16 or E4M3 KV, dense or QSA-selected keys, any GQA group up to 16.
//
// Work: one warp per (query row, KV head, split of the row's key list); a CTA holds 4 warps (4
// consecutive splits). Each warp walks its keys in tiles of 8 tokens:
//   S = Q . K^T  with mma.m16n8k8: M = the group's query heads (16 rows, padded), N = 8 tokens,
//                K = head dims. K arrives straight from global memory into B fragments: each
//                thread loads 16 contiguous bytes of one token and the head dims are permuted
//                consistently between Q (loaded once) and K, so no shared memory and no shuffles.
//   online softmax over the tile (fp32, base-2, k_scale and the decode factor folded in).
//   O^T += V^T . P^T with mma.m16n8k8: M = 16 head dims, N = 8 heads, K = 8 tokens. The C
//                fragment of S is exactly the B fragment of P^T, so P never leaves registers; V^T
//                fragments pair the same dims of two tokens (one byte permute per pair).
// E4M3 pages are decoded in registers (software: byte permute + shift + masks, value * 2^-8 with
// 2^8 folded into the scales; or cvt.rn.f16x2.e4m3x2 on sm_89+). Each K/V byte is read once.
// A second kernel merges the splits by log-sum-exp and applies v_scale, 1/l and the gate.
//
// Limits: head_dim 64/128/256, GQA group <= 16, block_size % 8 == 0. Instructions: mma.m16n8k8
// (sm_75+); the software decoder uses only sm_70 integer instructions.
#include "backend/cuda/paged_decode_attention.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/e4m3_vec.cuh"

namespace e4kv::cuda {
namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kTileTokens = 8;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

struct DecodeKernelParams {
  const uint8_t* cache;  // [n_blocks, 2, block_size, n_kv_heads, head_dim] FP16 or E4M3 bytes
  int32_t block_size;
  int32_t block_shift;  // log2(block_size) when a power of two, else -1
  int32_t n_kv_heads;
  const int32_t* block_table;  // [n_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const int32_t* row_seq;     // [n_rows]
  const int32_t* row_pos;     // [n_rows]
  const int32_t* sel_tokens;  // [n_rows, sel_width] or nullptr (dense)
  const int32_t* sel_counts;  // [n_rows]
  int64_t sel_width;
  int32_t n_heads;
  int32_t group;        // n_heads / n_kv_heads
  const uint16_t* q;    // [n_rows, n_heads, head_dim] FP16
  float qk_scale_log2;  // k_scale * decode factor / sqrt(head_dim) * log2(e)
  int32_t keys_per_split;
  int32_t n_splits;
  float* m;    // [n_rows, n_splits, n_heads] (base-2 logits)
  float* l;    // [n_rows, n_splits, n_heads]
  float* acc;  // [n_rows, n_splits, n_heads, head_dim]
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

// note: the explicit minimum of 1 resident CTA changes ptxas' register allocation and scheduling
// for this kernel: measured on the H200 (2026-12-01, interleaved A/B runs), FP16 decode at d 128
// went from 325 to 291 us (32 x 8K) and from 384 to 338 us (8 x 32K), E4M3 unchanged. Forcing 4 or
// 5 resident CTAs (128 or 102 registers) spilled and ran 15-65% slower.
template <int kHeadDim, class Elem, int kHeadTiles>
__global__ void __launch_bounds__(kWarpsPerCta * 32, 1)
    paged_decode_attention_kernel(const __grid_constant__ DecodeKernelParams p) {
  constexpr int kEB = Elem::kBytes;
  // K: each thread loads kKElems contiguous dims of its token per load.
  constexpr int kKElems = (16 / kEB) < (kHeadDim / 4) ? (16 / kEB) : (kHeadDim / 4);
  constexpr int kKLoads = kHeadDim / (4 * kKElems);
  constexpr int kKWords = kKElems * kEB / 4;
  constexpr int kStepsPerLoad = kKElems / 2;
  constexpr int kKSteps = kHeadDim / 8;
  // V: each thread loads kVElems contiguous dims of each of its two tokens per load.
  constexpr int kVDimsPerThread = kHeadDim / 8;
  constexpr int kVElems = (16 / kEB) < kVDimsPerThread ? (16 / kEB) : kVDimsPerThread;
  constexpr int kVLoads = kVDimsPerThread / kVElems;
  constexpr int kVWords = kVElems * kEB / 4;
  constexpr int kMTiles = kHeadDim / 16;
  // Tiles per iteration: about 64 registers of raw K/V per thread (8 KB per warp in flight), half
  // that with two head tiles (their Q and O fragments take the room).
  constexpr int kRawRegsPerTile = kKLoads * kKWords + 2 * kVLoads * kVWords;
  // Tiles per iteration: about 64 registers of raw K/V per thread (8 KB per warp in flight), half
  // that with two head tiles (their Q and O fragments take the room).
  constexpr int kRawBudget = kHeadTiles == 2 ? 32 : 64;
  constexpr int kSub = kRawBudget / kRawRegsPerTile < 1   ? 1
                       : kRawBudget / kRawRegsPerTile > 4 ? 4
                                                          : kRawBudget / kRawRegsPerTile;
  // note: prefetching the next iteration into a second register buffer was measured slower on the
  // H200 (2026-11-29: E4M3 d128 323 us vs 252 us; FP16 unchanged): the extra registers cost a
  // resident CTA per SM. Kept switchable for the next round of tuning.
  constexpr bool kPrefetch = false;
  constexpr int kIterTokens = kTileTokens * kSub;

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // fragment row group
  const int t = lane & 3;   // thread in group
  const int row = blockIdx.x / p.n_kv_heads;
  const int kv_head = blockIdx.x % p.n_kv_heads;
  const int split = blockIdx.y * kWarpsPerCta + warp;
  if (split >= p.n_splits) return;

  const int n_keys = p.sel_tokens != nullptr ? p.sel_counts[row] : p.row_pos[row] + 1;
  const int k_begin = split * p.keys_per_split;
  const int k_end = min(n_keys, k_begin + p.keys_per_split);
  const int head0 = kv_head * p.group;
  const int seq = p.row_seq[row];
  const int32_t* table = p.block_table + int64_t(seq) * p.max_blocks_per_seq;
  const int32_t* sel =
      p.sel_tokens != nullptr ? p.sel_tokens + int64_t(row) * p.sel_width : nullptr;
  const int64_t row_bytes = int64_t(p.n_kv_heads) * kHeadDim * kEB;
  const int64_t head_offset = int64_t(kv_head) * kHeadDim * kEB;

  // Q as A fragments, dims permuted like the K loads: step (c, m) covers, for thread t, dims
  // kKElems * (t + 4c) + 2m + {0, 1}.
  uint32_t q_lo[kKSteps];                        // heads head0 + g
  uint32_t q_hi[kHeadTiles == 2 ? kKSteps : 1];  // heads head0 + g + 8
  {
    const uint16_t* q_row = p.q + int64_t(row) * p.n_heads * kHeadDim;
    const bool lo_ok = g < p.group;
    const bool hi_ok = kHeadTiles == 2 && g + 8 < p.group;
#pragma unroll
    for (int c = 0; c < kKLoads; ++c) {
#pragma unroll
      for (int m = 0; m < kStepsPerLoad; ++m) {
        const int dim = kKElems * (t + 4 * c) + 2 * m;
        const int step = c * kStepsPerLoad + m;
        q_lo[step] =
            lo_ok ? *reinterpret_cast<const uint32_t*>(q_row + int64_t(head0 + g) * kHeadDim + dim)
                  : 0u;
        if constexpr (kHeadTiles == 2) {
          q_hi[step] = hi_ok ? *reinterpret_cast<const uint32_t*>(
                                   q_row + int64_t(head0 + g + 8) * kHeadDim + dim)
                             : 0u;
        }
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
    const int pos = sel != nullptr ? sel[key] : key;
    int64_t block;
    int slot;
    if (p.block_shift >= 0) {
      block = table[pos >> p.block_shift];
      slot = pos & (p.block_size - 1);
    } else {
      block = table[pos / p.block_size];
      slot = pos % p.block_size;
    }
    return p.cache + ((block * 2 + kv) * p.block_size + slot) * row_bytes + head_offset;
  };

  // Each iteration covers kSub tiles of 8 tokens. All loads of an iteration are issued before
  // any math, and (kPrefetch) the next iteration's loads are issued before this one's math, so
  // that two iterations of K/V bytes are in flight per warp.
  struct Raw {
    uint32_t k[kSub][kKLoads][kKWords];
    uint32_t v0[kSub][kVLoads][kVWords];
    uint32_t v1[kSub][kVLoads][kVWords];
  };
  auto load_iteration = [&](int tile, Raw& raw) {
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      // Keys past k_end read a valid token (k_begin) and are masked below.
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

  Raw cur;
  if constexpr (kPrefetch) {
    if (k_begin < k_end) load_iteration(k_begin, cur);
  }
  for (int tile = k_begin; tile < k_end; tile += kIterTokens) {
    Raw next;
    if constexpr (kPrefetch) {
      if (tile + kIterTokens < k_end) load_iteration(tile + kIterTokens, next);
    } else {
      load_iteration(tile, cur);
    }
    const auto& k_raw = cur.k;
    const auto& v_raw0 = cur.v0;
    const auto& v_raw1 = cur.v1;

    // S = Q . K^T: s[sub][0..1] = heads g (tokens 2t, 2t+1), s[sub][2..3] = heads g + 8.
    float s[kSub][4];
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      s[sub][0] = s[sub][1] = s[sub][2] = s[sub][3] = 0.0f;
#pragma unroll
      for (int c = 0; c < kKLoads; ++c) {
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
#pragma unroll
        for (int m = 0; m < kStepsPerLoad; ++m) {
          const int step = c * kStepsPerLoad + m;
          mma_m16n8k8(s[sub], q_lo[step], kHeadTiles == 2 ? q_hi[step] : 0u, b[m]);
        }
      }
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

    // O^T columns are heads 2t, 2t+1 (+8 for the second tile); their rescale factors live in the
    // lanes whose row group is that head.
#pragma unroll
    for (int r = 0; r < kHeadTiles; ++r) {
      const float a0 = __shfl_sync(kFullMask, alpha[r], 8 * t);
      const float a1 = __shfl_sync(kFullMask, alpha[r], 8 * t + 4);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        o[r][mt][0] *= a0;
        o[r][mt][2] *= a0;
        o[r][mt][1] *= a1;
        o[r][mt][3] *= a1;
      }
    }

    // O^T += V^T . P^T. M-tile mt takes the thread's dims j = 2mt (row g) and 2mt + 1 (row g + 8)
    // of its list: dim(j) = kVElems * (g + 8 * (j / kVElems)) + j % kVElems.
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const int c = (2 * mt) / kVElems;
        const int e = (2 * mt) % kVElems;
        uint32_t a0;
        uint32_t a1;
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
#pragma unroll
        for (int r = 0; r < kHeadTiles; ++r) mma_m16n8k8(o[r][mt], a0, a1, p_frag[sub][r]);
      }
    }
    if constexpr (kPrefetch) cur = next;
  }

  // Row sums live spread over the four threads of a group.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(kFullMask, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(kFullMask, l_run[r], 2);
  }
  const int64_t split_index = int64_t(row) * p.n_splits + split;
  if (t == 0) {
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
}

// One CTA per (row, head, 32-dim chunk) with kMergeWarps warps: warp w merges the splits
// s = w (mod kMergeWarps), one lane per dim, then the warps combine through shared memory. A row
// cut into hundreds of splits (one long sequence) is merged by many CTAs with many loads in flight.
constexpr int kMergeWarps = 8;

__global__ void __launch_bounds__(kMergeWarps * 32)
    decode_attention_merge_kernel(const __grid_constant__ MergeKernelParams p, int head_dim) {
  __shared__ float warp_max[kMergeWarps];
  __shared__ float warp_l[kMergeWarps];
  __shared__ float warp_acc[kMergeWarps][32];
  const int row = blockIdx.x;
  const int head = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int dim = blockIdx.z * 32 + lane;
  const int64_t base = int64_t(row) * p.n_splits;
  auto m_at = [&](int s) { return p.m[(base + s) * p.n_heads + head]; };

  // The largest split maximum.
  float m_max = -INFINITY;
  for (int s = threadIdx.x; s < p.n_splits; s += kMergeWarps * 32) m_max = fmaxf(m_max, m_at(s));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    m_max = fmaxf(m_max, __shfl_xor_sync(kFullMask, m_max, offset));
  }
  if (lane == 0) warp_max[warp] = m_max;
  __syncthreads();
  m_max = warp_max[0];
#pragma unroll
  for (int w = 1; w < kMergeWarps; ++w) m_max = fmaxf(m_max, warp_max[w]);

  float acc = 0.0f;
  float l_sum = 0.0f;
  if (m_max != -INFINITY) {
#pragma unroll 4
    for (int s = warp; s < p.n_splits; s += kMergeWarps) {
      const float m = m_at(s);
      const float w = m == -INFINITY ? 0.0f : exp2f(m - m_max);
      l_sum += w * p.l[(base + s) * p.n_heads + head];
      acc += w * p.acc[((base + s) * p.n_heads + head) * head_dim + dim];
    }
  }
  warp_acc[warp][lane] = acc;
  if (lane == 0) warp_l[warp] = l_sum;
  __syncthreads();
  if (warp != 0) return;
  acc = 0.0f;
  l_sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) {
    acc += warp_acc[w][lane];
    l_sum += warp_l[w];
  }
  const int64_t out_index = (int64_t(row) * p.n_heads + head) * head_dim + dim;
  float out = l_sum > 0.0f ? acc * p.out_scale / l_sum : 0.0f;
  if (p.gate != nullptr) {
    __half_raw raw;
    raw.x = p.gate[out_index];
    const float gate = __half2float(__half(raw));
    out *= 1.0f / (1.0f + expf(-gate));
  }
  p.out[out_index] = out;
}

template <int kHeadDim, class Elem>
void launch(const DecodeKernelParams& kp, int64_t n_rows, int64_t n_kv_heads, int group,
            cudaStream_t stream) {
  const dim3 grid(unsigned(n_rows * n_kv_heads),
                  unsigned((kp.n_splits + kWarpsPerCta - 1) / kWarpsPerCta));
  const dim3 block(kWarpsPerCta * 32);
  if (group <= 8) {
    paged_decode_attention_kernel<kHeadDim, Elem, 1><<<grid, block, 0, stream>>>(kp);
  } else {
    paged_decode_attention_kernel<kHeadDim, Elem, 2><<<grid, block, 0, stream>>>(kp);
  }
  E4KV_CUDA_CHECK_LAUNCH();
}

template <class Elem>
void launch_for_dim(int64_t head_dim, const DecodeKernelParams& kp, int64_t n_rows,
                    int64_t n_kv_heads, int group, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      launch<64, Elem>(kp, n_rows, n_kv_heads, group, stream);
      break;
    case 128:
      launch<128, Elem>(kp, n_rows, n_kv_heads, group, stream);
      break;
    default:
      launch<256, Elem>(kp, n_rows, n_kv_heads, group, stream);
      break;
  }
}

}  // namespace

bool decode_attention_native_e4m3_usable(int device) {
  if (!e4m3_native_available(device)) return false;
  cudaFuncAttributes attr{};
  E4KV_CUDA_CHECK(cudaFuncGetAttributes(
      &attr, paged_decode_attention_kernel<128, ElemE4m3<E4m3Decode::kNative>, 1>));
  return attr.binaryVersion >= 89;
}

DecodeAttentionPlan plan_decode_attention(int64_t n_rows, int64_t n_kv_heads, int64_t max_keys,
                                          int n_sms) {
  // Aim for about 16 warps per SM across the grid; never split below 64 keys per warp.
  const int64_t items = std::max<int64_t>(1, n_rows * n_kv_heads);
  const int64_t target_warps = int64_t(std::max(n_sms, 1)) * 16;
  int64_t splits = std::max<int64_t>(1, (target_warps + items - 1) / items);
  const int64_t max_useful = std::max<int64_t>(1, (max_keys + 63) / 64);
  splits = std::min(splits, max_useful);
  splits = (splits + kWarpsPerCta - 1) / kWarpsPerCta * kWarpsPerCta;
  int64_t keys_per_split = (std::max<int64_t>(max_keys, 1) + splits - 1) / splits;
  keys_per_split = (keys_per_split + kTileTokens - 1) / kTileTokens * kTileTokens;
  return DecodeAttentionPlan{keys_per_split, splits};
}

size_t decode_attention_workspace_floats(int64_t max_rows, int64_t max_splits, int64_t n_heads,
                                         int64_t head_dim) {
  return size_t(max_rows * max_splits * n_heads * (head_dim + 2));
}

Status paged_decode_attention(const PagedAttentionParams& params, const DecodeAttentionPlan& plan,
                              const DecodeAttentionWorkspace& workspace, bool native_e4m3,
                              cudaStream_t stream) {
  const KvCacheGeometry& geo = params.cache.geometry;
  const int64_t n_rows = params.rows.n_rows;
  if (geo.head_dim != 64 && geo.head_dim != 128 && geo.head_dim != 256) {
    return Status::error(
        cat("decode attention: head_dim ", geo.head_dim, " is not supported (64, 128 or 256)"));
  }
  if (geo.n_kv_heads <= 0 || params.n_heads % geo.n_kv_heads != 0 ||
      params.n_heads / geo.n_kv_heads > 16) {
    return Status::error(cat("decode attention: GQA group ", params.n_heads, "/", geo.n_kv_heads,
                             " is not supported (a whole group of at most 16)"));
  }
  if (geo.block_size <= 0 || geo.block_size % 8 != 0) {
    return Status::error(
        cat("decode attention: block_size ", geo.block_size, " is not a multiple of 8"));
  }
  if (plan.keys_per_split <= 0 || plan.keys_per_split % kTileTokens != 0 || plan.n_splits <= 0 ||
      plan.n_splits % kWarpsPerCta != 0) {
    return Status::error("decode attention: bad plan");
  }
  if (n_rows > workspace.max_rows || plan.n_splits > workspace.max_splits ||
      params.n_heads > workspace.n_heads || geo.head_dim > workspace.head_dim) {
    return Status::error("decode attention: workspace too small for this launch");
  }
  if (n_rows == 0) return Status();
  const int group = int(params.n_heads / geo.n_kv_heads);
  const bool e4m3 = geo.dtype == KvCacheDtype::kE4m3;
  const float factor = !e4m3         ? 1.0f
                       : native_e4m3 ? E4m3Decoder<E4m3Decode::kNative>::kValueFactor
                                     : E4m3Decoder<E4m3Decode::kSoftware>::kValueFactor;

  DecodeKernelParams kp{};
  kp.cache = static_cast<const uint8_t*>(params.cache.data);
  kp.block_size = int32_t(geo.block_size);
  kp.block_shift = -1;
  for (int shift = 0; shift < 31; ++shift) {
    if ((int64_t(1) << shift) == geo.block_size) kp.block_shift = shift;
  }
  kp.n_kv_heads = int32_t(geo.n_kv_heads);
  kp.block_table = params.block_table.blocks;
  kp.max_blocks_per_seq = params.block_table.max_blocks_per_seq;
  kp.row_seq = params.rows.row_seq;
  kp.row_pos = params.rows.row_pos;
  kp.sel_tokens = params.rows.sel_tokens;
  kp.sel_counts = params.rows.sel_counts;
  kp.sel_width = params.rows.sel_width;
  kp.n_heads = int32_t(params.n_heads);
  kp.group = group;
  kp.q = params.q;
  kp.qk_scale_log2 = float(double(params.cache.k_scale) * factor / std::sqrt(double(geo.head_dim)) *
                           1.4426950408889634);
  kp.keys_per_split = int32_t(plan.keys_per_split);
  kp.n_splits = int32_t(plan.n_splits);
  kp.m = workspace.m;
  kp.l = workspace.l;
  kp.acc = workspace.acc;

  if (!e4m3) {
    launch_for_dim<ElemF16>(geo.head_dim, kp, n_rows, geo.n_kv_heads, group, stream);
  } else if (native_e4m3) {
    launch_for_dim<ElemE4m3<E4m3Decode::kNative>>(geo.head_dim, kp, n_rows, geo.n_kv_heads, group,
                                                  stream);
  } else {
    launch_for_dim<ElemE4m3<E4m3Decode::kSoftware>>(geo.head_dim, kp, n_rows, geo.n_kv_heads, group,
                                                    stream);
  }

  MergeKernelParams mp{};
  mp.n_heads = int32_t(params.n_heads);
  mp.n_splits = int32_t(plan.n_splits);
  mp.m = workspace.m;
  mp.l = workspace.l;
  mp.acc = workspace.acc;
  mp.gate = params.gate;
  mp.out_scale = params.cache.v_scale * factor;
  mp.out = params.out;
  decode_attention_merge_kernel<<<dim3(unsigned(n_rows), unsigned(params.n_heads),
                                       unsigned(geo.head_dim / 32)),
                                  dim3(kMergeWarps * 32), 0, stream>>>(mp, int(geo.head_dim));
  E4KV_CUDA_CHECK_LAUNCH();
  return Status();
}

}  // namespace e4kv::cuda
