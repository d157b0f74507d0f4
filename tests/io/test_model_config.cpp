#include "io/model_config.h"

#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace e4kv {
namespace {

using json = nlohmann::json;

json llama_config() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": false,
    "attention_bias": false,
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rope_scaling": {
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192,
      "rope_type": "llama3"
    }
  })");
}

json qwen4exp_text_config() {
  json config = json::parse(R"({
    "model_type": "qwen4_exp_text",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25}
  })");
  return config;
}

Result<ModelConfig> parse(const json& config) {
  return parse_model_config(config.dump(), "cfg.json");
}

// The error message of parsing `config`, or a failure when it parses.
std::string error_of(const json& config) {
  Result<ModelConfig> result = parse(config);
  EXPECT_FALSE(result.ok()) << "expected an error for " << config.dump();
  return result.ok() ? std::string() : result.message();
}

std::vector<int64_t> indices_of(const ModelConfig& config, LayerKind kind) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < config.layers.size(); ++i) {
    if (config.layers[i] == kind) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

TEST(ModelConfig, DenseLlama3) {
  Result<ModelConfig> result = parse(llama_config());
  ASSERT_TRUE(result.ok()) << result.message();
  const ModelConfig& c = *result;
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_FALSE(c.nested_text_config);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.n_layers, 32);
  EXPECT_EQ(c.n_heads, 32);
  EXPECT_EQ(c.n_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rotary_dim, 128);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 8192);
  EXPECT_FALSE(c.qsa.has_value());
  ASSERT_EQ(c.layers.size(), 32u);
  EXPECT_EQ(c.count_layers(LayerKind::kFullAttention), 32);
  EXPECT_EQ(c.kv_cache_layers().size(), 32u);
}

TEST(ModelConfig, DefaultsForOptionalFields) {
  json config = {{"hidden_size", 64},
                 {"num_hidden_layers", 2},
                 {"num_attention_heads", 4},
                 {"vocab_size", 100}};
  Result<ModelConfig> result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(result->n_kv_heads, 4);  // defaults to num_attention_heads
  EXPECT_EQ(result->head_dim, 16);   // hidden_size / num_attention_heads
  EXPECT_EQ(result->rotary_dim, 16);
  EXPECT_EQ(result->intermediate_size, 0);
  EXPECT_EQ(result->max_position_embeddings, 0);
  EXPECT_EQ(result->rope.type, "default");
  EXPECT_DOUBLE_EQ(result->rope.theta, 10000.0);
  EXPECT_DOUBLE_EQ(result->rms_norm_eps, 1e-6);
  EXPECT_TRUE(result->architecture.empty());
  EXPECT_TRUE(result->torch_dtype.empty());
}

TEST(ModelConfig, NullMeansAbsentAndDtypeSpellings) {
  json config = llama_config();
  config["head_dim"] = nullptr;
  config["rope_scaling"] = nullptr;
  config["sliding_window"] = nullptr;
  config.erase("torch_dtype");
  config["dtype"] = "float16";
  Result<ModelConfig> result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(result->head_dim, 128);
  EXPECT_EQ(result->rope.type, "default");
  EXPECT_EQ(result->torch_dtype, "float16");
  EXPECT_FALSE(result->sliding_window.has_value());
}

