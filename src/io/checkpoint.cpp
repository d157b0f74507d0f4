#include "io/checkpoint.h"

#include <fstream>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "core/json.h"

namespace e4kv {
namespace {

using ordered_json = nlohmann::ordered_json;

// A shard named by the index must be a plain file name inside the checkpoint directory.
bool is_plain_file_name(std::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  for (char c : name) {
    if (c == '/' || c == '\\' || c == '\0') return false;
  }
  return true;
}


struct IndexEntry {
  std::string tensor;
  std::string shard;
};

// Parses model.safetensors.index.json: {"metadata": {...}, "weight_map": {"name": "file", ...}}.
// Entries keep the file's order so shards come out in the order the index first names them.
Result<std::vector<IndexEntry>> parse_index(const std::filesystem::path& path) {
  const std::string source = path.string();
  E4KV_ASSIGN_OR_RETURN(std::string text, read_file(path));
  E4KV_ASSIGN_OR_RETURN(const ordered_json root, parse_ordered_json(text, source));
  if (!root.is_object()) {
    return Status::error(
        cat(source, ": expected a JSON object with \"weight_map\", got ", root.type_name()));
  }
  auto metadata = root.find("metadata");
  if (metadata != root.end() && !metadata->is_null() && !metadata->is_object()) {
    return Status::error(
        cat(source, ": \"metadata\" must be an object, got ", metadata->type_name()));
  }
  auto weight_map = root.find("weight_map");
  if (weight_map == root.end()) {
    return Status::error(cat(source, ": required field \"weight_map\" is missing"));
  }
  if (!weight_map->is_object()) {
    return Status::error(cat(source,
                             ": \"weight_map\" must be an object mapping tensor names to "
                             "shard file names, got ",
                             weight_map->type_name()));
  }
  if (weight_map->empty()) return Status::error(cat(source, ": \"weight_map\" is empty"));
  std::vector<IndexEntry> entries;
  entries.reserve(weight_map->size());
  for (const auto& [tensor, shard] : weight_map->items()) {
    if (!shard.is_string()) {
      return Status::error(cat(source, ": weight_map entry \"", tensor,
                               "\" must name a shard file (a string), got ", shard.type_name()));
    }
    std::string shard_name = shard.get<std::string>();
    if (!is_plain_file_name(shard_name)) {
      return Status::error(cat(source, ": weight_map entry \"", tensor, "\" names shard \"",
                               shard_name,
                               "\", which is not a plain file name inside the checkpoint "
                               "directory (no '/', '\\\\' or '..')"));
    }
    entries.push_back({tensor, std::move(shard_name)});
  }
  return entries;
}

}  // namespace

Result<Checkpoint> Checkpoint::open(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) {
    return Status::error(cat(dir.string(), ": checkpoint directory not found"));
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::error(cat(dir.string(),
                             ": not a directory; expected a Hugging Face checkpoint "
                             "directory with config.json and *.safetensors"));
  }

  Checkpoint ckpt;
  ckpt.dir_ = dir;
  E4KV_ASSIGN_OR_RETURN(ckpt.config_, load_model_config(dir));

  const std::filesystem::path index_path = dir / kSafetensorsIndexName;
  const std::filesystem::path single_path = dir / kSingleSafetensorsName;
  std::vector<IndexEntry> entries;
  if (std::filesystem::exists(index_path, ec)) {
    ckpt.sharded_ = true;
    E4KV_ASSIGN_OR_RETURN(entries, parse_index(index_path));
    std::map<std::string, size_t, std::less<>> shard_ids;
    for (const IndexEntry& entry : entries) {
      if (shard_ids.contains(entry.shard)) continue;
      const std::filesystem::path shard_path = dir / entry.shard;
      if (!std::filesystem::exists(shard_path, ec)) {
        return Status::error(cat(index_path.string(), ": shard \"", entry.shard, "\" (named for \"",
                                 entry.tensor, "\") does not exist in ", dir.string()));
      }
      E4KV_ASSIGN_OR_RETURN(SafetensorsFile shard, SafetensorsFile::open(shard_path));
      shard_ids.emplace(entry.shard, ckpt.shards_.size());
      ckpt.shards_.push_back(std::make_unique<SafetensorsFile>(std::move(shard)));
      ckpt.shard_names_.push_back(entry.shard);
    }
  } else if (std::filesystem::exists(single_path, ec)) {
    E4KV_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(single_path));
    ckpt.shards_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    ckpt.shard_names_.emplace_back(kSingleSafetensorsName);
  } else {
    return Status::error(cat(dir.string(), ": no ", kSafetensorsIndexName, " or ",
                             kSingleSafetensorsName,
                             " found; expected a single model.safetensors or shards listed by "
                             "model.safetensors.index.json"));
  }

  // Every tensor of every shard, once.
  for (size_t s = 0; s < ckpt.shards_.size(); ++s) {
    for (const SafetensorsTensor& tensor : ckpt.shards_[s]->tensors()) {
      auto [it, inserted] = ckpt.tensors_.try_emplace(tensor.name, s, &tensor);
      if (!inserted) {
        return Status::error(
            cat(dir.string(), ": tensor \"", tensor.name, "\" is stored in two shards, ",
                ckpt.shard_names_[it->second.first], " and ", ckpt.shard_names_[s]));
      }
    }
  }

  if (ckpt.sharded_) {
    std::map<std::string_view, std::string_view> listed;  // tensor -> shard named by the index
    for (const IndexEntry& entry : entries) {
      listed.emplace(entry.tensor, entry.shard);
      auto it = ckpt.tensors_.find(entry.tensor);
      if (it == ckpt.tensors_.end()) {
        return Status::error(cat(index_path.string(), ": tensor \"", entry.tensor,
                                 "\" is mapped to ", entry.shard, ", which does not contain it"));
      }
      if (ckpt.shard_names_[it->second.first] != entry.shard) {
        return Status::error(cat(index_path.string(), ": tensor \"", entry.tensor,
                                 "\" is mapped to ", entry.shard, " but is stored in ",
                                 ckpt.shard_names_[it->second.first]));
      }
    }
    for (const auto& [name, location] : ckpt.tensors_) {
      if (!listed.contains(name)) {
        return Status::error(cat(index_path.string(), ": tensor \"", name, "\" is stored in ",
                                 ckpt.shard_names_[location.first],
                                 " but is not listed in \"weight_map\""));
      }
    }
  }
  return ckpt;
}

const SafetensorsTensor* Checkpoint::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.second;
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, location] : tensors_) names.push_back(name);
  return names;
}

std::string Checkpoint::shard_of(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? std::string() : shard_names_[it->second.first];
}

}  // namespace e4kv
