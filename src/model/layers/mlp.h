// The SiLU-gated MLP ffn: out = (silu(x Wg^T) * (x Wu^T)) Wd^T, x: [n_rows, hidden] act (normed).
// The dense families' ffn, and the shared expert of the MoE ffn (model/layers/moe.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "backend/backend.h"
#include "core/status.h"
#include "model/layers/fused_projection.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace e4kv {

// Activations of the MLPs of one model, shared by its layers, sized at load.
struct MlpWorkspace {
  BackendBuffer gate_up;  // [2, rows, intermediate] act: gate, then up (FusedProjection's parts)

  static Result<MlpWorkspace> create(Backend& backend, int64_t intermediate, int64_t max_rows);
};

class DenseMlp {
 public:
  // prefix: the module's weight names ("model.layers.3.mlp."); intermediate_name: the config
  // field of `intermediate`, for the errors' shapes.
  // tp: this rank's share of the intermediate channels (gate/up rows, down columns); its output
  // is then a partial sum.
  static Result<DenseMlp> load(WeightLoader& weights, const std::string& prefix, int64_t hidden,
                               int64_t intermediate,
                               std::string_view intermediate_name = "intermediate_size",
                               const TpShard& tp = {});
  int64_t intermediate() const { return intermediate_; }
  // gate_proj and up_proj as one weight [2 intermediate, hidden] (gate rows first) where they are
  // stored so (FusedProjection::stacked_view), and down_proj [hidden, intermediate].
  std::optional<LinearView> gate_up_view() const { return gate_up_.stacked_view(); }
  LinearView down_view() const { return down_.view(); }

  // x, out: [n_rows, hidden] act.
  Status forward(Backend& backend, int64_t n_rows, const void* x, void* out,
                 MlpWorkspace& ws) const;

 private:
  int64_t hidden_ = 0;
  int64_t intermediate_ = 0;
  FusedProjection gate_up_;  // gate_proj, up_proj: [inter, hidden] each
  LinearWeight down_;        // [hidden, inter]
};

}  // namespace e4kv
