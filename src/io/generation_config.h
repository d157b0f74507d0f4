// End-of-sequence ids of a Hugging Face model directory: "eos_token_id" of config.json and of
// generation_config.json (either may be one id or a list), merged.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "core/status.h"

namespace e4kv {

// The union of the eos_token_id entries of dir/config.json (top level or text_config) and
// dir/generation_config.json (when present), sorted, without duplicates. Absent or null fields
// give nothing. Errors name the file and field: unreadable or invalid JSON, an id that is not a
// non-negative integer that fits in int32.
Result<std::vector<int32_t>> load_eos_token_ids(const std::filesystem::path& model_dir);

}  // namespace e4kv
