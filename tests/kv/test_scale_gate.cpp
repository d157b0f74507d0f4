// The K/V scale start-up gate (DESIGN.md section 5): expected keys from the config, every kind of
// missing or invalid scale, aliases, duplicates, stray keys, the one message, and that a failed
// finalisation leaves the runtime scales untouched.
#include "kv/scale_gate.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/half.h"
#include "e4kv/e4m3.h"
#include "io/checkpoint.h"
#include "io/model_config.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

ModelConfig synth_config(SynthFamily family, int64_t n_layers) {
  SynthCheckpointOptions options;
  options.family = family;
  options.n_layers = n_layers;
  Result<SynthCheckpoint> ckpt = make_synth_checkpoint(options);
  E4KV_ASSERT(ckpt.ok(), ckpt.message());
  Result<ModelConfig> config = parse_model_config(ckpt->config_json, "config.json");
  E4KV_ASSERT(config.ok(), config.message());
  return *config;
}

// A tensor that owns its bytes; view() is what the gate sees.
struct OwnedTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;

  SafetensorsTensor view() const {
    SafetensorsTensor t;
    t.name = name;
    t.dtype = dtype;
    t.shape = shape;
    t.end = bytes.size();
    t.bytes = bytes;
    return t;
  }
};

OwnedTensor f32(const std::string& name, float value, std::vector<int64_t> shape = {}) {
  OwnedTensor t{name, DType::kF32, std::move(shape), std::vector<std::byte>(4)};
  std::memcpy(t.bytes.data(), &value, 4);
  return t;
}

OwnedTensor half_bits(const std::string& name, DType dtype, uint16_t bits,
                      std::vector<int64_t> shape = {}) {
  OwnedTensor t{name, dtype, std::move(shape), std::vector<std::byte>(2)};
  std::memcpy(t.bytes.data(), &bits, 2);
  return t;
}

std::string key(int64_t layer, KvTensor tensor) {
  return canonical_scale_key("model", layer, tensor);
}

// A Qwen4Exp-shaped model: 16 layers, KV cache on 3, 7, 11, 15 -> 8 scales.
class ScaleGateTest : public ::testing::Test {
 protected:
  ScaleGateTest() : config_(synth_config(SynthFamily::kQwen4Exp, 16)) {}

  KvScaleGate make_gate(KvCacheDtype dtype = KvCacheDtype::kE4m3) const {
    return KvScaleGate(config_, "model", dtype, {"/models/base", ""});
  }

  // Every expected key with a distinct valid value, except those in `skip`.
  std::vector<OwnedTensor> valid_set() const {
    std::vector<OwnedTensor> set;
    for (int64_t layer : config_.kv_cache_layers()) {
      set.push_back(f32(key(layer, KvTensor::kK), 0.01f * static_cast<float>(layer + 1)));
      set.push_back(f32(key(layer, KvTensor::kV), 0.02f * static_cast<float>(layer + 1)));
    }
    return set;
  }

  // Runs the gate over `tensors` into a runtime state filled with 2.0 and checks, on failure, that
  // the runtime state is unchanged.
  Status run(const std::vector<OwnedTensor>& tensors, KvCacheDtype dtype = KvCacheDtype::kE4m3) {
    KvScaleGate gate = make_gate(dtype);
    for (const OwnedTensor& t : tensors) EXPECT_TRUE(gate.load(t.name, t.view())) << t.name;
    runtime_ = KvScales::unit(config_.n_layers);
    std::fill(runtime_.k_scale.begin(), runtime_.k_scale.end(), 2.0f);
    std::fill(runtime_.v_scale.begin(), runtime_.v_scale.end(), 2.0f);
    runtime_.summary = "untouched";
    const KvScales before = runtime_;
    Status status = gate.finalize_into(runtime_);
    if (!status.ok()) {
      EXPECT_EQ(runtime_.k_scale, before.k_scale);
      EXPECT_EQ(runtime_.v_scale, before.v_scale);
      EXPECT_EQ(runtime_.loaded, before.loaded);
      EXPECT_EQ(runtime_.summary, "untouched");
      EXPECT_TRUE(runtime_.layers.empty());
    }
    return status;
  }

  ModelConfig config_;
  KvScales runtime_;
};

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

