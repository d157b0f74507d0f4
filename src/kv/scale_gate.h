// The K/V scale start-up gate (DESIGN.md section 5): an E4M3 KV cache starts only when every
// expected per-layer K and V scale was explicitly loaded and is valid: finite, > 0, and inside the
// range where the codec can store some FP16 value as neither 0 nor the E4M3 maximum
// (kv_scale_value_problem). It fails closed.
//
// Two kinds of state are kept apart, as in the seed: loading slots start at the invalid sentinel
// -1.0 and record which checkpoint key set them; runtime scales (KvScales) start at 1.0 and are
// written only by a successful finalisation, which validates every slot, copies them and drops the
// slots. 1.0 is a legal loaded value, never a "missing" signal. A failed finalisation changes no
// runtime state and reports every problem at once in one (multi-line) message:
//
//   KV scale gate: loaded 22/24 K/V scales for kv-cache-dtype fp8_e4m3 from <dir>
//     missing: model.layers.3.self_attn.k_scale
//     invalid: model.layers.7.self_attn.v_scale = nan (not finite)
//     make an overlay: e4kv summarize STATS... --out scales.json --report report
//                      && e4kv overlay <dir> ...
//
// The last line is advice that works for the directory at hand: a checkpoint without scale keys
// gets the overlay recipe; one whose scales are embedded in its own shards gets the overlay recipe
// with --replace-embedded-scales (a plain overlay refuses the key collision); an overlay gets
// `e4kv verify` and the re-create recipe.
//
// An overlay made with --unit-scale-negative-control holds explicitly loaded 1.0 scales, which the
// gate accepts (1.0 is a legal value); its scales shard carries a marker in its __metadata__
// (kNegativeControlMetadataKey = "true", or the policy "unit-scale-negative-control" of older
// overlays) and load_kv_scales() labels the result as a NEGATIVE CONTROL, never "calibrated".
//
// Plain C++ (no CUDA): the engine, `e4kv verify`, `e4kv inspect` and `e4kv overlay` share it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "kv/kv_cache_view.h"
#include "kv/scale_keys.h"

namespace e4kv {

class Checkpoint;

// __metadata__ keys e4kv writes into an overlay's model-kvscales.safetensors (calib/overlay.h).
// They live here because the gate reads them and kv/ does not depend on calib/.
inline constexpr std::string_view kBaseRevisionMetadataKey = "e4kv_base_revision";
inline constexpr std::string_view kPolicyMetadataKey = "e4kv_policy";
inline constexpr std::string_view kNegativeControlMetadataKey = "e4kv_negative_control";
// The policy recorded for --unit-scale-negative-control.
inline constexpr std::string_view kUnitNegativeControlPolicy = "unit-scale-negative-control";

// True when `metadata` (a safetensors __metadata__) marks unit scales written as a negative
// control.
bool is_negative_control_metadata(const std::map<std::string, std::string>& metadata);

// `--kv-cache-dtype`: "fp16" or "fp8_e4m3" ("fp8" is read as fp8_e4m3, as vLLM does).
Result<KvCacheDtype> parse_kv_cache_dtype(std::string_view name);
std::string_view kv_cache_dtype_name(KvCacheDtype dtype);  // "fp16" | "fp8_e4m3"

// `--kv-scales`: where an E4M3 cache takes its scales from.
enum class KvScalesMode {
  kCalibrated,  // from the checkpoint (an overlay); the default, and the only production mode
  kUnit,        // 1.0 everywhere, deliberately: a negative control, logged as such
};
Result<KvScalesMode> parse_kv_scales_mode(std::string_view name);  // "calibrated" | "unit"
std::string_view kv_scales_mode_name(KvScalesMode mode);

// Runtime K/V scales, indexed by model layer. Layers without an E4M3 cache (FP16 mode, linear
// attention) hold 1.0.
struct KvScales {
  KvCacheDtype dtype = KvCacheDtype::kF16;
  KvScalesMode mode = KvScalesMode::kCalibrated;
  std::vector<float> k_scale;   // [n_layers]
  std::vector<float> v_scale;   // [n_layers]
  std::vector<int64_t> layers;  // layers whose scales came through the gate (E4M3 cache layers)
  int64_t loaded = 0;           // slots explicitly loaded and valid
  int64_t expected = 0;         // 2 * layers.size() for E4M3, 0 for FP16
  int64_t ignored_keys = 0;     // scale keys in the checkpoint that this mode does not read
  // Calibrated mode over an overlay made with --unit-scale-negative-control: the loaded scales are
  // the 1.0 of a negative control, not calibrated (the scales shard's metadata says so).
  bool negative_control_overlay = false;
  // One line for the log, e.g. "kv scales: 24/24 calibrated K/V scales loaded" or, in unit mode
  // and for a negative-control overlay, "kv scales: NEGATIVE CONTROL: ..." (callers must log it).
  std::string summary;

