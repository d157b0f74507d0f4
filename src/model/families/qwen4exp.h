// The Qwen4Exp family (transformers' Qwen4ExpForCausalLM and the text model of
// Qwen4ExpForConditionalGeneration; docs/qwen4exp_reference.md): hyper-connection residual
// streams; linear_attention layers (GatedDeltaNet) and QSA attention layers; a sparse MoE ffn in
// every layer; PLE n-gram embeddings on the layers of ple_layer_ids. Composed from the shared
// layers of model/layers/ over Backend ops.
//
// Per layer, for the rows of a batch (X: [n_rows, hc_count * hidden] act, the streams):
//   X += PLE(X)                                              (PLE layers)
//   X_s += inj_s * mixer(mix(X))      mixer: QSA attention or GatedDeltaNet
//   X_s += inj_s * moe(mix(X))
// logits = final_mix(X[rows asked]) W_lm^T, fp32 (no final RMSNorm: the mixer's norm is it).
//
// Memory: paged K/V and compressed index rows for the QSA layers (per token); per sequence, at
// its slot: DeltaNet conv windows and fp32 recurrent states, QSA raw index-key rings, PLE conv
// windows and token histories. The scale gate expects K and V scales for the QSA layers only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "io/checkpoint.h"
#include "model/families/model_core.h"
#include "model/layers/gated_delta_net.h"
#include "model/layers/hyper_connection.h"
#include "model/layers/moe.h"
#include "model/layers/ple.h"
#include "model/layers/qsa_attention.h"
#include "model/model.h"

namespace e4kv {

// True for a config of the Qwen4Exp family (its text model or the multimodal wrapper).
bool is_qwen4exp(const ModelConfig& config);

class Qwen4ExpModel final : public CoreModel {
 public:
  // Checks the config and every tensor (presence, dtype, shape; an unexpected tensor is an error;
  // vision-tower and multi-token-prediction tensors are skipped and counted), runs the K/V scale
  // gate for an E4M3 cache (QSA layers only), uploads the weights, maps the PLE tables (or converts them to E4M3, options.ple_dtype), and
  // allocates caches, state pools (limits().max_seqs slots) and workspaces.
  static Result<std::unique_ptr<Qwen4ExpModel>> load(const Checkpoint& ckpt, Backend& backend,
                                                     const ModelOptions& options);

  ~Qwen4ExpModel() override;
  Qwen4ExpModel(const Qwen4ExpModel&) = delete;
  Qwen4ExpModel& operator=(const Qwen4ExpModel&) = delete;

  ModelMemory memory() const override;

  Status prepare(const ForwardBatch& batch) override;
  Status run_layers(const ForwardBatch& batch) override;
  Status run_device(const ForwardBatch& batch) override;
  Result<DeviceLogits> finish_step(const ForwardBatch& batch, const Status& device) override;
  void reset_padding_state() override { reset_state(int32_t(core_.limits.max_seqs)); }
  Result<int32_t> allocate_sequence() override;
  Status begin_sequence(int32_t slot) override;
  Status free_sequence(int32_t slot) override;
  Status copy_sequence_state(int32_t src_slot, int32_t dst_slot) override;
  Status copy_blocks(std::span<const BlockCopy> copies) override;

  // Tensors of the checkpoint the text model does not run (vision tower, MTP head), skipped.
  int64_t skipped_tensors() const { return skipped_tensors_; }
  std::vector<std::string> load_notes() const override;
  PleTablesSummary ple_tables() const override;
  std::string input_token_problem(int32_t id) const override;

  KvCacheView kv_cache(int64_t layer) const override {
    return layers_[size_t(layer)].qsa ? qsa_cache(size_t(layer)).kv : KvCacheView{};
  }

 private:
  // Zero states, an EOS-filled n-gram history: a slot as a new sequence finds it.
  void reset_state(int32_t slot);

  struct Layer {
    std::optional<PleBlock> ple;
    HyperConnection attn_hc;
    std::optional<QsaAttentionMixer> qsa;
    std::optional<DeltaNetMixer> delta_net;
    HyperConnection mlp_hc;
    MoeFfn moe;
  };
  // The memory of one layer: QSA caches or DeltaNet states, and PLE state.
  struct LayerMemory {
    BackendBuffer kv;          // QSA: [n_blocks, 2, block_size, n_kv_heads, head_dim]
    BackendBuffer compressed;  // QSA: [n_blocks, block_size / ratio, index_dim] FP16
    BackendBuffer rings;       // QSA: [slots, ratio, index_dim] FP16
    std::optional<DeltaNetState> delta_net;
    std::optional<PleState> ple;
  };
  struct Workspace;

  Qwen4ExpModel();
  QsaLayerCache qsa_cache(size_t layer) const;

  int64_t skipped_tensors_ = 0;

  HyperConnectionShape hc_shape_;
  QsaAttentionShape qsa_shape_;
  DeltaNetShape delta_net_shape_;
  PleShape ple_shape_;

  BackendBuffer embed_;    // [vocab, hidden]
  BackendBuffer lm_head_;  // [vocab, hidden]; empty when tied
  std::vector<Layer> layers_;
  std::optional<HyperConnection> final_mixer_;
  std::vector<LayerMemory> memory_;
  std::unique_ptr<Workspace> ws_;
};

}  // namespace e4kv