TEST(ScaleGateKeys, Qwen4Exp48LayersExpects24Keys) {
  const ModelConfig config = synth_config(SynthFamily::kQwen4Exp, 48);
  KvScaleGate gate(config, "model", KvCacheDtype::kE4m3, {});
  EXPECT_EQ(gate.expected(), 24);
  const std::vector<std::string> keys = gate.expected_keys();
  ASSERT_EQ(keys.size(), 24u);
  EXPECT_EQ(keys[0], "model.layers.3.self_attn.k_scale");
  EXPECT_EQ(keys[1], "model.layers.3.self_attn.v_scale");
  EXPECT_EQ(keys[23], "model.layers.47.self_attn.v_scale");
}

TEST(ScaleGateKeys, DenseLlamaExpectsEveryLayer) {
  const ModelConfig config = synth_config(SynthFamily::kLlama, 6);
  KvScaleGate gate(config, "model", KvCacheDtype::kE4m3, {});
  EXPECT_EQ(gate.expected(), 12);
  EXPECT_EQ(gate.expected_keys()[11], "model.layers.5.self_attn.v_scale");
  KvScaleGate fp16(config, "model", KvCacheDtype::kF16, {});
  EXPECT_EQ(fp16.expected(), 0);
}

TEST(ScaleGateKeys, PrefixFromKProjWeights) {
  EXPECT_EQ(kv_scale_prefix({"model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                             "model.layers.1.self_attn.k_proj.weight"}),
            "model");
  EXPECT_EQ(kv_scale_prefix({"model.language_model.layers.0.self_attn.k_proj.weight",
                             "model.language_model.layers.1.self_attn.k_proj.weight",
                             "mtp.layers.0.self_attn.k_proj.weight"}),
            "model.language_model");
  EXPECT_EQ(kv_scale_prefix({"layers.0.self_attn.k_proj.weight"}), "");
  EXPECT_EQ(kv_scale_prefix({"transformer.layers.3.self_attn.qkv_proj.weight"}), "transformer");
  EXPECT_EQ(kv_scale_prefix({"embed.weight"}), "model");
}

TEST(ScaleGateKeys, ParseFlags) {
  EXPECT_EQ(*parse_kv_cache_dtype("fp8_e4m3"), KvCacheDtype::kE4m3);
  EXPECT_EQ(*parse_kv_cache_dtype("fp8"), KvCacheDtype::kE4m3);
  EXPECT_EQ(*parse_kv_cache_dtype("fp16"), KvCacheDtype::kF16);
  EXPECT_EQ(parse_kv_cache_dtype("fp8_e5m2").status().option(), "kv_cache_dtype");
  EXPECT_TRUE(contains(parse_kv_cache_dtype("fp8_e5m2").message(), "expected fp16 or fp8_e4m3"));
  EXPECT_EQ(*parse_kv_scales_mode("calibrated"), KvScalesMode::kCalibrated);
  EXPECT_EQ(*parse_kv_scales_mode("unit"), KvScalesMode::kUnit);
  EXPECT_EQ(parse_kv_scales_mode("dynamic").status().option(), "kv_scales_mode");
}

TEST_F(ScaleGateTest, CompleteValidSetIsCopied) {
  ASSERT_TRUE(run(valid_set()).ok());
  EXPECT_EQ(runtime_.loaded, 8);
  EXPECT_EQ(runtime_.expected, 8);
  EXPECT_EQ(runtime_.layers, (std::vector<int64_t>{3, 7, 11, 15}));
  for (int64_t layer = 0; layer < 16; ++layer) {
    const bool kv = (layer + 1) % 4 == 0;
    EXPECT_EQ(runtime_.k_scale[layer], kv ? 0.01f * static_cast<float>(layer + 1) : 1.0f);
    EXPECT_EQ(runtime_.v_scale[layer], kv ? 0.02f * static_cast<float>(layer + 1) : 1.0f);
  }
  EXPECT_FALSE(runtime_.negative_control());
  EXPECT_TRUE(contains(runtime_.summary, "8/8 valid")) << runtime_.summary;
}

TEST_F(ScaleGateTest, FinalizeDropsSlots) {
  KvScaleGate gate = make_gate();
  for (const OwnedTensor& t : valid_set()) gate.load(t.name, t.view());
  Result<KvScales> scales = gate.finalize();
  ASSERT_TRUE(scales.ok()) << scales.message();
  EXPECT_TRUE(gate.expected_keys().empty());
  EXPECT_EQ(gate.expected(), 8);
}

TEST_F(ScaleGateTest, NonScaleNamesAreNotTaken) {
  KvScaleGate gate = make_gate();
  const OwnedTensor t = f32("model.layers.3.self_attn.k_proj.weight", 1.0f);
  EXPECT_FALSE(gate.load(t.name, t.view()));
  EXPECT_FALSE(gate.load("model.layers.3.self_attn.k_scales", t.view()));
}

TEST_F(ScaleGateTest, NoneLoaded) {
  Status status = run({});
  ASSERT_FALSE(status.ok());
  const std::string& m = status.message();
  EXPECT_EQ(m.rfind("KV scale gate: loaded 0/8 K/V scales for kv-cache-dtype fp8_e4m3 from "
                    "/models/base\n",
                    0),
            0u)
      << m;
  for (int64_t layer : {3, 7, 11, 15}) {
    EXPECT_TRUE(contains(m, "  missing: " + key(layer, KvTensor::kK) + "\n")) << m;
    EXPECT_TRUE(contains(m, "  missing: " + key(layer, KvTensor::kV) + "\n")) << m;
  }
  EXPECT_TRUE(contains(
      m,
      "\n  make an overlay: e4kv summarize STATS... --out scales.json --report "
      "report && e4kv overlay /models/base --scales scales.json --out /models/base-kvscales"))
      << m;
}

TEST_F(ScaleGateTest, OneMissing) {
  std::vector<OwnedTensor> set = valid_set();
  set.erase(set.begin() + 5);  // layer 11 V
  Status status = run(set);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(contains(status.message(), "loaded 7/8")) << status.message();
  EXPECT_TRUE(contains(status.message(), "missing: model.layers.11.self_attn.v_scale"));
  EXPECT_FALSE(contains(status.message(), "missing: model.layers.11.self_attn.k_scale"));
}

struct BadValue {
  const char* label;
  float value;
  const char* shown;
};

class ScaleGateBadValue : public ScaleGateTest, public ::testing::WithParamInterface<BadValue> {};

TEST_P(ScaleGateBadValue, IsInvalidAndNamed) {
  const BadValue& bad = GetParam();
  std::vector<OwnedTensor> set = valid_set();
  set[2] = f32(key(7, KvTensor::kK), bad.value);
  Status status = run(set);
  ASSERT_FALSE(status.ok()) << bad.label;
  EXPECT_TRUE(contains(status.message(), "loaded 7/8")) << status.message();
  EXPECT_TRUE(contains(status.message(),
                       cat("  invalid: model.layers.7.self_attn.k_scale = ", bad.shown, " (")))
      << status.message();
  EXPECT_FALSE(contains(status.message(), "missing:")) << status.message();
}

INSTANTIATE_TEST_SUITE_P(
    Values, ScaleGateBadValue,
    ::testing::Values(BadValue{"nan", std::numeric_limits<float>::quiet_NaN(), "nan"},
                      BadValue{"pos_inf", std::numeric_limits<float>::infinity(), "inf"},
                      BadValue{"neg_inf", -std::numeric_limits<float>::infinity(), "-inf"},
                      BadValue{"zero", 0.0f, "0"}, BadValue{"neg_zero", -0.0f, "-0"},
                      BadValue{"negative", -0.25f, "-0.25"}, BadValue{"sentinel", -1.0f, "-1"}),
    [](const auto& param_info) { return std::string(param_info.param.label); });

// The valid range found independently of kv_scale_limits(): a scale is useless when every finite
// nonzero FP16 value (all 63488 of them, both signs) encodes to +-448, or every finite FP16 value
// encodes to +-0, with the codec the cache write uses. Both properties are monotone in the scale,
// so the boundary is found by bisection over positive fp32 bit patterns with these brute-force
// predicates.
bool every_fp16_encodes_to(float scale, uint8_t magnitude_code) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float x = f16_to_f32(uint16_t(bits));
    if (!std::isfinite(x) || (x == 0.0f && magnitude_code != 0)) continue;
    if ((e4m3_encode(x, scale) & 0x7Fu) != magnitude_code) return false;
  }
  return true;
}

