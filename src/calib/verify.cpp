#include "calib/verify.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "calib/scales_file.h"
#include "core/file_io.h"
#include "core/json.h"
#include "core/sha256.h"
#include "io/checkpoint.h"
#include "kv/scale_keys.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// A base file as the provenance records it: hashed (sha256) or checked by size only (bytes).
struct RecordedFile {
  std::string name;
  std::string role;
  std::optional<std::string> sha256;  // nullopt: recorded by size only (--hash index-config)
  std::optional<uint64_t> bytes;
};

// A base shard that held scale keys, written anew without them (--replace-embedded-scales).
struct RewrittenShard {
  std::string name;
  std::vector<std::string> dropped;
  bool omitted = false;  // nothing was left, so the derived checkpoint has no such shard
  std::optional<std::string> sha256;
  std::optional<uint64_t> bytes;
};

struct Provenance {
  std::string base_dir;
  std::string revision;
  std::string revision_file;
  std::string hash_scope;
  bool negative_control = false;
  std::vector<RecordedFile> files;
  std::vector<RewrittenShard> rewritten;
  std::string policy;
  // "scales": every key model-kvscales.safetensors holds, with its value read back as fp32.
  std::map<std::string, float> scales;
  std::optional<std::string> scales_shard_sha256;
  std::optional<uint64_t> scales_shard_bytes;
  // "scales_file": the scales.json the overlay was made from (null for the negative control).
  std::optional<std::string> scales_file_path;
  std::optional<std::string> scales_file_sha256;
};

