// The QSA attention mixer of Qwen4Exp (docs/qwen4exp_reference.md section 4; DESIGN.md section 4),
// x: [n_rows, hidden] act (the hyper-connection mix):
//   indexer:  iq = rope((1+w) rms(x Wiq^T) per index head); ik = x Wik^T (raw, FP16)
//             ik -> the sequence's ring; every completed group's pooled, normed, rotated key ->
//             the compressed cache (paged with the main block table)
//   q | gate = x Wq^T (q_proj rows interleaved per head [q_h | gate_h]; regrouped at load)
//   q, k = rope((1+w) rms per head); v = x Wv^T; K/V -> the paged cache (FP16 or E4M3)
//   selection = top budget/ratio groups by index score + the causal tail (qsa/selection.h)
//   out = (attention over the selection * sigmoid(gate)) Wo^T
// Memory: paged K/V and compressed index rows per token; a raw ring of `ratio` index keys per
// sequence (FP16).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "kv/kv_cache_view.h"
#include "model/layers/attention.h"
#include "model/step_context.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace e4kv {

struct QsaAttentionShape {
  int64_t hidden = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;
  int64_t n_index_heads = 0;
  int64_t index_dim = 0;
  int64_t budget = 0;
  int64_t ratio = 0;
  bool bias = false;  // attention_bias: q/k/v/o_proj.bias
  float eps = 1e-6f;

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  int64_t index_q_dim() const { return n_index_heads * index_dim; }
  int64_t sel_width() const { return budget + ratio - 1; }
};

struct QsaAttentionWorkspace {
  AttentionWorkspace heads;  // the projections (q, k, v, gate, iq, ik), FP16 copies, the output
  BackendBuffer gate16, iq16, ik16;      // [rows, q_dim | index_q_dim | index_dim] FP16 bits of
                                         // gate, iq, ik; empty when act is FP16
  BackendBuffer sel_tokens, sel_counts;  // [rows, sel_width], [rows] int32

  static Result<QsaAttentionWorkspace> create(Backend& backend, const QsaAttentionShape& shape,
                                              int64_t max_rows);
};

// One QSA layer's caches: the main K/V (the model's), the compressed index rows and the rings.
struct QsaLayerCache {
  KvCacheView kv;
  IndexerCompressedView compressed;
  IndexerRingView rings;
};

class QsaAttentionMixer {
 public:
  // prefix: "model.layers.3.self_attn."; inv_freq: the model's RoPE frequencies [rotary_dim / 2]
  // (kept by the caller for the model's lifetime).
  static Result<QsaAttentionMixer> load(Backend& backend, WeightLoader& weights,
                                        const std::string& prefix, const QsaAttentionShape& shape,
                                        const double* inv_freq,
                                          const TpShard& tp = {});

  // x, out: [ctx.n_rows(), hidden] act; non_finite: the cache write's [2] counters; stats:
  // nullptr or the cache write's statistics.
  Status forward(Backend& backend, const StepContext& ctx, const QsaLayerCache& cache,
                 const void* x, void* out, QsaAttentionWorkspace& ws,
                 unsigned long long* non_finite, KvWriteStats* stats) const;

  const QsaAttentionShape& shape() const { return shape_; }

 private:
  QsaAttentionShape shape_;
  const double* inv_freq_ = nullptr;
  // Parts: q, k, v, gate (q and gate: q_proj's rows of each head, [q_h | gate_h] interleaved in
  // the checkpoint), the indexer's queries and its key (index_qk_proj's rows); the biases of
  // q/k/v_proj.
  FusedProjection proj_;
  LinearWeight o_;
  BackendBuffer o_bias_;  // empty without attention_bias
  BackendBuffer q_norm_, k_norm_;
  BackendBuffer index_q_norm_;    // [index_dim] act
  BackendBuffer index_k_norm16_;  // [index_dim] FP16 bits (the indexer cache's contract)
};

}  // namespace e4kv