float from_bits(uint32_t bits) {
  float value = 0.0f;
  std::memcpy(&value, &bits, 4);
  return value;
}

// The last bit pattern in [1, 0x7F7FFFFF] where `holds` equals `at_low` (true at 1, false at the
// top, or the reverse).
uint32_t last_with(const std::function<bool(float)>& holds, bool at_low) {
  uint32_t lo = 1u;
  uint32_t hi = 0x7F7FFFFFu;
  EXPECT_EQ(holds(from_bits(lo)), at_low);
  EXPECT_NE(holds(from_bits(hi)), at_low);
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    (holds(from_bits(mid)) == at_low ? lo : hi) = mid;
  }
  return lo;
}

TEST(KvScaleLimits, AreTheCodecsExactBoundaries) {
  const float saturating =
      from_bits(last_with([](float s) { return every_fp16_encodes_to(s, kE4m3MaxCode); }, true));
  const float flushing =
      from_bits(last_with([](float s) { return every_fp16_encodes_to(s, 0); }, false) + 1u);
  const KvScaleLimits& limits = kv_scale_limits();
  EXPECT_EQ(limits.largest_saturating, saturating);
  EXPECT_EQ(limits.smallest_flushing, flushing);
  // By hand: 65504 / s <= 2^-10 + 2^-34 (the tie rounds to the even 2^-10, which rounds to 0)
  // holds from s = 65504 * 2^10 / (1 + 2^-24) up, and fp32 steps by 4 there: 67076096 = 65504 *
  // 2^10. 2^-24 / s >= 432 - 2^-16 (which rounds to 432, half way to 448, which wins the tie):
  // s <= 2^-24 / (432 - 2^-16) = 1.3797371963...e-10, whose fp32 floor is 0x2F17B426.
  EXPECT_EQ(flushing, 67076096.0f);
  EXPECT_EQ(saturating, from_bits(0x2F17B426u));
  // Inside the range some FP16 value is stored as neither 0 nor +-448.
  EXPECT_FALSE(every_fp16_encodes_to(std::nextafter(saturating, 1.0f), kE4m3MaxCode));
  EXPECT_FALSE(every_fp16_encodes_to(std::nextafter(flushing, 0.0f), 0));
}

