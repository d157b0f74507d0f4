// e4kv inspect MODEL_DIR [--json]: what e4kv sees in a checkpoint: architecture, layer kinds,
// attention and QSA geometry, RoPE, tensor bytes by dtype, shards and K/V scale keys.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "io/checkpoint.h"
#include "kv/scale_gate.h"
#include "kv/scale_keys.h"

namespace e4kv::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

struct InspectArgs {
  std::string model_dir;
  bool json = false;
};

constexpr LayerKind kAllKinds[] = {LayerKind::kFullAttention, LayerKind::kQsaAttention,
                                   LayerKind::kSlidingAttention, LayerKind::kLinearAttention};

// The prefix in front of ".layers.<i>." taken from the checkpoint's k_proj keys (DESIGN.md §5).
std::string scale_key_prefix(const std::vector<std::string>& names) {
  constexpr std::string_view kSuffix = ".self_attn.k_proj.weight";
  constexpr std::string_view kLayers = "layers.";
  for (const std::string& name : names) {
    std::string_view view(name);
    if (!view.ends_with(kSuffix)) continue;
    view.remove_suffix(kSuffix.size());  // "<prefix>.layers.<i>"
    size_t pos = view.rfind(kLayers);
    if (pos == std::string_view::npos) continue;
    return std::string(pos == 0 ? std::string_view() : view.substr(0, pos - 1));
  }
  return "model";
}

std::optional<double> scalar_value(const SafetensorsTensor& tensor) {
  if (tensor.dtype != DType::kF32 || tensor.bytes.size() != 4) return std::nullopt;
  float value = 0.0f;
  std::memcpy(&value, tensor.bytes.data(), 4);
  return static_cast<double>(value);
}

ordered_json json_number_or_null(std::optional<double> value) {
  if (!value || !std::isfinite(*value)) return nullptr;
  return *value;
}

ordered_json scale_report(const Checkpoint& ckpt) {
  const ModelConfig& config = ckpt.config();
  const std::vector<std::string> names = ckpt.tensor_names();
  const std::string prefix = scale_key_prefix(names);

  struct Slot {
    std::string key;
    std::optional<double> value;
  };
  std::map<int64_t, std::map<KvTensor, Slot>> slots;
  ordered_json unexpected = ordered_json::array();
  ordered_json conflicts = ordered_json::array();
  int64_t present = 0;
  for (const std::string& name : names) {
    std::optional<ScaleKey> key = parse_scale_key(name);
    if (!key) continue;
    const char* which = key->tensor == KvTensor::kK ? "k" : "v";
    if (key->layer >= config.n_layers) {
      unexpected.push_back({{"key", name},
                            {"layer", key->layer},
                            {"reason", cat("layer ", key->layer, " does not exist (the model has ",
                                           config.n_layers, " layers)")}});
      continue;
    }
    const LayerKind kind = config.layers[static_cast<size_t>(key->layer)];
    if (!layer_has_kv_cache(kind)) {
      unexpected.push_back({{"key", name},
                            {"layer", key->layer},
                            {"reason", cat("layer ", key->layer, " is ", layer_kind_name(kind),
                                           " and has no KV cache")}});
      continue;
    }
    auto [it, inserted] = slots[key->layer].try_emplace(key->tensor);
    if (!inserted) {
      conflicts.push_back({{"layer", key->layer},
                           {"tensor", which},
                           {"keys", ordered_json::array({it->second.key, name})}});
      continue;
    }
    it->second.key = name;
    it->second.value = scalar_value(*ckpt.find(name));
    ++present;
  }

  ordered_json layers = ordered_json::array();
  ordered_json missing = ordered_json::array();
  const std::vector<int64_t> kv_layers = config.kv_cache_layers();
  for (int64_t layer : kv_layers) {
    ordered_json entry = {{"layer", layer}};
    for (KvTensor tensor : {KvTensor::kK, KvTensor::kV}) {
      const char* which = tensor == KvTensor::kK ? "k" : "v";
      auto layer_it = slots.find(layer);
      const Slot* slot = nullptr;
      if (layer_it != slots.end()) {
        auto slot_it = layer_it->second.find(tensor);
        if (slot_it != layer_it->second.end()) slot = &slot_it->second;
      }
      if (slot == nullptr) {
        entry[which] = nullptr;
        missing.push_back(canonical_scale_key(prefix, layer, tensor));
      } else {
        entry[which] = {{"key", slot->key}, {"value", json_number_or_null(slot->value)}};
      }
    }
    layers.push_back(std::move(entry));
  }
  // An overlay made with --unit-scale-negative-control marks its scales shard's metadata: its 1.0
  // scales are a negative control, not calibrated.
  bool negative_control = false;
  for (const auto& shard : ckpt.shards()) {
    if (is_negative_control_metadata(shard->metadata())) negative_control = true;
  }
  return {{"expected", 2 * static_cast<int64_t>(kv_layers.size())},
          {"present", present},
          {"negative_control", negative_control},
          {"layers", std::move(layers)},
          {"missing", std::move(missing)},
          {"unexpected", std::move(unexpected)},
          {"conflicts", std::move(conflicts)}};
}

