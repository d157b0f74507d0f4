#include "io/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "core/json.h"

namespace e4kv {
namespace {

using json = nlohmann::json;

// Sizes beyond these are certainly a broken config; refusing them early keeps later arithmetic
// (head counts times head_dim, one entry per layer) far from overflow.
constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxLayers = 100000;

// Qwen4Exp does not write full_attention_interval when it uses the library default.
constexpr int64_t kQwen4ExpDefaultInterval = 4;

std::string describe(const json& value) {
  return cat(value.type_name(), " ", json_excerpt(value, 48));
}

bool is_qwen4exp_family(std::string_view model_type) {
  return model_type.starts_with("qwen4_exp");
}

// Typed access to one JSON object of config.json. Absent keys and JSON null both read as "not
// given" (HF writes `"sliding_window": null`, `"head_dim": null`). Errors name the file and the
// field path ("text_config.head_dim").
class Fields {
 public:
  Fields(const json& object, const std::string& source, std::string prefix)
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  const json* get(std::string_view key) const {
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(std::string_view key) const { return get(key) != nullptr; }
  std::string path(std::string_view key) const { return cat(prefix_, key); }

  Status error(std::string_view key, std::string_view what) const {
    return Status::error(cat(source_, ": \"", path(key), "\" ", what));
  }
  Status bad_value(std::string_view key, std::string_view expected, const json& value) const {
    return error(key, cat("must be ", expected, ", got ", describe(value)));
  }

  Result<std::optional<int64_t>> opt_int(std::string_view key) const {
    const json* value = get(key);
    if (value == nullptr) return std::optional<int64_t>();
    if (value->is_number_unsigned()) {
      uint64_t u = value->get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return bad_value(key, "an integer that fits in 64 bits", *value);
      }
      return std::optional<int64_t>(static_cast<int64_t>(u));
    }
    if (value->is_number_integer()) return std::optional<int64_t>(value->get<int64_t>());
    if (value->is_number_float()) {
      // Some tools write integral values as floats ("8192.0"); accept exactly integral ones.
      double d = value->get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
        return std::optional<int64_t>(static_cast<int64_t>(d));
      }
    }
    return bad_value(key, "an integer", *value);
  }

  // A positive integer no larger than `max`; nullopt when absent.
  Result<std::optional<int64_t>> opt_positive(std::string_view key, int64_t max = kMaxSize) const {
    E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> value, opt_int(key));
    if (value && (*value <= 0 || *value > max)) {
      return error(key, cat("must be a positive integer no larger than ", max, ", got ", *value));
    }
    return value;
  }

  Result<int64_t> req_positive(std::string_view key, int64_t max = kMaxSize) const {
    E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> value, opt_positive(key, max));
    if (!value) return missing(key);
    return *value;
  }

  Result<std::optional<double>> opt_double(std::string_view key) const {
    const json* value = get(key);
    if (value == nullptr) return std::optional<double>();
    if (!value->is_number()) return bad_value(key, "a number", *value);
    double d = value->get<double>();
    if (!std::isfinite(d)) return bad_value(key, "a finite number", *value);
    return std::optional<double>(d);
  }

  Result<std::optional<double>> opt_positive_double(std::string_view key) const {
    E4KV_ASSIGN_OR_RETURN(std::optional<double> value, opt_double(key));
    if (value && !(*value > 0.0)) return error(key, cat("must be positive, got ", *value));
    return value;
  }

  Result<std::optional<bool>> opt_bool(std::string_view key) const {
    const json* value = get(key);
    if (value == nullptr) return std::optional<bool>();
    if (!value->is_boolean()) return bad_value(key, "true or false", *value);
    return std::optional<bool>(value->get<bool>());
  }

  Result<std::optional<std::string>> opt_string(std::string_view key) const {
    const json* value = get(key);
    if (value == nullptr) return std::optional<std::string>();
    if (!value->is_string()) return bad_value(key, "a string", *value);
    return std::optional<std::string>(value->get<std::string>());
  }

  // nullptr when absent; an error when present but not an object.
  Result<const json*> opt_object(std::string_view key) const {
    const json* value = get(key);
    if (value == nullptr) return static_cast<const json*>(nullptr);
    if (!value->is_object()) return bad_value(key, "an object", *value);
    return value;
  }

  Status missing(std::string_view key) const {
    return Status::error(cat(source_, ": required field \"", path(key), "\" is missing"));
  }

  const std::string& source() const { return source_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const json& object_;
  const std::string& source_;
  std::string prefix_;
};