TEST(ModelConfig, RopeV4LinearDynamicYarnAndLegacyTypeKey) {
  json config = llama_config();
  config["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  Result<ModelConfig> linear = parse(config);
  ASSERT_TRUE(linear.ok()) << linear.message();
  EXPECT_EQ(linear->rope.type, "linear");
  EXPECT_DOUBLE_EQ(linear->rope.factor, 2.0);
  EXPECT_DOUBLE_EQ(linear->rope.theta, 500000.0);

  config["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 4.0}};
  Result<ModelConfig> dynamic = parse(config);
  ASSERT_TRUE(dynamic.ok()) << dynamic.message();
  EXPECT_EQ(dynamic->rope.type, "dynamic");
  EXPECT_DOUBLE_EQ(dynamic->rope.factor, 4.0);

  config["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4.0},        {"original_max_position_embeddings", 32768},
      {"beta_fast", 16},     {"beta_slow", 2},       {"attention_factor", 1.1},
      {"mscale", 1.0},       {"mscale_all_dim", 0.5}};
  Result<ModelConfig> yarn = parse(config);
  ASSERT_TRUE(yarn.ok()) << yarn.message();
  EXPECT_EQ(yarn->rope.type, "yarn");
  EXPECT_DOUBLE_EQ(yarn->rope.factor, 4.0);
  EXPECT_EQ(yarn->rope.original_max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(yarn->rope.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(yarn->rope.beta_slow, 2.0);
  EXPECT_EQ(yarn->rope.attention_factor, 1.1);
  EXPECT_EQ(yarn->rope.mscale, 1.0);
  EXPECT_EQ(yarn->rope.mscale_all_dim, 0.5);

  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  Result<ModelConfig> yarn_defaults = parse(config);
  ASSERT_TRUE(yarn_defaults.ok()) << yarn_defaults.message();
  EXPECT_DOUBLE_EQ(yarn_defaults->rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(yarn_defaults->rope.beta_slow, 1.0);
  EXPECT_FALSE(yarn_defaults->rope.attention_factor.has_value());
  EXPECT_FALSE(yarn_defaults->rope.original_max_position_embeddings.has_value());
}

TEST(ModelConfig, RopeV5Parameters) {
  json config = llama_config();
  config.erase("rope_theta");
  config.erase("rope_scaling");
  config["rope_parameters"] = {
      {"rope_type", "llama3"},   {"rope_theta", 500000.0},
      {"factor", 32.0},          {"low_freq_factor", 1.0},
      {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  Result<ModelConfig> llama3 = parse(config);
  ASSERT_TRUE(llama3.ok()) << llama3.message();
  EXPECT_EQ(llama3->rope.type, "llama3");
  EXPECT_DOUBLE_EQ(llama3->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(llama3->rope.factor, 32.0);
  EXPECT_EQ(llama3->rope.original_max_position_embeddings, 8192);

  config["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4}};
  Result<ModelConfig> yarn = parse(config);
  ASSERT_TRUE(yarn.ok()) << yarn.message();
  EXPECT_EQ(yarn->rope.type, "yarn");
  EXPECT_DOUBLE_EQ(yarn->rope.theta, 1e6);

  config["rope_parameters"] = {{"rope_type", "linear"}, {"rope_theta", 1e4}, {"factor", 2.0}};
  Result<ModelConfig> linear = parse(config);
  ASSERT_TRUE(linear.ok()) << linear.message();
  EXPECT_EQ(linear->rope.type, "linear");
  EXPECT_DOUBLE_EQ(linear->rope.factor, 2.0);

  // rope_theta missing inside rope_parameters falls back to the top-level field.
  config["rope_theta"] = 123456.0;
  config["rope_parameters"] = {{"rope_type", "default"}};
  Result<ModelConfig> fallback = parse(config);
  ASSERT_TRUE(fallback.ok()) << fallback.message();
  EXPECT_DOUBLE_EQ(fallback->rope.theta, 123456.0);

  // Per-layer-type form: the full_attention entry is used.
  config["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"rope_theta", 1e6}, {"factor", 8.0}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 1e4}}}};
  Result<ModelConfig> per_type = parse(config);
  ASSERT_TRUE(per_type.ok()) << per_type.message();
  EXPECT_EQ(per_type->rope.type, "linear");
  EXPECT_DOUBLE_EQ(per_type->rope.theta, 1e6);
}

TEST(ModelConfig, PartialRotaryFactorInBothPlaces) {
  json config = llama_config();  // head_dim 128
  config["partial_rotary_factor"] = 0.5;
  Result<ModelConfig> top = parse(config);
  ASSERT_TRUE(top.ok()) << top.message();
  EXPECT_DOUBLE_EQ(top->rope.partial_rotary_factor, 0.5);
  EXPECT_EQ(top->rotary_dim, 64);

  config.erase("partial_rotary_factor");
  config.erase("rope_scaling");
  config["rope_parameters"] = {{"rope_type", "default"}, {"partial_rotary_factor", 0.25}};
  Result<ModelConfig> inner = parse(config);
  ASSERT_TRUE(inner.ok()) << inner.message();
  EXPECT_EQ(inner->rotary_dim, 32);
  EXPECT_DOUBLE_EQ(inner->rope.theta, 500000.0);

  config["partial_rotary_factor"] = 0.25;  // agrees
  EXPECT_TRUE(parse(config).ok());
  config["partial_rotary_factor"] = 0.5;  // disagrees
  std::string message = error_of(config);
  EXPECT_NE(message.find("partial_rotary_factor"), std::string::npos) << message;
  EXPECT_NE(message.find("disagree"), std::string::npos) << message;
}

TEST(ModelConfig, RotaryDimMustBeEvenIntegerWithinHeadDim) {
  json config = llama_config();           // head_dim 128
  config["partial_rotary_factor"] = 0.3;  // 38.4
  std::string message = error_of(config);
  EXPECT_NE(message.find("rotary_dim"), std::string::npos) << message;
  EXPECT_NE(message.find("cfg.json"), std::string::npos) << message;

  config["head_dim"] = 36;
  config["partial_rotary_factor"] = 0.25;  // 9: odd
  EXPECT_NE(error_of(config).find("even integer"), std::string::npos);

  config["partial_rotary_factor"] = 1.5;
  EXPECT_NE(error_of(config).find("\"partial_rotary_factor\" must be in (0, 1]"),
            std::string::npos);
  config["partial_rotary_factor"] = 0.0;
  EXPECT_NE(error_of(config).find("partial_rotary_factor"), std::string::npos);
}

TEST(ModelConfig, TextConfigNesting) {
  json config = {{"architectures", {"Qwen4ExpForConditionalGeneration"}},
                 {"model_type", "qwen4_exp"},
                 {"tie_word_embeddings", true},
                 {"torch_dtype", "bfloat16"},
                 {"vision_config", {{"hidden_size", 1152}}},
                 {"text_config", qwen4exp_text_config()}};
  Result<ModelConfig> result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  const ModelConfig& c = *result;
  EXPECT_TRUE(c.nested_text_config);
  EXPECT_EQ(c.architecture, "Qwen4ExpForConditionalGeneration");
  EXPECT_EQ(c.model_type, "qwen4_exp_text");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_TRUE(c.tie_word_embeddings);  // from the top level
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  // Default interval 4 for the family: QSA at 3 and 7.
  EXPECT_EQ(indices_of(c, LayerKind::kQsaAttention), (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(c.count_layers(LayerKind::kLinearAttention), 6);
  ASSERT_TRUE(c.qsa.has_value());
  EXPECT_EQ(c.qsa->n_index_heads, 4);
  EXPECT_EQ(c.qsa->n_index_kv_heads, 1);
  EXPECT_EQ(c.qsa->index_dim, 128);
  EXPECT_EQ(c.qsa->budget, 2048);
  EXPECT_EQ(c.qsa->ratio, 4);
  EXPECT_EQ(c.qsa->topk_groups(), 512);
  EXPECT_EQ(c.kv_cache_layers(), (std::vector<int64_t>{3, 7}));

  // Errors inside text_config name the nested path.
  config["text_config"]["hidden_size"] = "2048";
  std::string message = error_of(config);
  EXPECT_NE(message.find("\"text_config.hidden_size\""), std::string::npos) << message;
}

TEST(ModelConfig, LayerTypesList) {
  json config = llama_config();
  config["num_hidden_layers"] = 4;
  config["sliding_window"] = 4096;
  config["layer_types"] = {"sliding_attention", "full_attention", "linear_attention",
                           "qwen_sparse_attention"};
  config["indexer_n_heads"] = 4;
  config["indexer_kv_heads"] = 1;
  config["indexer_head_dim"] = 128;
  config["indexer_budget"] = 2048;
  config["indexer_compress_ratio"] = 4;
  Result<ModelConfig> result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(result->layers,
            (std::vector<LayerKind>{LayerKind::kSlidingAttention, LayerKind::kFullAttention,
                                    LayerKind::kLinearAttention, LayerKind::kQsaAttention}));
  EXPECT_EQ(result->kv_cache_layers(), (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(result->sliding_window, 4096);
  EXPECT_EQ(layer_kind_name(LayerKind::kQsaAttention), "qwen_sparse_attention");
  EXPECT_EQ(layer_kind_name(LayerKind::kLinearAttention), "linear_attention");

  // In the Qwen4Exp family "full_attention" means a QSA layer.
  json qwen = qwen4exp_text_config();
  qwen["num_hidden_layers"] = 3;
  qwen["layer_types"] = {"linear_attention", "full_attention", "qwen_sparse_attention"};
  Result<ModelConfig> qwen_result = parse(qwen);
  ASSERT_TRUE(qwen_result.ok()) << qwen_result.message();
  EXPECT_EQ(indices_of(*qwen_result, LayerKind::kQsaAttention), (std::vector<int64_t>{1, 2}));
}

TEST(ModelConfig, LayerTypesErrors) {
  json config = llama_config();
  config["num_hidden_layers"] = 3;
  config["layer_types"] = {"full_attention", "full_attention"};
  std::string length = error_of(config);
  EXPECT_NE(length.find("\"layer_types\" has 2 entries but num_hidden_layers is 3"),
            std::string::npos)
      << length;

  config["layer_types"] = {"full_attention", "mamba", "full_attention"};
  std::string unknown = error_of(config);
  EXPECT_NE(unknown.find("entry 1"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("\"mamba\""), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("cfg.json"), std::string::npos) << unknown;

  config["layer_types"] = {"full_attention", 7, "full_attention"};
  EXPECT_NE(error_of(config).find("entry 1 must be a string"), std::string::npos);

  config["layer_types"] = "full_attention";
  EXPECT_NE(error_of(config).find("\"layer_types\" must be a list of strings"), std::string::npos);

  // sliding layers need a window
  config["layer_types"] = {"sliding_attention", "full_attention", "full_attention"};
  EXPECT_NE(error_of(config).find("\"sliding_window\""), std::string::npos);
}

TEST(ModelConfig, FullAttentionInterval) {
  json config = llama_config();
  config["num_hidden_layers"] = 6;
  config["full_attention_interval"] = 3;
  Result<ModelConfig> result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(indices_of(*result, LayerKind::kFullAttention), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(indices_of(*result, LayerKind::kLinearAttention), (std::vector<int64_t>{0, 1, 3, 4}));

  json qwen = qwen4exp_text_config();
  qwen["num_hidden_layers"] = 6;
  qwen["full_attention_interval"] = 2;
  Result<ModelConfig> qwen_result = parse(qwen);
  ASSERT_TRUE(qwen_result.ok()) << qwen_result.message();
  EXPECT_EQ(indices_of(*qwen_result, LayerKind::kQsaAttention), (std::vector<int64_t>{1, 3, 5}));

  config["full_attention_interval"] = 0;
  EXPECT_NE(error_of(config).find("\"full_attention_interval\" must be a positive integer"),
            std::string::npos);
}

TEST(ModelConfig, SlidingWindowWithoutLayerTypes) {
  json mistral = llama_config();
  mistral["model_type"] = "mistral";
  mistral["num_hidden_layers"] = 4;
  mistral["sliding_window"] = 4096;
  Result<ModelConfig> all = parse(mistral);
  ASSERT_TRUE(all.ok()) << all.message();
  EXPECT_EQ(all->count_layers(LayerKind::kSlidingAttention), 4);

  json qwen2 = mistral;
  qwen2["model_type"] = "qwen2";
  qwen2["use_sliding_window"] = true;
  qwen2["max_window_layers"] = 2;
  Result<ModelConfig> partial = parse(qwen2);
  ASSERT_TRUE(partial.ok()) << partial.message();
  EXPECT_EQ(indices_of(*partial, LayerKind::kSlidingAttention), (std::vector<int64_t>{2, 3}));

  qwen2["use_sliding_window"] = false;
  Result<ModelConfig> off = parse(qwen2);
  ASSERT_TRUE(off.ok()) << off.message();
  EXPECT_FALSE(off->sliding_window.has_value());
  EXPECT_EQ(off->count_layers(LayerKind::kFullAttention), 4);
}

TEST(ModelConfig, Qwen4ExpQsaComplete) {
  json config = qwen4exp_text_config();
  config["architectures"] = {"Qwen4ExpForCausalLM"};
  config["layer_types"] = {"linear_attention",      "linear_attention",     "linear_attention",
                           "qwen_sparse_attention", "linear_attention",     "linear_attention",
                           "linear_attention",      "qwen_sparse_attention"};
  Result<ModelConfig> result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(result->architecture, "Qwen4ExpForCausalLM");
  EXPECT_EQ(result->rope.type, "default");
  EXPECT_DOUBLE_EQ(result->rope.theta, 1e7);
  EXPECT_DOUBLE_EQ(result->rope.partial_rotary_factor, 0.25);
  EXPECT_EQ(result->rotary_dim, 64);
  EXPECT_EQ(result->n_heads / result->n_kv_heads, 8);
  ASSERT_TRUE(result->qsa.has_value());
  EXPECT_EQ(result->qsa->budget, 2048);
}

TEST(ModelConfig, Qwen4ExpFamilyFieldsAndTheirDefaults) {
  // Absent fields take the defaults of transformers' Qwen4ExpTextConfig.
  Result<ModelConfig> defaults = parse(qwen4exp_text_config());
  ASSERT_TRUE(defaults.ok()) << defaults.message();
  ASSERT_TRUE(defaults->qwen4exp.has_value());
  const Qwen4ExpConfig& d = *defaults->qwen4exp;
  EXPECT_EQ(d.hc_count, 4);
  EXPECT_EQ(d.hc_lowrank, 320);
  EXPECT_EQ(d.linear_num_key_heads, 16);
  EXPECT_EQ(d.linear_num_value_heads, 32);
  EXPECT_EQ(d.linear_conv_kernel_dim, 4);
  EXPECT_EQ(d.num_experts, 512);
  EXPECT_EQ(d.num_experts_per_tok, 10);
  EXPECT_TRUE(d.norm_topk_prob);
  EXPECT_EQ(d.output_gate_type, "silu");
  EXPECT_TRUE(d.ple_layers.empty());
  EXPECT_EQ(d.ple_embed_dim, 2048);  // hidden_size
  EXPECT_FALSE(d.eos_token_id.has_value());

  json config = qwen4exp_text_config();
  config["hc_count"] = 2;
  config["hc_lowrank"] = 16;
  config["linear_num_key_heads"] = 2;
  config["linear_num_value_heads"] = 4;
  config["num_experts"] = 8;
  config["num_experts_per_tok"] = 1;
  config["norm_topk_prob"] = false;
  config["output_gate_type"] = "sigmoid";
  config["ple_layer_ids"] = json::array({3, 1, 3});  // one-based, unsorted, repeated
  config["ple_embed_dim"] = 64;
  config["heads_per_ngram"] = 4;
  config["eos_token_id"] = json::array({7, 9});
  Result<ModelConfig> result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  const Qwen4ExpConfig& q = *result->qwen4exp;
  EXPECT_EQ(q.hc_count, 2);
  EXPECT_EQ(q.num_experts_per_tok, 1);
  EXPECT_FALSE(q.norm_topk_prob);
  EXPECT_EQ(q.output_gate_type, "sigmoid");
  EXPECT_EQ(q.ple_layers, (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(q.has_ple(2));
  EXPECT_FALSE(q.has_ple(1));
  EXPECT_EQ(q.eos_token_id, 7);
  // Other spellings of the sparse layers.
  config["layer_types"] = {"linear_attention",          "linear_attention", "linear_attention",
                           "deepseek_sparse_attention", "linear_attention", "linear_attention",
                           "linear_attention",          "hybrid_indexed"};
  result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(result->count_layers(LayerKind::kQsaAttention), 2);
  // A dense family has none of this.
  EXPECT_FALSE(parse(json::parse(R"({"model_type": "llama", "hidden_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10})"))
                   ->qwen4exp);
}

TEST(ModelConfig, Qwen4ExpFamilyFieldsCheckedAsTransformersDoes) {
  auto with = [](const char* key, json value) {
    json config = qwen4exp_text_config();
    config[key] = std::move(value);
    return config;
  };
  EXPECT_NE(error_of(with("hc_count", 1)).find("\"hc_count\" must be greater than 1"),
            std::string::npos);
  json experts = with("num_experts", 4);
  experts["num_experts_per_tok"] = 5;
  EXPECT_NE(error_of(experts).find("\"num_experts_per_tok\" (5) must not exceed"),
            std::string::npos);
  EXPECT_NE(error_of(with("moe_intermediate_size", 0)).find("moe_intermediate_size"),
            std::string::npos);
  EXPECT_NE(error_of(with("output_gate_type", "gelu")).find("\"silu\" or \"sigmoid\""),
            std::string::npos);
  EXPECT_NE(error_of(with("hidden_act", "gelu")).find("SiLU"), std::string::npos);
  EXPECT_NE(error_of(with("linear_num_value_heads", 24)).find("multiple of"), std::string::npos);
  EXPECT_NE(
      error_of(with("ple_layer_ids", json::array({0}))).find("one-based layer numbers in [1, 8]"),
      std::string::npos);
  EXPECT_NE(error_of(with("ple_layer_ids", json::array({9}))).find("in [1, 8]"), std::string::npos);
  // PLE needs an eos_token_id and a width divisible by the n-gram heads (2 x 8 = 16).
  EXPECT_NE(error_of(with("ple_layer_ids", json::array({1}))).find("eos_token_id"),
            std::string::npos);
  json width = with("ple_layer_ids", json::array({1}));
  width["eos_token_id"] = 2;
  width["ple_embed_dim"] = 40;
  EXPECT_NE(error_of(width).find("multiple of (ngram_size - 1) x heads_per_ngram = 16"),
            std::string::npos);
  width["ple_embed_dim"] = 48;
  EXPECT_TRUE(parse(width).ok());
  // A multimodal config may keep eos_token_id at the top level only.
  json outer = {{"model_type", "qwen4_exp"},
                {"eos_token_id", 5},
                {"text_config", with("ple_layer_ids", json::array({2}))}};
  Result<ModelConfig> nested = parse(outer);
  ASSERT_TRUE(nested.ok()) << nested.message();
  EXPECT_EQ(nested->qwen4exp->eos_token_id, 5);
}

TEST(ModelConfig, Qwen4ExpQsaMissingAndBadFieldsInOneError) {
  json config = qwen4exp_text_config();
  config.erase("indexer_n_heads");
  config.erase("indexer_budget");
  config["indexer_head_dim"] = -128;
  config["indexer_kv_heads"] = "1";
  std::string message = error_of(config);
  EXPECT_NE(message.find("cfg.json"), std::string::npos) << message;
  EXPECT_NE(message.find("\"indexer_n_heads\" is missing"), std::string::npos) << message;
  EXPECT_NE(message.find("\"indexer_budget\" is missing"), std::string::npos) << message;
  EXPECT_NE(message.find("\"indexer_head_dim\" must be a positive integer"), std::string::npos)
      << message;
  EXPECT_NE(message.find("\"indexer_kv_heads\" must be a positive integer"), std::string::npos)
      << message;
  EXPECT_EQ(message.find("indexer_compress_ratio"), std::string::npos) << message;

  json two_kv = qwen4exp_text_config();
  two_kv["indexer_kv_heads"] = 2;
  EXPECT_NE(error_of(two_kv).find("\"indexer_kv_heads\" must be 1"), std::string::npos);

  json ratio = qwen4exp_text_config();
  ratio["indexer_budget"] = 2046;
  EXPECT_NE(error_of(ratio).find("must be a multiple of \"indexer_compress_ratio\""),
            std::string::npos);

  json zero = qwen4exp_text_config();
  zero["indexer_compress_ratio"] = 0;
  EXPECT_NE(error_of(zero).find("\"indexer_compress_ratio\" must be a positive integer"),
            std::string::npos);

  json rotary = qwen4exp_text_config();  // rotary_dim 64
  rotary["indexer_head_dim"] = 32;
  EXPECT_NE(error_of(rotary).find("rotary_dim 64"), std::string::npos);

  // Without QSA layers the indexer fields are not required.
  json no_qsa = qwen4exp_text_config();
  no_qsa.erase("indexer_n_heads");
  no_qsa["layer_types"] = std::vector<std::string>(8, "linear_attention");
  Result<ModelConfig> result = parse(no_qsa);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_FALSE(result->qsa.has_value());
  EXPECT_TRUE(result->kv_cache_layers().empty());
}

TEST(ModelConfig, RequiredFieldsMissing) {
  for (const char* field :
       {"hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"}) {
    json config = llama_config();
    config.erase(field);
    std::string message = error_of(config);
    EXPECT_NE(message.find(cat("required field \"", field, "\" is missing")), std::string::npos)
        << message;
    EXPECT_NE(message.find("cfg.json"), std::string::npos) << message;
  }
}

TEST(ModelConfig, NonPositiveSizes) {
  for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                            "max_position_embeddings", "sliding_window"}) {
    for (int value : {0, -4}) {
      json config = llama_config();
      config[field] = value;
      std::string message = error_of(config);
      EXPECT_NE(message.find(cat("\"", field, "\" must be a positive integer")), std::string::npos)
          << field << ": " << message;
      EXPECT_NE(message.find(cat("got ", value)), std::string::npos) << message;
    }
  }
  json config = llama_config();
  config["rms_norm_eps"] = 0.0;
  EXPECT_NE(error_of(config).find("\"rms_norm_eps\" must be positive"), std::string::npos);
  config = llama_config();
  config["rope_theta"] = -1.0;
  EXPECT_NE(error_of(config).find("\"rope_theta\" must be positive"), std::string::npos);
}

TEST(ModelConfig, HeadsDivisibility) {
  json config = llama_config();
  config["num_key_value_heads"] = 5;
  std::string message = error_of(config);
  EXPECT_NE(message.find("\"num_attention_heads\" (32) must be a multiple of"), std::string::npos)
      << message;

  json no_head_dim = llama_config();
  no_head_dim["hidden_size"] = 4095;
  EXPECT_NE(error_of(no_head_dim).find("\"head_dim\" is not given"), std::string::npos);
}

TEST(ModelConfig, WrongJsonTypes) {
  struct Case {
    const char* field;
    json value;
    const char* expected;
  };
  const Case cases[] = {
      {"hidden_size", "4096", "\"hidden_size\" must be an integer, got string \"4096\""},
      {"num_hidden_layers", 3.5, "\"num_hidden_layers\" must be an integer"},
      {"num_key_value_heads", true, "\"num_key_value_heads\" must be an integer"},
      {"rms_norm_eps", "1e-5", "\"rms_norm_eps\" must be a number"},
      {"tie_word_embeddings", 1, "\"tie_word_embeddings\" must be true or false"},
      {"attention_bias", "no", "\"attention_bias\" must be true or false"},
      {"torch_dtype", 16, "\"torch_dtype\" must be a string"},
      {"architectures", "LlamaForCausalLM", "\"architectures\" must be a list of strings"},
      {"rope_scaling", "llama3", "\"rope_scaling\" must be an object"},
      {"rope_parameters", json::array(), "\"rope_parameters\" must be an object"},
      {"text_config", 5, "\"text_config\" must be an object"},
      {"model_type", json::array(), "\"model_type\" must be a string"},
  };
  for (const Case& c : cases) {
    json config = llama_config();
    config[c.field] = c.value;
    std::string message = error_of(config);
    EXPECT_NE(message.find(c.expected), std::string::npos) << c.field << ": " << message;
    EXPECT_EQ(message.rfind("cfg.json: ", 0), 0u) << message;
  }
  // Integral floats are accepted for integers.
  json config = llama_config();
  config["max_position_embeddings"] = 8192.0;
  Result<ModelConfig> result = parse(config);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(result->max_position_embeddings, 8192);
}

TEST(ModelConfig, RopeValidation) {
  json config = llama_config();
  config["rope_scaling"].erase("low_freq_factor");
  EXPECT_NE(error_of(config).find("\"rope_scaling.low_freq_factor\" is missing"),
            std::string::npos);

  config = llama_config();
  config["rope_scaling"].erase("original_max_position_embeddings");
  EXPECT_NE(error_of(config).find("\"rope_scaling.original_max_position_embeddings\" is missing"),
            std::string::npos);

  config = llama_config();
  config["rope_scaling"]["high_freq_factor"] = 0.5;
  EXPECT_NE(error_of(config).find("\"rope_scaling.high_freq_factor\" must be greater"),
            std::string::npos);

  config = llama_config();
  config["rope_scaling"] = {{"rope_type", "linear"}};
  EXPECT_NE(error_of(config).find("\"rope_scaling.factor\" is missing"), std::string::npos);

  config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 0.5}};
  EXPECT_NE(error_of(config).find("\"rope_scaling.factor\" must be >= 1"), std::string::npos);

  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", "4"}};
  EXPECT_NE(error_of(config).find("\"rope_scaling.factor\" must be a number"), std::string::npos);

  config["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 1}, {"beta_slow", 2}};
  EXPECT_NE(error_of(config).find("\"rope_scaling.beta_fast\" must be greater"), std::string::npos);

  config.erase("rope_scaling");
  config["rope_parameters"] = {{"rope_type", 3}};
  EXPECT_NE(error_of(config).find("\"rope_parameters.rope_type\" must be a string"),
            std::string::npos);
  config["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", "1e4"}};
  EXPECT_NE(error_of(config).find("\"rope_parameters.rope_theta\" must be a number"),
            std::string::npos);
}

TEST(ModelConfig, InvalidJsonNamesFileAndPosition) {
  Result<ModelConfig> result =
      parse_model_config("{\"hidden_size\": 64,\n  \"vocab_size\": }", "/models/x/config.json");
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.message().find("/models/x/config.json: invalid JSON at byte"), std::string::npos)
      << result.message();
  EXPECT_NE(result.message().find("line 2"), std::string::npos) << result.message();

  Result<ModelConfig> not_object = parse_model_config("[1, 2]", "c.json");
  ASSERT_FALSE(not_object.ok());
  EXPECT_NE(not_object.message().find("c.json: expected a JSON object"), std::string::npos);

  Result<ModelConfig> empty = parse_model_config("", "c.json");
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.message().find("c.json: invalid JSON"), std::string::npos);
}

TEST(ModelConfig, LoadFromDirectory) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / cat("e4kv_model_config_", ::getpid());
  std::filesystem::create_directories(dir);
  Result<ModelConfig> missing = load_model_config(dir);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find((dir / "config.json").string()), std::string::npos)
      << missing.message();
  EXPECT_NE(missing.message().find("no such file or directory"), std::string::npos)
      << missing.message();

  {
    std::ofstream out(dir / "config.json");
    out << llama_config().dump(2);
  }
  Result<ModelConfig> loaded = load_model_config(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.message();
  EXPECT_EQ(loaded->n_layers, 32);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace e4kv

namespace e4kv {
namespace {

// Every config.json transformers 5.17 wrote for the Qwen4Exp references (both layouts, the
// full_attention spelling, eos lists, PLE on and off) parses to what it says.
TEST(ModelConfig, ReadsTheTransformersQwen4ExpReferences) {
  const std::filesystem::path root =
      std::filesystem::path(E4KV_SOURCE_DIR) / "tests/data/hf_qwen4exp";
  int cases = 0;
  for (const auto& entry : std::filesystem::directory_iterator(root)) {
    const std::filesystem::path path = entry.path() / "config.json";
    if (!std::filesystem::exists(path)) continue;
    ++cases;
    SCOPED_TRACE(path.string());
    std::ifstream in(path);
    const json raw = json::parse(in);
    const json& text = raw.contains("text_config") ? raw["text_config"] : raw;
    Result<ModelConfig> config = load_model_config(entry.path());
    ASSERT_TRUE(config.ok()) << config.message();
    ASSERT_TRUE(config->qwen4exp.has_value());
    ASSERT_TRUE(config->qsa.has_value());
    EXPECT_EQ(config->nested_text_config, raw.contains("text_config"));
    int64_t linear = 0;
    for (const json& type : text["layer_types"]) linear += type == "linear_attention" ? 1 : 0;
    EXPECT_EQ(config->count_layers(LayerKind::kLinearAttention), linear);
    EXPECT_EQ(config->count_layers(LayerKind::kQsaAttention), config->n_layers - linear);
    EXPECT_EQ(config->qwen4exp->hc_count, text["hc_count"].get<int64_t>());
    EXPECT_EQ(config->qwen4exp->num_experts, text["num_experts"].get<int64_t>());
    EXPECT_EQ(config->qwen4exp->num_experts_per_tok, text["num_experts_per_tok"].get<int64_t>());
    EXPECT_EQ(config->qsa->budget, text["indexer_budget"].get<int64_t>());
    EXPECT_EQ(config->qsa->ratio, text["indexer_compress_ratio"].get<int64_t>());
    EXPECT_EQ(config->qwen4exp->ple_layers.size(), text["ple_layer_ids"].size());
  }
  EXPECT_GE(cases, 6);
}

}  // namespace
}  // namespace e4kv