ordered_json build_report(const Checkpoint& ckpt) {
  const ModelConfig& c = ckpt.config();
  ordered_json report;
  report["path"] = ckpt.dir().string();
  report["architecture"] = c.architecture;
  report["model_type"] = c.model_type;
  report["nested_text_config"] = c.nested_text_config;
  report["dtype"] = c.torch_dtype;
  report["quantization"] = c.quant.describe();
  report["vocab_size"] = c.vocab_size;
  report["hidden_size"] = c.hidden_size;
  report["intermediate_size"] = c.intermediate_size;
  report["max_position_embeddings"] = c.max_position_embeddings;
  report["tie_word_embeddings"] = c.tie_word_embeddings;

  ordered_json by_kind = ordered_json::object();
  ordered_json qsa_layers = ordered_json::array();
  for (LayerKind kind : kAllKinds) {
    ordered_json indices = ordered_json::array();
    for (size_t i = 0; i < c.layers.size(); ++i) {
      if (c.layers[i] == kind) indices.push_back(i);
    }
    if (indices.empty()) continue;
    if (kind == LayerKind::kQsaAttention) qsa_layers = indices;
    by_kind[std::string(layer_kind_name(kind))] = {{"count", indices.size()}, {"indices", indices}};
  }
  ordered_json kinds = ordered_json::array();
  for (LayerKind kind : c.layers) kinds.push_back(layer_kind_name(kind));
  report["layers"] = {{"count", c.n_layers}, {"by_kind", by_kind}, {"kinds", kinds}};
  report["kv_cache_layers"] = c.kv_cache_layers();
  report["qsa_layers"] = qsa_layers;

  report["attention"] = {{"n_heads", c.n_heads},
                         {"n_kv_heads", c.n_kv_heads},
                         {"head_dim", c.head_dim},
                         {"rotary_dim", c.rotary_dim},
                         {"gqa_group", c.n_heads / c.n_kv_heads},
                         {"sliding_window", c.sliding_window ? ordered_json(*c.sliding_window)
                                                             : ordered_json(nullptr)}};
  if (c.qsa) {
    report["qsa_indexer"] = {
        {"n_heads", c.qsa->n_index_heads}, {"n_kv_heads", c.qsa->n_index_kv_heads},
        {"head_dim", c.qsa->index_dim},    {"budget", c.qsa->budget},
        {"compress_ratio", c.qsa->ratio},  {"topk_groups", c.qsa->topk_groups()}};
  } else {
    report["qsa_indexer"] = nullptr;
  }
  ordered_json rope = {{"type", c.rope.type},
                       {"theta", c.rope.theta},
                       {"partial_rotary_factor", c.rope.partial_rotary_factor}};
  if (c.rope.type != "default") rope["factor"] = c.rope.factor;
  if (c.rope.type == "llama3") {
    rope["low_freq_factor"] = c.rope.low_freq_factor;
    rope["high_freq_factor"] = c.rope.high_freq_factor;
  }
  if (c.rope.type == "yarn") {
    rope["beta_fast"] = c.rope.beta_fast;
    rope["beta_slow"] = c.rope.beta_slow;
    if (c.rope.attention_factor) rope["attention_factor"] = *c.rope.attention_factor;
  }
  if (c.rope.original_max_position_embeddings) {
    rope["original_max_position_embeddings"] = *c.rope.original_max_position_embeddings;
  }
  report["rope"] = rope;

  std::map<std::string, std::pair<uint64_t, uint64_t>> dtypes;  // name -> (count, bytes)
  uint64_t total_bytes = 0;
  uint64_t total_count = 0;
  // Shards listed by file name (model-00001-of-... first), whatever order the index names them.
  std::vector<const SafetensorsFile*> sorted_shards;
  for (const auto& shard : ckpt.shards()) sorted_shards.push_back(shard.get());
  std::sort(
      sorted_shards.begin(), sorted_shards.end(),
      [](const SafetensorsFile* a, const SafetensorsFile* b) { return a->source() < b->source(); });
  ordered_json shards = ordered_json::array();
  for (const SafetensorsFile* shard : sorted_shards) {
    uint64_t shard_bytes = 0;
    for (const SafetensorsTensor& tensor : shard->tensors()) {
      auto& [count, bytes] = dtypes[std::string(dtype_name(tensor.dtype))];
      ++count;
      bytes += tensor.bytes.size();
      shard_bytes += tensor.bytes.size();
    }
    total_bytes += shard_bytes;
    total_count += shard->tensors().size();
    shards.push_back({{"file", std::filesystem::path(shard->source()).filename().string()},
                      {"tensors", shard->tensors().size()},
                      {"bytes", shard_bytes}});
  }
  ordered_json by_dtype = ordered_json::object();
  for (const auto& [name, entry] : dtypes) {
    by_dtype[name] = {{"count", entry.first}, {"bytes", entry.second}};
  }
  report["tensors"] = {{"count", total_count}, {"bytes", total_bytes}, {"by_dtype", by_dtype}};
  report["sharded"] = ckpt.sharded();
  report["shards"] = shards;
  report["kv_scales"] = scale_report(ckpt);
  return report;
}

