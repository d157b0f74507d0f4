#include "backend/cpu/moe.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "core/check.h"
#include "core/status.h"
#include "quant/dequantize.h"

namespace e4kv {
namespace {

inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}
inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

// c[m, n] = a[m, k] b[n, k]^T (row-major; b is a PyTorch [out, in] weight).
void matmul_bt(const float* a, const float* b, int64_t m, int64_t n, int64_t k, float* c) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(k), b,
              static_cast<blasint>(k), 0.0f, c, static_cast<blasint>(n));
}

}  // namespace

void moe_route(const float* logits, int64_t n_tokens, int64_t n_experts, int64_t top_k,
               bool norm_topk_prob, int32_t* expert_ids, float* weights) {
  E4KV_ASSERT(
      n_tokens >= 0 && n_experts > 0 && top_k > 0 && top_k <= n_experts,
      cat("moe_route: bad shape n_tokens=", n_tokens, " n_experts=", n_experts, " top_k=", top_k));
  E4KV_ASSERT(n_experts <= INT32_MAX, cat("moe_route: n_experts ", n_experts, " exceeds int32"));
  E4KV_ASSERT(n_tokens == 0 || (logits != nullptr && expert_ids != nullptr && weights != nullptr),
              "moe_route: null input or output");
  std::vector<float> p(static_cast<size_t>(n_experts));
  std::vector<char> chosen(static_cast<size_t>(n_experts));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* row = logits + t * n_experts;
    float row_max = row[0];
    for (int64_t e = 1; e < n_experts; ++e) row_max = std::max(row_max, row[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < n_experts; ++e) {
      p[size_t(e)] = std::exp(row[e] - row_max);
      sum += p[size_t(e)];
    }
    for (float& v : p) v = v / sum;

    // Selection by repeated scans: a strictly greater p replaces the best, so among equal p the
    // lower id (seen first) wins. O(top_k * n_experts), well-defined for any input (even NaN).
    int32_t* ids = expert_ids + t * top_k;
    float* w = weights + t * top_k;
    std::fill(chosen.begin(), chosen.end(), char{0});
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < n_experts; ++e) {
        if (chosen[size_t(e)] != 0) continue;
        if (best < 0 || p[size_t(e)] > p[size_t(best)]) best = e;
      }
      chosen[size_t(best)] = 1;
      ids[j] = static_cast<int32_t>(best);
      w[j] = p[size_t(best)];
    }
    if (norm_topk_prob) {
      float chosen_sum = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) chosen_sum += w[j];
      for (int64_t j = 0; j < top_k; ++j) w[j] = w[j] / chosen_sum;
    }
  }
}

