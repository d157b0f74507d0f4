// Recognises checkpoint tensor names that carry per-layer K/V cache scales (DESIGN.md section 5).
// The canonical form is `<prefix>.layers.<i>.self_attn.k_scale` / `.v_scale`; the aliases written
// by other tools are also read: self_attn.{k,v}_proj.{k,v}_scale,
// self_attn.{k,v}_proj.output_scale, self_attn.attn.{k,v}_scale, self_attn.qkv_proj.{k,v}_scale.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace e4kv {

enum class KvTensor { kK, kV };

struct ScaleKey {
  std::string prefix;  // text before ".layers." ("model", "model.language_model", ...)
  int64_t layer = 0;
  KvTensor tensor = KvTensor::kK;
  bool canonical = false;  // the `self_attn.k_scale` form
};

// nullopt when `name` is not a K/V scale key in any accepted spelling.
std::optional<ScaleKey> parse_scale_key(std::string_view name);

// The canonical key for a slot: "<prefix>.layers.<layer>.self_attn.k_scale".
std::string canonical_scale_key(std::string_view prefix, int64_t layer, KvTensor tensor);

}  // namespace e4kv
