#include "kv/scale_gate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <utility>

#include "core/half.h"
#include "e4kv/e4m3.h"
#include "io/checkpoint.h"

namespace e4kv {
namespace {

const char* tensor_letter(KvTensor tensor) {
  return tensor == KvTensor::kK ? "K" : "V";
}

// "<prefix>.layers.<i>" (or "layers.<i>") at the front of `head` -> the prefix; nullopt otherwise.
std::optional<std::string_view> layers_prefix(std::string_view head) {
  const size_t dot = head.rfind('.');
  if (dot == std::string_view::npos || dot + 1 == head.size()) return std::nullopt;
  const std::string_view digits = head.substr(dot + 1);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  std::string_view before = head.substr(0, dot);  // "<prefix>.layers" or "layers"
  constexpr std::string_view kLayers = "layers";
  if (!before.ends_with(kLayers)) return std::nullopt;
  before.remove_suffix(kLayers.size());
  if (before.empty()) return before;
  if (!before.ends_with('.')) return std::nullopt;
  before.remove_suffix(1);
  return before;
}

// The most frequent prefix among names "<prefix>.layers.<i>.<marker>..." (first in sort order on a
// tie); nullopt when no name has the marker.
std::optional<std::string> most_common_prefix(const std::vector<std::string>& names,
                                              std::string_view marker, bool marker_is_suffix) {
  std::map<std::string, int64_t, std::less<>> counts;
  for (const std::string& name : names) {
    std::string_view view(name);
    std::string_view head;
    if (marker_is_suffix) {
      if (!view.ends_with(marker)) continue;
      head = view.substr(0, view.size() - marker.size());
    } else {
      const size_t pos = view.find(marker);
      if (pos == std::string_view::npos) continue;
      head = view.substr(0, pos);
    }
    std::optional<std::string_view> prefix = layers_prefix(head);
    if (prefix) ++counts[std::string(*prefix)];
  }
  if (counts.empty()) return std::nullopt;
  auto best = counts.begin();
  for (auto it = counts.begin(); it != counts.end(); ++it) {
    if (it->second > best->second) best = it;
  }
  return best->first;
}

Result<float> scalar_of(const SafetensorsTensor& tensor) {
  for (int64_t dim : tensor.shape) {
    if (dim != 1) {
      std::string shape = "[";
      for (size_t i = 0; i < tensor.shape.size(); ++i) {
        shape += cat(i ? ", " : "", tensor.shape[i]);
      }
      return Status::error(
          cat("has shape ", shape, "] (expected a scalar or a one-element tensor)"));
    }
  }
  const DType dtype = tensor.dtype;
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return Status::error(
        cat("has dtype ", dtype_name(dtype), " (expected an F32, F16 or BF16 scalar)"));
  }
  if (tensor.bytes.size() != dtype_size(dtype)) {
    return Status::error(cat("holds ", tensor.bytes.size(), " bytes (expected ", dtype_size(dtype),
                             " for one ", dtype_name(dtype), " value)"));
  }
  // safetensors stores little-endian values, as the hosts e4kv runs on do.
  if (dtype == DType::kF32) {
    float value = 0.0f;
    std::memcpy(&value, tensor.bytes.data(), 4);
    return value;
  }
  uint16_t bits = 0;
  std::memcpy(&bits, tensor.bytes.data(), 2);
  return dtype == DType::kF16 ? f16_to_f32(bits) : bf16_to_f32(bits);
}

std::string strip_trailing_slashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

}  // namespace

Result<KvCacheDtype> parse_kv_cache_dtype(std::string_view name) {
  if (name == "fp16") return KvCacheDtype::kF16;
  if (name == "fp8_e4m3" || name == "fp8") return KvCacheDtype::kE4m3;
  return Status::option_error("kv_cache_dtype",
                              cat("unknown value \"", name, "\"; expected fp16 or fp8_e4m3"));
}

std::string_view kv_cache_dtype_name(KvCacheDtype dtype) {
  return dtype == KvCacheDtype::kE4m3 ? "fp8_e4m3" : "fp16";
}

Result<KvScalesMode> parse_kv_scales_mode(std::string_view name) {
  if (name == "calibrated") return KvScalesMode::kCalibrated;
  if (name == "unit") return KvScalesMode::kUnit;
  return Status::option_error("kv_scales_mode",
                              cat("unknown value \"", name,
                                  "\"; expected calibrated (scales from the checkpoint) or unit "
                                  "(1.0, a negative control)"));
}

std::string_view kv_scales_mode_name(KvScalesMode mode) {
  return mode == KvScalesMode::kUnit ? "unit" : "calibrated";
}