void moe_experts(const MoeExpertsView& experts, const float* x, int64_t n_tokens,
                 const int32_t* expert_ids, const float* weights, int64_t top_k, float* out) {
  const int64_t hidden = experts.hidden;
  const int64_t inter = experts.inter;
  const int64_t n_experts = experts.n_experts;
  E4KV_ASSERT(n_experts > 0 && hidden > 0 && inter > 0 && n_tokens >= 0 && top_k > 0,
              cat("moe_experts: bad shape n_experts=", n_experts, " hidden=", hidden,
                  " inter=", inter, " n_tokens=", n_tokens, " top_k=", top_k));
  E4KV_ASSERT((experts.gate_up != nullptr || experts.gate_up_q != nullptr) &&
                  (experts.down != nullptr || experts.down_q != nullptr),
              "moe_experts: null expert weights");
  if (n_tokens == 0) return;
  E4KV_ASSERT(x != nullptr && expert_ids != nullptr && weights != nullptr && out != nullptr,
              "moe_experts: null input or output");
  E4KV_ASSERT(x != out, "moe_experts: out must not alias x");
  for (int64_t a = 0; a < n_tokens * top_k; ++a) {
    E4KV_ASSERT(expert_ids[a] >= -1 && expert_ids[a] < n_experts,
                cat("moe_experts: expert id ", expert_ids[a], " at token ", a / top_k, " slot ",
                    a % top_k, " is outside [0, ", n_experts, ")"));
  }

  const int64_t chunk_tokens = std::max<int64_t>(1, kMoeTermBufferFloats / (top_k * hidden));
  const int64_t max_assignments = std::min(n_tokens, chunk_tokens) * top_k;
  // Per chunk: term[a] for assignment a = t_local * top_k + j, the fully computed expert output.
  std::vector<float> terms(static_cast<size_t>(max_assignments * hidden));
  // Assignments sorted by expert (counting sort, stable: token order inside an expert).
  std::vector<int64_t> expert_begin(static_cast<size_t>(n_experts + 1));
  std::vector<int64_t> by_expert(static_cast<size_t>(max_assignments));
  // One expert's rows: gathered inputs, gate|up outputs, activations, down outputs.
  std::vector<float> x_rows;
  std::vector<float> gate_up_rows;
  std::vector<float> act_rows;
  std::vector<float> down_rows;
  // Expert e's weights dequantized, for quantized experts.
  std::vector<float> gate_up_weights;
  std::vector<float> down_weights;
  auto expert_gate_up = [&](int64_t e) -> const float* {
    if (experts.gate_up_q == nullptr) return experts.gate_up + e * 2 * inter * hidden;
    gate_up_weights.resize(size_t(2 * inter * hidden));
    dequantize_rows(*experts.gate_up_q, e * 2 * inter, 2 * inter, gate_up_weights.data());
    return gate_up_weights.data();
  };
  auto expert_down = [&](int64_t e) -> const float* {
    if (experts.down_q == nullptr) return experts.down + e * hidden * inter;
    down_weights.resize(size_t(hidden * inter));
    dequantize_rows(*experts.down_q, e * hidden, hidden, down_weights.data());
    return down_weights.data();
  };

  for (int64_t t0 = 0; t0 < n_tokens; t0 += chunk_tokens) {
    const int64_t n_chunk = std::min(chunk_tokens, n_tokens - t0);
    const int64_t n_assign = n_chunk * top_k;
    const int32_t* ids = expert_ids + t0 * top_k;

    std::fill(expert_begin.begin(), expert_begin.end(), int64_t{0});
    // An id of -1 is another rank's expert (expert parallelism): no term, zero in the sum.
    for (int64_t a = 0; a < n_assign; ++a) {
      if (ids[a] >= 0) ++expert_begin[size_t(ids[a]) + 1];
    }
    for (int64_t e = 0; e < n_experts; ++e) expert_begin[size_t(e + 1)] += expert_begin[size_t(e)];
    std::vector<int64_t> next_slot(expert_begin.begin(), expert_begin.end() - 1);
    for (int64_t a = 0; a < n_assign; ++a) {
      if (ids[a] >= 0) by_expert[size_t(next_slot[size_t(ids[a])]++)] = a;
    }

    for (int64_t e = 0; e < n_experts; ++e) {
      const int64_t begin = expert_begin[size_t(e)];
      const int64_t rows = expert_begin[size_t(e + 1)] - begin;
      if (rows == 0) continue;
      x_rows.resize(size_t(rows * hidden));
      gate_up_rows.resize(size_t(rows * 2 * inter));
      act_rows.resize(size_t(rows * inter));
      down_rows.resize(size_t(rows * hidden));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = t0 + by_expert[size_t(begin + r)] / top_k;
        std::copy_n(x + token * hidden, hidden, x_rows.data() + r * hidden);
      }
      // gate and up in one product: the packed [2 * inter, hidden] block of expert e.
      matmul_bt(x_rows.data(), expert_gate_up(e), rows, 2 * inter, hidden, gate_up_rows.data());
      for (int64_t r = 0; r < rows; ++r) {
        const float* gate = gate_up_rows.data() + r * 2 * inter;
        const float* up = gate + inter;
        float* act = act_rows.data() + r * inter;
        for (int64_t i = 0; i < inter; ++i) act[i] = silu(gate[i]) * up[i];
      }
      matmul_bt(act_rows.data(), expert_down(e), rows, hidden, inter, down_rows.data());
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(down_rows.data() + r * hidden, hidden,
                    terms.data() + by_expert[size_t(begin + r)] * hidden);
      }
    }

    // Weighted sum of each token's terms in j order, from zero.
    for (int64_t tl = 0; tl < n_chunk; ++tl) {
      const int64_t t = t0 + tl;
      float* o = out + t * hidden;
      std::fill(o, o + hidden, 0.0f);
      for (int64_t j = 0; j < top_k; ++j) {
        if (ids[tl * top_k + j] < 0) continue;
        const float w = weights[t * top_k + j];
        const float* term = terms.data() + (tl * top_k + j) * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          const float weighted = w * term[i];
          o[i] += weighted;
        }
      }
    }
  }
}

void sigmoid_gated_add(float* out, const float* y, const float* gate_logits, int64_t n_tokens,
                       int64_t dim) {
  E4KV_ASSERT(n_tokens >= 0 && dim > 0,
              cat("sigmoid_gated_add: bad shape n_tokens=", n_tokens, " dim=", dim));
  E4KV_ASSERT(n_tokens == 0 || (out != nullptr && y != nullptr && gate_logits != nullptr),
              "sigmoid_gated_add: null input or output");
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float gate = sigmoid(gate_logits[t]);
    float* o = out + t * dim;
    const float* yt = y + t * dim;
    for (int64_t i = 0; i < dim; ++i) {
      const float gated = gate * yt[i];
      o[i] += gated;
    }
  }
}

}  // namespace e4kv
