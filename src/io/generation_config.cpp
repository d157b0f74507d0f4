#include "io/generation_config.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "core/json.h"

namespace e4kv {
namespace {

using json = nlohmann::json;

Status add_ids(const json& value, const std::string& where, std::vector<int32_t>& ids) {
  if (value.is_null()) return ok_status();
  const bool is_list = value.is_array();
  const json list = is_list ? value : json::array({value});
  for (const json& entry : list) {
    if (!entry.is_number_integer() || entry.get<int64_t>() < 0 ||
        entry.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return Status::error(
          cat(where, " must be a token id or a list of token ids, got ", json_excerpt(value)));
    }
    ids.push_back(static_cast<int32_t>(entry.get<int64_t>()));
  }
  return ok_status();
}

Status read_file_ids(const std::filesystem::path& path, bool required, std::vector<int32_t>& ids) {
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> text, read_optional_file(path));
  if (!text) {
    if (required) return Status::error(cat(path.string(), ": file not found"));
    return ok_status();
  }
  E4KV_ASSIGN_OR_RETURN(const json root, parse_json(*text, path.string()));
  if (!root.is_object()) {
    return Status::error(cat(path.string(), ": not a valid JSON object"));
  }
  if (root.contains("eos_token_id")) {
    E4KV_RETURN_IF_ERROR(
        add_ids(root["eos_token_id"], cat(path.string(), ": \"eos_token_id\""), ids));
  }
  if (root.contains("text_config") && root["text_config"].is_object() &&
      root["text_config"].contains("eos_token_id")) {
    E4KV_RETURN_IF_ERROR(add_ids(root["text_config"]["eos_token_id"],
                                 cat(path.string(), ": \"text_config.eos_token_id\""), ids));
  }
  return ok_status();
}

}  // namespace

Result<std::vector<int32_t>> load_eos_token_ids(const std::filesystem::path& model_dir) {
  std::vector<int32_t> ids;
  E4KV_RETURN_IF_ERROR(read_file_ids(model_dir / "config.json", /*required=*/true, ids));
  E4KV_RETURN_IF_ERROR(
      read_file_ids(model_dir / "generation_config.json", /*required=*/false, ids));
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace e4kv
