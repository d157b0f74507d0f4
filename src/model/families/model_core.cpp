#include "model/families/model_core.h"

#include <string>

namespace e4kv {

Status ModelCore::init(const Checkpoint& ckpt, Backend& b, const ModelOptions& o) {
  config = ckpt.config();
  options = o;
  backend = &b;
  const std::string config_path = (ckpt.dir() / "config.json").string();
  E4KV_ASSIGN_OR_RETURN(limits, model_limits(o, config.max_position_embeddings, config_path));
  slots = SequenceSlots(limits.max_seqs);
  return ok_status();
}

Status ModelCore::load_rope_and_scales(const Checkpoint& ckpt) {
  E4KV_ASSIGN_OR_RETURN(rope, make_rope_table(config));
  E4KV_ASSIGN_OR_RETURN(kv_scales,
                        load_kv_scales(ckpt, options.kv_cache_dtype, options.kv_scales_mode));
  return ok_status();
}

Status ModelCore::create_step_and_head(int64_t width, const void* projection) {
  E4KV_ASSIGN_OR_RETURN(StepContext created,
                        StepContext::create(*backend, limits, rope.rotary_dim));
  step.emplace(std::move(created));
  E4KV_ASSIGN_OR_RETURN(LogitsHead logits_head,
                        LogitsHead::create(*backend, limits, width, config.hidden_size,
                                           config.vocab_size, projection));
  head.emplace(std::move(logits_head));
  return ok_status();
}

Status ModelCore::build_step(const ForwardBatch& batch) {
  mark("step_context");
  return step->build(batch, &rope, config.vocab_size, options.block_size, options.n_blocks);
}

KvCacheView ModelCore::kv_cache_view(void* data, size_t layer) const {
  KvCacheView cache;
  cache.data = data;
  // The pool's blocks and, last, the scratch block padding rows write (ForwardBatch::pad_to).
  cache.geometry.n_blocks = options.n_blocks + 1;
  cache.geometry.block_size = options.block_size;
  cache.geometry.n_kv_heads = config.n_kv_heads;
  cache.geometry.head_dim = config.head_dim;
  cache.geometry.dtype = options.kv_cache_dtype;
  if (options.kv_cache_dtype == KvCacheDtype::kE4m3 && layer < kv_scales.k_scale.size()) {
    cache.k_scale = kv_scales.k_scale[layer];
    cache.v_scale = kv_scales.v_scale[layer];
  }
  return cache;
}

}  // namespace e4kv