bool is_plain_file_name(std::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  return name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

std::string short_digest(const std::string& digest) {
  return digest.substr(0, 12);
}

// "a, b, c" (at most `limit` names, then "and N more").
std::string join_names(const std::vector<std::string>& names, size_t limit = 8) {
  std::string list;
  for (size_t i = 0; i < names.size() && i < limit; ++i) list += cat(i ? ", " : "", names[i]);
  if (names.size() > limit) list += cat(" and ", names.size() - limit, " more");
  return list;
}

Result<std::string> string_field(const Json& object, const char* field, const std::string& where) {
  auto it = object.find(field);
  if (it == object.end() || !it->is_string()) {
    return Status::error(cat(where, ": \"", field, "\" is missing or not a string"));
  }
  return it->get<std::string>();
}

// "sha256" (a digest, or null for a file recorded by size only) and "bytes" of a file record.
Status read_digest_and_size(const Json& object, const std::string& where,
                            std::optional<std::string>& sha256, std::optional<uint64_t>& bytes) {
  auto digest = object.find("sha256");
  if (digest != object.end() && digest->is_string()) {
    sha256 = digest->get<std::string>();
    if (!is_sha256_hex(*sha256)) {
      return Status::error(cat(where, ".sha256 is not a SHA-256 hex digest"));
    }
  } else if (digest == object.end() || !digest->is_null()) {
    return Status::error(cat(where,
                             ".sha256 is missing (expected a digest, or null for a file "
                             "recorded by size only)"));
  }
  auto size = object.find("bytes");
  if (size != object.end() && size->is_number_unsigned()) bytes = size->get<uint64_t>();
  if (!sha256 && !bytes) {
    return Status::error(cat(where, " has neither a digest nor a size"));
  }
  return ok_status();
}

Result<Provenance> read_provenance(const fs::path& path) {
  const std::string source = path.string();
  E4KV_ASSIGN_OR_RETURN(std::string text, read_file(path));
  Result<Json> parsed = parse_json(text, source);
  if (!parsed.ok()) {
    return Status::error(
        cat(parsed.message(), "; the provenance was damaged, re-create the overlay"));
  }
  const Json root = std::move(parsed).value();
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
  if (root.contains("negative_control") && root["negative_control"].is_boolean()) {
    provenance.negative_control = root["negative_control"].get<bool>();
  }
  if (root.contains("policy") && root["policy"].is_string()) {
    provenance.policy = root["policy"].get<std::string>();
  }
  auto scales = root.find("scales");
  if (scales == root.end() || !scales->is_object()) {
    return Status::error(cat(source, ": \"scales\" is missing or not an object"));
  }
  for (const auto& [key, value] : scales->items()) {
    if (!value.is_number()) {
      return Status::error(cat(source, ": scales[\"", key, "\"] is not a number"));
    }
    // The overlay writes each fp32 as a double that reads back as the same fp32.
    provenance.scales[key] = static_cast<float>(value.get<double>());
  }
  if (auto file = root.find("scales_file"); file != root.end() && file->is_object()) {
    if (file->contains("path") && (*file)["path"].is_string()) {
      provenance.scales_file_path = (*file)["path"].get<std::string>();
    }
    if (file->contains("sha256") && (*file)["sha256"].is_string()) {
      provenance.scales_file_sha256 = (*file)["sha256"].get<std::string>();
    }
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
    if (file.contains("role") && file["role"].is_string()) recorded.role = file["role"];
    if (!is_plain_file_name(recorded.name)) {
      return Status::error(
          cat(where, ".files names \"", recorded.name, "\", which is not a plain file name"));
    }
    E4KV_RETURN_IF_ERROR(read_digest_and_size(file, cat(where, ".files[\"", recorded.name, "\"]"),
                                              recorded.sha256, recorded.bytes));
    provenance.files.push_back(std::move(recorded));
  }
  if (auto derived = root.find("derived"); derived != root.end() && derived->is_object()) {
    if (auto shard = derived->find("scales_shard"); shard != derived->end() && shard->is_object()) {
      if (shard->contains("sha256") && (*shard)["sha256"].is_string()) {
        provenance.scales_shard_sha256 = (*shard)["sha256"].get<std::string>();
      }
      if (shard->contains("bytes") && (*shard)["bytes"].is_number_unsigned()) {
        provenance.scales_shard_bytes = (*shard)["bytes"].get<uint64_t>();
      }
    }
    if (auto rewritten = derived->find("rewritten_shards"); rewritten != derived->end()) {
      const std::string rwhere = cat(source, ": derived.rewritten_shards");
      if (!rewritten->is_array()) return Status::error(cat(rwhere, " is not an array"));
      for (const Json& item : *rewritten) {
        if (!item.is_object()) return Status::error(cat(rwhere, " holds a non-object entry"));
        RewrittenShard shard;
        E4KV_ASSIGN_OR_RETURN(shard.name, string_field(item, "file", cat(rwhere, "[]")));
        if (!is_plain_file_name(shard.name)) {
          return Status::error(
              cat(rwhere, " names \"", shard.name, "\", which is not a plain file name"));
        }
        const std::string iwhere = cat(rwhere, "[\"", shard.name, "\"]");
        auto dropped = item.find("dropped");
        if (dropped == item.end() || !dropped->is_array()) {
          return Status::error(cat(iwhere, ".dropped is missing or not an array"));
        }
        for (const Json& key : *dropped) {
          if (!key.is_string()) return Status::error(cat(iwhere, ".dropped holds a non-string"));
          shard.dropped.push_back(key.get<std::string>());
        }
        shard.omitted =
            item.contains("omitted") && item["omitted"].is_boolean() && item["omitted"].get<bool>();
        if (!shard.omitted) {
          E4KV_RETURN_IF_ERROR(read_digest_and_size(item, iwhere, shard.sha256, shard.bytes));
        }
        provenance.rewritten.push_back(std::move(shard));
      }
    }
  }
  return provenance;
}

// stat(2) of `path` (symlinks followed) as a problem text, or nullopt for an existing regular file.
// `what` names the file in the text ("base file config.json").
std::optional<std::string> regular_file_problem(const fs::path& path, const std::string& what,
                                                struct stat& st) {
  if (::stat(path.c_str(), &st) != 0) {
    const int error = errno;
    if (error == ENOENT) return cat(what, " is missing");
    return cat(what, " cannot be read: ", errno_message(error));
  }
  if (!S_ISREG(st.st_mode)) return cat(what, " is not a regular file");
  return std::nullopt;
}

// A JSON file the overlay wrote or recorded (the provenance's digest binds the base's index).
Result<Json> read_json_file(const fs::path& path) {
  E4KV_ASSIGN_OR_RETURN(std::string text, read_file(path));
  return parse_json(text, path.string());
}

// At most 60 characters of a JSON value for a message; "absent" for none.
std::string json_text(const Json* value) {
  if (value == nullptr) return "absent";
  return json_excerpt(*value, 60);
}

// The scales shard's tensors against the provenance's "scales": the same keys and, bit for bit,
// the same fp32 values.
void compare_recorded_scales(const SafetensorsFile& shard,
                             const std::map<std::string, float>& recorded,
                             std::vector<std::string>& problems) {
  std::vector<std::string> differences;
  std::set<std::string> seen;
  for (const SafetensorsTensor& tensor : shard.tensors()) {
    seen.insert(tensor.name);
    auto it = recorded.find(tensor.name);
    if (it == recorded.end()) {
      differences.push_back(cat(tensor.name, " is in ", kKvScalesShardName, " but not recorded"));
      continue;
    }
    if (tensor.dtype != DType::kF32 || tensor.bytes.size() != sizeof(float)) {
      differences.push_back(cat(tensor.name, " in ", kKvScalesShardName, " is not an F32 scalar"));
      continue;
    }
    float value = 0.0f;
    std::memcpy(&value, tensor.bytes.data(), sizeof(value));
    if (std::memcmp(&value, &it->second, sizeof(value)) != 0) {
      differences.push_back(cat(tensor.name, " = ", format_scale_value(it->second), " in ",
                                kProvenanceName, ", ", format_scale_value(value), " in ",
                                kKvScalesShardName));
    }
  }
  for (const auto& [key, value] : recorded) {
    if (seen.count(key) == 0) {
      differences.push_back(cat(key, " = ", format_scale_value(value), " is recorded but not in ",
                                kKvScalesShardName));
    }
  }
  if (!differences.empty()) {
    problems.push_back(cat(kProvenanceName, " \"scales\" and ", kKvScalesShardName,
                           " disagree: ", join_names(differences, 5)));
  }
}

// Everything of the merged index but its weight_map (checked tensor by tensor) against what
// make_overlay writes: the base index's other fields unchanged, and its metadata with total_size
// grown by the scales and shrunk by the embedded scales left out; for a single-file base,
// {"metadata": {"total_size": the bytes of every tensor}}.
void check_index_fields(const fs::path& dir, const fs::path& base, const Checkpoint& base_ckpt,
                        const std::set<std::string>& dropped, int64_t n_scales,
                        std::vector<std::string>& problems) {
  const std::string index_name(kSafetensorsIndexName);
  const uint64_t scale_bytes = sizeof(float) * static_cast<uint64_t>(n_scales);
  Json expected = Json::object();
  if (base_ckpt.sharded()) {
    Result<Json> base_index = read_json_file(base / kSafetensorsIndexName);
    if (!base_index.ok()) {
      problems.push_back(base_index.message());
      return;
    }
    expected = std::move(base_index).value();
    if (!expected.is_object()) {
      problems.push_back(cat("the base's ", index_name, " is not a JSON object"));
      return;
    }
    if (!expected.contains("metadata") || !expected["metadata"].is_object()) {
      expected["metadata"] = Json::object();
    }
    uint64_t dropped_bytes = 0;
    for (const std::string& name : dropped) {
      if (const SafetensorsTensor* tensor = base_ckpt.find(name)) {
        dropped_bytes += tensor->bytes.size();
      }
    }
    Json& metadata = expected["metadata"];
    if (auto total = metadata.find("total_size");
        total != metadata.end() && total->is_number_integer() && *total >= 0) {
      const uint64_t before = total->get<uint64_t>();
      *total = (before >= dropped_bytes ? before - dropped_bytes : 0) + scale_bytes;
    }
  } else {
    uint64_t total = scale_bytes;
    for (const std::string& name : base_ckpt.tensor_names()) {
      if (dropped.count(name) == 0) total += base_ckpt.find(name)->bytes.size();
    }
    expected["metadata"] = Json{{"total_size", total}};
  }
  expected.erase("weight_map");

  Result<Json> derived = read_json_file(dir / kSafetensorsIndexName);
  if (!derived.ok()) {
    problems.push_back(derived.message());
    return;
  }
  if (!derived->is_object()) {
    problems.push_back(cat(index_name, " is not a JSON object"));
    return;
  }
  derived->erase("weight_map");
  std::vector<std::string> differences;
  auto compare_objects = [&](const Json& have, const Json& want, const std::string& path) {
    std::set<std::string> keys;
    for (const auto& item : have.items()) keys.insert(item.key());
    for (const auto& item : want.items()) keys.insert(item.key());
    for (const std::string& key : keys) {
      auto h = have.find(key);
      auto w = want.find(key);
      const Json* have_value = h == have.end() ? nullptr : &*h;
      const Json* want_value = w == want.end() ? nullptr : &*w;
      if (have_value && want_value && *have_value == *want_value) continue;
      differences.push_back(cat(path, key, " is ", json_text(have_value), ", the overlay writes ",
                                json_text(want_value)));
    }
  };
  auto metadata = derived->find("metadata");
  if (metadata == derived->end() || !metadata->is_object()) {
    differences.push_back(cat("metadata is ",
                              json_text(metadata == derived->end() ? nullptr : &*metadata),
                              ", the overlay writes an object"));
  } else {
    compare_objects(*metadata, expected["metadata"], "metadata.");
  }
  derived->erase("metadata");
  expected.erase("metadata");
  compare_objects(*derived, expected, "");
  if (!differences.empty()) {
    problems.push_back(cat(
        index_name, " differs from the index the overlay writes: ", join_names(differences, 5)));
  }
}

}  // namespace