std::string join_indices(const ordered_json& indices) {
  std::string out;
  for (const auto& index : indices) out += (out.empty() ? "" : " ") + index.dump();
  return out;
}

std::string human_bytes(uint64_t bytes) {
  char buffer[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024.0 * 1024.0) {
    std::snprintf(buffer, sizeof(buffer), "%.2f GiB", b / (1024.0 * 1024.0 * 1024.0));
  } else if (b >= 1024.0 * 1024.0) {
    std::snprintf(buffer, sizeof(buffer), "%.2f MiB", b / (1024.0 * 1024.0));
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.2f KiB", b / 1024.0);
  }
  return buffer;
}

std::string text_or_dash(const ordered_json& value) {
  std::string text = value.get<std::string>();
  return text.empty() ? "-" : text;
}

void print_text(const ordered_json& r) {
  std::string out;
  auto line = [&out](const std::string& label, const std::string& text) {
    constexpr size_t kWidth = 14;
    out += label + std::string(label.size() + 2 > kWidth ? 2 : kWidth - label.size(), ' ') + text +
           "\n";
  };
  line("checkpoint", r["path"].get<std::string>());
  line("architecture", text_or_dash(r["architecture"]));
  line("model_type", text_or_dash(r["model_type"]) +
                         (r["nested_text_config"].get<bool>() ? " (from text_config)" : ""));
  line("dtype", text_or_dash(r["dtype"]));
  line("quantization", r["quantization"].get<std::string>());
  line("vocab", cat(r["vocab_size"].get<int64_t>(), ", hidden ", r["hidden_size"].get<int64_t>(),
                    ", intermediate ", r["intermediate_size"].get<int64_t>(), ", max positions ",
                    r["max_position_embeddings"].get<int64_t>(), ", tied embeddings ",
                    r["tie_word_embeddings"].get<bool>() ? "yes" : "no"));

  const ordered_json& layers = r["layers"];
  line("layers", cat(layers["count"].get<int64_t>()));
  for (const auto& [kind, entry] : layers["by_kind"].items()) {
    line(cat("  ", kind),
         cat(entry["count"].get<int64_t>(), " [", join_indices(entry["indices"]), "]"));
  }
  line("kv cache",
       cat(r["kv_cache_layers"].size(), " layers [", join_indices(r["kv_cache_layers"]), "]"));
  line("qsa", cat(r["qsa_layers"].size(), " layers [", join_indices(r["qsa_layers"]), "]"));

  const ordered_json& a = r["attention"];
  std::string attention =
      cat("q heads ", a["n_heads"].get<int64_t>(), ", kv heads ", a["n_kv_heads"].get<int64_t>(),
          ", head_dim ", a["head_dim"].get<int64_t>(), ", rotary_dim ",
          a["rotary_dim"].get<int64_t>(), ", gqa group ", a["gqa_group"].get<int64_t>());
  if (!a["sliding_window"].is_null()) {
    attention += cat(", sliding window ", a["sliding_window"].get<int64_t>());
  }
  line("attention", attention);
  if (!r["qsa_indexer"].is_null()) {
    const ordered_json& q = r["qsa_indexer"];
    line("qsa indexer",
         cat("heads ", q["n_heads"].get<int64_t>(), ", kv heads ", q["n_kv_heads"].get<int64_t>(),
             ", head_dim ", q["head_dim"].get<int64_t>(), ", budget ", q["budget"].get<int64_t>(),
             ", compress ratio ", q["compress_ratio"].get<int64_t>(), ", top-k groups ",
             q["topk_groups"].get<int64_t>()));
  }
  std::string rope;
  for (const auto& [key, value] : r["rope"].items()) {
    if (key == "type") {
      rope = value.get<std::string>();
    } else {
      rope += cat(", ", key, " ", value.dump());
    }
  }
  line("rope", rope);

  const ordered_json& t = r["tensors"];
  line("tensors", cat(t["count"].get<uint64_t>(), " tensors, ", t["bytes"].get<uint64_t>(),
                      " bytes (", human_bytes(t["bytes"].get<uint64_t>()), ")"));
  for (const auto& [dtype, entry] : t["by_dtype"].items()) {
    line(cat("  ", dtype), cat(entry["count"].get<uint64_t>(), " tensors, ",
                               entry["bytes"].get<uint64_t>(), " bytes"));
  }
  line("shards",
       cat(r["shards"].size(), r["sharded"].get<bool>() ? " (indexed)" : " (single file)"));
  for (const auto& shard : r["shards"]) {
    line(cat("  ", shard["file"].get<std::string>()),
         cat(shard["tensors"].get<uint64_t>(), " tensors, ", shard["bytes"].get<uint64_t>(),
             " bytes"));
  }

  const ordered_json& s = r["kv_scales"];
  line("kv scales", cat(s["present"].get<int64_t>(), "/", s["expected"].get<int64_t>(),
                        " present, ", s["missing"].size(), " missing, ", s["unexpected"].size(),
                        " unexpected, ", s["conflicts"].size(), " conflicting"));
  if (s["negative_control"].get<bool>()) {
    line("  NEGATIVE CONTROL",
         "unit scales (1.0) written by e4kv overlay --unit-scale-negative-control; not "
         "calibrated, not for production use");
  }
  for (const auto& layer : s["layers"]) {
    std::string text;
    for (const char* which : {"k", "v"}) {
      const ordered_json& slot = layer[which];
      text += text.empty() ? "" : ", ";
      if (slot.is_null()) {
        text += cat(which, " missing");
      } else {
        text += cat(which, " ", slot["key"].get<std::string>(), " = ", slot["value"].dump());
      }
    }
    line(cat("  layer ", layer["layer"].get<int64_t>()), text);
  }
  for (const auto& key : s["missing"]) line("  missing", key.get<std::string>());
  for (const auto& entry : s["unexpected"]) {
    line("  unexpected",
         cat(entry["key"].get<std::string>(), " (", entry["reason"].get<std::string>(), ")"));
  }
  for (const auto& entry : s["conflicts"]) {
    line("  conflict", cat("layer ", entry["layer"].get<int64_t>(), " ",
                           entry["tensor"].get<std::string>(), ": ", entry["keys"].dump()));
  }
  const ordered_json& gate = r["fp8_e4m3_startup"];
  line("fp8 start-up",
       cat(gate["ok"].get<bool>() ? "ok: " : "refused: ", gate["message"].get<std::string>()));
  std::fputs(out.c_str(), stdout);
}

