// A Hugging Face checkpoint directory: config.json plus one model.safetensors or shards listed by
// model.safetensors.index.json; one lookup from tensor name to a zero-copy view across shards.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "io/model_config.h"
#include "io/safetensors.h"

namespace e4kv {

inline constexpr std::string_view kSafetensorsIndexName = "model.safetensors.index.json";
inline constexpr std::string_view kSingleSafetensorsName = "model.safetensors";

class Checkpoint {
 public:
  // Opens `dir`: parses config.json, then model.safetensors.index.json if present (every shard it
  // names is opened and validated; every tensor the index lists must be in the shard it names, and
  // every tensor of a shard must be listed), else model.safetensors. Shard names in the index must
  // be plain file names inside `dir` (no '/', '\\' or ".."). A tensor name present in two shards is
  // an error. Errors name the file and the problem.
  static Result<Checkpoint> open(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  bool sharded() const { return sharded_; }
  // Shard files in the order the index first names them (or the single file).
  const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }

  // nullptr when absent.
  const SafetensorsTensor* find(std::string_view name) const;
  // Every tensor name, sorted.
  std::vector<std::string> tensor_names() const;
  // File name (relative to dir) of the shard holding `name`; empty when absent.
  std::string shard_of(std::string_view name) const;

 private:
  std::filesystem::path dir_;
  ModelConfig config_;
  bool sharded_ = false;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::vector<std::string> shard_names_;
  std::map<std::string, std::pair<size_t, const SafetensorsTensor*>, std::less<>> tensors_;
};

}  // namespace e4kv
