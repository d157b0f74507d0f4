// The dense decoder runtime: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (QKV bias) and
// Qwen3ForCausalLM (per-head q/k RMSNorm before RoPE), loaded onto a Backend, with the paged KV
// cache (FP16 or E4M3 behind the scale gate) of every layer.
//
// Per layer, for the rows of a batch (x: [n_rows, hidden] act):
//   h = rms_norm(x, input_layernorm)
//   q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)
//   q, k = rms_norm per head (q_norm, k_norm)                      Qwen3 only
//   q, k = rope_neox(q, k) at each row's position
//   k16, v16 = fp16(k), fp16(v); cache_write(k16, v16) at each row's slot
//   a = paged_attention(fp16(q)) over positions 0..pos of the row's sequence
//   x += a Wo^T (+bo)
//   h = rms_norm(x, post_attention_layernorm)
//   x += (silu(h Wg^T) * (h Wu^T)) Wd^T
// logits = rms_norm(x[rows asked], norm) W_lm^T (W_lm = embed_tokens when tied), fp32.
// K, V and q are FP16 at the cache and attention, as the cache contract (DESIGN.md section 2) says.
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
#include "kv/block_allocator.h"
#include "kv/scale_gate.h"
#include "model/rope.h"

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

struct DenseModelOptions {
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kF16;
  KvScalesMode kv_scales_mode = KvScalesMode::kCalibrated;
  int64_t block_size = 64;  // tokens per cache block, a multiple of 16
  int64_t n_blocks = 0;     // cache blocks shared by all sequences (> 0)
  // Longest sequence (positions 0..max_model_len-1); 0: the config's max_position_embeddings.
  // Sliding-window layers run as full attention, so a window smaller than this is refused.
  int64_t max_model_len = 0;
};

// One forward: rows of tokens, any mix of prefill chunks and decode rows of several sequences.
// Row r is token token_ids[r] of sequence row_seq[r] at position row_pos[r]. Sequence s has
// block table *seqs[s] whose n_tokens is its length after this forward (positions already in
// the cache plus the rows of this batch); every position 0..row_pos[r] must be in the cache before
// the forward or among its rows (the caller's bookkeeping; not checked). Logits are returned for
// the rows in logit_rows, in that order.
struct ForwardBatch {
  std::span<const int32_t> token_ids;  // [n_rows]
  std::span<const int32_t> row_seq;    // [n_rows] index into seqs
  std::span<const int32_t> row_pos;    // [n_rows]
  std::vector<const BlockTable*> seqs;
  std::span<const int32_t> logit_rows;  // [n_logits] row indices
};

class DenseModel {
 public:
  // Checks the config (family, layer kinds, sliding window, RoPE type, hidden_act) and every
  // tensor (presence, dtype, shape; an unexpected tensor is an error), runs the K/V scale gate
  // for an E4M3 cache, uploads the weights and allocates the cache. Errors name the file, field
  // or tensor and what to do.
  static Result<std::unique_ptr<DenseModel>> load(const Checkpoint& ckpt, Backend& backend,
                                                  const DenseModelOptions& options);

  ~DenseModel();
  DenseModel(const DenseModel&) = delete;
  DenseModel& operator=(const DenseModel&) = delete;

  const ModelConfig& config() const { return config_; }
  const DenseModelSpec& spec() const { return spec_; }
  const KvScales& kv_scales() const { return kv_scales_; }
  const RopeTable& rope() const { return rope_; }
  Backend& backend() const { return *backend_; }
  int64_t vocab_size() const { return config_.vocab_size; }
  int64_t block_size() const { return options_.block_size; }
  int64_t n_blocks() const { return options_.n_blocks; }
  int64_t max_model_len() const { return options_.max_model_len; }
  KvCacheDtype kv_cache_dtype() const { return options_.kv_cache_dtype; }

  // Runs the batch; returns logits [logit_rows.size(), vocab_size] fp32, row-major. Errors: bad
  // batch metadata (ids out of range, positions beyond the block table or max_model_len, ...),
  // non-finite K/V values reaching the cache, a backend op refusing a shape.
  Result<std::vector<float>> forward(const ForwardBatch& batch);

 private:
  struct Layer;
  DenseModel() = default;
  Status validate(const ForwardBatch& batch) const;
  Status ensure_scratch(int64_t n_rows, int64_t n_logits, int64_t n_seqs, int64_t max_blocks);

  ModelConfig config_;
  DenseModelSpec spec_;
  DenseModelOptions options_;
  KvScales kv_scales_;
  RopeTable rope_;
  Backend* backend_ = nullptr;

  BackendBuffer embed_;       // [vocab, hidden]
  BackendBuffer final_norm_;  // [hidden]
  BackendBuffer lm_head_;     // [vocab, hidden]; empty when tied
  std::vector<Layer> layers_;
  std::vector<BackendBuffer> caches_;  // per layer: [n_blocks, 2, block_size, n_kv_heads, head_dim]

  // Scratch, grown on demand.
  struct Scratch;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace e4kv
