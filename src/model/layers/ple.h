// PLE, the hashed n-gram embedding block of Qwen4Exp (docs/qwen4exp_reference.md section 7), on
// the layers of ple_layer_ids, added to every residual stream before the layer's mixer:
//   emb  = concat over hash heads h of table[id_h(token, previous tokens)]      (host, mmapped)
//   kn   = grouped (1+w) rms(emb Wkey^T); val = emb Wval^T; qn = grouped (1+w) rms(X)
//   gv_s = sigmoid(signed sqrt(kn_s . qn_s / sqrt(H))) * val
//   X   += gv + silu(dilated causal conv(grouped (1+w) rms(gv)))
// The n-gram table (about 48 GiB in the real model) stays in the memory-mapped checkpoint: the
// rows a forward needs are gathered on the host and copied in. Per-sequence state: the last
// ngram_size - 1 tokens (host, EOS at the start) and the conv window [(kernel - 1) * ngram_size,
// streams * hidden] act.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "io/checkpoint.h"
#include "model/ple_ngram.h"
#include "model/weights.h"

namespace e4kv {

struct PleShape {
  int64_t hidden = 0;
  int64_t streams = 0;
  int64_t embed_dim = 0;  // ple_embed_dim
  int64_t conv_kernel = 4;
  int64_t dilation = 3;  // ngram_size
  float eps = 1e-6f;

  int64_t width() const { return streams * hidden; }
  int64_t conv_state_elems() const { return (conv_kernel - 1) * dilation * width(); }
};

struct PleWorkspace {
  std::vector<int64_t> ids;    // [rows, hash heads] host
  std::vector<float> emb_f32;  // [rows, embed_dim] host
  std::vector<uint16_t> emb_f16;
  BackendBuffer emb;               // [rows, embed_dim] act
  BackendBuffer kn, qn, gv, conv;  // [rows, width] act
  BackendBuffer val;               // [rows, hidden] act

  static Result<PleWorkspace> create(Backend& backend, const PleShape& shape, int64_t n_heads,
                                     int64_t max_rows);
};

// One PLE layer's per-sequence state.
struct PleState {
  BackendBuffer conv;                         // [slots, conv_state_elems] act
  std::vector<std::vector<int32_t>> history;  // [slots][ngram_size - 1] host

  void reset(Backend& backend, const PleShape& shape, int32_t slot, int64_t ngram_size,
             int64_t eos);
  // Slot `dst` becomes a copy of slot `src` (a forked sequence); slots in [0, n_slots).
  Status copy(Backend& backend, const PleShape& shape, int32_t src, int32_t dst, int64_t n_slots);
};

class PleBlock {
 public:
  // prefix: "model.layers.0.ple."; ple_index: the layer's position in ple_layer_ids.
  static Result<PleBlock> load(const Checkpoint& ckpt, WeightLoader& weights,
                               const std::string& prefix, const PleShape& shape,
                               const Qwen4ExpConfig& config, int64_t vocab_size, int64_t ple_index);
  Result<PleState> create_state(Backend& backend, int64_t n_slots) const;

  // x += PLE(x) for the rows of the step. tokens: the step's token ids (host), rows of each
  // sequence as seqs says (host arrays). x: [n, width] act.
  Status forward(Backend& backend, std::span<const int32_t> tokens, const SequenceRowsView& seqs,
                 void* x, PleState& state, PleWorkspace& ws) const;

  const PleHashParams& hash() const { return hash_; }

 private:
  PleShape shape_;
  PleHashParams hash_;
  int64_t eos_ = 0;
  PleTable table_;
  BackendBuffer key_, value_, norm_key_, norm_query_, norm_conv_, conv_;
};

}  // namespace e4kv
