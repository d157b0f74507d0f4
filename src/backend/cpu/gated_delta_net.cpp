#include "backend/cpu/gated_delta_net.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "core/status.h"

namespace e4kv {
namespace {

void check_md(DType md, const char* op) {
  E4KV_ASSERT(md == DType::kF32 || md == DType::kF16 || md == DType::kBF16,
              cat(op, ": md must be F32, F16 or BF16, got ", dtype_name(md)));
}

// x rounded to md (round to nearest even), returned as fp32.
inline float round_to(float x, DType md) {
  switch (md) {
    case DType::kF16:
      return f16_to_f32(f32_to_f16(x));
    case DType::kBF16:
      return bf16_to_f32(f32_to_bf16(x));
    default:
      return x;
  }
}

// PyTorch's silu / sigmoid in fp32: x / (1 + exp(-x)), 1 / (1 + exp(-x)).
inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}
inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

// silu(rnd(sum)) rounded: HF's conv output in md, then the activation in md (M:241-249).
inline float conv_activation(float sum, DType md) {
  return round_to(silu(round_to(sum, md)), md);
}

void check_conv(const float* x, int64_t n_tokens, int64_t channels, const float* weight,
                int64_t kernel_size, const float* state, const float* out, DType md) {
  E4KV_ASSERT(n_tokens >= 0 && channels > 0 && kernel_size > 0,
              cat("causal_conv1d: bad shape n_tokens=", n_tokens, " channels=", channels,
                  " kernel_size=", kernel_size));
  E4KV_ASSERT(weight != nullptr && (kernel_size == 1 || state != nullptr),
              "causal_conv1d: null weight or state");
  E4KV_ASSERT(n_tokens == 0 || (x != nullptr && out != nullptr && x != out),
              "causal_conv1d: null or aliased x / out");
  check_md(md, "causal_conv1d");
}

// Normalised (and, for q, scaled) rows of one call: [n_tokens, n_k_heads, head_k_dim] each.
struct PreparedQk {
  std::vector<float> q;
  std::vector<float> k;
};

// HF order (M:298-309, M:420-430): optional l2norm of q and k, then q *= scale (chunked) or
// q /= sqrt(dk) (recurrent).
PreparedQk prepare_qk(const GatedDeltaRuleParams& p, bool divide_by_sqrt) {
  const int64_t rows = p.n_tokens * p.n_k_heads;
  const int64_t n = rows * p.head_k_dim;
  PreparedQk out;
  out.q.assign(p.q, p.q + n);
  out.k.assign(p.k, p.k + n);
  if (p.qk_l2norm) {
    l2norm_rows(out.q.data(), rows, p.head_k_dim, out.q.data());
    l2norm_rows(out.k.data(), rows, p.head_k_dim, out.k.data());
  }
  const double dk = double(p.head_k_dim);
  if (divide_by_sqrt) {
    const float sqrt_dk = float(std::sqrt(dk));  // query.shape[-1] ** 0.5 as an fp32 scalar
    for (float& x : out.q) x = x / sqrt_dk;
  } else {
    const float scale = float(std::pow(dk, -0.5));  // query.shape[-1] ** -0.5 as an fp32 scalar
    for (float& x : out.q) x = x * scale;
  }
  return out;
}

void check_rule(const GatedDeltaRuleParams& p, const char* op) {
  E4KV_ASSERT(
      p.n_tokens >= 0 && p.n_k_heads > 0 && p.n_v_heads > 0 && p.head_k_dim > 0 && p.head_v_dim > 0,
      cat(op, ": bad shape n_tokens=", p.n_tokens, " n_k_heads=", p.n_k_heads,
          " n_v_heads=", p.n_v_heads, " head_k_dim=", p.head_k_dim, " head_v_dim=", p.head_v_dim));
  E4KV_ASSERT(p.n_v_heads % p.n_k_heads == 0, cat(op, ": n_v_heads ", p.n_v_heads,
                                                  " is not a multiple of n_k_heads ", p.n_k_heads));
  E4KV_ASSERT(p.state != nullptr, cat(op, ": null state"));
  E4KV_ASSERT(p.n_tokens == 0 || (p.q != nullptr && p.k != nullptr && p.v != nullptr &&
                                  p.g != nullptr && p.beta != nullptr && p.out != nullptr),
              cat(op, ": null input or output"));
}

}  // namespace

