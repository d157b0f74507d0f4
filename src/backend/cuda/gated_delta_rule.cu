// The gated delta rule (GatedDeltaNet's linear attention, gated_delta_rule.cuh): per sequence and
// value head, a walk over the tokens in order through the fp32 state S [dk, dv]:
//   S = exp(g) S;  r = S^T k^;  S += k^ (beta (v - r))^T;  o = S^T q^.
//
// Work: one CTA per (sequence, value head, tile of 32 state columns). The columns of S are
// independent (only the q/k normalisation is shared, and every CTA recomputes it), so a CTA holds
// its 32 columns in registers for the whole call: lane = column (each warp reads and writes whole
// 128-byte row segments of S), warp w = rows [w * kRows, (w + 1) * kRows); kRows = 16 for
// dk <= 128 (8 warps at dk = 128), 32 up to dk = 256. S is read once and written once per call,
// which is the whole cost of a decode step (64 KiB fp32 per head at dk = dv = 128: memory-bound);
// the model's decode at batch 1 (32 value heads, dv = 128) already makes 128 CTAs.
//
// Per token, with q, k the raw FP16 rows widened to fp32 and S the state before the token: each
// warp loads the q and k elements of its own rows (one per lane) and broadcasts them by shuffles;
// every thread sums S[d, e] k[d] and S[d, e] q[d] over its rows, and every lane the warp's parts of
// |q|^2, |k|^2 and q.k; one barrier reduces these over the warps (all threads in the same order,
// so all hold the same values; the buffers are double-buffered by token), then
//   r = exp(g) |k|^-1 sum_d S k,  delta = beta (v - r),  S = exp(g) S + k (|k|^-1 delta),
//   o = exp(g) (S^T q^) + delta (k^ . q^)       (= S_new^T q^: the read after the write)
// The algebra differs from the CPU reference's order (decay and norms factored out of the sums, o
// from the state before the write, sums over warps, FMA contraction): fp32 rounding only.
//
// Two paths, chosen from the step's max_seq_rows: decode (every sequence one row or none)
// spends no registers on prefetching and runs 3 CTAs per SM; prefill (some sequence with several
// rows) loads token t + 1's inputs while token t computes, 2 CTAs per SM.
// Figures and the variants measured against this design: bench/notes/qwen4exp_ops.md.
//
// Prefill walks the tokens one after another too (a chain of dependent steps per CTA, about one
// barrier and the shuffles per token): about 0.86 us per token for one sequence (885 us for 1024
// tokens), correct but slow for long prompts.
// TODO: the chunked form (kGatedDeltaChunkSize tokens per step on tensor cores) for prefill.
//
// Limits: head_k_dim <= 256; head_v_dim any (tiled by 32; lanes past dv idle). Static shared
// memory 4.25 KiB. Instructions: sm_70+ (griddepcontrol on sm_90+, launch.cuh).
#include "backend/cuda/gated_delta_rule.cuh"

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "backend/cpu/gated_delta_net.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"