// Fills `rope` from one rope-parameter object (v5 "rope_parameters" or v4 "rope_scaling").
Status read_rope_fields(const Fields& fields, RopeConfig& rope) {
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> rope_type, fields.opt_string("rope_type"));
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> legacy_type, fields.opt_string("type"));
  if (rope_type) {
    rope.type = *rope_type;
  } else if (legacy_type) {
    rope.type = *legacy_type;
  }
  if (rope.type.empty()) return fields.error("rope_type", "must not be empty");

  E4KV_ASSIGN_OR_RETURN(std::optional<double> factor, fields.opt_positive_double("factor"));
  if (factor) rope.factor = *factor;
  E4KV_ASSIGN_OR_RETURN(std::optional<double> low, fields.opt_positive_double("low_freq_factor"));
  if (low) rope.low_freq_factor = *low;
  E4KV_ASSIGN_OR_RETURN(std::optional<double> high, fields.opt_positive_double("high_freq_factor"));
  if (high) rope.high_freq_factor = *high;
  E4KV_ASSIGN_OR_RETURN(rope.original_max_position_embeddings,
                        fields.opt_positive("original_max_position_embeddings"));
  E4KV_ASSIGN_OR_RETURN(std::optional<double> beta_fast, fields.opt_positive_double("beta_fast"));
  if (beta_fast) rope.beta_fast = *beta_fast;
  E4KV_ASSIGN_OR_RETURN(std::optional<double> beta_slow, fields.opt_positive_double("beta_slow"));
  if (beta_slow) rope.beta_slow = *beta_slow;
  E4KV_ASSIGN_OR_RETURN(rope.attention_factor, fields.opt_positive_double("attention_factor"));
  E4KV_ASSIGN_OR_RETURN(rope.mscale, fields.opt_double("mscale"));
  E4KV_ASSIGN_OR_RETURN(rope.mscale_all_dim, fields.opt_double("mscale_all_dim"));
  E4KV_ASSIGN_OR_RETURN(std::optional<bool> truncate, fields.opt_bool("truncate"));
  if (truncate) rope.truncate = *truncate;

  // Each scaling type needs its own fields, as transformers' rope validation demands.
  const std::string& type = rope.type;
  if (type == "linear" || type == "dynamic" || type == "yarn" || type == "llama3") {
    if (!factor) return fields.missing("factor");
    if (rope.factor < 1.0) {
      return fields.error("factor",
                          cat("must be >= 1 for rope type ", type, ", got ", rope.factor));
    }
  }
  if (type == "llama3") {
    if (!low) return fields.missing("low_freq_factor");
    if (!high) return fields.missing("high_freq_factor");
    if (!rope.original_max_position_embeddings) {
      return fields.missing("original_max_position_embeddings");
    }
    if (!(rope.high_freq_factor > rope.low_freq_factor)) {
      return fields.error("high_freq_factor",
                          cat("must be greater than low_freq_factor (", rope.low_freq_factor,
                              "), got ", rope.high_freq_factor));
    }
  }
  if (type == "yarn" && !(rope.beta_fast > rope.beta_slow)) {
    return fields.error("beta_fast", cat("must be greater than beta_slow (", rope.beta_slow,
                                         "), got ", rope.beta_fast));
  }
  return ok_status();
}

struct PartialFactor {
  double value = 1.0;
  std::string where;  // field path it came from; empty when defaulted
};

Status read_partial_factor(const Fields& fields, PartialFactor& out) {
  E4KV_ASSIGN_OR_RETURN(std::optional<double> value, fields.opt_double("partial_rotary_factor"));
  if (!value) return ok_status();
  if (!(*value > 0.0 && *value <= 1.0)) {
    return fields.error("partial_rotary_factor", cat("must be in (0, 1], got ", *value));
  }
  std::string where = fields.path("partial_rotary_factor");
  if (!out.where.empty() && out.value != *value) {
    return Status::error(cat(fields.source(), ": \"", out.where, "\" (", out.value, ") and \"",
                             where, "\" (", *value, ") disagree"));
  }
  out.value = *value;
  out.where = std::move(where);
  return ok_status();
}