TEST(KvScaleLimits, ValueProblemUsesThem) {
  const KvScaleLimits& limits = kv_scale_limits();
  const float inf = std::numeric_limits<float>::infinity();
  for (float valid : {std::nextafter(limits.largest_saturating, inf), 1.0f, 0.0171247218f,
                      std::nextafter(limits.smallest_flushing, 0.0f)}) {
    EXPECT_FALSE(kv_scale_value_problem(valid)) << valid;
  }
  for (float low : {limits.largest_saturating, 1.4e-45f, std::numeric_limits<float>::min(),
                    std::nextafter(std::numeric_limits<float>::min(), 0.0f)}) {
    ASSERT_TRUE(kv_scale_value_problem(low)) << low;
    EXPECT_TRUE(contains(*kv_scale_value_problem(low), "every nonzero FP16 value would saturate"));
  }
  for (float high : {limits.smallest_flushing, 1e30f, std::numeric_limits<float>::max()}) {
    ASSERT_TRUE(kv_scale_value_problem(high)) << high;
    EXPECT_TRUE(contains(*kv_scale_value_problem(high), "every FP16 value would round to zero"));
  }
  EXPECT_EQ(kv_scale_value_problem(std::nanf("")), "not finite");
  EXPECT_EQ(kv_scale_value_problem(-inf), "not finite");
  EXPECT_EQ(kv_scale_value_problem(-0.0f), "not > 0");
}

// The gate refuses the boundary values and the absurd ones, naming the key and the value, and
// accepts the values just inside.
TEST_F(ScaleGateTest, ScalesOutsideTheUsableRangeAreInvalid) {
  const KvScaleLimits& limits = kv_scale_limits();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<OwnedTensor> set = valid_set();
  set[0] = f32(key(3, KvTensor::kK), std::nextafter(limits.largest_saturating, inf));
  set[1] = f32(key(3, KvTensor::kV), std::nextafter(limits.smallest_flushing, 0.0f));
  ASSERT_TRUE(run(set).ok());
  EXPECT_EQ(runtime_.k_scale[3], std::nextafter(limits.largest_saturating, inf));
  EXPECT_EQ(runtime_.v_scale[3], 67076092.0f);

  set = valid_set();
  set[0] = f32(key(3, KvTensor::kK), limits.largest_saturating);
  set[1] = f32(key(3, KvTensor::kV), limits.smallest_flushing);
  set[2] = f32(key(7, KvTensor::kK), 1e30f);
  set[3] = f32(key(7, KvTensor::kV), 1.4e-45f);
  // Every positive finite FP16 scale is usable; a BF16 one need not be.
  set[4] = half_bits(key(11, KvTensor::kK), DType::kBF16, f32_to_bf16(std::ldexp(1.0f, -40)));
  Status status = run(set);
  ASSERT_FALSE(status.ok());
  const std::string& m = status.message();
  EXPECT_TRUE(contains(m, "loaded 3/8")) << m;
  const std::string low = " (too small: every nonzero FP16 value would saturate to +-448 in E4M3";
  const std::string high = " (too large: every FP16 value would round to zero in E4M3";
  EXPECT_TRUE(contains(m, "invalid: model.layers.3.self_attn.k_scale = 1.37973716e-10" + low)) << m;
  EXPECT_TRUE(contains(m, "invalid: model.layers.3.self_attn.v_scale = 67076096" + high)) << m;
  EXPECT_TRUE(contains(m, "invalid: model.layers.7.self_attn.k_scale = 1.00000002e+30" + high))
      << m;
  EXPECT_TRUE(contains(m, "invalid: model.layers.7.self_attn.v_scale = 1.40129846e-45" + low)) << m;
  EXPECT_TRUE(contains(m, "invalid: model.layers.11.self_attn.k_scale = 9.09494702e-13" + low))
      << m;
  EXPECT_TRUE(contains(m, "valid scales lie strictly between 1.37973716e-10 and 67076096")) << m;
}

