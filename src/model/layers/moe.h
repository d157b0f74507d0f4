// The sparse MoE ffn of Qwen4Exp (docs/qwen4exp_reference.md section 6), x: [n_rows, hidden] act:
//   p = softmax(x Wrouter^T) over all experts (the projection's output in fp32); top-k
//   (norm_topk_prob: renormalised)
//   out = sum_j w_j * expert_{e_j}(x) + sigmoid(x wgate^T) * shared_expert(x)
// expert(x) = down(silu(gate x) * up x). The routed experts are held packed as transformers holds
// them after loading (gate_up [E, 2I, H], down [E, H, I]); a checkpoint storing them per expert
// (mlp.experts.{e}.{gate,up,down}_proj.weight, what save_pretrained writes) is stacked at load.
#pragma once

#include <cstdint>
#include <string>

#include "backend/backend.h"
#include "core/status.h"
#include "model/layers/fused_projection.h"
#include "model/layers/mlp.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace e4kv {

struct MoeShape {
  int64_t hidden = 0;
  int64_t n_experts = 0;
  int64_t top_k = 0;
  int64_t inter = 0;         // moe_intermediate_size
  int64_t shared_inter = 0;  // shared_expert_intermediate_size
  bool norm_topk_prob = true;
};

struct MoeWorkspace {
  BackendBuffer logits;       // [rows, n_experts] then [rows] fp32: router logits, shared gate
  BackendBuffer ids;          // [rows, top_k + 1] int32 (the shared expert: MoeFfn::forward)
  BackendBuffer weights;      // [rows, top_k] fp32
  MlpWorkspace shared_mlp;    // the shared expert's: [rows, shared_inter] act
  BackendBuffer shared;       // [rows, hidden] act

  static Result<MoeWorkspace> create(Backend& backend, const MoeShape& shape, int64_t max_rows);
};

class MoeFfn {
 public:
  // prefix: "model.layers.3.mlp.".
  // tp: this rank's experts (expert parallelism) and share of the shared expert's channels; its
  // output is then a partial sum.
  static Result<MoeFfn> load(WeightLoader& weights, const std::string& prefix,
                             const MoeShape& shape, const TpShard& tp = {});

  // x, out: [n, hidden] act.
  Status forward(Backend& backend, int64_t n, const void* x, void* out, MoeWorkspace& ws) const;

 private:
  MoeShape shape_;
  int64_t expert_begin_ = 0;  // this rank's experts
  int64_t expert_count_ = 0;
  FusedProjection router_;  // parts: the router (gate) [n_experts, hidden], shared_expert_gate
                            // [1, hidden], both fp32 out
  LinearWeight gate_up_, down_;  // [n_experts * 2 * inter, hidden], [n_experts * hidden, inter]
  DenseMlp shared_expert_;
};

}  // namespace e4kv