// RoPE: transformers v5 "rope_parameters" (with rope_theta inside) or v4 "rope_theta" +
// "rope_scaling". "partial_rotary_factor" may sit at the top level or inside rope_parameters; when
// both are given they must agree.
Status read_rope(const Fields& text, RopeConfig& rope) {
  E4KV_ASSIGN_OR_RETURN(std::optional<double> top_theta, text.opt_positive_double("rope_theta"));
  PartialFactor partial;
  E4KV_RETURN_IF_ERROR(read_partial_factor(text, partial));

  E4KV_ASSIGN_OR_RETURN(const json* params, text.opt_object("rope_parameters"));
  if (params != nullptr) {
    std::string prefix = text.path("rope_parameters.");
    // Per-layer-type form ({"full_attention": {...}, "sliding_attention": {...}}): the full
    // attention entry describes the layers that own the long-context cache.
    if (!params->contains("rope_type") && !params->contains("rope_theta") &&
        params->contains("full_attention")) {
      Fields outer(*params, text.source(), prefix);
      E4KV_ASSIGN_OR_RETURN(params, outer.opt_object("full_attention"));
      if (params == nullptr) return outer.missing("full_attention");
      prefix += "full_attention.";
    }
    Fields fields(*params, text.source(), prefix);
    E4KV_RETURN_IF_ERROR(read_rope_fields(fields, rope));
    E4KV_ASSIGN_OR_RETURN(std::optional<double> theta, fields.opt_positive_double("rope_theta"));
    if (theta) {
      rope.theta = *theta;
    } else if (top_theta) {
      rope.theta = *top_theta;
    }
    E4KV_RETURN_IF_ERROR(read_partial_factor(fields, partial));
  } else {
    if (top_theta) rope.theta = *top_theta;
    E4KV_ASSIGN_OR_RETURN(const json* scaling, text.opt_object("rope_scaling"));
    if (scaling != nullptr) {
      Fields fields(*scaling, text.source(), text.path("rope_scaling."));
      E4KV_RETURN_IF_ERROR(read_rope_fields(fields, rope));
    }
  }
  rope.partial_rotary_factor = partial.value;
  return ok_status();
}

Result<LayerKind> parse_layer_type(const std::string& name, bool qwen4exp) {
  if (name == "full_attention") {
    return qwen4exp ? LayerKind::kQsaAttention : LayerKind::kFullAttention;
  }
  // The spellings Qwen4Exp releases use for the sparse layers (hybrid_indexed: one that also
  // carries PLE, which ple_layer_ids says).
  if (name == "qwen_sparse_attention" || name == "deepseek_sparse_attention" ||
      name == "hybrid_indexed") {
    return LayerKind::kQsaAttention;
  }
  if (name == "sliding_attention") return LayerKind::kSlidingAttention;
  if (name == "linear_attention") return LayerKind::kLinearAttention;
  return Status::error("unknown");
}

