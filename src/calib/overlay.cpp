#include "calib/overlay.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <optional>
#include <span>
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
using OrderedJson = nlohmann::ordered_json;

constexpr std::string_view kTempMarker = ".e4kv-overlay-tmp.";

std::string errno_text(int error) {
  return std::strerror(error);
}

// The test hook described in overlay.h.
void crash_point(const char* name) {
  const char* at = std::getenv("E4KV_TEST_CRASH_AT");
  if (at != nullptr && std::strcmp(at, name) == 0) ::_exit(9);
}

// True when `inner` is `outer` or lies below it (both absolute and normalised).
bool path_within(const fs::path& inner, const fs::path& outer) {
  auto o = outer.begin();
  auto i = inner.begin();
  for (; o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

Result<std::string> read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(cat(path.string(), ": cannot open for reading"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::error(cat(path.string(), ": read failed"));
  return text.str();
}

Status sync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0)
    return Status::error(cat(path.string(), ": cannot open to sync: ", errno_text(errno)));
  const int synced = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (synced != 0) return Status::error(cat(path.string(), ": cannot sync: ", errno_text(error)));
  return ok_status();
}

// Writes `text` to a new file and syncs it (the file lives in the temporary directory, which is
// renamed as a whole, so no per-file rename is needed).
Status write_new_file(const fs::path& path, std::string_view text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::error(cat(path.string(), ": cannot create: ", errno_text(errno)));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      ::close(fd);
      return Status::error(cat(path.string(), ": write failed: ", errno_text(error)));
    }
    done += static_cast<size_t>(n);
  }
  const int synced = ::fsync(fd);
  const int error = errno;
  if (::close(fd) != 0 || synced != 0) {
    return Status::error(cat(path.string(), ": cannot sync: ", errno_text(error)));
  }
  return ok_status();
}

// The double whose shortest decimal form reads back as the same fp32 (see scales_file.cpp).
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

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

// Removes the temporary directory unless released.
class TempDirGuard {
 public:
  explicit TempDirGuard(fs::path path) : path_(std::move(path)) {}
  ~TempDirGuard() {
    if (path_.empty()) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDirGuard(const TempDirGuard&) = delete;
  TempDirGuard& operator=(const TempDirGuard&) = delete;
  void release() { path_.clear(); }

 private:
  fs::path path_;
};

// Removes `<parent>/.<name>.e4kv-overlay-tmp.<pid>` directories left by processes that no longer
// run (or by an earlier life of this pid).
std::vector<fs::path> remove_stale_temp_dirs(const fs::path& parent, const std::string& name) {
  std::vector<fs::path> removed;
  const std::string stem = cat(".", name, kTempMarker);
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(parent, ec)) {
    const std::string file = entry.path().filename().string();
    if (!file.starts_with(stem)) continue;
    const std::string digits = file.substr(stem.size());
    if (digits.empty() || digits.size() > 9 ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    const bool dead = pid == ::getpid() || (::kill(pid, 0) != 0 && errno == ESRCH);
    if (!dead) continue;  // another overlay run may be building it right now
    std::error_code remove_ec;
    fs::remove_all(entry.path(), remove_ec);
    if (!remove_ec) removed.push_back(entry.path());
  }
  return removed;
}

struct BaseFile {
  std::string name;  // relative to the base directory
  std::string role;  // "index" | "config" | "shard"
  uint64_t bytes = 0;
  std::string sha256;
};

Status link_entry(const fs::path& source, const fs::path& target, OverlayLinkMode mode);

// Hard links or copies every entry below `source` into the new directory `target`.
Status link_tree(const fs::path& source, const fs::path& target, OverlayLinkMode mode) {
  std::error_code ec;
  fs::create_directory(target, ec);
  if (ec) return Status::error(cat(target.string(), ": cannot create directory: ", ec.message()));
  ec.clear();
  for (const fs::directory_entry& entry : fs::directory_iterator(source, ec)) {
    E4KV_RETURN_IF_ERROR(link_entry(entry.path(), target / entry.path().filename(), mode));
  }
  if (ec) return Status::error(cat(source.string(), ": cannot list: ", ec.message()));
  return ok_status();
}

// One base entry into the derived directory. Symbolic links point at the base's own path (so an
// HF cache snapshot's links keep resolving); hard links and copies take the file the base's path
// resolves to (a hard link to a relative symbolic link would dangle).
Status link_entry(const fs::path& source, const fs::path& target, OverlayLinkMode mode) {
  std::error_code ec;
  if (mode == OverlayLinkMode::kSymlink) {
    fs::create_symlink(source, target, ec);
    if (ec) {
      return Status::error(cat(target.string(), ": cannot create a symbolic link to ",
                               source.string(), ": ", ec.message()));
    }
    return ok_status();
  }
  const fs::path resolved = fs::canonical(source, ec);
  if (ec) {
    return Status::error(cat(source.string(), ": cannot resolve (a broken symbolic link?): ",
                             ec.message(), "; fix the base or use --link symlink"));
  }
  const fs::file_status status = fs::status(resolved, ec);
  if (fs::is_directory(status)) return link_tree(resolved, target, mode);
  if (!fs::is_regular_file(status)) {
    return Status::error(cat(source.string(),
                             ": not a regular file or directory; remove it from the base or use "
                             "--link symlink"));
  }
  if (mode == OverlayLinkMode::kHardlink) {
    fs::create_hard_link(resolved, target, ec);
    if (ec) {
      return Status::error(cat(target.string(), ": cannot hard-link ", resolved.string(), ": ",
                               ec.message(),
                               ec == std::errc::cross_device_link
                                   ? "; the output must be on the base's filesystem for --link "
                                     "hardlink (use --link symlink or copy)"
                                   : ""));
    }
    return ok_status();
  }
  fs::copy_file(resolved, target, fs::copy_options::none, ec);
  if (ec) {
    return Status::error(
        cat(target.string(), ": cannot copy ", resolved.string(), ": ", ec.message()));
  }
  return sync_path(target, false);
}

}  // namespace

