#include "kv/weight_memory.h"

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "io/checkpoint.h"

namespace e4kv {
namespace {

bool contains(std::string_view name, std::string_view part) {
  return name.find(part) != std::string_view::npos;
}

bool is_float(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

WeightKind kind_of(std::string_view name, bool moe) {
  if (contains(name, "embed_tokens.") || name.starts_with("lm_head.")) {
    return WeightKind::kEmbeddings;
  }
  if (contains(name, ".shared_expert.") || contains(name, ".shared_expert_gate.")) {
    return WeightKind::kSharedExpert;
  }
  if (contains(name, ".mlp.experts.") || (moe && contains(name, ".mlp.gate."))) {
    return WeightKind::kMoeExperts;
  }
  if (contains(name, ".self_attn.")) return WeightKind::kAttention;
  if (contains(name, ".linear_attn.")) return WeightKind::kDeltaNet;
  if (contains(name, ".mlp.")) return WeightKind::kMlp;
  return WeightKind::kOther;
}

// config.json's quantization_config (top level, or in text_config): its quant_method, with its
// format when it names one ("compressed-tensors nvfp4-pack-quantized"); "none" without one.
std::string quantization_of(const std::filesystem::path& dir) {
  Result<std::string> text = read_file(dir / "config.json");
  if (!text.ok()) return "none";  // the checkpoint opened, so this does not happen
  const nlohmann::json config = nlohmann::json::parse(*text, nullptr, false);
  if (!config.is_object()) return "none";
  const nlohmann::json* q = nullptr;
  if (config.contains("quantization_config")) {
    q = &config["quantization_config"];
  } else if (config.contains("text_config") && config["text_config"].is_object() &&
             config["text_config"].contains("quantization_config")) {
    q = &config["text_config"]["quantization_config"];
  }
  if (q == nullptr || !q->is_object()) return "none";
  std::string out = q->contains("quant_method") && (*q)["quant_method"].is_string()
                        ? (*q)["quant_method"].get<std::string>()
                        : std::string("unknown");
  if (q->contains("format") && (*q)["format"].is_string()) {
    out += " " + (*q)["format"].get<std::string>();
  }
  return out;
}

}  // namespace

std::string_view weight_kind_name(WeightKind kind) {
  switch (kind) {
    case WeightKind::kEmbeddings:
      return "embeddings";
    case WeightKind::kAttention:
      return "attention";
    case WeightKind::kDeltaNet:
      return "deltanet";
    case WeightKind::kMoeExperts:
      return "moe_experts";
    case WeightKind::kSharedExpert:
      return "shared_expert";
    case WeightKind::kMlp:
      return "mlp";
    case WeightKind::kOther:
    case WeightKind::kCount:
      break;
  }
  return "other";
}

int64_t WeightMemory::device_total() const {
  int64_t total = 0;
  for (int64_t bytes : device_bytes) total += bytes;
  return total;
}

Result<WeightMemory> weight_memory(const std::filesystem::path& dir) {
  E4KV_ASSIGN_OR_RETURN(const Checkpoint ckpt, Checkpoint::open(dir));
  const ModelConfig& config = ckpt.config();
  const bool moe = config.qwen4exp.has_value() && config.qwen4exp->num_experts > 0;
  WeightMemory memory;
  memory.quantization = quantization_of(dir);
  for (const std::string& name : ckpt.tensor_names()) {
    const SafetensorsTensor& t = *ckpt.find(name);
    const int64_t stored = int64_t(t.bytes.size());
    const std::string_view n = name;
    if (n.starts_with("model.visual.") || n.starts_with("mtp.") ||
        (config.tie_word_embeddings && n == "lm_head.weight")) {
      memory.skipped_tensors += 1;
      continue;
    }
    if (contains(n, ".ple_embedding.ngram_embedding.")) {
      memory.ple_checkpoint_bytes += stored;
      if (t.shape.size() == 2) {
        memory.ple_rows += t.shape[0];
        memory.ple_values += t.shape[0] * t.shape[1];
      }
      continue;
    }
    // Host values: the PLE hash buffers, K/V scales, NVFP4 activation scales (weight-only).
    if (contains(n, ".ple_embedding.") || n.ends_with("k_scale") || n.ends_with("v_scale") ||
        n.ends_with(".input_global_scale")) {
      continue;
    }
    int64_t bytes = stored;
    if (n.ends_with(".weight_global_scale")) {
      // One FP32 per output row on the device (quant/linear_weight.h: per row, so that tensors of
      // different global scales stack).
      const std::string packed =
          name.substr(0, name.size() - std::string_view("weight_global_scale").size()) +
          "weight_packed";
      const SafetensorsTensor* w = ckpt.find(packed);
      bytes = w != nullptr && !w->shape.empty() ? w->shape[0] * 4 : 0;
    } else if (n.ends_with(".qzeros")) {
      bytes = t.numel() * 8;  // eight 4-bit zeros per I32, one byte each
    } else if (n.ends_with(".weight_scale_inv")) {
      const std::string weight = name.substr(0, name.size() - std::string_view("_scale_inv").size());
      const SafetensorsTensor* w = ckpt.find(weight);
      if (w == nullptr || w->shape.empty() || t.shape.size() != 2) {
        return Status::error(cat(dir.string(), ": tensor ", name,
                                 " (FP8 block scales, 2-D) has no 2-D weight ", weight,
                                 " beside it"));
      }
      bytes = w->shape[0] * t.shape[1] * 4;
    } else if (is_float(t.dtype)) {
      bytes = t.numel() * 2;
    }
    const auto k = size_t(kind_of(n, moe));
    memory.device_bytes[k] += bytes;
    memory.tensors[k] += 1;
  }
  return memory;
}

}  // namespace e4kv
