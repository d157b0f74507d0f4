#include "model/layers/moe.h"

#include <optional>
#include <utility>
#include <vector>

#include "model/workspace.h"

namespace e4kv {

Result<MoeWorkspace> MoeWorkspace::create(Backend& backend, const MoeShape& shape,
                                          int64_t max_rows) {
  MoeWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  E4KV_RETURN_IF_ERROR(allocate_buffers(backend, {{&ws.logits, n * size_t(shape.n_experts + 1) * 4},
                                                  {&ws.ids, n * size_t(shape.top_k + 1) * 4},
                                                  {&ws.weights, n * size_t(shape.top_k + 1) * 4},
                                                  {&ws.shared, n * size_t(shape.hidden) * act}}));
  E4KV_ASSIGN_OR_RETURN(ws.shared_mlp, MlpWorkspace::create(backend, shape.shared_inter, max_rows));
  return ws;
}

Result<MoeFfn> MoeFfn::load(WeightLoader& weights, const std::string& p, const MoeShape& shape,
                            const TpShard& tp) {
  MoeFfn m;
  m.shape_ = shape;
  const int64_t h = shape.hidden;
  const int64_t e = shape.n_experts;
  const int64_t i = shape.inter;
  // Expert parallelism: this rank's experts [eb, eb + ec); the router and the shared expert's
  // gate are whole on every rank, the shared expert is split by its channels.
  if (e % tp.size != 0) {
    return Status::error(cat("tensor parallel size ", tp.size, " does not split ", e,
                             " experts evenly; choose a size that divides num_experts"));
  }
  const int64_t eb = tp.begin(e);
  const int64_t ec = tp.count(e);
  m.expert_begin_ = eb;
  m.expert_count_ = ec;
  E4KV_ASSIGN_OR_RETURN(m.router_,
                        FusedProjection::load(weights, h,
                                              {{p + "gate", e, "[num_experts, hidden_size]"},
                                               {p + "shared_expert_gate", 1, "[1, hidden_size]"}}));
  if (weights.has(p + "experts.gate_up_proj")) {
    E4KV_ASSIGN_OR_RETURN(
        BackendBuffer gate_up,
        weights.load_rows(p + "experts.gate_up_proj", {e, 2 * i, h},
                          "[num_experts, 2 * moe_intermediate_size, hidden_size]", eb, ec));
    E4KV_ASSIGN_OR_RETURN(
        BackendBuffer down,
        weights.load_rows(p + "experts.down_proj", {e, h, i},
                          "[num_experts, hidden_size, moe_intermediate_size]", eb, ec));
    const auto act_size = int64_t(weights.backend().act_size());
    m.gate_up_ = LinearWeight::dense(std::move(gate_up), ec * 2 * i, h, act_size);
    m.down_ = LinearWeight::dense(std::move(down), ec * h, i, act_size);
  } else {
    // Per expert: gate_0, up_0, gate_1, up_1, ... stacked is the packed [E, 2I, H] layout.
    std::vector<std::string> gate_up, down;
    for (int64_t x = 0; x < e; ++x) {
      const std::string q = cat(p, "experts.", x, ".");
      if (x < eb || x >= eb + ec) {
        weights.skip_prefix(q);  // another rank's expert
        continue;
      }
      gate_up.push_back(q + "gate_proj");
      gate_up.push_back(q + "up_proj");
      down.push_back(q + "down_proj");
    }
    E4KV_ASSIGN_OR_RETURN(m.gate_up_, weights.load_linear_concat(
                                          gate_up, i, h, "[moe_intermediate_size, hidden_size]"));
    E4KV_ASSIGN_OR_RETURN(
        m.down_, weights.load_linear_concat(down, h, i, "[hidden_size, moe_intermediate_size]"));
  }
  E4KV_ASSIGN_OR_RETURN(m.shared_expert_,
                        DenseMlp::load(weights, p + "shared_expert.", h, shape.shared_inter,
                                       "shared_expert_intermediate_size", tp));
  return m;
}

Status MoeFfn::forward(Backend& b, int64_t n, const void* x, void* out, MoeWorkspace& ws) const {
  const MoeShape& s = shape_;
  // The router's logits and the shared expert's gate in one projection (fp32).
  E4KV_RETURN_IF_ERROR(router_.forward(b, x, n, ws.logits.data(), DType::kF32));
  const float* logits = router_.part<float>(ws.logits.data(), n, 0, 4);
  const float* shared_gate = router_.part<float>(ws.logits.data(), n, 1, 4);
  if (expert_count_ == s.n_experts && shared_expert_.intermediate() == s.inter) {
    // The shared expert as one more expert of every row, where the backend does that (a decode
    // step on CUDA: two MLP launches and its gated add fewer).
    if (const std::optional<LinearView> shared_gate_up = shared_expert_.gate_up_view()) {
      E4KV_ASSIGN_OR_RETURN(
          const bool fused,
          b.moe_route_experts_shared(logits, s.norm_topk_prob, x, gate_up_.view(), down_.view(),
                                     s.n_experts, s.hidden, s.inter, ws.ids.as<int32_t>(),
                                     ws.weights.as<float>(), n, s.top_k, out, *shared_gate_up,
                                     shared_expert_.down_view(), shared_gate));
      if (fused) return ok_status();
    }
  }
  E4KV_RETURN_IF_ERROR(shared_expert_.forward(b, n, x, ws.shared.data(), ws.shared_mlp));
  if (expert_count_ == s.n_experts) {
    // Every expert on this rank: the router, the experts and the shared expert's gated add in
    // one call (fewer launches).
    return b.moe_route_experts(logits, s.norm_topk_prob, x, gate_up_.view(), down_.view(),
                               s.n_experts, s.hidden, s.inter, ws.ids.as<int32_t>(),
                               ws.weights.as<float>(), n, s.top_k, out, ws.shared.data(),
                               shared_gate);
  }
  E4KV_RETURN_IF_ERROR(b.moe_route(logits, n, s.n_experts, s.top_k, s.norm_topk_prob,
                                   ws.ids.as<int32_t>(), ws.weights.as<float>()));
  E4KV_RETURN_IF_ERROR(
      b.moe_local_ids(ws.ids.as<int32_t>(), n, s.top_k, expert_begin_, expert_count_));
  E4KV_RETURN_IF_ERROR(b.moe_experts(x, gate_up_.view(), down_.view(), expert_count_, s.hidden,
                                     s.inter, ws.ids.as<int32_t>(), ws.weights.as<float>(), n,
                                     s.top_k, out));
  return b.sigmoid_gated_add(out, ws.shared.data(), shared_gate, n, s.hidden);
}

}  // namespace e4kv
