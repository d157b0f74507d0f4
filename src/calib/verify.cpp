#include "calib/verify.h"

#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "calib/scales_file.h"
#include "core/sha256.h"
#include "io/checkpoint.h"
#include "kv/scale_keys.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

struct RecordedFile {
  std::string name;
  std::string role;
  std::string sha256;
};

struct Provenance {
  std::string base_dir;
  std::string revision;
  std::string revision_file;
  std::string hash_scope;
  std::vector<RecordedFile> files;
  std::optional<std::string> scales_shard_sha256;
};

bool is_plain_file_name(std::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  return name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

std::string short_digest(const std::string& digest) {
  return digest.substr(0, 12);
}

Result<std::string> string_field(const Json& object, const char* field, const std::string& where) {
  auto it = object.find(field);
  if (it == object.end() || !it->is_string()) {
    return Status::error(cat(where, ": \"", field, "\" is missing or not a string"));
  }
  return it->get<std::string>();
}

Result<Provenance> read_provenance(const fs::path& path) {
  const std::string source = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(cat(source, ": cannot open for reading"));
  std::ostringstream text;
  text << in.rdbuf();
  Json root;
  try {
    root = Json::parse(text.str());
  } catch (const Json::parse_error& e) {
    return Status::error(cat(source, ": invalid JSON at byte ", e.byte,
                             "; the provenance was damaged, re-create the overlay"));
  }
  if (!root.is_object()) return Status::error(cat(source, ": expected a JSON object"));
  E4KV_ASSIGN_OR_RETURN(std::string format, string_field(root, "format", source));
  if (format != kProvenanceFormat) {
    return Status::error(
        cat(source, ": \"format\" is \"", format, "\"; expected \"", kProvenanceFormat, "\""));
  }
  Provenance provenance;
  if (root.contains("hash_scope") && root["hash_scope"].is_string()) {
    provenance.hash_scope = root["hash_scope"].get<std::string>();
  }
  auto base = root.find("base");
  if (base == root.end() || !base->is_object()) {
    return Status::error(cat(source, ": \"base\" is missing or not an object"));
  }
  const std::string where = cat(source, ": base");
  E4KV_ASSIGN_OR_RETURN(provenance.base_dir, string_field(*base, "dir", where));
  E4KV_ASSIGN_OR_RETURN(provenance.revision, string_field(*base, "revision", where));
  E4KV_ASSIGN_OR_RETURN(provenance.revision_file, string_field(*base, "revision_file", where));
  if (!is_sha256_hex(provenance.revision)) {
    return Status::error(cat(where, ".revision is not a SHA-256 hex digest"));
  }
  auto files = base->find("files");
  if (files == base->end() || !files->is_array() || files->empty()) {
    return Status::error(cat(where, ".files is missing, empty or not an array"));
  }
  for (const Json& file : *files) {
    if (!file.is_object()) return Status::error(cat(where, ".files holds a non-object entry"));
    RecordedFile recorded;
    E4KV_ASSIGN_OR_RETURN(recorded.name, string_field(file, "file", cat(where, ".files[]")));
    E4KV_ASSIGN_OR_RETURN(recorded.sha256, string_field(file, "sha256", cat(where, ".files[]")));
    if (file.contains("role") && file["role"].is_string()) recorded.role = file["role"];
    if (!is_plain_file_name(recorded.name)) {
      return Status::error(
          cat(where, ".files names \"", recorded.name, "\", which is not a plain file name"));
    }
    if (!is_sha256_hex(recorded.sha256)) {
      return Status::error(
          cat(where, ".files[\"", recorded.name, "\"].sha256 is not a SHA-256 hex digest"));
    }
    provenance.files.push_back(std::move(recorded));
  }
  if (auto derived = root.find("derived"); derived != root.end() && derived->is_object()) {
    if (auto shard = derived->find("scales_shard"); shard != derived->end() && shard->is_object()) {
      if (shard->contains("sha256") && (*shard)["sha256"].is_string()) {
        provenance.scales_shard_sha256 = (*shard)["sha256"].get<std::string>();
      }
    }
  }
  return provenance;
}

}  // namespace

