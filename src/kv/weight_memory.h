// What a checkpoint's weights take once loaded, from its safetensors headers alone (no weight is
// read): device bytes by kind as the CUDA backend holds them, and the PLE n-gram tables that stay
// in host memory. `e4kv capacity --gpu-memory-gib` subtracts the device bytes from the card's share
// to size the KV pool (kv/capacity.h).
//
// Device bytes of a tensor:
//   - F32, F16 and BF16 tensors: 2 bytes per element (Backend::upload_weight converts every float
//     weight to the FP16 activation dtype);
//   - the quantized formats, as their canonical layouts (quant/linear_weight.h) hold them:
//       AWQ            qweight (I32) and scales (F16) as stored; qzeros widen to one byte per zero
//                      (8 per stored I32: twice the stored bytes);
//       NVFP4          weight_packed (U8) and weight_scale (F8_E4M3) as stored; *_global_scale
//                      is a host float (0 device bytes);
//       FP8 block      weight (F8_E4M3) as stored; weight_scale_inv stays FP32 and is expanded to
//                      one row per output row: out * ceil(in / block) * 4 bytes, out the rows of
//                      the matching weight;
//   - other tensors (integer, F8) as stored;
//   - none for what is not on the device: the PLE n-gram tables (host, below) and their I64 hash
//     buffers, K/V scales (read by the scale gate on the host), a tied lm_head, and the tensors the
//     text model skips (model.visual.*, mtp.*).
// Kinds, by tensor name: embeddings (embed_tokens, lm_head), attention (self_attn), DeltaNet
// (linear_attn), MoE experts (mlp.experts and the router mlp.gate), shared expert, dense MLP (mlp
// of a dense model), other (norms, hyper-connections, the PLE projections, ...).
// Not counted: activations, workspaces, the CUDA context.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "core/status.h"

namespace e4kv {

enum class WeightKind : int {
  kEmbeddings,
  kAttention,
  kDeltaNet,
  kMoeExperts,
  kSharedExpert,
  kMlp,
  kOther,
  kCount,
};
std::string_view weight_kind_name(WeightKind kind);  // "embeddings", "attention", ...

struct WeightMemory {
  std::string quantization;  // config.json quantization_config.quant_method, or "none"
  std::array<int64_t, size_t(WeightKind::kCount)> device_bytes{};
  std::array<int64_t, size_t(WeightKind::kCount)> tensors{};
  int64_t skipped_tensors = 0;  // not loaded (vision tower, MTP head, tied lm_head)
  // The PLE n-gram tables (host memory): their bytes in the checkpoint (what --ple-dtype auto maps
  // in place), rows and values (--ple-dtype fp8_e4m3 holds values + 4 * rows bytes).
  int64_t ple_checkpoint_bytes = 0;
  int64_t ple_rows = 0;
  int64_t ple_values = 0;

  int64_t device_total() const;
  int64_t ple_e4m3_bytes() const { return ple_values + 4 * ple_rows; }
};

// Reads the checkpoint in `dir` (config.json, model.safetensors or the shards of
// model.safetensors.index.json; headers only). Errors: those of Checkpoint::open; an FP8
// weight_scale_inv without its weight.
Result<WeightMemory> weight_memory(const std::filesystem::path& dir);

}  // namespace e4kv