  // 1.0 everywhere for `n_layers` layers: the state before any gate ran.
  static KvScales unit(int64_t n_layers);
  bool negative_control() const {
    return dtype == KvCacheDtype::kE4m3 &&
           (mode == KvScalesMode::kUnit || negative_control_overlay);
  }
};

// The prefix in front of ".layers.<i>." used by the checkpoint's attention weights, taken from the
// `*.layers.<i>.self_attn.k_proj.weight` keys (the most common prefix when several occur; then any
// `*.layers.<i>.self_attn.*` key; "model" when there is none).
std::string kv_scale_prefix(const std::vector<std::string>& tensor_names);

// One pass of the gate over a checkpoint's (or a would-be overlay's) scale tensors.
class KvScaleGate {
 public:
  struct Options {
    std::string source;  // what the scales come from, for the message ("/models/x", "scales.json")
    // The last line of a failure message: how to make good scales. Empty: the overlay recipe for
    // `source`.
    std::string remedy;
  };

  // Expected slots: K and V of every KV-cache layer of `config` when `dtype` is E4M3, named
  // `<prefix>.layers.<i>.self_attn.{k,v}_scale`; none for FP16.
  KvScaleGate(const ModelConfig& config, std::string prefix, KvCacheDtype dtype, Options options);

  // Offers one tensor. Returns false (and records nothing) when `name` is not a K/V scale key in
  // any accepted spelling; true otherwise. In FP16 mode scale keys are accepted and ignored. A
  // scale key for a layer with no E4M3 cache, with another prefix, or for a slot already set by
  // another key, and a tensor that is not an F32/F16/BF16 one-element tensor or whose value
  // kv_scale_value_problem() refuses, are recorded as problems for finalize().
  bool load(std::string_view name, const SafetensorsTensor& tensor);

  // Validates every slot. On success copies the slots into `runtime` (resized to n_layers if
  // needed) and drops the slots; on failure returns the one message and leaves `runtime` as it was.
  Status finalize_into(KvScales& runtime);
  // finalize_into() on KvScales::unit(n_layers).
  Result<KvScales> finalize();

  int64_t expected() const { return expected_; }
  // Canonical keys of the expected slots, layer by layer, K before V (empty after a successful
  // finalize, which drops the slots).
  std::vector<std::string> expected_keys() const;
  const std::string& prefix() const { return prefix_; }

 private:
  struct Slot {
    int64_t layer = 0;
    KvTensor tensor = KvTensor::kK;
    float value = -1.0f;  // the invalid sentinel until a key loads it
    bool loaded = false;
    bool duplicated = false;  // a second key named this slot
    std::string key;          // the checkpoint key that loaded it
    std::string problem;      // why the loaded value is invalid; empty when valid
  };
  Slot* find_slot(int64_t layer, KvTensor tensor);

  int64_t n_layers_ = 0;
  std::vector<LayerKind> layer_kinds_;
  std::string prefix_;
  KvCacheDtype dtype_;
  Options options_;
  std::vector<Slot> slots_;
  std::vector<std::string> duplicates_;  // one line each
  std::vector<std::string> unexpected_;  // one line each
  int64_t expected_ = 0;
  int64_t ignored_keys_ = 0;
  bool finalized_ = false;
};

// What engine start-up, `e4kv verify` and `e4kv inspect` call: runs the gate over every scale key
// of `ckpt`. FP16: no scales needed (keys ignored), all 1.0. E4M3 + calibrated: the gate; any
// problem is the one message, whose advice fits the directory (see the top of this file). E4M3 +
// unit: all 1.0 without reading the checkpoint's keys, and KvScales::summary says it is a negative
// control; so does a calibrated load from a negative-control overlay.
Result<KvScales> load_kv_scales(const Checkpoint& ckpt, KvCacheDtype dtype,
                                KvScalesMode mode = KvScalesMode::kCalibrated);

// A scale value as the gate's messages print it: "nan", "inf", "-0", "0.0171247218".
std::string format_scale_value(float value);

// The range of usable K/V scales, derived from the codec (include/e4kv/e4m3.h): the cache stores
// e4m3_encode(x, scale) = e4m3_satfinite_rne(fl(x / scale)) for FP16 values x, whose finite
// nonzero magnitudes run from 2^-24 to 65504. At a scale at or below `largest_saturating` even
// 2^-24 / scale rounds to the E4M3 maximum, so every nonzero FP16 value is stored as +-448; at a
// scale at or above `smallest_flushing` even 65504 / scale rounds to 0, so every value is stored
// as 0. Valid scales lie strictly between the two (both are exact fp32 boundaries, found by
// bisection over fp32 bit patterns with the codec itself).
struct KvScaleLimits {
  float largest_saturating = 0.0f;
  float smallest_flushing = 0.0f;
};
const KvScaleLimits& kv_scale_limits();

// Why `value` cannot be a K/V scale, or nullopt when it can: not finite, not > 0, or outside
// kv_scale_limits() (the text then says which way every FP16 value would go, gives the valid
// range and says how to make scales). The one rule for scales everywhere: the gate, scales.json
// (read and written), summarize and overlay.
std::optional<std::string> kv_scale_value_problem(float value);

}  // namespace e4kv