namespace e4kv::cuda {
namespace {

constexpr int kColumns = 32;  // state columns per CTA: one per lane
constexpr int kMaxWarps = 8;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

struct GatedDeltaRuleKernelParams {
  const uint16_t* qkv;        // [n_rows, row_width] FP16
  const float* g;             // [n_rows, n_v_heads], or null: from the raw gates below
  const float* beta;          // [n_rows, n_v_heads], or null: from the raw gates below
  const uint16_t* raw_a;      // [n_rows, n_v_heads] FP16 (in_proj_a), with g null
  const uint16_t* raw_b;      // [n_rows, n_v_heads] FP16 (in_proj_b), with beta null
  const uint16_t* a_log;      // [n_v_heads] FP16
  const uint16_t* dt_bias;    // [n_v_heads] FP16
  float* states;              // [n_slots, n_v_heads, head_k_dim, head_v_dim]
  const int32_t* row_begin;   // [n_seqs + 1]
  const int32_t* state_slot;  // [n_seqs]
  uint16_t* out;              // [n_rows, n_v_heads, head_v_dim] FP16
  int64_t row_width;          // 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim
  int32_t n_k_heads;
  int32_t n_v_heads;
  int32_t head_k_dim;
  int32_t head_v_dim;
  int32_t n_column_tiles;  // ceil(head_v_dim / kColumns)
  int32_t n_warps;         // ceil(head_k_dim / kRows)
  float sqrt_dk;           // fl32(sqrt(head_k_dim)), as the CPU's recurrent form
  float l2norm_eps;
};

__device__ __forceinline__ float h2f(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t f2h(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// The inputs of one token for one thread (raw, widened to fp32; zeros past dk / dv). The warp's
// q and k rows are spread over its lanes: element e of [q rows | k rows] (2 kRows of them) is
// register e / 32 of lane e % 32, and reach every lane by shuffles.
template <int kRows>
struct TokenInputs {
  static constexpr int kRegs = (2 * kRows + 31) / 32;
  float qk[kRegs];
  float v;  // v[column]
  float g;
  float beta;
};

template <int kRows>
__device__ __forceinline__ TokenInputs<kRows> load_token(const GatedDeltaRuleKernelParams& p,
                                                         int64_t row, int k_head, int v_head,
                                                         int row0, int column) {
  const int lane = threadIdx.x % 32;
  const int dk = p.head_k_dim;
  const uint16_t* q = p.qkv + row * p.row_width + int64_t(k_head) * dk;
  const uint16_t* k = q + int64_t(p.n_k_heads) * dk;
  const uint16_t* v =
      p.qkv + row * p.row_width + 2 * int64_t(p.n_k_heads) * dk + int64_t(v_head) * p.head_v_dim;
  TokenInputs<kRows> in;
#pragma unroll
  for (int j = 0; j < TokenInputs<kRows>::kRegs; ++j) {
    const int e = j * 32 + lane;
    const int d = row0 + (e < kRows ? e : e - kRows);
    in.qk[j] = e < 2 * kRows && d < dk ? h2f((e < kRows ? q : k)[d]) : 0.0f;
  }
  in.v = column < p.head_v_dim ? h2f(v[column]) : 0.0f;
  const int64_t gate = row * p.n_v_heads + v_head;
  if (p.g != nullptr) {
    in.g = p.g[gate];
    in.beta = p.beta[gate];
  } else {  // gated_delta_gates' formulas (hybrid_ops.cu), the same fp32 operations
    const float s = h2f(p.raw_a[gate]) + h2f(p.dt_bias[v_head]);
    const float softplus = s > 20.0f ? s : log1pf(expf(s));
    const float decay_rate = expf(h2f(p.a_log[v_head]));
    in.g = -decay_rate * softplus;
    in.beta = 1.0f / (1.0f + expf(-h2f(p.raw_b[gate])));
  }
  return in;
}

// Element e of the warp's [q rows | k rows] (e a compile-time constant after unrolling).
template <int kRows>
__device__ __forceinline__ float row_value(const TokenInputs<kRows>& in, int e) {
  return __shfl_sync(kFullMask, in.qk[e / 32], e % 32);
}

// kPrefetch: load token t + 1's inputs while token t computes (prefill); decode rows have nothing
// to overlap and leave the registers to occupancy. kMinCtas: the CTAs per SM asked of the
// register allocator (launch).
template <int kRows, bool kPrefetch, int kMinCtas>
__global__ void __launch_bounds__(kMaxWarps * 32, kMinCtas)
    gated_delta_rule_kernel(const __grid_constant__ GatedDeltaRuleKernelParams p) {
  enter_dependent_grid();
  // [buffer, warp, lane]: (sum_d S k, sum_d S q) over each warp's rows, and [buffer, warp]:
  // (|q|^2, |k|^2, q.k) over its rows; double-buffered by token.
  __shared__ float2 partials[2][kMaxWarps][32];
  __shared__ float4 norms[2][kMaxWarps];

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t block = blockIdx.x;
  const int tile = int(block % p.n_column_tiles);
  const int v_head = int((block / p.n_column_tiles) % p.n_v_heads);
  const int64_t seq = block / (int64_t(p.n_column_tiles) * p.n_v_heads);
  const int64_t first_row = p.row_begin[seq];
  const int64_t n_rows = p.row_begin[seq + 1] - first_row;
  if (n_rows <= 0) return;  // uniform over the CTA

  const int dk = p.head_k_dim;
  const int dv = p.head_v_dim;
  const int k_head = v_head / (p.n_v_heads / p.n_k_heads);
  const int column = tile * kColumns + lane;
  const bool column_ok = column < dv;
  const int row0 = warp * kRows;
  float* state = p.states + (int64_t(p.state_slot[seq]) * p.n_v_heads + v_head) * dk * dv;

  float s[kRows];  // S[row0 + i, column]
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    s[i] = column_ok && row0 + i < dk ? state[int64_t(row0 + i) * dv + column] : 0.0f;
  }

  TokenInputs<kRows> cur;
  if constexpr (kPrefetch) cur = load_token<kRows>(p, first_row, k_head, v_head, row0, column);
  for (int64_t t = 0; t < n_rows; ++t) {
    const int64_t row = first_row + t;
    if constexpr (!kPrefetch) cur = load_token<kRows>(p, row, k_head, v_head, row0, column);
    // With kPrefetch, the next token's inputs (the last token reloads itself) are in flight
    // during this one.
    TokenInputs<kRows> next = cur;
    if constexpr (kPrefetch) {
      next = load_token<kRows>(p, t + 1 < n_rows ? row + 1 : row, k_head, v_head, row0, column);
    }

    // Every lane sums over the warp's rows (the shuffles broadcast them): the norms' parts are
    // the same in all lanes, the state products are per column.
    float qq = 0.0f;
    float kk = 0.0f;
    float qk = 0.0f;
    float sum_sk = 0.0f;
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const float q_i = row_value(cur, i);
      const float k_i = row_value(cur, kRows + i);
      qq += q_i * q_i;
      kk += k_i * k_i;
      qk += q_i * k_i;
      sum_sk += s[i] * k_i;
      sum_sq += s[i] * q_i;
    }
    const int buffer = int(t % 2);
    partials[buffer][warp][lane] = make_float2(sum_sk, sum_sq);
    if (lane == 0) norms[buffer][warp] = make_float4(qq, kk, qk, 0.0f);
    __syncthreads();
    // The buffer is next written two tokens on, after every thread has passed the next barrier.
    // Every thread sums the warps in the same order: all hold the same values.
    qq = kk = qk = sum_sk = sum_sq = 0.0f;
    for (int w = 0; w < p.n_warps; ++w) {
      const float2 part = partials[buffer][w][lane];
      const float4 norm = norms[buffer][w];
      sum_sk += part.x;
      sum_sq += part.y;
      qq += norm.x;
      kk += norm.y;
      qk += norm.z;
    }

    const float inv_k = 1.0f / sqrtf(kk + p.l2norm_eps);
    const float q_scale = (1.0f / sqrtf(qq + p.l2norm_eps)) / p.sqrt_dk;  // q^ = q * q_scale
    const float decay = expf(cur.g);
    const float read = decay * (inv_k * sum_sk);  // (exp(g) S)^T k^
    const float delta = cur.beta * (cur.v - read);
    const float k_delta = inv_k * delta;
#pragma unroll
    for (int i = 0; i < kRows; ++i) s[i] = s[i] * decay + row_value(cur, kRows + i) * k_delta;
    const float o = decay * (q_scale * sum_sq) + delta * (qk * inv_k * q_scale);
    if (warp == 0 && column_ok) {
      p.out[(row * p.n_v_heads + v_head) * int64_t(dv) + column] = f2h(o);
    }
    cur = next;
  }

#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    if (column_ok && row0 + i < dk) state[int64_t(row0 + i) * dv + column] = s[i];
  }
}

// Rows per thread and occupancy per path (dk <= 128: 16 rows, 8 warps at dk = 128; dk <= 256:
// 32 rows). The decode path asks for 3 CTAs per SM (80 registers), the prefill path for 2 (the
// prefetched inputs need more); see the figures at the top of the file.
template <int kRows, bool kPrefetch>
void launch(const GatedDeltaRuleKernelParams& params, int64_t n_ctas, cudaStream_t stream) {
  constexpr int kMinCtas = kRows > 16 ? 1 : kPrefetch ? 2 : 3;
  const LaunchDims dims{dim3(static_cast<unsigned>(n_ctas)),
                        dim3(static_cast<unsigned>(params.n_warps * 32))};
  launch_kernel(gated_delta_rule_kernel<kRows, kPrefetch, kMinCtas>, dims, stream, params);
}

// The gates as the kernel reads them: precomputed (g, beta) or raw (the other four).
struct GateInputs {
  const float* g;
  const float* beta;
  const uint16_t* raw_a;
  const uint16_t* raw_b;
  const uint16_t* a_log;
  const uint16_t* dt_bias;
};

Status launch_rule(const uint16_t* qkv, const GateInputs& gates, int64_t n_k_heads,
                   int64_t n_v_heads, int64_t head_k_dim, int64_t head_v_dim, float* states,
                   const SequenceRowsView& seqs, uint16_t* out, cudaStream_t stream);

}  // namespace