Result<VerifyResult> verify_overlay(const VerifyOptions& options) {
  const fs::path dir = options.dir;
  // 1. The start-up gate, exactly as the engine runs it.
  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(dir));
  VerifyResult result;
  E4KV_ASSIGN_OR_RETURN(result.scales,
                        load_kv_scales(ckpt, options.dtype, KvScalesMode::kCalibrated));

  // 2. The revision binding. An overlay is known by its provenance, by a base revision recorded in
  // a shard's metadata, or by its scales shard; without the provenance it fails.
  std::string recorded_revision;
  std::string recorded_in;
  for (const auto& shard : ckpt.shards()) {
    auto revision = shard->metadata().find(std::string(kBaseRevisionMetadataKey));
    if (revision == shard->metadata().end()) continue;
    recorded_revision = revision->second;
    recorded_in = fs::path(shard->source()).filename().string();
    break;
  }
  const fs::path provenance_path = dir / kProvenanceName;
  const std::string remedy = "; re-create the overlay from the current base with e4kv overlay";
  {
    struct stat st {};
    if (::lstat(provenance_path.c_str(), &st) != 0) {
      const int error = errno;
      if (error != ENOENT) {
        return Status::error(
            cat(provenance_path.string(), ": cannot read: ", errno_message(error)));
      }
      struct stat shard_st {};
      const bool has_scales_shard = ::lstat((dir / kKvScalesShardName).c_str(), &shard_st) == 0;
      if (!recorded_revision.empty() || has_scales_shard) {
        const std::string why = !recorded_revision.empty()
                                    ? cat(recorded_in, " records base revision ",
                                          short_digest(recorded_revision), "...")
                                    : cat("it holds ", kKvScalesShardName);
        return Status::error(cat(dir.string(), ": is an overlay (", why, ") but its ",
                                 kProvenanceName,
                                 " is missing, so its binding to the base cannot be checked",
                                 remedy, " BASE_DIR --scales scales.json --out NEW_DIR"));
      }
      result.notes.push_back(
          cat("provenance: not checked (no ", kProvenanceName,
              ": a plain checkpoint, its binding to a base revision is unknown)"));
      return result;
    }
  }
  E4KV_ASSIGN_OR_RETURN(Provenance provenance, read_provenance(provenance_path));
  result.provenance_checked = true;
  result.base_dir = provenance.base_dir;
  result.base_revision = provenance.revision;
  const fs::path base = provenance.base_dir;
  const std::string context = cat(dir.string(), ": does not match its base ", base.string(),
                                  " as recorded in ", kProvenanceName, ": ");
  {
    struct stat st {};
    if (::stat(base.c_str(), &st) != 0) {
      const int error = errno;
      return Status::error(cat(context, "the base directory ",
                               error == ENOENT ? std::string("is missing")
                                               : cat("cannot be read: ", errno_message(error)),
                               remedy));
    }
    if (!S_ISDIR(st.st_mode)) {
      return Status::error(cat(context, "the base is not a directory", remedy));
    }
  }

  std::vector<std::string> problems;
  std::map<std::string, const RewrittenShard*> rewritten;
  std::set<std::string> dropped;
  for (const RewrittenShard& shard : provenance.rewritten) {
    rewritten[shard.name] = &shard;
    dropped.insert(shard.dropped.begin(), shard.dropped.end());
  }
  // What to hash: each recorded base file, and the derived file standing in for it when it is not
  // the same file (a copy, or a shard written anew without embedded scales). Files recorded by
  // size only are compared by size. The derived index is the merged one and is checked
  // structurally below.
  struct Job {
    fs::path path;
    std::string label;
    std::string name;
    std::string expected;
    bool derived;
  };
  std::vector<Job> jobs;
  std::vector<std::string> hashed_names;
  std::vector<std::string> size_only_names;
  std::set<std::string> recorded_names;
  bool revision_recorded = false;
  auto size_changed = [](const std::string& what, uint64_t now, uint64_t recorded) {
    return cat(what, " changed size since the overlay was made (now ", now, " bytes, recorded ",
               recorded, ")");
  };
  for (const RecordedFile& file : provenance.files) {
    recorded_names.insert(file.name);
    if (file.name == provenance.revision_file) {
      revision_recorded = true;
      if (file.sha256 != provenance.revision) {
        problems.push_back(
            cat("the recorded digest of ", file.name, " differs from the recorded base revision"));
      }
    }
    const fs::path base_file = base / file.name;
    struct stat base_st {};
    if (auto problem = regular_file_problem(base_file, cat("base file ", file.name), base_st)) {
      problems.push_back(*problem);
      continue;
    }
    if (file.sha256) {
      jobs.push_back({base_file, file.name, file.name, *file.sha256, false});
      hashed_names.push_back(file.name);
    } else {
      size_only_names.push_back(file.name);
      if (file.bytes && static_cast<uint64_t>(base_st.st_size) != *file.bytes) {
        problems.push_back(size_changed(cat("base file ", file.name),
                                        static_cast<uint64_t>(base_st.st_size), *file.bytes));
      }
    }
    if (file.name == kSafetensorsIndexName) continue;
    const fs::path derived_file = dir / file.name;
    auto rewrite = rewritten.find(file.name);
    if (rewrite != rewritten.end()) {
      const RewrittenShard& shard = *rewrite->second;
      if (shard.omitted) continue;
      struct stat derived_st {};
      if (auto problem = regular_file_problem(
              derived_file, cat("derived file ", file.name, " (written without embedded scales)"),
              derived_st)) {
        problems.push_back(*problem);
      } else if (shard.sha256) {
        jobs.push_back({derived_file, cat(file.name, " (derived, rewritten)"), file.name,
                        *shard.sha256, true});
      } else if (shard.bytes && static_cast<uint64_t>(derived_st.st_size) != *shard.bytes) {
        problems.push_back(size_changed(cat("derived file ", file.name),
                                        static_cast<uint64_t>(derived_st.st_size), *shard.bytes));
      }
      continue;
    }
    struct stat derived_st {};
    if (auto problem = regular_file_problem(
            derived_file, cat("derived file ", file.name, " (a link to the base file)"),
            derived_st)) {
      problems.push_back(*problem);
      continue;
    }
    if (derived_st.st_dev == base_st.st_dev && derived_st.st_ino == base_st.st_ino) continue;
    if (file.sha256) {
      jobs.push_back(
          {derived_file, cat(file.name, " (derived copy)"), file.name, *file.sha256, true});
    } else if (derived_st.st_size != base_st.st_size) {
      problems.push_back(cat("derived file ", file.name,
                             " no longer matches the base file recorded (size now ",
                             derived_st.st_size, " bytes, base ", base_st.st_size, ")"));
    }
  }
  if (!revision_recorded) {
    problems.push_back(cat("the revision file ", provenance.revision_file, " is not recorded"));
  }
  // Every file the engine reads from the derived directory must be bound.
  for (std::string_view name : kEngineReadFiles) {
    if (recorded_names.count(std::string(name)) != 0) continue;
    struct stat st {};
    const int error = ::stat((dir / name).c_str(), &st) == 0 ? 0 : errno;
    if (error == 0) {
      problems.push_back(cat(name,
                             " is read by the engine but not recorded in the provenance (added "
                             "after the overlay was made, or an overlay made by an older e4kv)"));
    } else if (error != ENOENT) {
      problems.push_back(cat("derived file ", name, " cannot be read: ", errno_message(error)));
    }
  }
  for (const auto& shard : ckpt.shards()) {
    const std::string name = fs::path(shard->source()).filename().string();
    if (name == kKvScalesShardName || recorded_names.count(name) != 0) continue;
    problems.push_back(cat("shard ", name,
                           " is read by the engine but not recorded in the provenance (an "
                           "overlay made by an older e4kv, or a shard added since)"));
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
    if (digests[i] == job.expected) continue;
    problems.push_back(cat(job.derived ? "derived file " : "base file ", job.name,
                           job.derived ? " no longer matches the file recorded"
                                       : " changed since the overlay was made",
                           " (sha256 now ", short_digest(digests[i]), "..., recorded ",
                           short_digest(job.expected), "...)"));
  }

  // The scales shard: contract, revision, policy, negative-control marker, size and digest as
  // recorded, and exactly the scales the provenance records. The digest alone proves nothing
  // when whoever changed the shard also rewrote the digest; the recorded scales are checked too.
  const fs::path scales_shard = dir / kKvScalesShardName;
  const std::string shard_name(kKvScalesShardName);
  int64_t n_scale_tensors = 0;
  struct stat scales_st {};
  if (auto problem = regular_file_problem(scales_shard, shard_name, scales_st)) {
    problems.push_back(*problem);
  } else {
    Result<SafetensorsFile> shard = SafetensorsFile::open(scales_shard);
    if (!shard.ok()) {
      problems.push_back(shard.message());
    } else {
      n_scale_tensors = static_cast<int64_t>(shard->tensors().size());
      const auto& metadata = shard->metadata();
      auto contract = metadata.find(std::string(kContractMetadataKey));
      if (contract == metadata.end() || contract->second != kScalesFormat) {
        problems.push_back(
            cat(shard_name, " lacks the contract string \"", kScalesFormat, "\" in its metadata"));
      }
      auto revision = metadata.find(std::string(kBaseRevisionMetadataKey));
      if (revision == metadata.end() || revision->second != provenance.revision) {
        problems.push_back(cat(shard_name, " was made for another base revision (",
                               revision == metadata.end() ? "none" : revision->second, ")"));
      }
      auto revision_file = metadata.find("e4kv_base_revision_file");
      if (revision_file != metadata.end() && revision_file->second != provenance.revision_file) {
        problems.push_back(cat(shard_name, " names the revision file ", revision_file->second, ", ",
                               kProvenanceName, " ", provenance.revision_file));
      }
      auto policy = metadata.find(std::string(kPolicyMetadataKey));
      if (policy != metadata.end() && policy->second != provenance.policy) {
        problems.push_back(cat(shard_name, " records the policy \"", policy->second, "\", ",
                               kProvenanceName, " \"", provenance.policy, "\""));
      }
      if (is_negative_control_metadata(metadata) != provenance.negative_control) {
        problems.push_back(cat(shard_name, " and ", kProvenanceName,
                               " disagree on whether the scales are a negative control"));
      }
      compare_recorded_scales(*shard, provenance.scales, problems);
    }
    if (!provenance.scales_shard_sha256) {
      problems.push_back(cat(kProvenanceName, " records no sha256 for ", shard_name,
                             " (derived.scales_shard.sha256)"));
    } else {
      Result<std::string> digest = sha256_file(scales_shard);
      if (!digest.ok()) {
        problems.push_back(digest.message());
      } else if (*digest != *provenance.scales_shard_sha256) {
        problems.push_back(cat(shard_name, " changed since the overlay was made (sha256 now ",
                               short_digest(*digest), "..., recorded ",
                               short_digest(*provenance.scales_shard_sha256), "...)"));
      }
    }
    if (provenance.scales_shard_bytes &&
        static_cast<uint64_t>(scales_st.st_size) != *provenance.scales_shard_bytes) {
      problems.push_back(size_changed(shard_name, static_cast<uint64_t>(scales_st.st_size),
                                      *provenance.scales_shard_bytes));
    }
  }

  // The merged index: every base tensor where the base keeps it, and nothing else but scales.
  // Embedded scale keys the overlay replaced are absent, or a scale key of the scales shard.
  Result<Checkpoint> base_ckpt = Checkpoint::open(base);
  if (!base_ckpt.ok()) {
    problems.push_back(cat("the base no longer opens: ", base_ckpt.message()));
  } else {
    std::vector<std::string> wrong;
    for (const std::string& name : base_ckpt->tensor_names()) {
      const std::string derived_shard = ckpt.shard_of(name);
      if (dropped.count(name) != 0) {
        if (!derived_shard.empty() && derived_shard != kKvScalesShardName) {
          wrong.push_back(cat(name, " (replaced) is mapped to ", derived_shard));
        }
        continue;
      }
      if (derived_shard != base_ckpt->shard_of(name)) {
        wrong.push_back(cat(name, derived_shard.empty() ? " is not in the derived index"
                                                        : " is mapped to " + derived_shard));
      }
    }
    for (const std::string& name : ckpt.tensor_names()) {
      if (base_ckpt->find(name) != nullptr && dropped.count(name) == 0) continue;
      if (!parse_scale_key(name) || ckpt.shard_of(name) != kKvScalesShardName) {
        wrong.push_back(
            cat(name, " is not in the base and not a K/V scale in ", kKvScalesShardName));
      }
    }
    if (!wrong.empty()) {
      problems.push_back(cat("the derived index does not match the base: ", join_names(wrong, 5)));
    }
    check_index_fields(dir, base, *base_ckpt, dropped, n_scale_tensors, problems);
  }

  if (!problems.empty()) {
    std::string list;
    for (size_t i = 0; i < problems.size(); ++i) list += cat(i ? "; " : "", problems[i]);
    return Status::error(cat(context, list, remedy));
  }
  result.hashed_files = hashed_names;
  result.size_only_files = size_only_names;
  result.notes.push_back(cat("provenance: base ", base.string(), " revision ",
                             short_digest(provenance.revision), " (", provenance.revision_file,
                             "): ", result.n_hashed, " files hashed, all match (",
                             join_names(hashed_names), ")"));
  if (!size_only_names.empty()) {
    result.notes.push_back(cat("provenance: ", size_only_names.size(),
                               " files checked for existence and size only, not hashed (the "
                               "overlay was made by e4kv overlay --hash index-config): ",
                               join_names(size_only_names)));
  }
  if (!provenance.rewritten.empty()) {
    std::vector<std::string> names;
    for (const RewrittenShard& shard : provenance.rewritten) {
      names.push_back(cat(shard.name, shard.omitted ? " (omitted: only scales)" : ""));
    }
    result.notes.push_back(
        cat("provenance: ", dropped.size(),
            " K/V scale key(s) embedded in the base replaced "
            "(e4kv overlay --replace-embedded-scales); base shards written anew without "
            "them: ",
            join_names(names)));
  }
  // The scales file is not part of the overlay (its scales are in the scales shard, checked
  // above) and may since have been moved or rewritten: its digest is recomputed and reported.
  if (provenance.scales_file_path && provenance.scales_file_sha256) {
    const std::string& path = *provenance.scales_file_path;
    struct stat st {};
    if (regular_file_problem(path, path, st)) {
      result.notes.push_back(cat("provenance: the scales file ", path,
                                 " is gone or unreadable (not needed: the overlay holds its "
                                 "scales)"));
    } else if (Result<std::string> digest = sha256_file(path);
               digest.ok() && *digest == *provenance.scales_file_sha256) {
      result.notes.push_back(cat("provenance: the scales file ", path, " is unchanged"));
    } else {
      result.notes.push_back(cat("provenance: the scales file ", path,
                                 " changed since the overlay was made (not part of the overlay, "
                                 "whose scales match its provenance)"));
    }
  }
  if (provenance.negative_control) {
    result.notes.push_back(
        "NEGATIVE CONTROL: this overlay was made by e4kv overlay --unit-scale-negative-control; "
        "every K/V "
        "scale is 1.0 (unit scales, not calibrated): not for production use");
  }
  return result;
}

}  // namespace e4kv
