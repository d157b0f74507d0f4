#include "quant/quant_config.h"

#include <cctype>
#include <utility>

#include "core/json.h"

namespace e4kv {

namespace {

using json = nlohmann::json;

const char* const kSupported =
    "e4kv loads AWQ (quant_method awq, 4 bits, version gemm, group_size 32, 64 or 128), "
    "compressed-tensors NVFP4 (format nvfp4-pack-quantized) and FP8 with 128x128-style blocks "
    "(quant_method fp8, weight_block_size)";

class Reader {
 public:
  Reader(const json& object, std::string source, std::string path)
      : object_(object), source_(std::move(source)), path_(std::move(path)) {}

  Status error(const std::string& key, const std::string& what) const {
    return Status::error(cat(source_, ": ", path_, key.empty() ? "" : ".", key, " ", what, "; ",
                             kSupported));
  }
  const json* get(const std::string& key) const {
    auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  Result<std::string> string(const std::string& key, const std::string& fallback) const {
    const json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_string()) return error(key, cat("is ", json_excerpt(*v), ", expected a string"));
    return v->get<std::string>();
  }
  Result<int64_t> integer(const std::string& key, int64_t fallback) const {
    const json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_number_integer()) {
      return error(key, cat("is ", json_excerpt(*v), ", expected an integer"));
    }
    return v->get<int64_t>();
  }
  Result<bool> boolean(const std::string& key, bool fallback) const {
    const json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) return error(key, cat("is ", json_excerpt(*v), ", expected true or false"));
    return v->get<bool>();
  }
  Status names(const std::string& key, std::vector<std::string>& out) const {
    const json* v = get(key);
    if (v == nullptr) return ok_status();
    if (!v->is_array()) return error(key, cat("is ", json_excerpt(*v), ", expected a list of names"));
    for (const json& item : *v) {
      if (!item.is_string()) {
        return error(key, cat("holds ", json_excerpt(item), ", expected module names"));
      }
      out.push_back(item.get<std::string>());
    }
    return ok_status();
  }
  const std::string& path() const { return path_; }

 private:
  const json& object_;
  std::string source_;
  std::string path_;
};

Status read_awq(const Reader& r, QuantConfig& q) {
  q.method = QuantMethod::kAwq;
  // transformers writes bits / group_size; AutoAWQ's own quant_config.json w_bit / q_group_size.
  const std::string bits_key = r.get("bits") != nullptr || r.get("w_bit") == nullptr ? "bits" : "w_bit";
  E4KV_ASSIGN_OR_RETURN(const int64_t bits, r.integer(bits_key, 4));
  if (bits != 4) return r.error(bits_key, cat("is ", bits, ": only 4-bit AWQ is supported"));
  const std::string group_key =
      r.get("group_size") != nullptr || r.get("q_group_size") == nullptr ? "group_size" : "q_group_size";
  E4KV_ASSIGN_OR_RETURN(const int64_t group, r.integer(group_key, 128));
  if (group != 32 && group != 64 && group != 128) {
    return r.error(group_key, cat("is ", group, ": AWQ group sizes 32, 64 and 128 are supported"));
  }
  q.group_size = group;
  E4KV_ASSIGN_OR_RETURN(q.zero_point, r.boolean("zero_point", true));
  E4KV_ASSIGN_OR_RETURN(std::string version, r.string("version", "gemm"));
  for (char& c : version) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (version != "gemm") {
    return r.error("version", cat("is \"", version,
                                  "\": only AutoAWQ's GEMM packing is supported (re-export the "
                                  "checkpoint with version gemm)"));
  }
  return r.names("modules_to_not_convert", q.excluded);
}