Status read_layer_kinds(const Fields& text, bool qwen4exp, ModelConfig& config) {
  config.layers.clear();
  const int64_t n = config.n_layers;
  if (const json* types = text.get("layer_types")) {
    if (!types->is_array()) return text.bad_value("layer_types", "a list of strings", *types);
    if (static_cast<int64_t>(types->size()) != n) {
      return text.error(
          "layer_types",
          cat("has ", types->size(), " entries but num_hidden_layers is ", n, "; they must match"));
    }
    for (size_t i = 0; i < types->size(); ++i) {
      const json& entry = (*types)[i];
      if (!entry.is_string()) {
        return text.error("layer_types",
                          cat("entry ", i, " must be a string, got ", describe(entry)));
      }
      Result<LayerKind> kind = parse_layer_type(entry.get<std::string>(), qwen4exp);
      if (!kind.ok()) {
        return text.error("layer_types",
                          cat("entry ", i, " is the unknown layer type ", json_excerpt(entry, 80),
                              "; expected full_attention, sliding_attention, linear_attention or "
                              "qwen_sparse_attention"));
      }
      config.layers.push_back(*kind);
    }
    return ok_status();
  }

  E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> interval,
                        text.opt_positive("full_attention_interval", kMaxLayers));
  if (!interval && qwen4exp) interval = kQwen4ExpDefaultInterval;
  if (interval) {
    const LayerKind full = qwen4exp ? LayerKind::kQsaAttention : LayerKind::kFullAttention;
    for (int64_t i = 0; i < n; ++i) {
      config.layers.push_back((i + 1) % *interval == 0 ? full : LayerKind::kLinearAttention);
    }
    return ok_status();
  }

  // No explicit kinds: with an active sliding window, transformers v4 Qwen2/Qwen3 slide the layers
  // from max_window_layers on, Mistral slides every layer.
  int64_t first_sliding = n;
  if (config.sliding_window) {
    E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> max_window_layers,
                          text.opt_int("max_window_layers"));
    if (max_window_layers && *max_window_layers < 0) {
      return text.error("max_window_layers", cat("must not be negative, got ", *max_window_layers));
    }
    first_sliding = max_window_layers ? std::min(*max_window_layers, n) : 0;
  }
  for (int64_t i = 0; i < n; ++i) {
    config.layers.push_back(i >= first_sliding ? LayerKind::kSlidingAttention
                                               : LayerKind::kFullAttention);
  }
  return ok_status();
}

// QSA indexer geometry: all five fields present, positive and consistent, reported together.
Status read_qsa(const Fields& text, ModelConfig& config) {
  struct Field {
    const char* key;
    int64_t* out;
  };
  QsaConfig qsa;
  const Field fields[] = {
      {"indexer_n_heads", &qsa.n_index_heads}, {"indexer_kv_heads", &qsa.n_index_kv_heads},
      {"indexer_head_dim", &qsa.index_dim},    {"indexer_budget", &qsa.budget},
      {"indexer_compress_ratio", &qsa.ratio},
  };
  std::vector<std::string> problems;
  for (const Field& field : fields) {
    const json* value = text.get(field.key);
    if (value == nullptr) {
      problems.push_back(cat("\"", text.path(field.key), "\" is missing"));
      continue;
    }
    Result<std::optional<int64_t>> parsed = text.opt_int(field.key);
    if (!parsed.ok() || **parsed <= 0 || **parsed > kMaxSize) {
      problems.push_back(
          cat("\"", text.path(field.key), "\" must be a positive integer, got ", describe(*value)));
      continue;
    }
    *field.out = **parsed;
  }
  if (qsa.n_index_kv_heads > 1) {
    problems.push_back(cat("\"", text.path("indexer_kv_heads"), "\" must be 1 (one shared index ",
                           "key head), got ", qsa.n_index_kv_heads));
  }
  if (qsa.budget > 0 && qsa.ratio > 0 && qsa.budget % qsa.ratio != 0) {
    problems.push_back(cat("\"", text.path("indexer_budget"), "\" (", qsa.budget,
                           ") must be a multiple of \"", text.path("indexer_compress_ratio"),
                           "\" (", qsa.ratio, ")"));
  }
  if (qsa.index_dim > 0 && config.rotary_dim > qsa.index_dim) {
    problems.push_back(cat("rotary_dim ", config.rotary_dim, " (head_dim x partial_rotary_factor) ",
                           "must not exceed \"", text.path("indexer_head_dim"), "\" (",
                           qsa.index_dim, ")"));
  }
  if (!problems.empty()) {
    std::string message =
        cat(text.source(), ": the config has ", config.count_layers(LayerKind::kQsaAttention),
            " QSA layers but its indexer fields are incomplete or invalid: ");
    for (size_t i = 0; i < problems.size(); ++i) {
      message += (i == 0 ? "" : "; ") + problems[i];
    }
    return Status::error(message);
  }
  config.qsa = qsa;
  return ok_status();
}