KvScales KvScales::unit(int64_t n_layers) {
  KvScales scales;
  scales.k_scale.assign(static_cast<size_t>(std::max<int64_t>(n_layers, 0)), 1.0f);
  scales.v_scale = scales.k_scale;
  return scales;
}

std::string kv_scale_prefix(const std::vector<std::string>& tensor_names) {
  if (auto prefix = most_common_prefix(tensor_names, ".self_attn.k_proj.weight", true)) {
    return *prefix;
  }
  if (auto prefix = most_common_prefix(tensor_names, ".self_attn.", false)) return *prefix;
  return "model";
}

std::string format_scale_value(float value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", static_cast<double>(value));
  return text;
}

namespace {

// The extreme finite nonzero FP16 magnitudes: the smallest subnormal and the largest normal.
constexpr float kFp16MinSubnormal = 5.9604644775390625e-08f;  // 2^-24
constexpr float kFp16Max = 65504.0f;

// fl(x / scale) does not increase with the scale and the E4M3 rounding is monotone, so for a
// positive scale these hold for every FP16 value exactly when they hold for the extreme one.
bool every_fp16_saturates(float scale) {
  return e4m3_encode(kFp16MinSubnormal, scale) == kE4m3MaxCode;
}
bool every_fp16_flushes(float scale) {
  return e4m3_encode(kFp16Max, scale) == 0;
}

// The last positive finite fp32 for which `holds` is true, `holds` being true up to some point and
// false after it (or the reverse with `rising`); positive fp32 values sort as their bit patterns.
float fp32_boundary(bool (*holds)(float), bool rising) {
  uint32_t lo = 1u;           // denorm_min
  uint32_t hi = 0x7F7FFFFFu;  // the largest finite fp32
  auto at = [](uint32_t bits) {
    float value = 0.0f;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  };
  // Invariant: holds(lo) != rising, holds(hi) == rising.
  E4KV_ASSERT(holds(at(lo)) != rising && holds(at(hi)) == rising, "kv scale limits: not monotone");
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    (holds(at(mid)) == rising ? hi : lo) = mid;
  }
  return at(rising ? hi : lo);
}

}  // namespace

const KvScaleLimits& kv_scale_limits() {
  static const KvScaleLimits limits = {fp32_boundary(every_fp16_saturates, /*rising=*/false),
                                       fp32_boundary(every_fp16_flushes, /*rising=*/true)};
  return limits;
}

std::optional<std::string> kv_scale_value_problem(float value) {
  if (!std::isfinite(value)) return std::string("not finite");
  if (!(value > 0.0f)) return std::string("not > 0");
  const KvScaleLimits& limits = kv_scale_limits();
  const std::string range =
      cat("valid scales lie strictly between ", format_scale_value(limits.largest_saturating),
          " and ", format_scale_value(limits.smallest_flushing),
          "; make scales with e4kv calibrate and e4kv summarize");
  if (value <= limits.largest_saturating) {
    return cat(
        "too small: every nonzero FP16 value would saturate to +-448 in E4M3, even 2^-24 / "
        "scale rounds to the E4M3 maximum; ",
        range);
  }
  if (value >= limits.smallest_flushing) {
    return cat(
        "too large: every FP16 value would round to zero in E4M3, even 65504 / scale "
        "rounds to 0; ",
        range);
  }
  return std::nullopt;
}

KvScaleGate::KvScaleGate(const ModelConfig& config, std::string prefix, KvCacheDtype dtype,
                         Options options)
    : n_layers_(config.n_layers),
      layer_kinds_(config.layers),
      prefix_(std::move(prefix)),
      dtype_(dtype),
      options_(std::move(options)) {
  E4KV_ASSERT(static_cast<int64_t>(layer_kinds_.size()) == n_layers_,
              "ModelConfig::layers must hold n_layers entries");
  if (dtype_ != KvCacheDtype::kE4m3) return;
  for (int64_t layer : config.kv_cache_layers()) {
    for (KvTensor tensor : {KvTensor::kK, KvTensor::kV}) {
      Slot slot;
      slot.layer = layer;
      slot.tensor = tensor;
      slots_.push_back(std::move(slot));
    }
  }
  expected_ = static_cast<int64_t>(slots_.size());
}

KvScaleGate::Slot* KvScaleGate::find_slot(int64_t layer, KvTensor tensor) {
  for (Slot& slot : slots_) {
    if (slot.layer == layer && slot.tensor == tensor) return &slot;
  }
  return nullptr;
}

std::vector<std::string> KvScaleGate::expected_keys() const {
  std::vector<std::string> keys;
  keys.reserve(slots_.size());
  for (const Slot& slot : slots_)
    keys.push_back(canonical_scale_key(prefix_, slot.layer, slot.tensor));
  return keys;
}