Result<std::vector<std::string>> hash_files(const std::vector<fs::path>& paths,
                                            const std::vector<std::string>& labels,
                                            const FilesProgress& progress) {
  E4KV_ASSERT(paths.size() == labels.size(), "hash_files: one label per path");
  uint64_t total = 0;
  for (const fs::path& path : paths) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    if (ec) {
      return Status::error(cat(path.string(), ": cannot read its size: ", ec.message()));
    }
    total += size;
  }
  std::vector<std::string> digests;
  uint64_t before = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    HashProgress file_progress;
    if (progress) {
      file_progress = [&, i](uint64_t done, uint64_t) {
        progress(labels[i], before + done, std::max(total, before + done));
      };
    }
    E4KV_ASSIGN_OR_RETURN(std::string digest, sha256_file(paths[i], file_progress));
    std::error_code ec;
    before += fs::file_size(paths[i], ec);
    digests.push_back(std::move(digest));
  }
  return digests;
}

Result<OverlayLinkMode> parse_overlay_link_mode(std::string_view name) {
  if (name == "symlink") return OverlayLinkMode::kSymlink;
  if (name == "hardlink") return OverlayLinkMode::kHardlink;
  if (name == "copy") return OverlayLinkMode::kCopy;
  return Status::error(
      cat("--link: unknown mode \"", name, "\"; expected symlink, hardlink or copy"));
}

std::string_view overlay_link_mode_name(OverlayLinkMode mode) {
  switch (mode) {
    case OverlayLinkMode::kSymlink:
      return "symlink";
    case OverlayLinkMode::kHardlink:
      return "hardlink";
    case OverlayLinkMode::kCopy:
      return "copy";
  }
  return "symlink";
}

Result<OverlayHashScope> parse_overlay_hash_scope(std::string_view name) {
  if (name == "all") return OverlayHashScope::kAll;
  if (name == "index-config") return OverlayHashScope::kIndexConfig;
  return Status::error(cat("--hash: unknown scope \"", name, "\"; expected all or index-config"));
}

std::string_view overlay_hash_scope_name(OverlayHashScope scope) {
  return scope == OverlayHashScope::kAll ? "all" : "index-config";
}

