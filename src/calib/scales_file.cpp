#include "calib/scales_file.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "core/json.h"
#include "kv/scale_gate.h"
#include "kv/scale_keys.h"

namespace e4kv {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// The double whose shortest decimal form reads back as `value` both as a double and (through a
// double, as JSON readers do) as an fp32: the shortest fp32 digits when that round trip is exact,
// else the exact widening of `value`.
double json_number_for(float value) {
  char text[64];
  auto [end, ec] = std::to_chars(text, text + sizeof(text) - 1, value);
  if (ec == std::errc()) {
    *end = '\0';
    const double shortest = std::strtod(text, nullptr);
    if (static_cast<float>(shortest) == value) return shortest;
  }
  return static_cast<double>(value);
}

// (prefix, layer, K before V) order for writing; keys that do not parse sort last by name.
bool scale_key_less(const std::string& a, const std::string& b) {
  std::optional<ScaleKey> ka = parse_scale_key(a);
  std::optional<ScaleKey> kb = parse_scale_key(b);
  if (!ka || !kb) return std::make_tuple(!ka, a) < std::make_tuple(!kb, b);
  return std::make_tuple(ka->prefix, ka->layer, ka->tensor == KvTensor::kV, a) <
         std::make_tuple(kb->prefix, kb->layer, kb->tensor == KvTensor::kV, b);
}

// The gate's rule (kv_scale_value_problem), so a scales file that reads or writes cleanly also
// passes the start-up gate.
Status check_scale_value(const std::string& source, const std::string& key, float value) {
  if (std::optional<std::string> problem = kv_scale_value_problem(value)) {
    return Status::error(
        cat(source, ": scale \"", key, "\" = ", format_scale_value(value), " is ", *problem));
  }
  return ok_status();
}

}  // namespace

Result<ScalesFile> parse_scales_file(std::string_view json_text, const std::string& source) {
  // nlohmann keeps only the last of duplicate keys; the check sees every key so a repeated one
  // is an error instead of a silently dropped scale.
  std::vector<std::set<std::string, std::less<>>> open_objects;
  auto no_duplicate_keys = [&](int /*depth*/, Json::parse_event_t event,
                               const Json& parsed) -> Status {
    if (event == Json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == Json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == Json::parse_event_t::key && !open_objects.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(key).second) {
        return Status::error(cat(source, ": key ", json_excerpt(parsed, 120),
                                 " appears twice in one object; keep exactly one"));
      }
    }
    return ok_status();
  };
  E4KV_ASSIGN_OR_RETURN(const Json root, parse_json(json_text, source, {}, no_duplicate_keys));
  if (!root.is_object()) {
    return Status::error(cat(
        source, ": expected a JSON object with \"format\" and \"scales\", got ", root.type_name()));
  }
  auto format = root.find("format");
  if (format == root.end()) {
    return Status::error(
        cat(source, ": required field \"format\" is missing; expected \"", kScalesFormat, "\""));
  }
  if (!format->is_string() || format->get<std::string>() != kScalesFormat) {
    return Status::error(cat(source, ": \"format\" is ", json_excerpt(*format), "; expected \"",
                             kScalesFormat, "\" (a file written by e4kv summarize)"));
  }

  ScalesFile file;
  auto policy = root.find("policy");
  if (policy != root.end() && !policy->is_null()) {
    if (!policy->is_string()) {
      return Status::error(cat(source, ": \"policy\" must be a string, got ", policy->type_name()));
    }
    file.policy = policy->get<std::string>();
  }
  auto src = root.find("source");
  if (src != root.end() && !src->is_null()) {
    if (!src->is_object()) {
      return Status::error(cat(source, ": \"source\" must be an object, got ", src->type_name()));
    }
    file.source_json = src->dump();
  }

  auto scales = root.find("scales");
  if (scales == root.end())
    return Status::error(cat(source, ": required field \"scales\" is missing"));
  if (!scales->is_object()) {
    return Status::error(cat(source,
                             ": \"scales\" must be an object mapping scale keys to numbers, got ",
                             scales->type_name()));
  }
  if (scales->empty()) return Status::error(cat(source, ": \"scales\" is empty"));
  std::map<std::string, std::string> spelled;  // canonical key -> key as written
  for (const auto& [key, value] : scales->items()) {
    std::optional<ScaleKey> parsed = parse_scale_key(key);
    if (!parsed) {
      return Status::error(cat(source, ": \"", key,
                               "\" is not a K/V scale key; expected "
                               "<prefix>.layers.<i>.self_attn.k_scale or .v_scale"));
    }
    if (!value.is_number()) {
      return Status::error(
          cat(source, ": scale \"", key, "\" must be a number, got ", value.type_name()));
    }
    const double wide = value.get<double>();
    const float narrow = static_cast<float>(wide);
    if (std::isfinite(wide) && !std::isfinite(narrow)) {
      return Status::error(cat(source, ": scale \"", key, "\" = ", wide, " overflows fp32"));
    }
    if (wide > 0.0 && narrow == 0.0f) {
      return Status::error(cat(source, ": scale \"", key, "\" = ", wide, " underflows fp32 to 0"));
    }
    E4KV_RETURN_IF_ERROR(check_scale_value(source, key, narrow));
    const std::string canonical =
        canonical_scale_key(parsed->prefix, parsed->layer, parsed->tensor);
    auto [it, inserted] = spelled.emplace(canonical, key);
    if (!inserted) {
      return Status::error(cat(source, ": \"", it->second, "\" and \"", key,
                               "\" both set the scale ", canonical, "; keep exactly one"));
    }
    file.scales[canonical] = narrow;
  }
  return file;
}

Result<ScalesFile> read_scales_file(const std::filesystem::path& path) {
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> text, read_optional_file(path));
  if (!text) {
    return Status::error(cat(path.string(),
                             ": scales file not found; make one with e4kv summarize STATS... "
                             "--out scales.json --report report"));
  }
  return parse_scales_file(*text, path.string());
}

Status write_scales_file(const std::filesystem::path& path, const ScalesFile& file) {
  const std::string target = path.string();
  if (!path.has_filename()) return Status::error(cat(target, ": the path names no file"));
  std::vector<std::string> keys;
  for (const auto& [key, value] : file.scales) {
    std::optional<ScaleKey> parsed = parse_scale_key(key);
    if (!parsed || !parsed->canonical) {
      return Status::error(cat(target, ": cannot write \"", key,
                               "\": scales.json keys must be canonical "
                               "<prefix>.layers.<i>.self_attn.{k,v}_scale keys"));
    }
    E4KV_RETURN_IF_ERROR(check_scale_value(target, key, value));
    keys.push_back(key);
  }
  std::sort(keys.begin(), keys.end(), scale_key_less);

  E4KV_ASSIGN_OR_RETURN(const OrderedJson source_object,
                        parse_ordered_json(file.source_json.empty() ? "{}" : file.source_json,
                                           cat(target, ": cannot write: the source object")));
  if (!source_object.is_object()) {
    return Status::error(cat(target, ": cannot write: the source must be a JSON object, got ",
                             source_object.type_name()));
  }
  OrderedJson root;
  root["format"] = kScalesFormat;
  root["policy"] = file.policy;
  OrderedJson scales = OrderedJson::object();
  for (const std::string& key : keys) scales[key] = json_number_for(file.scales.at(key));
  root["scales"] = std::move(scales);
  root["source"] = std::move(source_object);
  const std::string text = root.dump(2) + "\n";

  return write_file_atomic(path, text);
}

}  // namespace e4kv
