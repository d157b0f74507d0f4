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
  BackendBuffer xn;   // [rows, streams * hidden] act
  BackendBuffer a;    // [rows, rank] act
  BackendBuffer up;   // [rows, streams * hidden] act
  BackendBuffer inj;  // [rows, streams] act

  static Result<HyperConnectionWorkspace> create(Backend& backend,
                                                 const HyperConnectionShape& shape,
                                                 int64_t max_rows);
};

class HyperConnection {
 public:
  // prefix: "model.layers.3.attn_hyper_connection."; inject: the block has block_inject_weight
  // (every layer block; not the final mixer).
  static Result<HyperConnection> load(WeightLoader& weights, const std::string& prefix,
                                      const HyperConnectionShape& shape, bool inject);

  // mix = the block's input mix of x for n rows; with injection, also leaves the injection
  // logits of these rows in ws.inj for inject(). x: [n, width] act; mix: [n, hidden] act.
  Status mix(Backend& backend, int64_t n, const void* x, void* mix,
             HyperConnectionWorkspace& ws) const;
  // x_s += 2 sigmoid(inj_s / S) * y, with the logits mix() left in ws. y: [n, hidden] act.
  Status inject(Backend& backend, int64_t n, void* x, const void* y,
                HyperConnectionWorkspace& ws) const;

 private:
  HyperConnectionShape shape_;
  BackendBuffer norm_, down_, up_, inject_;  // inject_ empty for the final mixer
};

}  // namespace e4kv
