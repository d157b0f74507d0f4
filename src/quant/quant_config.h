// The checkpoint's weight quantization, read from config.json's "quantization_config" (top level,
// or the text config's in a multimodal wrapper) as the public tools write it:
//   AWQ (AutoAWQ)             {"quant_method": "awq", "bits": 4, "group_size": 32|64|128,
//                              "zero_point": bool, "version": "gemm", "modules_to_not_convert": [..]}
//   NVFP4 (llm-compressor)    {"quant_method": "compressed-tensors", "format":
//                              "nvfp4-pack-quantized", "config_groups": {..: {"weights":
//                              {"num_bits": 4, "type": "float", "group_size": 16, ..}}},
//                              "ignore": [..]}
//   FP8 blocks (Qwen3, DeepSeek) {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
//                              [bo, bi], "modules_to_not_convert" | "ignored_layers": [..]}
// Anything else (another method, bit width, group size, layout, per-tensor FP8, activation
// quantization we would have to honour) is refused with a message naming the field and what e4kv
// supports. Which modules are quantized is read from the tensors themselves (a module with the
// method's tensors is quantized, one with a plain .weight is not): tools also skip modules for
// their shape, so the exclusion lists are recorded, not needed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace e4kv {

enum class QuantMethod : uint8_t { kNone, kAwq, kNvfp4, kFp8Block };

struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;
  int64_t group_size = 0;  // AWQ: input columns per scale; NVFP4: 16; FP8: the block's columns
  int64_t block_rows = 0;  // FP8: the block's rows
  bool zero_point = true;  // AWQ
  std::vector<std::string> excluded;  // modules_to_not_convert / ignore / ignored_layers, as given
  std::string field;  // where it was read: "quantization_config" or "text_config.quantization_config"

  bool quantized() const { return method != QuantMethod::kNone; }
  // "AWQ W4A16 g128 (zero points)", "NVFP4 (weight only)", "FP8 E4M3 blocks 128x128", "none".
  std::string describe() const;
};

// Reads the quantization config of a parsed config.json (the root object). No
// quantization_config (or null): method kNone. source: the file, for messages.
Result<QuantConfig> parse_quant_config(const nlohmann::json& root, const std::string& source);

}  // namespace e4kv