Status gated_delta_rule_f16(const uint16_t* qkv, const float* g, const float* beta,
                            int64_t n_k_heads, int64_t n_v_heads, int64_t head_k_dim,
                            int64_t head_v_dim, float* states, const SequenceRowsView& seqs,
                            uint16_t* out, cudaStream_t stream) {
  return launch_rule(qkv, GateInputs{g, beta, nullptr, nullptr, nullptr, nullptr}, n_k_heads,
                     n_v_heads, head_k_dim, head_v_dim, states, seqs, out, stream);
}

Status gated_delta_rule_raw_gates_f16(const uint16_t* qkv, const uint16_t* a, const uint16_t* b,
                                      const uint16_t* a_log, const uint16_t* dt_bias,
                                      int64_t n_k_heads, int64_t n_v_heads, int64_t head_k_dim,
                                      int64_t head_v_dim, float* states,
                                      const SequenceRowsView& seqs, uint16_t* out,
                                      cudaStream_t stream) {
  return launch_rule(qkv, GateInputs{nullptr, nullptr, a, b, a_log, dt_bias}, n_k_heads,
                     n_v_heads, head_k_dim, head_v_dim, states, seqs, out, stream);
}

namespace {

Status launch_rule(const uint16_t* qkv, const GateInputs& gates, int64_t n_k_heads,
                   int64_t n_v_heads, int64_t head_k_dim, int64_t head_v_dim, float* states,
                   const SequenceRowsView& seqs, uint16_t* out, cudaStream_t stream) {
  constexpr const char* kOp = "gated_delta_rule_f16: ";
  if (n_k_heads < 1 || n_v_heads < 1 || head_k_dim < 1 || head_v_dim < 1) {
    return Status::error(cat(kOp, "bad shape n_k_heads ", n_k_heads, " n_v_heads ", n_v_heads,
                             " head_k_dim ", head_k_dim, " head_v_dim ", head_v_dim,
                             " (each must be >= 1)"));
  }
  if (n_v_heads % n_k_heads != 0) {
    return Status::error(
        cat(kOp, "n_v_heads ", n_v_heads, " is not a multiple of n_k_heads ", n_k_heads));
  }
  if (head_k_dim > kGatedDeltaRuleMaxHeadKDim) {
    return Status::error(cat(kOp, "head_k_dim ", head_k_dim, " is above the limit ",
                             kGatedDeltaRuleMaxHeadKDim,
                             " (a CTA holds the key rows of its state columns in registers)"));
  }
  const int64_t row_width = 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim;
  if (row_width > INT32_MAX) {
    return Status::error(
        cat(kOp, "qkv row width ", row_width, " elements is above the limit 2^31 - 1"));
  }
  if (seqs.n_seqs < 0) return Status::error(cat(kOp, "negative n_seqs ", seqs.n_seqs));
  if (seqs.n_seqs == 0) return ok_status();
  if (seqs.end_row == seqs.first_row) return ok_status();  // no rows: nothing to read or write
  const bool gates_given = gates.g != nullptr && gates.beta != nullptr;
  const bool raw_given = gates.raw_a != nullptr && gates.raw_b != nullptr &&
                         gates.a_log != nullptr && gates.dt_bias != nullptr;
  if (qkv == nullptr || states == nullptr || out == nullptr || seqs.row_begin == nullptr ||
      seqs.state_slot == nullptr || !(gates_given || raw_given)) {
    return Status::error(cat(kOp, "null qkv, gates, states, out, row_begin or state_slot"));
  }
  const int64_t n_column_tiles = (head_v_dim + kColumns - 1) / kColumns;
  const int64_t n_ctas = seqs.n_seqs * n_v_heads * n_column_tiles;
  if (n_ctas > INT32_MAX) {
    return Status::error(cat(kOp, "n_seqs * n_v_heads * ceil(head_v_dim / 32) = ", n_ctas,
                             " CTAs is above the grid limit 2^31 - 1"));
  }

  // The prefill path when some sequence has several rows (decided once per step on the host).
  const bool prefill = seqs.max_seq_rows > 1;
  const int rows_per_thread = head_k_dim <= 128 ? 16 : 32;
  GatedDeltaRuleKernelParams params{};
  params.qkv = qkv;
  params.g = gates.g;
  params.beta = gates.beta;
  params.raw_a = gates.raw_a;
  params.raw_b = gates.raw_b;
  params.a_log = gates.a_log;
  params.dt_bias = gates.dt_bias;
  params.states = states;
  params.row_begin = seqs.row_begin;
  params.state_slot = seqs.state_slot;
  params.out = out;
  params.row_width = row_width;
  params.n_k_heads = int32_t(n_k_heads);
  params.n_v_heads = int32_t(n_v_heads);
  params.head_k_dim = int32_t(head_k_dim);
  params.head_v_dim = int32_t(head_v_dim);
  params.n_column_tiles = int32_t(n_column_tiles);
  params.n_warps = int32_t((head_k_dim + rows_per_thread - 1) / rows_per_thread);
  params.sqrt_dk = float(std::sqrt(double(head_k_dim)));
  params.l2norm_eps = kGatedDeltaL2NormEps;
  if (rows_per_thread == 16) {
    prefill ? launch<16, true>(params, n_ctas, stream) : launch<16, false>(params, n_ctas, stream);
  } else {
    prefill ? launch<32, true>(params, n_ctas, stream) : launch<32, false>(params, n_ctas, stream);
  }
  E4KV_CUDA_CHECK_LAUNCH();
  return ok_status();
}

}  // namespace

}  // namespace e4kv::cuda