// The Qwen4Exp family's own fields, with transformers' defaults and checks.
Status read_qwen4exp(const Fields& text, const Fields& top, ModelConfig& config) {
  Qwen4ExpConfig q;
  q.ple_embed_dim = config.hidden_size;
  struct Positive {
    const char* key;
    int64_t* out;
  };
  for (const Positive& field : {
           Positive{"hc_count", &q.hc_count},
           Positive{"hc_lowrank", &q.hc_lowrank},
           Positive{"linear_conv_kernel_dim", &q.linear_conv_kernel_dim},
           Positive{"linear_key_head_dim", &q.linear_key_head_dim},
           Positive{"linear_value_head_dim", &q.linear_value_head_dim},
           Positive{"linear_num_key_heads", &q.linear_num_key_heads},
           Positive{"linear_num_value_heads", &q.linear_num_value_heads},
           Positive{"num_experts", &q.num_experts},
           Positive{"num_experts_per_tok", &q.num_experts_per_tok},
           Positive{"moe_intermediate_size", &q.moe_intermediate_size},
           Positive{"shared_expert_intermediate_size", &q.shared_expert_intermediate_size},
           Positive{"ple_embed_dim", &q.ple_embed_dim},
           Positive{"ple_conv_kernel_size", &q.ple_conv_kernel_size},
           Positive{"ngram_size", &q.ngram_size},
           Positive{"heads_per_ngram", &q.heads_per_ngram},
           Positive{"ngram_vocab_size_base", &q.ngram_vocab_size_base},
           Positive{"make_ngram_vocab_size_divisible_by", &q.make_ngram_vocab_size_divisible_by},
           Positive{"split_ngram_parts", &q.split_ngram_parts},
       }) {
    E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> value, text.opt_positive(field.key));
    if (value) *field.out = *value;
  }
  E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> seed, text.opt_int("seed"));
  if (seed) q.seed = *seed;
  E4KV_ASSIGN_OR_RETURN(std::optional<bool> norm_topk, text.opt_bool("norm_topk_prob"));
  if (norm_topk) q.norm_topk_prob = *norm_topk;
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> act, text.opt_string("hidden_act"));
  if (act) q.hidden_act = *act;
  if (q.hidden_act != "silu") {
    return text.error("hidden_act", cat("is \"", q.hidden_act,
                                        "\"; the Qwen4Exp experts are SiLU-gated (\"silu\")"));
  }
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> gate, text.opt_string("output_gate_type"));
  q.output_gate_type = gate.value_or(q.hidden_act);
  if (q.output_gate_type != "silu" && q.output_gate_type != "sigmoid") {
    return text.error("output_gate_type",
                      cat("must be \"silu\" or \"sigmoid\", got \"", q.output_gate_type, "\""));
  }
  if (q.hc_count <= 1) {
    return text.error("hc_count", cat("must be greater than 1 (hyper-connection streams), got ",
                                      q.hc_count));
  }
  if (q.num_experts_per_tok > q.num_experts) {
    return text.error("num_experts_per_tok", cat("(", q.num_experts_per_tok, ") must not exceed \"",
                                                 text.path("num_experts"), "\" (", q.num_experts,
                                                 ")"));
  }
  if (q.linear_num_value_heads % q.linear_num_key_heads != 0) {
    return text.error("linear_num_value_heads",
                      cat("(", q.linear_num_value_heads, ") must be a multiple of \"",
                          text.path("linear_num_key_heads"), "\" (", q.linear_num_key_heads,
                          ")"));
  }
  if (const json* ids = text.get("ple_layer_ids")) {
    if (!ids->is_array()) return text.bad_value("ple_layer_ids", "a list of layer numbers", *ids);
    for (const json& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 1 ||
          id.get<int64_t>() > config.n_layers) {
        return text.error("ple_layer_ids", cat("must hold one-based layer numbers in [1, ",
                                               config.n_layers, "], got ", describe(id)));
      }
      q.ple_layers.push_back(id.get<int64_t>() - 1);
    }
    std::sort(q.ple_layers.begin(), q.ple_layers.end());
    q.ple_layers.erase(std::unique(q.ple_layers.begin(), q.ple_layers.end()), q.ple_layers.end());
  }
  if (!q.ple_layers.empty()) {
    const int64_t ngram_heads = (q.ngram_size - 1) * q.heads_per_ngram;
    if (ngram_heads <= 0 || q.ple_embed_dim % ngram_heads != 0) {
      return text.error("ple_embed_dim",
                        cat("(", q.ple_embed_dim, ") must be a multiple of (ngram_size - 1) x "
                            "heads_per_ngram = ", ngram_heads));
    }
    const json* eos = text.has("eos_token_id") ? text.get("eos_token_id") : top.get("eos_token_id");
    if (eos != nullptr && eos->is_array() && !eos->empty()) eos = &(*eos)[0];
    if (eos == nullptr || !eos->is_number_integer() || eos->get<int64_t>() < 0) {
      return text.error("eos_token_id",
                        "must be set (a token id) when ple_layer_ids enables PLE layers: the "
                        "n-gram history starts from it");
    }
    q.eos_token_id = eos->get<int64_t>();
  }
  // The multimodal wrapper's media placeholders (top level): the text runtime refuses them.
  for (const char* key : {"image_token_id", "video_token_id"}) {
    const json* id = top.get(key);
    if (id != nullptr && id->is_number_integer() && id->get<int64_t>() >= 0) {
      q.media_token_ids.push_back(id->get<int64_t>());
    }
  }
  config.qwen4exp = q;
  return ok_status();
}

