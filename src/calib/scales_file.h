// scales.json: the output of `e4kv summarize` and the input of `e4kv overlay`.
//
//   {"format": "e4kv-kv-scales/1",
//    "scales": {"model.layers.3.self_attn.k_scale": 0.0171247218, ...},
//    "policy": "absmax",
//    "source": {...free-form provenance: statistics files and their SHA-256, token counts...}}
//
// Keys are canonical scale keys (kv/scale_keys.h). Values are written with enough digits to read
// back the same fp32 (max_digits10).
#pragma once

#include <filesystem>
#include <map>
#include <string>

#include "core/status.h"

namespace e4kv {

inline constexpr const char* kScalesFormat = "e4kv-kv-scales/1";

struct ScalesFile {
  std::map<std::string, float> scales;  // canonical key -> scale
  std::string policy;                   // "absmax", "p99.9", "p99.99", or "unit"
  std::string source_json = "{}";       // the "source" object, serialised JSON
};

// Parses scales.json text; errors name `source` and the offending key or field (wrong format
// string, non-object "scales", non-number values or values the start-up gate refuses
// (kv_scale_value_problem: not finite, not > 0, or outside the usable range), unknown scale key
// spellings).
Result<ScalesFile> parse_scales_file(std::string_view json_text, const std::string& source);
Result<ScalesFile> read_scales_file(const std::filesystem::path& path);
// Writes atomically (temporary file, fsync, rename).
Status write_scales_file(const std::filesystem::path& path, const ScalesFile& file);

}  // namespace e4kv
