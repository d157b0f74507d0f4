#include "kv/scale_keys.h"

#include <array>
#include <charconv>

#include "core/status.h"

namespace e4kv {
namespace {

struct Suffix {
  std::string_view text;
  KvTensor tensor;
  bool canonical;
};

constexpr std::array<Suffix, 10> kSuffixes{{
    {"self_attn.k_scale", KvTensor::kK, true},
    {"self_attn.v_scale", KvTensor::kV, true},
    {"self_attn.k_proj.k_scale", KvTensor::kK, false},
    {"self_attn.v_proj.v_scale", KvTensor::kV, false},
    {"self_attn.k_proj.output_scale", KvTensor::kK, false},
    {"self_attn.v_proj.output_scale", KvTensor::kV, false},
    {"self_attn.attn.k_scale", KvTensor::kK, false},
    {"self_attn.attn.v_scale", KvTensor::kV, false},
    {"self_attn.qkv_proj.k_scale", KvTensor::kK, false},
    {"self_attn.qkv_proj.v_scale", KvTensor::kV, false},
}};

constexpr std::string_view kLayers = "layers.";

}  // namespace

std::optional<ScaleKey> parse_scale_key(std::string_view name) {
  for (const Suffix& suffix : kSuffixes) {
    if (name.size() <= suffix.text.size() + 1 || !name.ends_with(suffix.text)) continue;
    std::string_view head = name.substr(0, name.size() - suffix.text.size());
    if (!head.ends_with('.')) continue;
    head.remove_suffix(1);  // "<prefix>.layers.<i>" or "layers.<i>"
    size_t dot = head.rfind('.');
    std::string_view digits =
        dot == std::string_view::npos ? std::string_view() : head.substr(dot + 1);
    if (digits.empty() || digits.size() > 9) continue;
    int64_t layer = 0;
    auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), layer);
    if (ec != std::errc() || ptr != digits.data() + digits.size()) continue;
    if (digits.size() > 1 && digits.front() == '0') continue;
    std::string_view before = head.substr(0, dot + 1);  // "...layers."
    if (!before.ends_with(kLayers)) continue;
    std::string_view prefix = before.substr(0, before.size() - kLayers.size());
    if (!prefix.empty()) {
      if (!prefix.ends_with('.')) continue;
      prefix.remove_suffix(1);
    }
    return ScaleKey{std::string(prefix), layer, suffix.tensor, suffix.canonical};
  }
  return std::nullopt;
}

std::string canonical_scale_key(std::string_view prefix, int64_t layer, KvTensor tensor) {
  return cat(prefix, prefix.empty() ? "" : ".", "layers.", layer, ".self_attn.",
             tensor == KvTensor::kK ? "k_scale" : "v_scale");
}

}  // namespace e4kv