Result<ModelConfig> parse_config_object(const json& root, const std::string& source) {
  if (!root.is_object()) {
    return Status::error(
        cat(source, ": expected a JSON object at the top level, got ", describe(root)));
  }
  Fields top(root, source, "");
  E4KV_ASSIGN_OR_RETURN(const json* text_object, top.opt_object("text_config"));
  ModelConfig config;
  config.nested_text_config = text_object != nullptr;
  Fields text(text_object != nullptr ? *text_object : root, source,
              text_object != nullptr ? "text_config." : "");

  // Architecture from the outer config; a bare text config may carry its own.
  for (const Fields* fields : {&top, &text}) {
    const json* archs = fields->get("architectures");
    if (archs == nullptr) continue;
    if (!archs->is_array()) return fields->bad_value("architectures", "a list of strings", *archs);
    for (const json& arch : *archs) {
      if (!arch.is_string()) {
        return fields->bad_value("architectures", "a list of strings", *archs);
      }
    }
    if (!archs->empty() && config.architecture.empty()) {
      config.architecture = (*archs)[0].get<std::string>();
    }
  }

  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> text_type, text.opt_string("model_type"));
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> top_type, top.opt_string("model_type"));
  config.model_type = text_type ? *text_type : top_type.value_or("");
  const bool qwen4exp =
      is_qwen4exp_family(config.model_type) || is_qwen4exp_family(top_type.value_or(""));

  E4KV_ASSIGN_OR_RETURN(config.vocab_size, text.req_positive("vocab_size"));
  E4KV_ASSIGN_OR_RETURN(config.hidden_size, text.req_positive("hidden_size"));
  E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> intermediate,
                        text.opt_positive("intermediate_size"));
  config.intermediate_size = intermediate.value_or(0);
  E4KV_ASSIGN_OR_RETURN(config.n_layers, text.req_positive("num_hidden_layers", kMaxLayers));
  E4KV_ASSIGN_OR_RETURN(config.n_heads, text.req_positive("num_attention_heads"));
  E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> kv_heads, text.opt_positive("num_key_value_heads"));
  config.n_kv_heads = kv_heads.value_or(config.n_heads);
  if (config.n_heads % config.n_kv_heads != 0) {
    return text.error("num_attention_heads",
                      cat("(", config.n_heads, ") must be a multiple of \"",
                          text.path("num_key_value_heads"), "\" (", config.n_kv_heads, ")"));
  }
  E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> head_dim, text.opt_positive("head_dim"));
  if (head_dim) {
    config.head_dim = *head_dim;
  } else {
    if (config.hidden_size % config.n_heads != 0) {
      return text.error("head_dim",
                        cat("is not given and hidden_size (", config.hidden_size,
                            ") is not a multiple of num_attention_heads (", config.n_heads, ")"));
    }
    config.head_dim = config.hidden_size / config.n_heads;
  }

  E4KV_ASSIGN_OR_RETURN(std::optional<double> eps, text.opt_positive_double("rms_norm_eps"));
  if (eps) config.rms_norm_eps = *eps;
  E4KV_ASSIGN_OR_RETURN(std::optional<int64_t> max_pos,
                        text.opt_positive("max_position_embeddings"));
  config.max_position_embeddings = max_pos.value_or(0);
  E4KV_ASSIGN_OR_RETURN(std::optional<bool> attention_bias, text.opt_bool("attention_bias"));
  config.attention_bias = attention_bias.value_or(false);

  // Multimodal wrappers may keep these at the top level only.
  for (const Fields* fields : {&text, &top}) {
    E4KV_ASSIGN_OR_RETURN(std::optional<bool> tie, fields->opt_bool("tie_word_embeddings"));
    if (tie) {
      config.tie_word_embeddings = *tie;
      break;
    }
  }
  for (const Fields* fields : {&text, &top}) {
    E4KV_ASSIGN_OR_RETURN(std::optional<std::string> dtype, fields->opt_string("dtype"));
    E4KV_ASSIGN_OR_RETURN(std::optional<std::string> torch_dtype,
                          fields->opt_string("torch_dtype"));
    if (dtype || torch_dtype) {
      config.torch_dtype = dtype ? *dtype : *torch_dtype;
      break;
    }
  }

  E4KV_ASSIGN_OR_RETURN(config.sliding_window, text.opt_positive("sliding_window"));
  E4KV_ASSIGN_OR_RETURN(std::optional<bool> use_sliding, text.opt_bool("use_sliding_window"));
  if (use_sliding && !*use_sliding) config.sliding_window.reset();

  E4KV_RETURN_IF_ERROR(read_rope(text, config.rope));
  const double rotary = static_cast<double>(config.head_dim) * config.rope.partial_rotary_factor;
  const double rounded = std::round(rotary);
  config.rotary_dim = static_cast<int64_t>(rounded);
  if (std::fabs(rotary - rounded) > 1e-6 || config.rotary_dim <= 0 || config.rotary_dim % 2 != 0 ||
      config.rotary_dim > config.head_dim) {
    return Status::error(cat(source, ": rotary_dim = head_dim (", config.head_dim,
                             ") x partial_rotary_factor (", config.rope.partial_rotary_factor,
                             ") = ", rotary, " must be an even integer in (0, head_dim]"));
  }

  E4KV_RETURN_IF_ERROR(read_layer_kinds(text, qwen4exp, config));
  if (config.count_layers(LayerKind::kQsaAttention) > 0) {
    E4KV_RETURN_IF_ERROR(read_qsa(text, config));
  }
  if (qwen4exp) E4KV_RETURN_IF_ERROR(read_qwen4exp(text, top, config));
  E4KV_ASSIGN_OR_RETURN(config.quant, parse_quant_config(root, source));
  if (config.count_layers(LayerKind::kSlidingAttention) > 0 && !config.sliding_window) {
    return text.error("sliding_window",
                      "is required when layer_types has sliding_attention layers");
  }
  return config;
}

}  // namespace