Result<VerifyResult> verify_overlay(const VerifyOptions& options) {
  const fs::path dir = options.dir;
  // 1. The start-up gate, exactly as the engine runs it.
  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(dir));
  VerifyResult result;
  E4KV_ASSIGN_OR_RETURN(result.scales,
                        load_kv_scales(ckpt, options.dtype, KvScalesMode::kCalibrated));

  // 2. The revision binding.
  std::error_code ec;
  const fs::path provenance_path = dir / kProvenanceName;
  if (!fs::exists(fs::symlink_status(provenance_path, ec))) {
    result.notes.push_back(cat("provenance: not checked (no ", kProvenanceName,
                               ": a plain checkpoint, its binding to a base revision is unknown)"));
    return result;
  }
  E4KV_ASSIGN_OR_RETURN(Provenance provenance, read_provenance(provenance_path));
  result.provenance_checked = true;
  result.base_dir = provenance.base_dir;
  result.base_revision = provenance.revision;
  const fs::path base = provenance.base_dir;
  const std::string context = cat(dir.string(), ": does not match its base ", base.string(),
                                  " as recorded in ", kProvenanceName, ": ");
  const std::string remedy = "; re-create the overlay from the current base with e4kv overlay";
  if (!fs::is_directory(base, ec)) {
    return Status::error(cat(context, "the base directory is missing", remedy));
  }

  std::vector<std::string> problems;
  // What to hash: each recorded base file, and the derived file standing in for it when it is not
  // the same file (a copy). The derived index is the merged one and is checked structurally below.
  struct Job {
    fs::path path;
    std::string label;
    const RecordedFile* recorded;
    bool derived;
  };
  std::vector<Job> jobs;
  bool revision_recorded = false;
  for (const RecordedFile& file : provenance.files) {
    if (file.name == provenance.revision_file) {
      revision_recorded = true;
      if (file.sha256 != provenance.revision) {
        problems.push_back(
            cat("the recorded digest of ", file.name, " differs from the recorded base revision"));
      }
    }
    const fs::path base_file = base / file.name;
    if (!fs::is_regular_file(base_file, ec)) {
      problems.push_back(cat("base file ", file.name, " is missing"));
      continue;
    }
    jobs.push_back({base_file, file.name, &file, false});
    if (file.name == kSafetensorsIndexName) continue;
    const fs::path derived_file = dir / file.name;
    if (!fs::is_regular_file(derived_file, ec)) {
      problems.push_back(cat("derived file ", file.name, " (a link to the base file) is missing"));
      continue;
    }
    if (!fs::equivalent(derived_file, base_file, ec)) {
      jobs.push_back({derived_file, cat(file.name, " (derived copy)"), &file, true});
    }
  }
  if (!revision_recorded) {
    problems.push_back(cat("the revision file ", provenance.revision_file, " is not recorded"));
  }
  std::vector<fs::path> paths;
  std::vector<std::string> labels;
  for (const Job& job : jobs) {
    paths.push_back(job.path);
    labels.push_back(job.label);
  }
  E4KV_ASSIGN_OR_RETURN(std::vector<std::string> digests,
                        hash_files(paths, labels, options.progress));
  result.n_hashed = static_cast<int64_t>(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& job = jobs[i];
    if (digests[i] == job.recorded->sha256) continue;
    problems.push_back(cat(job.derived ? "derived file " : "base file ", job.recorded->name,
                           job.derived ? " no longer matches the base file recorded"
                                       : " changed since the overlay was made",
                           " (sha256 now ", short_digest(digests[i]), "..., recorded ",
                           short_digest(job.recorded->sha256), "...)"));
  }

  // The scales shard: contract, revision and digest as recorded.
  const fs::path scales_shard = dir / kKvScalesShardName;
  if (!fs::is_regular_file(scales_shard, ec)) {
    problems.push_back(cat(kKvScalesShardName, " is missing"));
  } else {
    Result<SafetensorsFile> shard = SafetensorsFile::open(scales_shard);
    if (!shard.ok()) {
      problems.push_back(shard.message());
    } else {
      const auto& metadata = shard->metadata();
      auto contract = metadata.find(std::string(kContractMetadataKey));
      if (contract == metadata.end() || contract->second != kScalesFormat) {
        problems.push_back(cat(kKvScalesShardName, " lacks the contract string \"", kScalesFormat,
                               "\" in its metadata"));
      }
      auto revision = metadata.find(std::string(kBaseRevisionMetadataKey));
      if (revision == metadata.end() || revision->second != provenance.revision) {
        problems.push_back(cat(kKvScalesShardName, " was made for another base revision (",
                               revision == metadata.end() ? "none" : revision->second, ")"));
      }
    }
    if (provenance.scales_shard_sha256) {
      Result<std::string> digest = sha256_file(scales_shard);
      if (!digest.ok()) {
        problems.push_back(digest.message());
      } else if (*digest != *provenance.scales_shard_sha256) {
        problems.push_back(cat(kKvScalesShardName,
                               " changed since the overlay was made (sha256 now ",
                               short_digest(*digest), "..., recorded ",
                               short_digest(*provenance.scales_shard_sha256), "...)"));
      }
    }
  }

  // The merged index: every base tensor where the base keeps it, and nothing else but scales.
  Result<Checkpoint> base_ckpt = Checkpoint::open(base);
  if (!base_ckpt.ok()) {
    problems.push_back(cat("the base no longer opens: ", base_ckpt.message()));
  } else {
    std::vector<std::string> wrong;
    for (const std::string& name : base_ckpt->tensor_names()) {
      const std::string derived_shard = ckpt.shard_of(name);
      if (derived_shard != base_ckpt->shard_of(name)) {
        wrong.push_back(cat(name, derived_shard.empty() ? " is not in the derived index"
                                                        : " is mapped to " + derived_shard));
      }
    }
    for (const std::string& name : ckpt.tensor_names()) {
      if (base_ckpt->find(name) != nullptr) continue;
      if (!parse_scale_key(name) || ckpt.shard_of(name) != kKvScalesShardName) {
        wrong.push_back(
            cat(name, " is not in the base and not a K/V scale in ", kKvScalesShardName));
      }
    }
    if (!wrong.empty()) {
      std::string list;
      for (size_t i = 0; i < wrong.size() && i < 5; ++i) list += cat(i ? ", " : "", wrong[i]);
      if (wrong.size() > 5) list += cat(" and ", wrong.size() - 5, " more");
      problems.push_back(cat("the derived index does not match the base: ", list));
    }
  }

  if (!problems.empty()) {
    std::string list;
    for (size_t i = 0; i < problems.size(); ++i) list += cat(i ? "; " : "", problems[i]);
    return Status::error(cat(context, list, remedy));
  }
  result.notes.push_back(cat("provenance: base ", base.string(), " revision ",
                             short_digest(provenance.revision), " (", provenance.revision_file,
                             "): ", result.n_hashed, " files hashed, all match"));
  if (provenance.hash_scope == "index-config") {
    result.notes.push_back(
        "provenance: the overlay was made with --hash index-config, so base shards are not "
        "bound by digest (only the index and config.json)");
  }
  return result;
}

}  // namespace e4kv