bool KvScaleGate::load(std::string_view name, const SafetensorsTensor& tensor) {
  E4KV_ASSERT(!finalized_, "KvScaleGate::load after a successful finalize");
  std::optional<ScaleKey> key = parse_scale_key(name);
  if (!key) return false;
  if (dtype_ != KvCacheDtype::kE4m3) {
    ++ignored_keys_;
    return true;
  }
  if (key->prefix != prefix_) {
    unexpected_.push_back(cat(name, " (prefix \"", key->prefix,
                              "\" does not match the checkpoint's layer prefix \"", prefix_,
                              "\"; the scales belong to another model)"));
    return true;
  }
  if (key->layer >= n_layers_) {
    unexpected_.push_back(cat(name, " (layer ", key->layer, " does not exist: the model has ",
                              n_layers_, " layers; the scales belong to another model)"));
    return true;
  }
  Slot* slot = find_slot(key->layer, key->tensor);
  if (slot == nullptr) {
    const LayerKind kind = layer_kinds_[static_cast<size_t>(key->layer)];
    unexpected_.push_back(cat(name, " (layer ", key->layer, " is ", layer_kind_name(kind),
                              " and has no E4M3 KV cache; the scales belong to another model)"));
    return true;
  }
  if (slot->loaded) {
    slot->duplicated = true;
    duplicates_.push_back(cat("layer ", key->layer, " ", tensor_letter(key->tensor),
                              " scale is set by both ", slot->key, " and ", name,
                              " (keep exactly one key per slot)"));
    return true;
  }
  slot->loaded = true;
  slot->key = std::string(name);
  Result<float> value = scalar_of(tensor);
  if (!value.ok()) {
    slot->problem = value.message();
    return true;
  }
  if (std::optional<std::string> problem = kv_scale_value_problem(*value)) {
    slot->problem = cat("= ", format_scale_value(*value), " (", *problem,
                        *value == -1.0f ? "; -1 is the unloaded sentinel" : "", ")");
  } else {
    slot->value = *value;
  }
  return true;
}

Status KvScaleGate::finalize_into(KvScales& runtime) {
  E4KV_ASSERT(!finalized_, "KvScaleGate::finalize after a successful finalize");
  std::vector<std::string> missing;
  std::vector<std::string> invalid;
  // A slot set by two keys counts as not loaded: which of the two wins is not defined.
  int64_t loaded = 0;
  for (const Slot& slot : slots_) {
    if (!slot.loaded) {
      missing.push_back(canonical_scale_key(prefix_, slot.layer, slot.tensor));
    } else if (!slot.problem.empty()) {
      invalid.push_back(cat(slot.key, " ", slot.problem));
    } else if (!slot.duplicated) {
      ++loaded;
    }
  }
  const int64_t expected_count = expected_;
  if (!missing.empty() || !invalid.empty() || !duplicates_.empty() || !unexpected_.empty()) {
    const std::string source = strip_trailing_slashes(options_.source);
    std::string message =
        cat("KV scale gate: loaded ", loaded, "/", expected_count,
            " K/V scales for kv-cache-dtype ", kv_cache_dtype_name(dtype_), " from ", source);
    for (const std::string& line : missing) message += cat("\n  missing: ", line);
    for (const std::string& line : invalid) message += cat("\n  invalid: ", line);
    for (const std::string& line : duplicates_) message += cat("\n  duplicate: ", line);
    for (const std::string& line : unexpected_) message += cat("\n  unexpected: ", line);
    if (!options_.remedy.empty()) {
      message += cat("\n  ", options_.remedy);
    } else {
      message +=
          cat("\n  make an overlay: e4kv summarize STATS... --out scales.json --report report "
              "&& e4kv overlay ",
              source, " --scales scales.json --out ", source, "-kvscales");
    }
    return Status::error(std::move(message));
  }

  // Validated: copy into fresh runtime vectors, then swap them in, then drop the slots.
  std::vector<float> k_scale(static_cast<size_t>(std::max<int64_t>(n_layers_, 0)), 1.0f);
  std::vector<float> v_scale = k_scale;
  std::vector<int64_t> layers;
  float lo = 0.0f;
  float hi = 0.0f;
  for (const Slot& slot : slots_) {
    (slot.tensor == KvTensor::kK ? k_scale : v_scale)[static_cast<size_t>(slot.layer)] = slot.value;
    if (layers.empty() || layers.back() != slot.layer) layers.push_back(slot.layer);
    lo = lo == 0.0f ? slot.value : std::min(lo, slot.value);
    hi = std::max(hi, slot.value);
  }
  runtime.dtype = dtype_;
  runtime.mode = KvScalesMode::kCalibrated;
  runtime.k_scale = std::move(k_scale);
  runtime.v_scale = std::move(v_scale);
  runtime.layers = std::move(layers);
  runtime.loaded = loaded;
  runtime.expected = expected_count;
  runtime.ignored_keys = ignored_keys_;
  if (dtype_ == KvCacheDtype::kE4m3) {
    runtime.summary = cat("kv scales: ", loaded, "/", expected_count,
                          " valid for kv-cache-dtype fp8_e4m3 (calibrated");
    if (expected_count > 0) {
      runtime.summary += cat(", ", format_scale_value(lo), " .. ", format_scale_value(hi));
    }
    runtime.summary += ")";
  } else {
    runtime.summary = cat("kv scales: not needed for kv-cache-dtype fp16 (", ignored_keys_,
                          " scale keys in the checkpoint ignored)");
  }
  slots_.clear();
  slots_.shrink_to_fit();
  finalized_ = true;
  return ok_status();
}