Result<OverlayResult> make_overlay(const OverlayOptions& options) {
  // ---- arguments and paths: nothing is created until every check below has passed --------------
  if (options.unit_scale_negative_control && !options.scales_path.empty()) {
    return Status::error(
        "--unit-scale-negative-control writes 1.0 for every scale and reads no scales file; pass "
        "either --scales or --unit-scale-negative-control, not both");
  }
  if (!options.unit_scale_negative_control && options.scales_path.empty()) {
    return Status::error(
        "--scales is required: the scales.json made by e4kv summarize (or pass "
        "--unit-scale-negative-control for a deliberate 1.0 negative control)");
  }
  std::error_code ec;
  const fs::path base_arg = options.base_dir;
  if (!fs::exists(base_arg, ec)) {
    return Status::error(cat(base_arg.string(), ": base checkpoint directory not found"));
  }
  if (!fs::is_directory(base_arg, ec)) {
    return Status::error(cat(base_arg.string(), ": the base is not a directory"));
  }
  const fs::path base = fs::canonical(base_arg, ec);
  if (ec) return Status::error(cat(base_arg.string(), ": cannot resolve: ", ec.message()));

  if (options.out_dir.empty()) return Status::error("--out is required: the derived directory");
  fs::path out_abs = fs::absolute(options.out_dir, ec).lexically_normal();
  if (!out_abs.has_filename()) out_abs = out_abs.parent_path();  // "dir/" -> "dir"
  const std::string out_arg = options.out_dir.string();
  if (!out_abs.has_filename() || out_abs.filename() == "." || out_abs.filename() == "..") {
    return Status::error(cat("--out ", out_arg, ": names no directory"));
  }
  const fs::path parent_arg = out_abs.parent_path();
  if (!fs::is_directory(parent_arg, ec)) {
    return Status::error(cat("--out ", out_arg, ": the parent directory ", parent_arg.string(),
                             " does not exist; create it first"));
  }
  const fs::path parent = fs::canonical(parent_arg, ec);
  if (ec) return Status::error(cat(parent_arg.string(), ": cannot resolve: ", ec.message()));
  const std::string out_name = out_abs.filename().string();
  fs::path out = parent / out_name;
  const fs::file_status out_link_status = fs::symlink_status(out, ec);
  if (fs::is_symlink(out_link_status)) {
    return Status::error(
        cat("--out ", out_arg, ": is a symbolic link; give the real path of a new directory"));
  }
  if (out == base) {
    return Status::error(cat("--out ", out_arg, ": is the base directory ", base.string(),
                             "; an overlay never writes into its base, choose a new directory"));
  }
  if (path_within(out, base)) {
    return Status::error(cat("--out ", out_arg, ": lies inside the base directory ", base.string(),
                             "; an overlay never writes into its base, choose a "
                             "directory outside it"));
  }
  if (path_within(base, out)) {
    return Status::error(cat("--out ", out_arg, ": contains the base directory ", base.string(),
                             "; choose a new directory"));
  }
  if (fs::exists(out_link_status)) {
    if (!fs::is_directory(out_link_status)) {
      return Status::error(cat("--out ", out_arg, ": exists and is not a directory"));
    }
    if (!fs::is_empty(out, ec)) {
      return Status::error(
          cat("--out ", out_arg, ": exists and is not empty; choose a new directory or remove it"));
    }
  }

  // ---- the base checkpoint ----------------------------------------------------------------------
  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(base));
  const ModelConfig& config = ckpt.config();
  if (config.kv_cache_layers().empty()) {
    return Status::error(
        cat(base.string(), ": the model has no layer with a KV cache, so it takes no K/V scales"));
  }
  for (std::string_view reserved : {kKvScalesShardName, kProvenanceName}) {
    if (fs::exists(fs::symlink_status(base / reserved, ec))) {
      return Status::error(cat(base.string(), ": already holds ", reserved,
                               ", so it is an overlay itself; make the overlay from the original "
                               "base checkpoint"));
    }
  }
  const std::vector<std::string> names = ckpt.tensor_names();
  std::vector<std::string> collisions;
  for (const std::string& name : names) {
    if (parse_scale_key(name)) collisions.push_back(cat(name, " (in ", ckpt.shard_of(name), ")"));
  }
  if (!collisions.empty()) {
    constexpr size_t kListed = 8;
    std::string list;
    for (size_t i = 0; i < collisions.size() && i < kListed; ++i) {
      list += cat(i ? ", " : "", collisions[i]);
    }
    if (collisions.size() > kListed) list += cat(" and ", collisions.size() - kListed, " more");
    return Status::error(cat(base.string(), ": the base already holds ", collisions.size(),
                             " K/V scale key(s): ", list,
                             "; an overlay would collide with them (two keys for one scale); "
                             "use a base checkpoint without K/V scales"));
  }

  // ---- the scales, through the same gate start-up will run --------------------------------------
  const std::string prefix = kv_scale_prefix(names);
  ScalesFile scales_file;
  std::string scales_sha256;
  fs::path scales_abs;
  if (options.unit_scale_negative_control) {
    scales_file.policy = std::string(kUnitNegativeControlPolicy);
    scales_file.source_json = OrderedJson{{"negative_control", true},
                                          {"note",
                                           "every K/V scale is 1.0 by "
                                           "--unit-scale-negative-control; not calibrated"}}
                                  .dump();
    KvScaleGate probe(config, prefix, KvCacheDtype::kE4m3, {});
    for (const std::string& key : probe.expected_keys()) scales_file.scales[key] = 1.0f;
  } else {
    scales_abs = fs::absolute(options.scales_path, ec).lexically_normal();
    if (!fs::is_regular_file(scales_abs, ec)) {
      return Status::error(cat("--scales ", options.scales_path.string(),
                               ": not found (or not a regular file); make it with e4kv summarize "
                               "STATS... --out scales.json"));
    }
    E4KV_ASSIGN_OR_RETURN(std::string text, read_text(scales_abs));
    E4KV_ASSIGN_OR_RETURN(scales_file, parse_scales_file(text, options.scales_path.string()));
    scales_sha256 = sha256_hex(text);
  }
  // The tensors model-kvscales.safetensors will hold, in (layer, K, V) order.
  std::vector<std::pair<std::string, float>> entries;
  {
    KvScaleGate order(config, prefix, KvCacheDtype::kE4m3, {});
    for (const std::string& key : order.expected_keys()) {
      auto it = scales_file.scales.find(key);
      if (it != scales_file.scales.end()) entries.emplace_back(key, it->second);
    }
    for (const auto& [key, value] : scales_file.scales) {
      if (std::none_of(entries.begin(), entries.end(),
                       [&](const auto& e) { return e.first == key; })) {
        entries.emplace_back(key, value);  // stray keys: the gate below names them
      }
    }
  }
  {
    const std::string source = options.unit_scale_negative_control ? "--unit-scale-negative-control"
                                                                   : options.scales_path.string();
    KvScaleGate gate(config, prefix, KvCacheDtype::kE4m3,
                     {cat(source, " for base ", base.string()),
                      cat("make complete scales: e4kv summarize STATS... --out scales.json with "
                          "statistics of every KV-cache layer of this model (layer prefix \"",
                          prefix, "\")")});
    for (const auto& [key, value] : entries) {
      SafetensorsTensor tensor;
      tensor.name = key;
      tensor.dtype = DType::kF32;
      tensor.bytes = std::as_bytes(std::span<const float>(&value, 1));
      tensor.end = 4;
      gate.load(key, tensor);
    }
    E4KV_ASSIGN_OR_RETURN(KvScales checked, gate.finalize());
    (void)checked;
  }

  // ---- hash the base (before anything is created, so a long hash can be interrupted safely) -----
  std::vector<BaseFile> base_files;
  const bool sharded = ckpt.sharded();
  const std::string revision_file =
      std::string(sharded ? kSafetensorsIndexName : kSingleSafetensorsName);
  base_files.push_back({revision_file, sharded ? "index" : "shard"});
  base_files.push_back({"config.json", "config"});
  if (sharded && options.hash == OverlayHashScope::kAll) {
    std::vector<std::string> shard_names;
    for (const std::string& name : names) {
      std::string shard = ckpt.shard_of(name);
      if (std::find(shard_names.begin(), shard_names.end(), shard) == shard_names.end()) {
        shard_names.push_back(std::move(shard));
      }
    }
    std::sort(shard_names.begin(), shard_names.end());
    for (std::string& shard : shard_names) base_files.push_back({std::move(shard), "shard"});
  }
  std::vector<fs::path> hash_paths;
  std::vector<std::string> hash_labels;
  for (BaseFile& file : base_files) {
    hash_paths.push_back(base / file.name);
    hash_labels.push_back(file.name);
    file.bytes = fs::file_size(base / file.name, ec);
    if (ec) return Status::error(cat((base / file.name).string(), ": ", ec.message()));
  }
  E4KV_ASSIGN_OR_RETURN(std::vector<std::string> digests,
                        hash_files(hash_paths, hash_labels, options.progress));
  OverlayResult result;
  for (size_t i = 0; i < base_files.size(); ++i) {
    base_files[i].sha256 = digests[i];
    result.hashed_bytes += base_files[i].bytes;
  }
  result.n_hashed = static_cast<int64_t>(base_files.size());
  result.base_revision = base_files[0].sha256;
  result.revision_file = revision_file;
  result.policy = scales_file.policy;
  result.n_scales = static_cast<int64_t>(entries.size());

  // ---- build in a temporary directory beside the output -----------------------------------------
  result.removed_stale = remove_stale_temp_dirs(parent, out_name);
  const fs::path temp = parent / cat(".", out_name, kTempMarker, ::getpid());
  if (::mkdir(temp.c_str(), 0755) != 0) {
    return Status::error(
        cat(temp.string(), ": cannot create the temporary directory: ", errno_text(errno)));
  }
  TempDirGuard guard(temp);
  crash_point("after-temp-dir");

  std::error_code list_ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(base, list_ec)) {
    const std::string name = entry.path().filename().string();
    if (name == kSafetensorsIndexName) continue;  // replaced by the merged index
    E4KV_RETURN_IF_ERROR(link_entry(base / name, temp / name, options.link));
    ++result.n_linked;
  }
  if (list_ec) return Status::error(cat(base.string(), ": cannot list: ", list_ec.message()));
  crash_point("after-links");

  std::vector<float> values;
  values.reserve(entries.size());
  for (const auto& [key, value] : entries) values.push_back(value);
  std::vector<SafetensorsWriteTensor> tensors;
  for (size_t i = 0; i < entries.size(); ++i) {
    tensors.push_back(
        {entries[i].first, DType::kF32, {}, std::as_bytes(std::span<const float>(&values[i], 1))});
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},  // what Hugging Face loaders expect of a PyTorch checkpoint's shard
      {std::string(kContractMetadataKey), kScalesFormat},
      {std::string(kBaseRevisionMetadataKey), result.base_revision},
      {"e4kv_base_revision_file", revision_file},
      {"e4kv_policy", scales_file.policy},
  };
  const fs::path scales_shard = temp / kKvScalesShardName;
  E4KV_RETURN_IF_ERROR(write_safetensors(scales_shard, tensors, metadata));
  crash_point("after-scales");

  // Merged index: the base's (metadata kept, total_size grown) or a new one for a single file.
  OrderedJson index;
  Json weight_map = Json::object();  // sorted by tensor name, as Hugging Face writes it
  const uint64_t scale_bytes = 4 * entries.size();
  if (sharded) {
    E4KV_ASSIGN_OR_RETURN(std::string text, read_text(base / kSafetensorsIndexName));
    try {
      index = OrderedJson::parse(text);
    } catch (const OrderedJson::parse_error& e) {
      return Status::error(
          cat((base / kSafetensorsIndexName).string(), ": invalid JSON: ", e.what()));
    }
    for (const auto& [name, shard] : index["weight_map"].items()) weight_map[name] = shard;
    if (!index.contains("metadata") || !index["metadata"].is_object()) {
      index["metadata"] = OrderedJson::object();
    }
    OrderedJson& metadata_object = index["metadata"];
    if (auto total = metadata_object.find("total_size");
        total != metadata_object.end() && total->is_number_integer() && *total >= 0) {
      *total = total->get<uint64_t>() + scale_bytes;
    }
  } else {
    uint64_t total = scale_bytes;
    for (const std::string& name : names) {
      weight_map[name] = std::string(kSingleSafetensorsName);
      total += ckpt.find(name)->bytes.size();
    }
    index["metadata"] = OrderedJson{{"total_size", total}};
  }
  for (const auto& [key, value] : entries) weight_map[key] = std::string(kKvScalesShardName);
  index["weight_map"] = weight_map;
  E4KV_RETURN_IF_ERROR(write_new_file(temp / kSafetensorsIndexName, index.dump(2) + "\n"));
  crash_point("after-index");

  // Provenance.
  E4KV_ASSIGN_OR_RETURN(std::string scales_shard_sha256, sha256_file(scales_shard));
  OrderedJson provenance;
  provenance["format"] = kProvenanceFormat;
  provenance["tool"] = {{"name", "e4kv"}, {"version", E4KV_VERSION}};
  provenance["created_utc"] = utc_now();
  provenance["kv_cache_dtype"] = "fp8_e4m3";
  provenance["policy"] = scales_file.policy;
  provenance["negative_control"] = options.unit_scale_negative_control;
  if (options.unit_scale_negative_control) {
    provenance["scales_file"] = nullptr;
  } else {
    provenance["scales_file"] = {{"path", scales_abs.string()}, {"sha256", scales_sha256}};
  }
  provenance["source"] = OrderedJson::parse(scales_file.source_json);
  OrderedJson scale_values = OrderedJson::object();
  for (const auto& [key, value] : entries) scale_values[key] = json_number_for(value);
  provenance["scales"] = std::move(scale_values);
  provenance["link_mode"] = overlay_link_mode_name(options.link);
  provenance["hash_scope"] = overlay_hash_scope_name(options.hash);
  OrderedJson files = OrderedJson::array();
  for (const BaseFile& file : base_files) {
    files.push_back(
        {{"file", file.name}, {"role", file.role}, {"bytes", file.bytes}, {"sha256", file.sha256}});
  }
  provenance["base"] = {{"dir", base.string()},
                        {"revision", result.base_revision},
                        {"revision_file", revision_file},
                        {"files", std::move(files)}};
  provenance["derived"] = {{"scales_shard",
                            {{"file", kKvScalesShardName},
                             {"bytes", fs::file_size(scales_shard, ec)},
                             {"sha256", scales_shard_sha256}}}};
  E4KV_RETURN_IF_ERROR(write_new_file(temp / kProvenanceName, provenance.dump(2) + "\n"));
  crash_point("after-provenance");
  E4KV_RETURN_IF_ERROR(sync_path(temp, true));

  // The derived directory must pass the gate exactly as engine start-up runs it.
  {
    E4KV_ASSIGN_OR_RETURN(Checkpoint derived, Checkpoint::open(temp));
    E4KV_ASSIGN_OR_RETURN(result.scales,
                          load_kv_scales(derived, KvCacheDtype::kE4m3, KvScalesMode::kCalibrated));
  }
  crash_point("before-rename");

  // rename(2) is atomic and replaces an empty directory; a non-empty one (something appeared since
  // the check above) is refused by the kernel.
  if (::rename(temp.c_str(), out.c_str()) != 0) {
    const int error = errno;
    return Status::error(cat("--out ", out_arg, ": cannot move ", temp.string(),
                             " into place: ", errno_text(error),
                             error == ENOTEMPTY || error == EEXIST
                                 ? " (the output appeared or filled up meanwhile; choose a new "
                                   "directory)"
                                 : ""));
  }
  guard.release();
  E4KV_RETURN_IF_ERROR(sync_path(parent, true));
  result.out_dir = out;
  return result;
}

HashProgressBar::~HashProgressBar() {
  if (drawn_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

void HashProgressBar::update(const std::string& file, uint64_t done, uint64_t total) {
  const int permille = total == 0 ? 1000 : static_cast<int>(done * 1000 / total);
  if (permille == last_permille_ && file == last_file_) return;
  last_permille_ = permille;
  last_file_ = file;
  constexpr int kWidth = 30;
  const int filled = permille * kWidth / 1000;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, ' ');
  std::string shown = file;
  if (shown.size() > 40) shown = "..." + shown.substr(shown.size() - 37);
  std::fprintf(out_, "\rhashing [%s] %5.1f%% %8.2f / %.2f GiB  %-40s", bar.c_str(), permille / 10.0,
               static_cast<double>(done) / (1u << 30), static_cast<double>(total) / (1u << 30),
               shown.c_str());
  std::fflush(out_);
  drawn_ = true;
}

}  // namespace e4kv