Status read_compressed_tensors(const Reader& r, const json& object, const std::string& source,
                               QuantConfig& q) {
  E4KV_ASSIGN_OR_RETURN(const std::string format, r.string("format", ""));
  if (format != "nvfp4-pack-quantized") {
    return r.error("format", cat("is \"", format,
                                 "\": of compressed-tensors formats only nvfp4-pack-quantized is "
                                 "supported"));
  }
  q.method = QuantMethod::kNvfp4;
  q.group_size = 16;
  const json* groups = r.get("config_groups");
  if (groups == nullptr || !groups->is_object() || groups->empty()) {
    return r.error("config_groups", "is missing or empty: it says how the weights were quantized");
  }
  for (const auto& [name, group] : groups->items()) {
    const std::string at = cat(r.path(), ".config_groups.", name);
    if (!group.is_object()) {
      return Reader(object, source, r.path()).error(cat("config_groups.", name), "is not an object");
    }
    const Reader g(group, source, at);
    const json* weights = g.get("weights");
    if (weights == nullptr || !weights->is_object()) {
      return g.error("weights", "is missing: the group must quantize weights");
    }
    const Reader w(*weights, source, at + ".weights");
    E4KV_ASSIGN_OR_RETURN(const int64_t bits, w.integer("num_bits", 0));
    E4KV_ASSIGN_OR_RETURN(const std::string type, w.string("type", ""));
    E4KV_ASSIGN_OR_RETURN(const int64_t group_size, w.integer("group_size", 0));
    if (bits != 4 || type != "float" || group_size != 16) {
      return w.error("", cat("is num_bits ", bits, ", type \"", type, "\", group_size ", group_size,
                             ": NVFP4 weights are num_bits 4, type float, group_size 16"));
    }
    // Input activations (FP4 on Blackwell) are ignored: e4kv runs the weights against FP16
    // activations, which needs nothing from their parameters.
  }
  return r.names("ignore", q.excluded);
}

Status read_fp8(const Reader& r, QuantConfig& q) {
  q.method = QuantMethod::kFp8Block;
  E4KV_ASSIGN_OR_RETURN(const std::string fmt, r.string("fmt", "e4m3"));
  if (fmt != "e4m3") return r.error("fmt", cat("is \"", fmt, "\": only E4M3 weights are supported"));
  const json* block = r.get("weight_block_size");
  if (block == nullptr) {
    return r.error("weight_block_size",
                   "is missing: per-tensor FP8 weights are not supported, only block scales");
  }
  if (!block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
      !(*block)[1].is_number_integer() || (*block)[0].get<int64_t>() <= 0 ||
      (*block)[1].get<int64_t>() <= 0 || (*block)[0].get<int64_t>() > 65536 ||
      (*block)[1].get<int64_t>() > 65536) {
    return r.error("weight_block_size",
                   cat("is ", json_excerpt(*block), ", expected two positive integers [rows, "
                                                    "columns]"));
  }
  q.block_rows = (*block)[0].get<int64_t>();
  q.group_size = (*block)[1].get<int64_t>();
  E4KV_RETURN_IF_ERROR(r.names("modules_to_not_convert", q.excluded));
  return r.names("ignored_layers", q.excluded);
}

}  // namespace

std::string QuantConfig::describe() const {
  switch (method) {
    case QuantMethod::kNone:
      return "none";
    case QuantMethod::kAwq:
      return cat("AWQ W4A16 g", group_size, zero_point ? " (zero points)" : " (symmetric)");
    case QuantMethod::kNvfp4:
      return "NVFP4 (weight only)";
    case QuantMethod::kFp8Block:
      return cat("FP8 E4M3 blocks ", block_rows, "x", group_size);
  }
  return "?";
}

Result<QuantConfig> parse_quant_config(const json& root, const std::string& source) {
  QuantConfig q;
  if (!root.is_object()) return q;
  const json* object = nullptr;
  auto top = root.find("quantization_config");
  if (top != root.end() && !top->is_null()) {
    object = &*top;
    q.field = "quantization_config";
  } else if (auto text = root.find("text_config"); text != root.end() && text->is_object()) {
    auto inner = text->find("quantization_config");
    if (inner != text->end() && !inner->is_null()) {
      object = &*inner;
      q.field = "text_config.quantization_config";
    }
  }
  if (object == nullptr) return q;
  if (!object->is_object()) {
    return Status::error(cat(source, ": ", q.field, " is ", json_excerpt(*object),
                             ", expected an object"));
  }
  const Reader r(*object, source, q.field);
  E4KV_ASSIGN_OR_RETURN(std::string method, r.string("quant_method", ""));
  for (char& c : method) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (method == "awq") {
    E4KV_RETURN_IF_ERROR(read_awq(r, q));
  } else if (method == "compressed-tensors") {
    E4KV_RETURN_IF_ERROR(read_compressed_tensors(r, *object, source, q));
  } else if (method == "fp8") {
    E4KV_RETURN_IF_ERROR(read_fp8(r, q));
  } else {
    return r.error("quant_method", cat("is \"", method, "\", which e4kv does not load"));
  }
  return q;
}

}  // namespace e4kv