TEST_F(ScaleGateTest, NotFiniteAndNotPositiveSayWhy) {
  std::vector<OwnedTensor> set = valid_set();
  set[0] = f32(key(3, KvTensor::kK), std::numeric_limits<float>::quiet_NaN());
  set[1] = f32(key(3, KvTensor::kV), -1.0f);
  Status status = run(set);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(contains(status.message(), "self_attn.k_scale = nan (not finite)"));
  EXPECT_TRUE(contains(status.message(),
                       "self_attn.v_scale = -1 (not > 0; -1 is the unloaded "
                       "sentinel)"))
      << status.message();
  EXPECT_TRUE(contains(status.message(), "loaded 6/8"));
}

TEST_F(ScaleGateTest, OneIsLegal) {
  std::vector<OwnedTensor> set;
  for (int64_t layer : config_.kv_cache_layers()) {
    set.push_back(f32(key(layer, KvTensor::kK), 1.0f));
    set.push_back(f32(key(layer, KvTensor::kV), 1.0f));
  }
  ASSERT_TRUE(run(set).ok());
  EXPECT_EQ(runtime_.loaded, 8);
  EXPECT_EQ(runtime_.k_scale[3], 1.0f);
  EXPECT_FALSE(runtime_.negative_control());  // explicitly loaded 1.0 is calibrated data
}

TEST_F(ScaleGateTest, HalfAndBfloatAndOneElementShapesAreAccepted) {
  std::vector<OwnedTensor> set = valid_set();
  set[0] = half_bits(key(3, KvTensor::kK), DType::kF16, f32_to_f16(0.125f));
  set[1] = half_bits(key(3, KvTensor::kV), DType::kBF16, f32_to_bf16(0.5f), {1});
  set[2] = f32(key(7, KvTensor::kK), 0.75f, {1, 1});
  ASSERT_TRUE(run(set).ok());
  EXPECT_EQ(runtime_.k_scale[3], 0.125f);
  EXPECT_EQ(runtime_.v_scale[3], 0.5f);
  EXPECT_EQ(runtime_.k_scale[7], 0.75f);
}

TEST_F(ScaleGateTest, HalfNanIsInvalid) {
  std::vector<OwnedTensor> set = valid_set();
  set[0] = half_bits(key(3, KvTensor::kK), DType::kF16, 0x7E00);
  Status status = run(set);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(contains(status.message(), "k_scale = nan (not finite)")) << status.message();
}

TEST_F(ScaleGateTest, WrongDtype) {
  for (DType dtype : {DType::kI32, DType::kF64, DType::kF8E4M3, DType::kU8}) {
    std::vector<OwnedTensor> set = valid_set();
    set[3] =
        OwnedTensor{key(7, KvTensor::kV), dtype, {}, std::vector<std::byte>(dtype_size(dtype))};
    Status status = run(set);
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(contains(status.message(),
                         cat("invalid: model.layers.7.self_attn.v_scale has dtype ",
                             dtype_name(dtype), " (expected an F32, F16 or BF16 scalar)")))
        << status.message();
    EXPECT_TRUE(contains(status.message(), "loaded 7/8"));
  }
}

TEST_F(ScaleGateTest, WrongShape) {
  for (std::vector<int64_t> shape :
       {std::vector<int64_t>{2}, std::vector<int64_t>{1, 2}, std::vector<int64_t>{0}}) {
    std::vector<OwnedTensor> set = valid_set();
    const int64_t n = shape.size() == 1 ? shape[0] : 2;
    set[3] = OwnedTensor{key(7, KvTensor::kV), DType::kF32, shape,
                         std::vector<std::byte>(4 * static_cast<size_t>(n))};
    Status status = run(set);
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(contains(status.message(), "invalid: model.layers.7.self_attn.v_scale has shape ["))
        << status.message();
    EXPECT_TRUE(contains(status.message(), "(expected a scalar or a one-element tensor)"));
  }
}

