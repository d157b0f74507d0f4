#include "model/layers/hyper_connection.h"

#include "model/workspace.h"

namespace e4kv {

Result<HyperConnectionWorkspace> HyperConnectionWorkspace::create(Backend& backend,
                                                                  const HyperConnectionShape& shape,
                                                                  int64_t max_rows) {
  HyperConnectionWorkspace ws;
  const size_t n = size_t(max_rows);
  const size_t act = backend.act_size();
  E4KV_RETURN_IF_ERROR(allocate_buffers(backend, {{&ws.xn, n * size_t(shape.width()) * act},
                                                  {&ws.a, n * size_t(shape.rank) * act},
                                                  {&ws.up, n * size_t(shape.width()) * act},
                                                  {&ws.inj[0], n * size_t(shape.streams) * act},
                                                  {&ws.inj[1], n * size_t(shape.streams) * act}}));
  return ws;
}

Result<HyperConnection> HyperConnection::load(WeightLoader& weights, const std::string& p,
                                              const HyperConnectionShape& shape, bool inject) {
  HyperConnection hc;
  hc.shape_ = shape;
  const int64_t width = shape.width();
  E4KV_ASSIGN_OR_RETURN(hc.norm_,
                        weights.load(p + "hc_norm.weight", {width}, "[hc_count * hidden_size]"));
  E4KV_ASSIGN_OR_RETURN(hc.down_,
                        weights.load(p + "input_mix_weight_down.weight", {shape.rank, width},
                                     "[hc_lowrank, hc_count * hidden_size]"));
  E4KV_ASSIGN_OR_RETURN(hc.up_, weights.load(p + "input_mix_weight_up.weight", {width, shape.rank},
                                             "[hc_count * hidden_size, hc_lowrank]"));
  if (inject) {
    E4KV_ASSIGN_OR_RETURN(hc.inject_,
                          weights.load(p + "block_inject_weight.weight", {shape.streams, width},
                                       "[hc_count, hc_count * hidden_size]"));
  }
  return hc;
}

Status HyperConnection::mix(Backend& b, int64_t n, void* x, void* mix, HyperConnectionWorkspace& ws,
                            const HcPending& pending) const {
  const HyperConnectionShape& s = shape_;
  const DType act = b.act_dtype();
  const float inv_streams = 1.0f / float(s.streams);
  // This block's logits go to the buffer the pending injection does not hold.
  void* inj = pending.inj == ws.inj[0].data() ? ws.inj[1].data() : ws.inj[0].data();
  {
    const bool inject = !inject_.empty();
    E4KV_ASSIGN_OR_RETURN(
        const bool fused,
        b.hc_mix_fused(x, norm_.data(), down_.data(), up_.data(), inject ? inject_.data() : nullptr,
                       n, s.streams, s.hidden, s.rank, s.eps, mix, inject ? inj : nullptr,
                       ws.up.data(), ws.up.bytes(), pending.y, pending.inj));
    if (fused) {
      ws.last_inj = inject ? inj : nullptr;
      return ok_status();
    }
  }
  if (pending) E4KV_RETURN_IF_ERROR(apply_pending(b, n, x, pending, s));
  E4KV_RETURN_IF_ERROR(b.rms_norm_grouped(x, norm_.data(), n, s.streams, s.hidden, s.eps,
                                          RmsNormForm::kOnePlusWeight, ws.xn.data()));
  E4KV_RETURN_IF_ERROR(
      b.linear(ws.xn.data(), down_.data(), nullptr, n, s.width(), s.rank, ws.a.data(), act));
  E4KV_RETURN_IF_ERROR(b.silu_scaled(ws.a.data(), n * s.rank, inv_streams, ws.a.data()));
  E4KV_RETURN_IF_ERROR(
      b.linear(ws.a.data(), up_.data(), nullptr, n, s.rank, s.width(), ws.up.data(), act));
  E4KV_RETURN_IF_ERROR(b.hc_mix(ws.up.data(), ws.xn.data(), n, s.streams, s.hidden, mix));
  if (!inject_.empty()) {
    E4KV_RETURN_IF_ERROR(
        b.linear(ws.xn.data(), inject_.data(), nullptr, n, s.width(), s.streams, inj, act));
  }
  ws.last_inj = inject_.empty() ? nullptr : inj;
  return ok_status();
}

Status HyperConnection::inject(Backend& b, int64_t n, void* x, const void* y,
                               HyperConnectionWorkspace& ws) const {
  return apply_pending(b, n, x, defer_inject(y, ws), shape_);
}

HcPending HyperConnection::defer_inject(const void* y, const HyperConnectionWorkspace& ws) const {
  E4KV_ASSERT(!inject_.empty() && ws.last_inj != nullptr,
              "HyperConnection::inject on a block without injection weights or logits");
  return HcPending{y, ws.last_inj};
}

Status HyperConnection::apply_pending(Backend& b, int64_t n, void* x, const HcPending& pending,
                                      const HyperConnectionShape& shape) {
  if (!pending) return ok_status();
  return b.hc_inject(x, pending.y, pending.inj, n, shape.streams, shape.hidden);
}

}  // namespace e4kv
