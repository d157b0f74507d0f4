#include "model/layers/mlp.h"

#include <algorithm>

namespace e4kv {

Result<MlpWorkspace> MlpWorkspace::create(Backend& backend, int64_t intermediate,
                                          int64_t max_rows) {
  MlpWorkspace ws;
  const size_t bytes =
      std::max<size_t>(64, size_t(2 * max_rows * intermediate) * backend.act_size());
  E4KV_ASSIGN_OR_RETURN(ws.gate_up, backend.allocate(bytes));
  return ws;
}

Result<DenseMlp> DenseMlp::load(WeightLoader& weights, const std::string& p, int64_t hidden,
                                int64_t intermediate, std::string_view intermediate_name,
                                const TpShard& tp) {
  if (intermediate % tp.size != 0) {
    return Status::error(cat("tensor parallel size ", tp.size, " does not split ",
                             intermediate_name, " ", intermediate,
                             " evenly; choose a size that divides it"));
  }
  DenseMlp m;
  m.hidden_ = hidden;
  m.intermediate_ = tp.count(intermediate);
  const std::string in_shape = cat("[", intermediate_name, ", hidden_size]");
  const std::string out_shape = cat("[hidden_size, ", intermediate_name, "]");
  LinearSlice cols;
  std::vector<RowRange> rows;
  if (tp.split()) {
    rows = {{tp.begin(intermediate), m.intermediate_}};
    cols = {LinearSlice::Dim::kColumns, tp.begin(intermediate), m.intermediate_};
  }
  E4KV_ASSIGN_OR_RETURN(m.gate_up_,
                        FusedProjection::load(weights, hidden,
                                              {{p + "gate_proj", intermediate, in_shape, rows},
                                               {p + "up_proj", intermediate, in_shape, rows}}));
  E4KV_ASSIGN_OR_RETURN(m.down_,
                        weights.load_linear(p + "down_proj", hidden, intermediate, out_shape, cols));
  return m;
}

Status DenseMlp::forward(Backend& b, int64_t n, const void* x, void* out, MlpWorkspace& ws) const {
  const DType act = b.act_dtype();
  E4KV_RETURN_IF_ERROR(gate_up_.forward(b, x, n, ws.gate_up.data(), act));
  void* gate = gate_up_.part(ws.gate_up.data(), n, 0, b.act_size());
  void* up = gate_up_.part(ws.gate_up.data(), n, 1, b.act_size());
  E4KV_RETURN_IF_ERROR(b.silu_mul(gate, up, gate, n * intermediate_));
  return b.linear(gate, down_.view(), nullptr, n, out, act);
}

}  // namespace e4kv