TEST_F(ScaleGateTest, EveryAliasLoadsItsSlot) {
  const std::vector<std::pair<std::string, std::string>> aliases = {
      {"self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"},
      {"self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"},
      {"self_attn.attn.k_scale", "self_attn.attn.v_scale"},
      {"self_attn.qkv_proj.k_scale", "self_attn.qkv_proj.v_scale"},
  };
  std::vector<OwnedTensor> set;
  const std::vector<int64_t> layers = config_.kv_cache_layers();
  for (size_t i = 0; i < layers.size(); ++i) {
    set.push_back(f32(cat("model.layers.", layers[i], ".", aliases[i].first), 0.5f));
    set.push_back(f32(cat("model.layers.", layers[i], ".", aliases[i].second), 0.25f));
  }
  ASSERT_TRUE(run(set).ok());
  for (int64_t layer : layers) {
    EXPECT_EQ(runtime_.k_scale[layer], 0.5f);
    EXPECT_EQ(runtime_.v_scale[layer], 0.25f);
  }
}

TEST_F(ScaleGateTest, TwoKeysForOneSlot) {
  std::vector<OwnedTensor> set = valid_set();
  set.push_back(f32("model.layers.3.self_attn.k_proj.k_scale", 0.5f));
  Status status = run(set);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(contains(status.message(),
                       "duplicate: layer 3 K scale is set by both model.layers.3.self_attn.k_scale "
                       "and model.layers.3.self_attn.k_proj.k_scale"))
      << status.message();
  EXPECT_TRUE(contains(status.message(), "loaded 7/8"));
}

TEST_F(ScaleGateTest, StrayKeys) {
  struct Case {
    std::string name;
    std::string reason;
  };
  for (const Case& c : {
           Case{"model.layers.2.self_attn.k_scale",
                "(layer 2 is linear_attention and has no E4M3 KV cache; the scales belong to "
                "another model)"},
           Case{"model.layers.16.self_attn.v_scale", "(layer 16 does not exist: the model has 16"},
           Case{"model.language_model.layers.3.self_attn.k_scale",
                "(prefix \"model.language_model\" does not match the checkpoint's layer prefix "
                "\"model\""},
       }) {
    std::vector<OwnedTensor> set = valid_set();
    set.push_back(f32(c.name, 0.5f));
    Status status = run(set);
    ASSERT_FALSE(status.ok()) << c.name;
    EXPECT_TRUE(contains(status.message(), "unexpected: " + c.name + " " + c.reason))
        << status.message();
    EXPECT_TRUE(contains(status.message(), "loaded 8/8")) << status.message();
  }
}

TEST_F(ScaleGateTest, AllProblemsInOneMessage) {
  std::vector<OwnedTensor> set = valid_set();
  set.erase(set.begin());  // layer 3 K missing
  set[0] = f32(key(3, KvTensor::kV), std::numeric_limits<float>::infinity());
  set.push_back(f32("model.layers.7.self_attn.attn.v_scale", 0.5f));
  set.push_back(f32("model.layers.0.self_attn.v_scale", 0.5f));
  Status status = run(set);
  ASSERT_FALSE(status.ok());
  const std::string& m = status.message();
  EXPECT_TRUE(contains(m, "loaded 5/8")) << m;
  const size_t missing = m.find("\n  missing: model.layers.3.self_attn.k_scale");
  const size_t invalid = m.find("\n  invalid: model.layers.3.self_attn.v_scale = inf (not finite)");
  const size_t duplicate = m.find("\n  duplicate: layer 7 V scale");
  const size_t unexpected = m.find("\n  unexpected: model.layers.0.self_attn.v_scale");
  const size_t remedy = m.find("\n  make an overlay:");
  ASSERT_NE(missing, std::string::npos) << m;
  ASSERT_NE(invalid, std::string::npos) << m;
  ASSERT_NE(duplicate, std::string::npos) << m;
  ASSERT_NE(unexpected, std::string::npos) << m;
  ASSERT_NE(remedy, std::string::npos) << m;
  EXPECT_LT(missing, invalid);
  EXPECT_LT(invalid, duplicate);
  EXPECT_LT(duplicate, unexpected);
  EXPECT_LT(unexpected, remedy);
}