void causal_conv1d_silu_prefill(const float* x, int64_t n_tokens, int64_t channels,
                                const float* weight, int64_t kernel_size, float* state, float* out,
                                DType md) {
  check_conv(x, n_tokens, channels, weight, kernel_size, state, out, md);
  const int64_t n_state = kernel_size - 1;
  // Input j of this call's window: j < 0 reaches back into the state (its row n_state + j).
  auto input = [&](int64_t j, int64_t c) {
    return j < 0 ? state[(n_state + j) * channels + c] : x[j * channels + c];
  };
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      const float* w = weight + c * kernel_size;
      float sum = 0.0f;
      for (int64_t i = 0; i < kernel_size; ++i) sum += w[i] * input(t - n_state + i, c);
      out[t * channels + c] = conv_activation(sum, md);
    }
  }
  // The new state is the last n_state rows of [state | x]. Ascending rows read only rows at or
  // after the one written, so the shift is safe in place.
  for (int64_t r = 0; r < n_state; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      state[r * channels + c] = input(r + n_tokens - n_state, c);
    }
  }
}

void causal_conv1d_silu_decode(const float* x, int64_t channels, const float* weight,
                               int64_t kernel_size, float* state, float* out, DType md) {
  check_conv(x, 1, channels, weight, kernel_size, state, out, md);
  const int64_t n_state = kernel_size - 1;
  // HF's causal_conv1d_update: window = [state | x], output = weights . window, state = window
  // without its oldest input.
  for (int64_t c = 0; c < channels; ++c) {
    const float* w = weight + c * kernel_size;
    float sum = 0.0f;
    for (int64_t i = 0; i < n_state; ++i) sum += w[i] * state[i * channels + c];
    sum += w[n_state] * x[c];
    out[c] = conv_activation(sum, md);
    for (int64_t i = 0; i + 1 < n_state; ++i)
      state[i * channels + c] = state[(i + 1) * channels + c];
    if (n_state > 0) state[(n_state - 1) * channels + c] = x[c];
  }
}

void l2norm_rows(const float* x, int64_t n_rows, int64_t dim, float* out, float eps) {
  E4KV_ASSERT(n_rows >= 0 && dim > 0, cat("l2norm_rows: bad shape ", n_rows, " x ", dim));
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum_sq += xr[i] * xr[i];
    const float inv_norm = 1.0f / std::sqrt(sum_sq + eps);  // torch.rsqrt(ss + eps)
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv_norm;
  }
}

void gated_delta_gates(const float* a, const float* b, const float* a_log, const float* dt_bias,
                       int64_t n_tokens, int64_t n_v_heads, float* g, float* beta) {
  E4KV_ASSERT(n_tokens >= 0 && n_v_heads > 0,
              cat("gated_delta_gates: bad shape ", n_tokens, " x ", n_v_heads));
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < n_v_heads; ++h) {
      const int64_t i = t * n_v_heads + h;
      const float s = a[i] + dt_bias[h];
      const float softplus = s > 20.0f ? s : std::log1p(std::exp(s));
      const float decay_rate = std::exp(a_log[h]);
      g[i] = -decay_rate * softplus;
      beta[i] = sigmoid(b[i]);
    }
  }
}

void gated_delta_rule_recurrent(const GatedDeltaRuleParams& p) {
  check_rule(p, "gated_delta_rule_recurrent");
  const PreparedQk qk = prepare_qk(p, /*divide_by_sqrt=*/true);
  const int64_t dk = p.head_k_dim;
  const int64_t dv = p.head_v_dim;
  const int64_t group = p.n_v_heads / p.n_k_heads;
  std::vector<float> kv_mem(static_cast<size_t>(dv));
  std::vector<float> delta(static_cast<size_t>(dv));
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    for (int64_t h = 0; h < p.n_v_heads; ++h) {
      const int64_t qk_row = (t * p.n_k_heads + h / group) * dk;
      const float* q = qk.q.data() + qk_row;  // [dk]
      const float* k = qk.k.data() + qk_row;  // [dk]
      const float* v = p.v + (t * p.n_v_heads + h) * dv;
      const float g_decay = std::exp(p.g[t * p.n_v_heads + h]);
      const float beta = p.beta[t * p.n_v_heads + h];
      float* s = p.state + h * dk * dv;  // [dk, dv]
      float* o = p.out + (t * p.n_v_heads + h) * dv;
      for (int64_t i = 0; i < dk * dv; ++i) s[i] = s[i] * g_decay;
      for (int64_t e = 0; e < dv; ++e) kv_mem[size_t(e)] = 0.0f;
      for (int64_t d = 0; d < dk; ++d) {
        for (int64_t e = 0; e < dv; ++e) kv_mem[size_t(e)] += s[d * dv + e] * k[d];
      }
      for (int64_t e = 0; e < dv; ++e) delta[size_t(e)] = (v[e] - kv_mem[size_t(e)]) * beta;
      for (int64_t d = 0; d < dk; ++d) {
        for (int64_t e = 0; e < dv; ++e) s[d * dv + e] = s[d * dv + e] + k[d] * delta[size_t(e)];
      }
      for (int64_t e = 0; e < dv; ++e) o[e] = 0.0f;
      for (int64_t d = 0; d < dk; ++d) {
        for (int64_t e = 0; e < dv; ++e) o[e] += s[d * dv + e] * q[d];
      }
    }
  }
}