Status run_inspect(const InspectArgs& args) {
  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(args.model_dir));
  ordered_json report = build_report(ckpt);
  // What engine start-up with --kv-cache-dtype fp8_e4m3 would say: the same gate, the first line of
  // its message when it refuses ("loaded N/M ...").
  const Result<KvScales> gate = load_kv_scales(ckpt, KvCacheDtype::kE4m3);
  std::string gate_message = gate.ok() ? gate->summary : gate.message();
  if (!gate.ok()) gate_message = gate_message.substr(0, gate_message.find('\n'));
  report["fp8_e4m3_startup"] =
      ordered_json{{"ok", gate.ok()},
                   {"negative_control", gate.ok() && gate->negative_control()},
                   {"message", gate_message}};
  if (args.json) {
    const std::string text =
        report.dump(2, ' ', false, ordered_json::error_handler_t::replace) + "\n";
    std::fputs(text.c_str(), stdout);
  } else {
    print_text(report);
  }
  if (std::fflush(stdout) != 0) return Status::error("writing to standard output failed");
  return ok_status();
}

}  // namespace

void add_inspect_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "inspect",
      "Show the architecture, layer kinds, geometry, tensors and K/V scale keys of a "
      "Hugging Face checkpoint directory");
  auto args = std::make_shared<InspectArgs>();
  cmd->add_option("MODEL_DIR", args->model_dir, "Checkpoint directory")->required();
  cmd->add_flag("--json", args->json, "Print one JSON object instead of text");
  cmd->callback([args, &result] { result = one_line(run_inspect(*args)); });
}

}  // namespace e4kv::cli