std::string_view layer_kind_name(LayerKind kind) {
  switch (kind) {
    case LayerKind::kFullAttention:
      return "full_attention";
    case LayerKind::kQsaAttention:
      return "qwen_sparse_attention";
    case LayerKind::kSlidingAttention:
      return "sliding_attention";
    case LayerKind::kLinearAttention:
      return "linear_attention";
  }
  E4KV_ASSERT(false, "unknown LayerKind value");
  return "";
}

int64_t ModelConfig::count_layers(LayerKind kind) const {
  int64_t count = 0;
  for (LayerKind layer : layers) count += layer == kind ? 1 : 0;
  return count;
}

bool Qwen4ExpConfig::has_ple(int64_t layer) const {
  return std::binary_search(ple_layers.begin(), ple_layers.end(), layer);
}

std::vector<int64_t> ModelConfig::kv_cache_layers() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layer_has_kv_cache(layers[i])) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

Result<ModelConfig> parse_model_config(std::string_view json_text, const std::string& source) {
  E4KV_ASSIGN_OR_RETURN(const json root, parse_json(json_text, source));
  return parse_config_object(root, source);
}

Result<ModelConfig> load_model_config(const std::filesystem::path& model_dir) {
  const std::filesystem::path path = model_dir / "config.json";
  E4KV_ASSIGN_OR_RETURN(std::string text, read_file(path));
  return parse_model_config(text, path.string());
}

}  // namespace e4kv
