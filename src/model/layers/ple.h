// PLE, the hashed n-gram embedding block of Qwen4Exp (docs/qwen4exp_reference.md section 7), on
// the layers of ple_layer_ids, added to every residual stream before the layer's mixer:
//   emb  = concat over hash heads h of table[id_h(token, previous tokens)]      (host, mmapped)
//   kn   = grouped (1+w) rms(emb Wkey^T); val = emb Wval^T; qn = grouped (1+w) rms(X)
//   gv_s = sigmoid(signed sqrt(kn_s . qn_s / sqrt(H))) * val
//   X   += gv + silu(dilated causal conv(grouped (1+w) rms(gv)))
// The n-gram table (about 48 GiB in the real model) stays in the memory-mapped checkpoint, or with
// --ple-dtype fp8_e4m3 becomes an E4M3 copy with a scale per row (model/ple_ngram.h): the
// host half of a forward (PleBlock::prepare, before the first launch) hashes the step's tokens and
// gathers the rows of every PLE layer into one staging block uploaded once; the layer's device
// half (PleBlock::forward) only reads device buffers. Per-sequence state: the last
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
#include "model/layers/fused_projection.h"
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
  BackendBuffer key_value;     // the key and value projections' parts (FusedProjection):
                               // [rows, width] then [rows, hidden] act
  BackendBuffer qn, gv, conv;  // [rows, width] act

  static Result<PleWorkspace> create(Backend& backend, const PleShape& shape, int64_t max_rows);
};

// The host half's buffers for the PLE layers of one step: the gathered table rows of every layer,
// staged in host memory (page-locked on CUDA) and uploaded in one copy.
struct PleStepBuffers {
  int64_t n_layers = 0;
  int64_t embed_dim = 0;
  std::vector<int64_t> ids;    // [rows, hash heads] host scratch
  std::vector<float> emb_f32;  // [rows, embed_dim] host scratch
  HostBuffer staging;          // [n_layers, rows, embed_dim] act
  BackendBuffer emb;           // [n_layers, rows, embed_dim] act: layer i's rows at i * rows

  static Result<PleStepBuffers> create(Backend& backend, const PleShape& shape, int64_t n_heads,
                                       int64_t n_layers, int64_t max_rows);
  // Layer i's staged rows on the host and on the device, for a step of n rows.
  void* host_rows(int64_t i, int64_t n, size_t act_size) const {
    return staging.as<std::byte>() + size_t(i * n * embed_dim) * act_size;
  }
  const void* device_rows(int64_t i, int64_t n, size_t act_size) const {
    return emb.as<std::byte>() + size_t(i * n * embed_dim) * act_size;
  }
  // Uploads the staged rows of every layer for a step of n rows (one copy).
  void upload(Backend& backend, int64_t n) const {
    backend.copy_from_host(emb.data(), staging.data(),
                           size_t(n_layers * n * embed_dim) * backend.act_size());
  }
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
  // prefix: "model.layers.0.ple."; ple_index: the layer's position in ple_layer_ids. ple_dtype
  // kE4m3: the table is converted (PleTable::to_e4m3, through `cache` when given).
  static Result<PleBlock> load(const Checkpoint& ckpt, WeightLoader& weights,
                               const std::string& prefix, const PleShape& shape,
                               const Qwen4ExpConfig& config, int64_t vocab_size, int64_t ple_index,
                               PleDtype ple_dtype = PleDtype::kAuto,
                               PleE4m3Cache* cache = nullptr);
  Result<PleState> create_state(Backend& backend, int64_t n_slots) const;

  // The host half for one step: the n-gram ids of the tokens of each sequence (rows
  // [row_begin[s], row_begin[s + 1]), history of slot slots[s], advanced in place) and their table
  // rows, converted to `act` into emb [n, embed_dim] (host). ids: [n, hash heads] scratch;
  // emb_f32: [n, embed_dim] scratch. Errors: an id outside the table (the checkpoint's hash
  // buffers and table disagree); the histories may then be partly advanced.
  Status prepare(std::span<const int32_t> tokens, std::span<const int32_t> row_begin,
                 std::span<const int32_t> slots, PleState& state, int64_t* ids, float* emb_f32,
                 DType act, void* emb) const;

  // The device half: x += PLE(x) for the n rows of the step. emb: [n, embed_dim] act (the rows
  // prepare() staged, uploaded); seqs: the rows of each sequence. x: [n, width] act.
  Status forward(Backend& backend, int64_t n, const void* emb, const SequenceRowsView& seqs,
                 void* x, PleState& state, PleWorkspace& ws) const;

  const PleHashParams& hash() const { return hash_; }
  const PleTable& table() const { return table_; }

 private:
  PleShape shape_;
  PleHashParams hash_;
  int64_t eos_ = 0;
  PleTable table_;
  FusedProjection key_value_;  // key_proj [width, embed_dim], value_proj [hidden, embed_dim]
  BackendBuffer norm_key_, norm_query_, norm_conv_, conv_;
};

}  // namespace e4kv