TEST_F(ScaleGateTest, Fp16IgnoresScaleKeys) {
  std::vector<OwnedTensor> set = valid_set();
  set.push_back(f32("model.layers.2.self_attn.k_scale", std::nanf("")));
  set.push_back(f32("model.layers.3.self_attn.k_proj.k_scale", 0.5f));
  ASSERT_TRUE(run(set, KvCacheDtype::kF16).ok());
  EXPECT_EQ(runtime_.expected, 0);
  EXPECT_EQ(runtime_.ignored_keys, 10);
  for (int64_t layer = 0; layer < 16; ++layer) {
    EXPECT_EQ(runtime_.k_scale[layer], 1.0f);
    EXPECT_EQ(runtime_.v_scale[layer], 1.0f);
  }
  EXPECT_TRUE(contains(runtime_.summary, "not needed for kv-cache-dtype fp16"));
}

TEST_F(ScaleGateTest, CustomSourceAndRemedy) {
  KvScaleGate gate(config_, "model", KvCacheDtype::kE4m3, {"scales.json", "re-run summarize"});
  Result<KvScales> scales = gate.finalize();
  ASSERT_FALSE(scales.ok());
  EXPECT_TRUE(contains(scales.message(), "from scales.json\n"));
  EXPECT_TRUE(contains(scales.message(), "\n  re-run summarize"));
  EXPECT_FALSE(contains(scales.message(), "make an overlay"));
}

TEST(ScaleGateFormat, Values) {
  EXPECT_EQ(format_scale_value(std::nanf("")), "nan");
  EXPECT_EQ(format_scale_value(-std::numeric_limits<float>::infinity()), "-inf");
  EXPECT_EQ(format_scale_value(-0.0f), "-0");
  EXPECT_EQ(format_scale_value(0.0171247218f), "0.0171247218");
}

// ---- load_kv_scales over a checkpoint on disk ---------------------------------------------------

class LoadKvScalesTest : public ::testing::Test {
 protected:
  LoadKvScalesTest() {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() / cat("e4kv_scale_gate_", ::getpid(), "_", counter++);
    fs::remove_all(dir_);
  }
  ~LoadKvScalesTest() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  Checkpoint write(bool with_scales) {
    SynthCheckpointOptions options;
    options.family = SynthFamily::kQwen4Exp;
    options.n_layers = 8;
    options.n_shards = 2;
    options.with_kv_scales = with_scales;
    Status written = write_synth_checkpoint(dir_, options);
    E4KV_ASSERT(written.ok(), written.message());
    Result<Checkpoint> ckpt = Checkpoint::open(dir_);
    E4KV_ASSERT(ckpt.ok(), ckpt.message());
    return std::move(ckpt).value();
  }
  fs::path dir_;
};

TEST_F(LoadKvScalesTest, CheckpointWithScalesPasses) {
  const Checkpoint ckpt = write(true);
  Result<KvScales> scales = load_kv_scales(ckpt, KvCacheDtype::kE4m3);
  ASSERT_TRUE(scales.ok()) << scales.message();
  EXPECT_EQ(scales->loaded, 4);
  EXPECT_EQ(scales->expected, 4);
  EXPECT_EQ(scales->layers, (std::vector<int64_t>{3, 7}));
  EXPECT_GT(scales->k_scale[3], 0.0f);
  EXPECT_EQ(scales->k_scale[0], 1.0f);
}

TEST_F(LoadKvScalesTest, CheckpointWithoutScalesFailsClosed) {
  const Checkpoint ckpt = write(false);
  Result<KvScales> scales = load_kv_scales(ckpt, KvCacheDtype::kE4m3, KvScalesMode::kCalibrated);
  ASSERT_FALSE(scales.ok());
  EXPECT_TRUE(contains(scales.message(), cat("loaded 0/4 K/V scales for kv-cache-dtype fp8_e4m3 "
                                             "from ",
                                             dir_.string())))
      << scales.message();
  EXPECT_TRUE(contains(scales.message(), cat("e4kv overlay ", dir_.string(), " --scales")));
}

TEST_F(LoadKvScalesTest, UnitModeIsANegativeControl) {
  const Checkpoint ckpt = write(true);
  Result<KvScales> scales = load_kv_scales(ckpt, KvCacheDtype::kE4m3, KvScalesMode::kUnit);
  ASSERT_TRUE(scales.ok()) << scales.message();
  EXPECT_TRUE(scales->negative_control());
  EXPECT_EQ(scales->ignored_keys, 4);
  EXPECT_EQ(scales->expected, 4);
  EXPECT_EQ(scales->k_scale[3], 1.0f);
  EXPECT_EQ(scales->v_scale[7], 1.0f);
  EXPECT_TRUE(contains(scales->summary, "NEGATIVE CONTROL")) << scales->summary;
  // Unit mode needs no scales at all.
  fs::remove_all(dir_);
  const Checkpoint bare = write(false);
  EXPECT_TRUE(load_kv_scales(bare, KvCacheDtype::kE4m3, KvScalesMode::kUnit).ok());
}

