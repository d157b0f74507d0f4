// Hyper-connections (Qwen4Exp, docs/qwen4exp_reference.md section 3.2): the residual is n_streams
// copies of the hidden state side by side, X: [n_rows, n_streams * hidden] act. A block reads a
// learned mix of the streams and writes its output back into every stream with its own gate:
//   Xn   = grouped (1 + w) RMSNorm of each stream                     hc_norm
//   a    = silu((Xn Wdown^T) / S);  m = sigmoid(a Wup^T)               input_mix_weight_{down,up}
//   mix  = mean over s of m_s * Xn_s                                   -> the mixer / ffn input
//   inj  = 2 sigmoid((Xn Winj^T) / S)                                  block_inject_weight
//   X_s += inj_s * y                                                   after the mixer / ffn
// The model's final mixer is the same block without the injection (no final RMSNorm).
#pragma once

#include <cstdint>
#include <string>

#include "backend/backend.h"
#include "core/status.h"
#include "model/weights.h"

namespace e4kv {

struct HyperConnectionShape {
  int64_t hidden = 0;
  int64_t streams = 0;  // hc_count
  int64_t rank = 0;     // hc_lowrank
  float eps = 1e-6f;

  int64_t width() const { return streams * hidden; }
};

// Activations of the hyper-connection blocks of one model, shared by its layers.
struct HyperConnectionWorkspace {
  BackendBuffer xn;      // [rows, streams * hidden] act
  BackendBuffer a;       // [rows, rank] act
  BackendBuffer up;      // [rows, streams * hidden] act
  BackendBuffer inj[2];  // [rows, streams] act: a block's logits, and the previous block's while
                         // its injection is pending (HcPending)
  const void* last_inj = nullptr;  // which of inj[] the last mix() wrote

  static Result<HyperConnectionWorkspace> create(Backend& backend,
                                                 const HyperConnectionShape& shape,
                                                 int64_t max_rows);
};

// A block's injection not yet applied to x: mix() of the next block applies it (in its fused
// form, inside the mix's own launches; otherwise as hc_inject first), apply_pending() alone.
struct HcPending {
  const void* y = nullptr;    // [n, hidden] act: the block's output
  const void* inj = nullptr;  // [n, streams] act: its injection logits (one of ws.inj[])
  explicit operator bool() const { return y != nullptr; }
};

class HyperConnection {
 public:
  // prefix: "model.layers.3.attn_hyper_connection."; inject: the block has block_inject_weight
  // (every layer block; not the final mixer).
  static Result<HyperConnection> load(WeightLoader& weights, const std::string& prefix,
                                      const HyperConnectionShape& shape, bool inject);

  // mix = the block's input mix of x for n rows; with injection, also leaves the injection
  // logits of these rows in ws.inj for inject(). x: [n, width] act; mix: [n, hidden] act.
  // `pending`: the previous block's injection, applied to x first (x is written).
  Status mix(Backend& backend, int64_t n, void* x, void* mix, HyperConnectionWorkspace& ws,
             const HcPending& pending) const;
  // Nothing pending: x is only read.
  Status mix(Backend& backend, int64_t n, const void* x, void* mix,
             HyperConnectionWorkspace& ws) const {
    return this->mix(backend, n, const_cast<void*>(x), mix, ws, HcPending{});
  }
  // x_s += 2 sigmoid(inj_s / S) * y, with the logits mix() left in ws. y: [n, hidden] act.
  Status inject(Backend& backend, int64_t n, void* x, const void* y,
                HyperConnectionWorkspace& ws) const;
  // The same injection left for the next block's mix() (y must stay unchanged until then).
  HcPending defer_inject(const void* y, const HyperConnectionWorkspace& ws) const;
  // Applies a pending injection on its own (before anything else reads or changes x).
  static Status apply_pending(Backend& backend, int64_t n, void* x, const HcPending& pending,
                              const HyperConnectionShape& shape);
  const HyperConnectionShape& shape() const { return shape_; }

 private:
  HyperConnectionShape shape_;
  BackendBuffer norm_, down_, up_, inject_;  // inject_ empty for the final mixer
};

}  // namespace e4kv
