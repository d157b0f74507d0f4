// The dense decoder families: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (QKV bias)
// and Qwen3ForCausalLM (per-head q/k RMSNorm before RoPE), composed from the shared layers
// (model/layers/) with the paged KV cache (FP16 or E4M3 behind the scale gate) of every layer.
//
// Per layer, for the rows of a batch (x: [n_rows, hidden] act):
//   x += attention(rms_norm(x, input_layernorm))            (model/layers/attention.h)
//   x += mlp(rms_norm(x, post_attention_layernorm))          (model/layers/mlp.h)
// logits = rms_norm(x[rows asked], norm) W_lm^T (W_lm = embed_tokens when tied), fp32.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "io/checkpoint.h"
#include "model/families/model_core.h"
#include "model/layers/attention.h"
#include "model/layers/mlp.h"
#include "model/model.h"

namespace e4kv {

enum class DenseFamily { kLlama, kMistral, kQwen2, kQwen3 };
std::string_view dense_family_name(DenseFamily family);

// What the weights of a family look like.
struct DenseModelSpec {
  DenseFamily family = DenseFamily::kLlama;
  bool qkv_bias = false;  // q/k/v_proj.bias (Qwen2 always; Llama/Mistral/Qwen3 with attention_bias)
  bool o_bias = false;    // o_proj.bias (Llama/Mistral/Qwen3 with attention_bias)
  bool qk_norm = false;   // self_attn.{q,k}_norm.weight [head_dim] (Qwen3)
};

// The family of `config` (from "architectures", else "model_type"), or an error naming the
// architecture and listing the supported ones.
Result<DenseModelSpec> dense_model_spec(const ModelConfig& config);

class DenseModel final : public CoreModel {
 public:
  // Checks the config (family, layer kinds, sliding window, RoPE type, hidden_act) and every
  // tensor (presence, dtype, shape; an unexpected tensor is an error), runs the K/V scale gate
  // for an E4M3 cache, uploads the weights and allocates the cache and every workspace for the
  // limits of `options`. Errors name the file, field or tensor and what to do.
  static Result<std::unique_ptr<DenseModel>> load(const Checkpoint& ckpt, Backend& backend,
                                                  const ModelOptions& options);

  ~DenseModel() override;
  DenseModel(const DenseModel&) = delete;
  DenseModel& operator=(const DenseModel&) = delete;

  ModelMemory memory() const override;
  const DenseModelSpec& spec() const { return spec_; }
  const RopeTable& rope() const { return core_.rope; }

  Status prepare(const ForwardBatch& batch) override;
  Status run_layers(const ForwardBatch& batch) override;
  Status run_device(const ForwardBatch& batch) override;
  Result<DeviceLogits> finish_step(const ForwardBatch& batch, const Status& device) override;
  // The dense families keep no per-sequence state; the slots only count live sequences.
  Result<int32_t> allocate_sequence() override { return core_.slots.allocate(); }
  Status begin_sequence(int32_t slot) override { return core_.slots.acquire(slot); }
  Status free_sequence(int32_t slot) override { return core_.slots.release(slot); }
  Status copy_sequence_state(int32_t src_slot, int32_t dst_slot) override {
    return core_.slots.copy(src_slot, dst_slot);
  }
  Status copy_blocks(std::span<const BlockCopy> copies) override;

  KvCacheView kv_cache(int64_t layer) const override { return cache_view(size_t(layer)); }

 private:
  struct Layer {
    BackendBuffer input_norm;  // [hidden]
    AttentionMixer attention;
    BackendBuffer post_norm;  // [hidden]
    DenseMlp mlp;
  };
  struct Workspace;
  DenseModel();
  KvCacheView cache_view(size_t layer) const;

  DenseModelSpec spec_;

  BackendBuffer embed_;       // [vocab, hidden]
  BackendBuffer final_norm_;  // [hidden]
  BackendBuffer lm_head_;     // [vocab, hidden]; empty when tied
  std::vector<Layer> layers_;
  std::vector<BackendBuffer> caches_;  // per layer: [n_blocks, 2, block_size, n_kv_heads, head_dim]
  std::unique_ptr<Workspace> ws_;
};

}  // namespace e4kv
