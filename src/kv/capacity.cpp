#include "kv/capacity.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/check.h"
#include "core/checked.h"
#include "kv/block_allocator.h"

namespace e4kv {

int64_t KvCacheLayout::main_bytes_per_token_per_layer(KvCacheDtype dtype) const {
  return 2 * n_kv_heads * head_dim * static_cast<int64_t>(kv_cache_elem_bytes(dtype));
}

int64_t KvCacheLayout::index_bytes_per_block_per_layer() const {
  if (n_qsa_layers == 0) return 0;
  return (block_size / ratio) * index_dim * 2;
}

int64_t KvCacheLayout::block_bytes(KvCacheDtype dtype) const {
  return n_kv_layers * block_size * main_bytes_per_token_per_layer(dtype) +
         n_qsa_layers * index_bytes_per_block_per_layer();
}

double KvCacheLayout::bytes_per_token(KvCacheDtype dtype) const {
  return static_cast<double>(block_bytes(dtype)) / static_cast<double>(block_size);
}

int64_t KvCacheLayout::ring_bytes_per_seq() const {
  return n_qsa_layers * ring_cap * index_dim * 2;
}

Result<KvCacheLayout> kv_cache_layout(const ModelConfig& config, int64_t block_size,
                                      int64_t ring_cap) {
  E4KV_RETURN_IF_ERROR(validate_block_size(block_size));
  KvCacheLayout layout;
  layout.block_size = block_size;
  layout.n_kv_layers = static_cast<int64_t>(config.kv_cache_layers().size());
  layout.n_qsa_layers = config.count_layers(LayerKind::kQsaAttention);
  layout.n_kv_heads = config.n_kv_heads;
  layout.head_dim = config.head_dim;
  if (layout.n_kv_layers == 0) {
    return Status::error(
        "the model has no layer with a KV cache (all layers are linear attention)");
  }
  if (layout.n_kv_heads <= 0 || layout.head_dim <= 0) {
    return Status::error(cat("the model config gives n_kv_heads ", layout.n_kv_heads,
                             " and head_dim ", layout.head_dim, "; both must be positive"));
  }
  if (layout.n_qsa_layers > 0) {
    if (!config.qsa || config.qsa->index_dim <= 0 || config.qsa->ratio <= 0) {
      return Status::error("the model has QSA layers but no valid indexer geometry");
    }
    layout.index_dim = config.qsa->index_dim;
    layout.ratio = config.qsa->ratio;
    if (block_size % layout.ratio != 0) {
      return Status::error(cat("block size ", block_size,
                               " is not a multiple of the QSA compress ratio ", layout.ratio));
    }
    layout.ring_cap = ring_cap == 0 ? layout.ratio : ring_cap;
    if (layout.ring_cap < layout.ratio) {
      return Status::error(
          cat("raw ring capacity ", ring_cap, " is below the QSA compress ratio ", layout.ratio));
    }
  }
  if (config.qwen4exp) {
    // Per-sequence states of the hybrid layers (FP16 conv windows, fp32 recurrent states).
    const Qwen4ExpConfig& q = *config.qwen4exp;
    const int64_t conv_channels = 2 * q.linear_num_key_heads * q.linear_key_head_dim +
                                  q.linear_num_value_heads * q.linear_value_head_dim;
    const std::optional<int64_t> conv =
        checked_product({q.linear_conv_kernel_dim - 1, conv_channels, 2});
    const std::optional<int64_t> recurrent = checked_product(
        {q.linear_num_value_heads, q.linear_key_head_dim, q.linear_value_head_dim, 4});
    const std::optional<int64_t> ple = checked_product(
        {q.ple_conv_kernel_size - 1, q.ngram_size, q.hc_count, config.hidden_size, 2});
    std::optional<int64_t> total;
    if (conv && recurrent && ple) {
      const std::optional<int64_t> per_linear = checked_add(*conv, *recurrent);
      const std::optional<int64_t> linear =
          per_linear ? checked_mul(config.count_layers(LayerKind::kLinearAttention), *per_linear)
                     : std::nullopt;
      const std::optional<int64_t> ples = checked_mul(int64_t(q.ple_layers.size()), *ple);
      if (linear && ples) total = checked_add(*linear, *ples);
    }
    if (!total) {
      return Status::error("the per-sequence states of the model need more than 2^63 bytes");
    }
    layout.state_bytes_per_seq = *total;
  }
  // Every byte count the layout reports, checked once here so its accessors cannot overflow. The
  // FP16 block is the larger one.
  const std::optional<int64_t> main_block =
      checked_product({layout.n_kv_layers, block_size, 2, layout.n_kv_heads, layout.head_dim,
                       static_cast<int64_t>(kv_cache_elem_bytes(KvCacheDtype::kF16))});
  const std::optional<int64_t> index_block =
      layout.n_qsa_layers == 0
          ? std::optional<int64_t>(0)
          : checked_product({layout.n_qsa_layers, block_size / std::max<int64_t>(1, layout.ratio),
                             layout.index_dim, 2});
  const std::optional<int64_t> ring =
      checked_product({layout.n_qsa_layers, layout.ring_cap, layout.index_dim, 2});
  if (!main_block || !index_block || !ring || !checked_add(*main_block, *index_block)) {
    return Status::error(cat("the KV cache geometry (", layout.n_kv_layers, " KV layers x ",
                             layout.n_kv_heads, " KV heads x head_dim ", layout.head_dim,
                             ", block size ", block_size,
                             ") gives block sizes that do not fit in 64 bits; the config's sizes "
                             "are not those of a real model"));
  }
  return layout;
}

Result<KvCapacity> kv_capacity(const KvCacheLayout& layout, KvCacheDtype dtype,
                               int64_t budget_bytes, int64_t reserved_seqs) {
  if (budget_bytes < 0) return Status::error(cat("a negative memory budget: ", budget_bytes));
  if (reserved_seqs < 0) {
    return Status::error(cat("a negative number of reserved sequences: ", reserved_seqs));
  }
  const int64_t block_bytes = layout.block_bytes(dtype);
  E4KV_ASSERT(block_bytes > 0, "kv_capacity: empty block");
  const std::optional<int64_t> rings = checked_mul(reserved_seqs, layout.bytes_per_seq());
  if (!rings || *rings > budget_bytes) {
    return Status::error(cat("the per-sequence state (QSA raw rings, recurrent states) of ",
                             reserved_seqs, " sequences needs ",
                             rings ? cat(*rings, " bytes") : std::string("more than 2^63 bytes"),
                             ", more than the budget of ", budget_bytes, " bytes"));
  }
  const int64_t pool = budget_bytes - *rings;
  KvCapacity capacity;
  capacity.n_blocks = pool / block_bytes;
  capacity.n_tokens = capacity.n_blocks * layout.block_size;
  capacity.pool_bytes = capacity.n_blocks * block_bytes;
  return capacity;
}

Result<RequestConcurrency> request_concurrency(const KvCacheLayout& layout, KvCacheDtype dtype,
                                               int64_t budget_bytes, int64_t request_tokens) {
  if (request_tokens <= 0) {
    return Status::error(cat("a request of ", request_tokens, " tokens; it must be positive"));
  }
  RequestConcurrency out;
  out.blocks_per_request = blocks_for_tokens(request_tokens, layout.block_size);
  const std::optional<int64_t> blocks_bytes =
      checked_mul(out.blocks_per_request, layout.block_bytes(dtype));
  const std::optional<int64_t> bytes =
      blocks_bytes ? checked_add(*blocks_bytes, layout.bytes_per_seq()) : std::nullopt;
  if (!bytes) {
    return Status::error(cat("a request of ", request_tokens,
                             " tokens needs more than 2^63 bytes of KV cache"));
  }
  out.bytes_per_request = *bytes;
  out.max_concurrency =
      static_cast<double>(budget_bytes) / static_cast<double>(out.bytes_per_request);
  out.max_requests = budget_bytes / out.bytes_per_request;
  return out;
}

Result<KvPoolSummary> kv_pool_summary(const KvCacheLayout& layout, KvCacheDtype dtype,
                                      int64_t n_blocks, int64_t max_model_len) {
  E4KV_ASSERT(n_blocks >= 0 && max_model_len > 0, "kv_pool_summary: bad sizes");
  KvPoolSummary out;
  out.n_blocks = n_blocks;
  const std::optional<int64_t> tokens = checked_mul(n_blocks, layout.block_size);
  const std::optional<int64_t> bytes = checked_mul(n_blocks, layout.block_bytes(dtype));
  if (!tokens || !bytes) {
    return Status::error(cat("a KV pool of ", n_blocks, " blocks of ", layout.block_size,
                             " tokens needs more than 2^63 bytes"));
  }
  out.n_tokens = *tokens;
  out.pool_bytes = *bytes;
  // Whole FP16 blocks, as the pool is made of whole blocks; never more tokens than the pool's own
  // (an FP16 block is never smaller).
  out.fp16_equivalent_tokens =
      out.pool_bytes / layout.block_bytes(KvCacheDtype::kF16) * layout.block_size;
  out.max_concurrency = static_cast<double>(n_blocks) /
                        static_cast<double>(blocks_for_tokens(max_model_len, layout.block_size));
  return out;
}

Status check_pool_holds_max_model_len(int64_t n_blocks, int64_t block_size, int64_t max_model_len,
                                      const std::string& source) {
  const std::optional<int64_t> tokens = checked_mul(n_blocks, block_size);
  if (tokens && *tokens >= max_model_len) return ok_status();
  return Status::error(cat(source, ": the KV cache pool holds ", n_blocks, " blocks of ",
                           block_size, " tokens = ", tokens.value_or(0),
                           " tokens, fewer than the max model length of ", max_model_len,
                           ", so a sequence of that length could never finish; give the pool "
                           "more memory or lower --max-model-len"));
}

Result<int64_t> kv_budget_for_utilization(int64_t total_bytes, double utilization,
                                          int64_t used_bytes, int64_t pool_bytes_in_use) {
  if (!(utilization > 0.0 && utilization <= 1.0)) {
    return Status::error(cat("expected a fraction in (0, 1], got ", utilization));
  }
  if (total_bytes <= 0 || used_bytes < 0 || used_bytes > total_bytes || pool_bytes_in_use < 0 ||
      pool_bytes_in_use > used_bytes) {
    return Status::error(cat("inconsistent device memory figures: total ", total_bytes,
                             " bytes, used ", used_bytes, " bytes, of which KV pool ",
                             pool_bytes_in_use, " bytes"));
  }
  // Rounded down: the target is a ceiling.
  const auto target = static_cast<int64_t>(
      std::floor(static_cast<long double>(utilization) * static_cast<long double>(total_bytes)));
  const int64_t besides_pool = used_bytes - pool_bytes_in_use;
  if (besides_pool >= target) {
    return Status::error(cat(utilization, " of the device's ", total_bytes, " bytes is ", target,
                             " bytes, but the weights, workspaces and activation peak (and any "
                             "other process on the device) already take ",
                             besides_pool, " bytes; raise it or free the device"));
  }
  return target - besides_pool;
}

}  // namespace e4kv