TEST_F(LoadKvScalesTest, Fp16NeedsNoScales) {
  const Checkpoint ckpt = write(false);
  Result<KvScales> scales = load_kv_scales(ckpt, KvCacheDtype::kF16);
  ASSERT_TRUE(scales.ok()) << scales.message();
  EXPECT_FALSE(scales->negative_control());
  EXPECT_EQ(scales->expected, 0);
}

// Rewrites every shard of the checkpoint at `dir`, setting `key` (when present) to `value` and
// adding `metadata` to each shard's __metadata__.
void rewrite_shards(const fs::path& dir, const std::string& key, float value,
                    const std::map<std::string, std::string>& metadata) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    Result<SafetensorsFile> file = SafetensorsFile::open(entry.path());
    ASSERT_TRUE(file.ok()) << file.message();
    std::vector<SafetensorsWriteTensor> tensors;
    for (const SafetensorsTensor& t : file->tensors()) {
      tensors.push_back(
          {t.name, t.dtype, t.shape,
           t.name == key ? std::as_bytes(std::span<const float>(&value, 1)) : t.bytes});
    }
    std::map<std::string, std::string> merged = file->metadata();
    for (const auto& [k, v] : metadata) merged[k] = v;
    const fs::path temp = dir.parent_path() / cat(dir.filename().string(), ".rewrite.tmp");
    ASSERT_TRUE(write_safetensors(temp, tensors, merged).ok());
    fs::rename(temp, entry.path());
  }
}

TEST_F(LoadKvScalesTest, EmbeddedInvalidScalesGetTheReplaceAdvice) {
  write(true);
  rewrite_shards(dir_, "model.layers.7.self_attn.k_scale", 0.0f, {});
  Result<Checkpoint> ckpt = Checkpoint::open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<KvScales> scales = load_kv_scales(*ckpt, KvCacheDtype::kE4m3);
  ASSERT_FALSE(scales.ok());
  EXPECT_TRUE(contains(scales.message(), "invalid: model.layers.7.self_attn.k_scale = 0"))
      << scales.message();
  // A plain overlay would refuse this base (its keys collide): the advice names the option that
  // replaces them.
  EXPECT_TRUE(contains(scales.message(), cat("e4kv overlay ", dir_.string(),
                                             " --scales scales.json --replace-embedded-scales")))
      << scales.message();
  EXPECT_FALSE(contains(scales.message(), "make an overlay")) << scales.message();
}

TEST_F(LoadKvScalesTest, NegativeControlMarkerIsLabelled) {
  write(true);
  for (const auto& marker : std::vector<std::map<std::string, std::string>>{
           {{"e4kv_negative_control", "true"}}, {{"e4kv_policy", "unit-scale-negative-control"}}}) {
    rewrite_shards(dir_, "", 0.0f, marker);
    Result<Checkpoint> ckpt = Checkpoint::open(dir_);
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    Result<KvScales> scales = load_kv_scales(*ckpt, KvCacheDtype::kE4m3);
    ASSERT_TRUE(scales.ok()) << scales.message();
    EXPECT_TRUE(scales->negative_control_overlay);
    EXPECT_TRUE(scales->negative_control());
    EXPECT_EQ(scales->mode, KvScalesMode::kCalibrated);
    EXPECT_TRUE(contains(scales->summary, "kv scales: NEGATIVE CONTROL: 4/4")) << scales->summary;
    EXPECT_FALSE(contains(scales->summary, "(calibrated,")) << scales->summary;
    // An FP16 cache takes no scales, so nothing is a negative control.
    Result<KvScales> fp16 = load_kv_scales(*ckpt, KvCacheDtype::kF16);
    ASSERT_TRUE(fp16.ok());
    EXPECT_FALSE(fp16->negative_control());
    fs::remove_all(dir_);
    write(true);
  }
  // "false" is no marker.
  rewrite_shards(dir_, "", 0.0f, {{"e4kv_negative_control", "false"}});
  Result<Checkpoint> ckpt = Checkpoint::open(dir_);
  ASSERT_TRUE(ckpt.ok());
  Result<KvScales> scales = load_kv_scales(*ckpt, KvCacheDtype::kE4m3);
  ASSERT_TRUE(scales.ok());
  EXPECT_FALSE(scales->negative_control());
  EXPECT_TRUE(contains(scales->summary, "(calibrated,")) << scales->summary;
}

}  // namespace
}  // namespace e4kv