Result<KvScales> KvScaleGate::finalize() {
  KvScales runtime = KvScales::unit(n_layers_);
  E4KV_RETURN_IF_ERROR(finalize_into(runtime));
  return runtime;
}

bool is_negative_control_metadata(const std::map<std::string, std::string>& metadata) {
  auto marker = metadata.find(std::string(kNegativeControlMetadataKey));
  if (marker != metadata.end() && marker->second == "true") return true;
  auto policy = metadata.find(std::string(kPolicyMetadataKey));
  return policy != metadata.end() && policy->second == kUnitNegativeControlPolicy;
}

Result<KvScales> load_kv_scales(const Checkpoint& ckpt, KvCacheDtype dtype, KvScalesMode mode) {
  const std::vector<std::string> names = ckpt.tensor_names();
  const ModelConfig& config = ckpt.config();
  if (dtype == KvCacheDtype::kE4m3 && mode == KvScalesMode::kUnit) {
    KvScales scales = KvScales::unit(config.n_layers);
    scales.dtype = dtype;
    scales.mode = mode;
    scales.layers = config.kv_cache_layers();
    scales.expected = 2 * static_cast<int64_t>(scales.layers.size());
    scales.loaded = 0;
    for (const std::string& name : names) {
      if (parse_scale_key(name)) ++scales.ignored_keys;
    }
    scales.summary =
        cat("kv scales: NEGATIVE CONTROL: the unit scales mode runs the fp8_e4m3 cache "
            "with all ",
            scales.expected, " K/V scales = 1.0 (", scales.ignored_keys,
            " scale keys in the checkpoint ignored); not for production use");
    return scales;
  }
  // Which advice fits this directory when the gate refuses (see scale_gate.h).
  const std::string dir = strip_trailing_slashes(ckpt.dir().string());
  bool overlay = false;
  bool negative_control = false;
  for (const auto& shard : ckpt.shards()) {
    const auto& metadata = shard->metadata();
    if (metadata.count(std::string(kBaseRevisionMetadataKey)) != 0) overlay = true;
    if (is_negative_control_metadata(metadata)) negative_control = true;
  }
  // note: the file name of calib/overlay.h's provenance (kv/ does not depend on calib/).
  std::error_code ec;
  if (std::filesystem::exists(ckpt.dir() / "kvscales-provenance.json", ec)) overlay = true;
  int64_t embedded_keys = 0;
  for (const std::string& name : names) {
    if (parse_scale_key(name)) ++embedded_keys;
  }
  KvScaleGate::Options options{ckpt.dir().string(), ""};
  if (overlay) {
    options.remedy = cat("this directory is an overlay: e4kv verify ", dir,
                         " checks it against its base; re-create it with e4kv overlay BASE_DIR "
                         "--scales scales.json --out NEW_DIR");
  } else if (embedded_keys > 0) {
    // A plain overlay refuses a base that already holds scale keys (two keys for one slot); this
    // option leaves them out of the derived checkpoint and never writes into the base.
    options.remedy =
        cat("the K/V scales are embedded in this checkpoint's own shards; replace them without "
            "writing into it: e4kv summarize STATS... --out scales.json --report report && "
            "e4kv overlay ",
            dir, " --scales scales.json --replace-embedded-scales --out ", dir, "-kvscales");
  }
  KvScaleGate gate(config, kv_scale_prefix(names), dtype, std::move(options));
  for (const std::string& name : names) gate.load(name, *ckpt.find(name));
  E4KV_ASSIGN_OR_RETURN(KvScales scales, gate.finalize());
  if (dtype == KvCacheDtype::kE4m3 && negative_control) {
    scales.negative_control_overlay = true;
    scales.summary = cat("kv scales: NEGATIVE CONTROL: ", scales.loaded, "/", scales.expected,
                         " K/V scales are the unit scales (1.0) of an overlay made with "
                         "--unit-scale-negative-control; not calibrated, not for production use");
  }
  return scales;
}

}  // namespace e4kv
