// The full-attention mixer over the paged KV cache (FP16 or E4M3 behind the scale gate), for the
// rows of one forward (x: [n_rows, hidden] act, already normed):
//   q, k, v = x Wq^T (+bq), x Wk^T (+bk), x Wv^T (+bv)
//   q, k = rms_norm per head (q_norm, k_norm)                      when the family has them
//   q, k = rope_neox(q, k) at each row's position (the step's cos/sin)
//   k16, v16 = fp16(k), fp16(v); cache_write(k16, v16) at each row's slot
//   a = paged_attention(fp16(q)) over positions 0..pos of the row's sequence
//   out = a Wo^T (+bo)
// K, V and q are FP16 at the cache and attention, as the cache contract (DESIGN.md section 2) says.
// The QSA mixer (model/layers/qsa_attention.h) shares the path from the per-head norms to the cache
// write (write_kv_rows) and the output projection (project_attention_output).
#pragma once

#include <cstdint>
#include <string>

#include "backend/backend.h"
#include "core/status.h"
#include "kv/kv_cache_view.h"
#include "model/layers/fused_projection.h"
#include "model/step_context.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace e4kv {

struct AttentionShape {
  int64_t hidden = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;
  bool qkv_bias = false;  // q/k/v_proj.bias
  bool o_bias = false;    // o_proj.bias
  bool qk_norm = false;   // q_norm.weight, k_norm.weight [head_dim]
  RmsNormForm qk_norm_form = RmsNormForm::kWeight;
  float eps = 1e-6f;

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }

  // Tensor parallelism: rank r of N takes the r-th N-th of the query heads and the key/value
  // heads they read: its N-th of those when there are at least N, else the one its query heads
  // share (replicated, as vLLM does). Errors: heads that do not split so.
  struct Share {
    int64_t q_head_begin = 0;
    int64_t kv_head_begin = 0;
  };
  Result<Share> shard(const TpShard& tp, AttentionShape& local) const;
};

// Activations of the attention mixers of one model, shared by its layers, sized at load.
struct AttentionWorkspace {
  BackendBuffer proj;           // [rows, proj_cols] act: the step's projections (FusedProjection)
  BackendBuffer q16, k16, v16;  // [rows, q_dim | kv_dim] FP16 bits; empty when act is FP16
  BackendBuffer attn;           // [rows, q_dim] fp32
  BackendBuffer attn_act;       // [rows, q_dim] act (only when act is not fp32)

  // proj_cols: the columns of every projection the mixer computes at once (q_dim + 2 kv_dim
  // for plain attention).
  static Result<AttentionWorkspace> create(Backend& backend, int64_t q_dim, int64_t kv_dim,
                                           int64_t proj_cols, int64_t max_rows);
};

// One step's q, k and v (act, in the workspace's projections) and their FP16 forms: the act
// buffers themselves when act is FP16 (nothing to convert), else the workspace's copies.
struct AttentionRows {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  uint16_t* q16 = nullptr;
  uint16_t* k16 = nullptr;
  uint16_t* v16 = nullptr;

  static AttentionRows in(AttentionWorkspace& ws, DType act, void* q, void* k, void* v);
};

// The heads of an attention layer, as write_kv_rows sees them.
struct AttentionHeads {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;
  float eps = 1e-6f;
};

// For the rows of the step, after the projections into rows.q, rows.k, rows.v: q and k normed
// per head (q_norm, k_norm: [head_dim] act, both or neither, in `form`), rotated at each row's
// position; q, k, v converted to FP16 (rows.q16, k16, v16; nothing to do when those are the act
// buffers); K and V written to `cache` at each row's slot. non_finite: the cache write's [2]
// counters; stats: nullptr or its statistics.
Status write_kv_rows(Backend& backend, const StepContext& ctx, const KvCacheView& cache,
                     const AttentionHeads& heads, const void* q_norm, const void* k_norm,
                     RmsNormForm form, const AttentionRows& rows, unsigned long long* non_finite,
                     KvWriteStats* stats);

// out = attention Wo^T (+bo) of the rows of the step, from ws.attn (fp32, converted to act first
// when act is not fp32). o: [hidden, q_dim]; o_bias: [hidden] act or nullptr.
Status project_attention_output(Backend& backend, int64_t n_rows, int64_t q_dim, int64_t hidden,
                                AttentionWorkspace& ws, const LinearView& o, const void* o_bias,
                                void* out);

class AttentionMixer {
 public:
  // prefix: the module's weight names up to the projection ("model.layers.3.self_attn.").
  // shape: the whole layer's; tp: this rank's share (AttentionShape::shard), whose output
  // projection leaves a partial sum (the bias added by rank 0 only).
  static Result<AttentionMixer> load(WeightLoader& weights, const std::string& prefix,
                                     const AttentionShape& shape, const TpShard& tp = {});

  // out = the mixer of x for every row of the step. x, out: [ctx.n_rows(), hidden] act;
  // non_finite: the cache write's [2] counters; stats: nullptr or the cache write's statistics.
  Status forward(Backend& backend, const StepContext& ctx, const KvCacheView& cache, const void* x,
                 void* out, AttentionWorkspace& ws, unsigned long long* non_finite,
                 KvWriteStats* stats) const;

  const AttentionShape& shape() const { return shape_; }

 private:
  AttentionShape shape_;
  FusedProjection qkv_;  // q_proj, k_proj, v_proj (and their biases)
  LinearWeight o_;
  BackendBuffer o_bias_;           // empty when absent
  BackendBuffer q_norm_, k_norm_;                    // empty when absent
};

}  // namespace e4kv