void gated_delta_rule_chunked(const GatedDeltaRuleParams& p, int64_t chunk_size) {
  check_rule(p, "gated_delta_rule_chunked");
  E4KV_ASSERT(chunk_size > 0, cat("gated_delta_rule_chunked: chunk_size ", chunk_size));
  const PreparedQk qk = prepare_qk(p, /*divide_by_sqrt=*/false);
  const int64_t dk = p.head_k_dim;
  const int64_t dv = p.head_v_dim;
  const int64_t group = p.n_v_heads / p.n_k_heads;
  // Longest chunk this call forms: the row stride of the [L, L] scratch matrices.
  const int64_t max_len = std::max<int64_t>(1, std::min(chunk_size, p.n_tokens));
  const auto cs = static_cast<size_t>(max_len);
  std::vector<float> tail_decay(cs);      // [L] exp(gamma_last - gamma_j)
  std::vector<float> gamma(cs);           // [L] cumulative log decay
  std::vector<float> decay(cs * cs);      // [L, L] exp(gamma_i - gamma_j)
  std::vector<float> ut(cs * cs);         // [L, L] A, strictly lower
  std::vector<float> attn(cs * cs);       // [L, L] (q^_i . k_j) D_ij
  std::vector<float> u(cs * size_t(dv));  // [L, dv] U, then V'
  std::vector<float> w(cs * size_t(dk));  // [L, dk] W
  std::vector<float> out_inter(static_cast<size_t>(dv));

  for (int64_t h = 0; h < p.n_v_heads; ++h) {
    const int64_t kh = h / group;
    float* s = p.state + h * dk * dv;  // [dk, dv]
    for (int64_t t0 = 0; t0 < p.n_tokens; t0 += chunk_size) {
      const int64_t len = std::min(chunk_size, p.n_tokens - t0);
      auto q_row = [&](int64_t i) { return qk.q.data() + ((t0 + i) * p.n_k_heads + kh) * dk; };
      auto k_row = [&](int64_t i) { return qk.k.data() + ((t0 + i) * p.n_k_heads + kh) * dk; };
      auto v_row = [&](int64_t i) { return p.v + ((t0 + i) * p.n_v_heads + h) * dv; };
      auto beta_at = [&](int64_t i) { return p.beta[(t0 + i) * p.n_v_heads + h]; };

      // gamma_i = g_0 + ... + g_i, summed in order (torch.cumsum).
      float running = 0.0f;
      for (int64_t i = 0; i < len; ++i) {
        running += p.g[(t0 + i) * p.n_v_heads + h];
        gamma[size_t(i)] = running;
      }
      for (int64_t i = 0; i < len; ++i) {
        for (int64_t j = 0; j <= i; ++j) {
          decay[size_t(i * max_len + j)] = std::exp(gamma[size_t(i)] - gamma[size_t(j)]);
        }
      }
      // A_ij = ((beta_i k_i) . k_j) D_ij and the intra-chunk scores (q^_i . k_j) D_ij.
      for (int64_t i = 0; i < len; ++i) {
        const float beta_i = beta_at(i);
        for (int64_t j = 0; j <= i; ++j) {
          float kk = 0.0f;
          float qk_dot = 0.0f;
          for (int64_t d = 0; d < dk; ++d) {
            kk += (k_row(i)[d] * beta_i) * k_row(j)[d];
            qk_dot += q_row(i)[d] * k_row(j)[d];
          }
          const float dij = decay[size_t(i * max_len + j)];
          ut[size_t(i * max_len + j)] = kk * dij;
          attn[size_t(i * max_len + j)] = qk_dot * dij;
        }
      }
      // Forward substitution with a unit diagonal: U = (I + A)^-1 (beta v),
      // W = (I + A)^-1 (beta k exp(gamma)).
      for (int64_t i = 0; i < len; ++i) {
        const float beta_i = beta_at(i);
        const float decay_i = std::exp(gamma[size_t(i)]);
        float* ui = u.data() + i * dv;
        float* wi = w.data() + i * dk;
        for (int64_t e = 0; e < dv; ++e) ui[e] = v_row(i)[e] * beta_i;
        for (int64_t d = 0; d < dk; ++d) wi[d] = (k_row(i)[d] * beta_i) * decay_i;
        for (int64_t j = 0; j < i; ++j) {
          const float a_ij = ut[size_t(i * max_len + j)];
          const float* uj = u.data() + j * dv;
          const float* wj = w.data() + j * dk;
          for (int64_t e = 0; e < dv; ++e) ui[e] -= a_ij * uj[e];
          for (int64_t d = 0; d < dk; ++d) wi[d] -= a_ij * wj[d];
        }
      }
      // V' = U - W S (in place in u), with S the state entering the chunk.
      for (int64_t i = 0; i < len; ++i) {
        float* ui = u.data() + i * dv;
        const float* wi = w.data() + i * dk;
        for (int64_t e = 0; e < dv; ++e) {
          float ws = 0.0f;
          for (int64_t d = 0; d < dk; ++d) ws += wi[d] * s[d * dv + e];
          ui[e] = ui[e] - ws;
        }
      }
      // O_i = (q^_i exp(gamma_i)) S + sum_{j <= i} attn_ij V'_j.
      for (int64_t i = 0; i < len; ++i) {
        const float decay_i = std::exp(gamma[size_t(i)]);
        const float* qi = q_row(i);
        for (int64_t e = 0; e < dv; ++e) out_inter[size_t(e)] = 0.0f;
        for (int64_t d = 0; d < dk; ++d) {
          const float qd = qi[d] * decay_i;
          for (int64_t e = 0; e < dv; ++e) out_inter[size_t(e)] += qd * s[d * dv + e];
        }
        float* o = p.out + ((t0 + i) * p.n_v_heads + h) * dv;
        for (int64_t e = 0; e < dv; ++e) {
          float intra = 0.0f;
          for (int64_t j = 0; j <= i; ++j) {
            intra += attn[size_t(i * max_len + j)] * u[size_t(j * dv + e)];
          }
          o[e] = out_inter[size_t(e)] + intra;
        }
      }
      // S = exp(gamma_last) S + sum_j (k_j exp(gamma_last - gamma_j)) (x) V'_j.
      const float gamma_last = gamma[size_t(len - 1)];
      const float chunk_decay = std::exp(gamma_last);
      for (int64_t j = 0; j < len; ++j)
        tail_decay[size_t(j)] = std::exp(gamma_last - gamma[size_t(j)]);
      for (int64_t d = 0; d < dk; ++d) {
        for (int64_t e = 0; e < dv; ++e) {
          float update = 0.0f;
          for (int64_t j = 0; j < len; ++j) {
            const float kd = k_row(j)[d] * tail_decay[size_t(j)];
            update += kd * u[size_t(j * dv + e)];
          }
          s[d * dv + e] = s[d * dv + e] * chunk_decay + update;
        }
      }
    }
  }
}

void gated_rms_norm(const float* x, const float* z, const float* weight, int64_t n_rows,
                    int64_t dim, float eps, GateActivation activation, float* out, DType md) {
  E4KV_ASSERT(n_rows >= 0 && dim > 0, cat("gated_rms_norm: bad shape ", n_rows, " x ", dim));
  check_md(md, "gated_rms_norm");
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * dim;
    const float* zr = z + r * dim;
    float* yr = out + r * dim;
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum_sq += xr[i] * xr[i];
    const float variance = sum_sq / float(dim);
    const float inv_rms = 1.0f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < dim; ++i) {
      const float normed = round_to(xr[i] * inv_rms, md);
      const float weighted = round_to(weight[i] * normed, md);
      const float gate = activation == GateActivation::kSilu ? silu(zr[i]) : sigmoid(zr[i]);
      yr[i] = round_to(weighted * gate, md);
    }
  }
}

}  // namespace e4kv
