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
#include <set>
#include <span>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "calib/scales_file.h"
#include "core/file_io.h"
#include "core/json.h"
#include "core/output_set.h"
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
  return errno_message(error);
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
  std::string role;  // "index" | "config" | "generation" | "tokenizer" | "shard"
  uint64_t bytes = 0;
  bool hashed = true;  // false: recorded by size only (--hash index-config)
  std::string sha256;
};

// The text of a std::error_code from the filesystem library, as errno_message writes it.
std::string ec_text(const std::error_code& ec) {
  if (ec.category() == std::generic_category() || ec.category() == std::system_category()) {
    return errno_message(ec.value());
  }
  return ec.message();
}

// The walk of the base for --link hardlink and copy (the rules are at the top of overlay.h).
struct LinkWalk {
  fs::path base;     // canonical
  fs::path derived;  // the temporary directory
  OverlayLinkMode mode = OverlayLinkMode::kCopy;
  // Checks only, creating nothing: make_overlay walks once so before it creates anything (a refused
  // link leaves no trace), then again to link.
  bool dry_run = false;
  std::set<std::pair<dev_t, ino_t>> walked;  // directories entered
};

std::string mode_text(OverlayLinkMode mode) {
  return cat("the ", overlay_link_mode_name(mode), " link mode");
}

// Hard-links or copies the regular file `file` (already resolved) to `target`.
Status link_file(const LinkWalk& walk, const fs::path& file, const fs::path& target) {
  if (walk.dry_run) return ok_status();
  const OverlayLinkMode mode = walk.mode;
  std::error_code ec;
  if (mode == OverlayLinkMode::kHardlink) {
    fs::create_hard_link(file, target, ec);
    if (ec == std::errc::cross_device_link) {
      return Status::option_error(
          "link", cat(target.string(), ": cannot hard-link ", file.string(), ": ", ec_text(ec),
                      "; the output must be on the base's filesystem for the hardlink mode (use "
                      "symlink or copy)"));
    }
    if (ec) {
      return Status::error(
          cat(target.string(), ": cannot hard-link ", file.string(), ": ", ec_text(ec)));
    }
    return ok_status();
  }
  fs::copy_file(file, target, fs::copy_options::none, ec);
  if (ec) {
    return Status::error(cat(target.string(), ": cannot copy ", file.string(), ": ", ec_text(ec)));
  }
  return sync_path(target, false);
}

Status link_walk_entry(LinkWalk& walk, const fs::path& rel);

// A real directory of the base: recreated and walked, once.
Status link_walk_directory(LinkWalk& walk, const fs::path& rel, const struct stat& st) {
  const fs::path source = walk.base / rel;
  if (!walk.walked.emplace(st.st_dev, st.st_ino).second) {
    return Status::option_error(
        "link", cat(source.string(),
                    ": this directory is reached a second time (a bind mount loop?); remove the "
                    "loop from the base or use the symlink mode"));
  }
  const fs::path target = walk.derived / rel;
  if (!walk.dry_run && ::mkdir(target.c_str(), 0755) != 0) {
    return Status::error(cat(target.string(), ": cannot create directory: ", errno_text(errno)));
  }
  std::error_code ec;
  fs::directory_iterator it(source, ec);
  if (ec) return Status::error(cat(source.string(), ": cannot list: ", ec_text(ec)));
  std::vector<fs::path> names;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    names.push_back(it->path().filename());
  }
  if (ec) return Status::error(cat(source.string(), ": cannot list: ", ec_text(ec)));
  for (const fs::path& name : names) E4KV_RETURN_IF_ERROR(link_walk_entry(walk, rel / name));
  return ok_status();
}

// A symbolic link of the base that points at a directory: never descended.
Status link_walk_directory_link(LinkWalk& walk, const fs::path& rel) {
  const fs::path source = walk.base / rel;
  std::error_code ec;
  const fs::path resolved = fs::canonical(source, ec);
  if (ec) {
    return Status::error(
        cat(source.string(), ": a symbolic link that cannot be resolved: ", ec_text(ec)));
  }
  if (!path_within(resolved, walk.base)) {
    return Status::option_error(
        "link", cat(source.string(), ": a symbolic link to the directory ", resolved.string(),
                    ", outside the base ", walk.base.string(), "; ", mode_text(walk.mode),
                    " never follows a directory link out of the base (it could copy anything, or "
                    "loop); remove the link from the base or use the symlink mode"));
  }
  if (walk.dry_run) return ok_status();
  // The same place in the derived tree, relative to the link's own folder there.
  const fs::path target = walk.derived / rel;
  const fs::path rel_target = resolved.lexically_relative(walk.base);
  const fs::path inside =
      rel_target.empty() || rel_target == "." ? walk.derived : walk.derived / rel_target;
  fs::path text = inside.lexically_relative(target.parent_path());
  if (text.empty()) text = ".";
  fs::create_directory_symlink(text, target, ec);
  if (ec) {
    return Status::error(cat(target.string(), ": cannot create a symbolic link to ", text.string(),
                             ": ", ec_text(ec)));
  }
  return ok_status();
}

// One base entry (relative path `rel`) into the derived tree, hardlink or copy mode.
Status link_walk_entry(LinkWalk& walk, const fs::path& rel) {
  const fs::path source = walk.base / rel;
  struct stat link_st {};
  if (::lstat(source.c_str(), &link_st) != 0) {
    return Status::error(cat(source.string(), ": cannot read: ", errno_text(errno)));
  }
  if (S_ISDIR(link_st.st_mode)) return link_walk_directory(walk, rel, link_st);
  if (S_ISREG(link_st.st_mode)) return link_file(walk, source, walk.derived / rel);
  if (!S_ISLNK(link_st.st_mode)) {
    return Status::option_error(
        "link", cat(source.string(),
                    ": not a regular file, directory or symbolic link; remove it from the base "
                    "or use the symlink mode"));
  }
  struct stat st {};
  if (::stat(source.c_str(), &st) != 0) {
    const int error = errno;
    return Status::option_error(
        "link", cat(source.string(), ": a symbolic link that cannot be followed: ",
                    errno_text(error), "; fix or remove it in the base, or use the symlink mode"));
  }
  if (S_ISDIR(st.st_mode)) return link_walk_directory_link(walk, rel);
  if (!S_ISREG(st.st_mode)) {
    return Status::option_error(
        "link", cat(source.string(),
                    ": a symbolic link to something that is not a regular file or directory; "
                    "remove it from the base or use the symlink mode"));
  }
  // A link to a regular file: the file the engine reads through the base, wherever it lies.
  std::error_code ec;
  const fs::path resolved = fs::canonical(source, ec);
  if (ec) {
    return Status::error(
        cat(source.string(), ": a symbolic link that cannot be resolved: ", ec_text(ec)));
  }
  return link_file(walk, resolved, walk.derived / rel);
}

// One top-level base entry into the derived directory. Symbolic links point at the base's own path
// (so an HF cache snapshot's links keep resolving); hard links and copies walk the base as
// described at the top of overlay.h.
Status link_entry(LinkWalk& walk, const std::string& name) {
  if (walk.mode == OverlayLinkMode::kSymlink) {
    if (walk.dry_run) return ok_status();
    std::error_code ec;
    const fs::path source = walk.base / name;
    const fs::path target = walk.derived / name;
    fs::create_symlink(source, target, ec);
    if (ec) {
      return Status::error(cat(target.string(), ": cannot create a symbolic link to ",
                               source.string(), ": ", ec_text(ec)));
    }
    return ok_status();
  }
  return link_walk_entry(walk, fs::path(name));
}

// Whether `path` exists (symlinks followed): false for ENOENT; an error with the real errno for
// anything else that stops stat(2) (permission denied, a symbolic link loop).
Result<bool> file_exists(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      return Status::error(cat(path.string(), ": not a regular file"));
    }
    return true;
  }
  const int error = errno;
  if (error == ENOENT) return false;
  return Status::error(cat(path.string(), ": cannot read: ", errno_text(error)));
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
  return Status::option_error(
      "link", cat("unknown mode \"", name, "\"; expected symlink, hardlink or copy"));
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
  return Status::option_error("hash",
                              cat("unknown scope \"", name, "\"; expected all or index-config"));
}

std::string_view overlay_hash_scope_name(OverlayHashScope scope) {
  return scope == OverlayHashScope::kAll ? "all" : "index-config";
}

Result<OverlayResult> make_overlay(const OverlayOptions& options) {
  // ---- arguments and paths: nothing is created until every check below has passed --------------
  if (options.unit_scale_negative_control && !options.scales_path.empty()) {
    return Status::option_error(
        "unit_scale_negative_control",
        "writes 1.0 for every scale and reads no scales file; give either a scales file or the "
        "negative control, not both");
  }
  if (!options.unit_scale_negative_control && options.scales_path.empty()) {
    return Status::option_error(
        "scales_path",
        "is required: the scales.json made by e4kv summarize (or ask for the unit-scale negative "
        "control, a deliberate 1.0 for every scale)");
  }
  std::error_code ec;
  const fs::path base_arg = options.base_dir;
  {
    struct stat st {};
    if (::stat(base_arg.c_str(), &st) != 0) {
      const int error = errno;
      if (error == ENOENT) {
        return Status::error(cat(base_arg.string(), ": base checkpoint directory not found"));
      }
      return Status::error(cat(base_arg.string(),
                               ": cannot open the base checkpoint directory: ", errno_text(error)));
    }
    if (!S_ISDIR(st.st_mode)) {
      return Status::error(cat(base_arg.string(), ": the base is not a directory"));
    }
  }
  const fs::path base = fs::canonical(base_arg, ec);
  if (ec) return Status::error(cat(base_arg.string(), ": cannot resolve: ", ec_text(ec)));

  if (options.out_dir.empty()) {
    return Status::option_error("out_dir", "is required: the derived directory");
  }
  if (Status root = check_not_in_root(options.out_dir); !root.ok()) {
    return Status::option_error("out_dir", root.message());
  }
  fs::path out_abs = fs::absolute(options.out_dir, ec).lexically_normal();
  if (!out_abs.has_filename()) out_abs = out_abs.parent_path();  // "dir/" -> "dir"
  const std::string out_arg = options.out_dir.string();
  if (!out_abs.has_filename() || out_abs.filename() == "." || out_abs.filename() == "..") {
    return Status::option_error("out_dir", cat(out_arg, ": names no directory"));
  }
  const fs::path parent_arg = out_abs.parent_path();
  {
    struct stat st {};
    if (::stat(parent_arg.c_str(), &st) != 0) {
      const int error = errno;
      if (error == ENOENT) {
        return Status::option_error("out_dir",
                                    cat(out_arg, ": the parent directory ", parent_arg.string(),
                                        " does not exist; create it first"));
      }
      return Status::option_error("out_dir", cat(out_arg, ": cannot use the parent directory ",
                                                 parent_arg.string(), ": ", errno_text(error)));
    }
    if (!S_ISDIR(st.st_mode)) {
      return Status::option_error(
          "out_dir", cat(out_arg, ": the parent ", parent_arg.string(), " is not a directory"));
    }
  }
  const fs::path parent = fs::canonical(parent_arg, ec);
  if (ec) return Status::error(cat(parent_arg.string(), ": cannot resolve: ", ec_text(ec)));
  const std::string out_name = out_abs.filename().string();
  fs::path out = parent / out_name;
  const fs::file_status out_link_status = fs::symlink_status(out, ec);
  if (fs::is_symlink(out_link_status)) {
    return Status::option_error(
        "out_dir", cat(out_arg, ": is a symbolic link; give the real path of a new directory"));
  }
  if (out == base) {
    return Status::option_error(
        "out_dir", cat(out_arg, ": is the base directory ", base.string(),
                       "; an overlay never writes into its base, choose a new directory"));
  }
  if (path_within(out, base)) {
    return Status::option_error("out_dir",
                                cat(out_arg, ": lies inside the base directory ", base.string(),
                                    "; an overlay never writes into its base, choose a "
                                    "directory outside it"));
  }
  if (path_within(base, out)) {
    return Status::option_error("out_dir", cat(out_arg, ": contains the base directory ",
                                               base.string(), "; choose a new directory"));
  }
  if (fs::exists(out_link_status)) {
    if (!fs::is_directory(out_link_status)) {
      return Status::option_error("out_dir", cat(out_arg, ": exists and is not a directory"));
    }
    const bool empty = fs::is_empty(out, ec);
    if (ec) return Status::option_error("out_dir", cat(out_arg, ": cannot list: ", ec_text(ec)));
    if (!empty) {
      return Status::option_error(
          "out_dir",
          cat(out_arg, ": exists and is not empty; choose a new directory or remove it"));
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
  // Scale keys the base holds, by the shard holding them (replace_embedded_scales drops them).
  std::map<std::string, std::vector<std::string>> embedded_by_shard;
  std::set<std::string> embedded;
  for (const std::string& name : names) {
    if (!parse_scale_key(name)) continue;
    collisions.push_back(cat(name, " (in ", ckpt.shard_of(name), ")"));
    embedded_by_shard[ckpt.shard_of(name)].push_back(name);
    embedded.insert(name);
  }
  if (!collisions.empty() && !options.replace_embedded_scales) {
    constexpr size_t kListed = 8;
    std::string list;
    for (size_t i = 0; i < collisions.size() && i < kListed; ++i) {
      list += cat(i ? ", " : "", collisions[i]);
    }
    if (collisions.size() > kListed) list += cat(" and ", collisions.size() - kListed, " more");
    return Status::option_error(
        "replace_embedded_scales",
        cat(base.string(), ": the base already holds ", collisions.size(),
            " K/V scale key(s): ", list,
            "; an overlay would collide with them (two keys for one scale); to replace them with "
            "your scales, set this option (the shards holding them are written anew into the "
            "derived directory without them; the base is not touched)"));
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
                                           "every K/V scale is 1.0 (the unit-scale negative "
                                           "control); not calibrated"}}
                                  .dump();
    KvScaleGate probe(config, prefix, KvCacheDtype::kE4m3, {});
    for (const std::string& key : probe.expected_keys()) scales_file.scales[key] = 1.0f;
  } else {
    scales_abs = fs::absolute(options.scales_path, ec).lexically_normal();
    struct stat st {};
    if (::stat(options.scales_path.c_str(), &st) != 0 && errno == ENOENT) {
      return Status::option_error("scales_path",
                                  cat(options.scales_path.string(),
                                      ": not found; make it with e4kv summarize STATS... --out "
                                      "scales.json --report report"));
    }
    Result<std::string> read = read_file(options.scales_path);
    if (!read.ok()) return Status::option_error("scales_path", read.message());
    const std::string text = std::move(read).value();
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
    const std::string source = options.unit_scale_negative_control
                                   ? std::string("the unit-scale negative control")
                                   : options.scales_path.string();
    KvScaleGate gate(config, prefix, KvCacheDtype::kE4m3,
                     {cat(source, " for base ", base.string()),
                      cat("make complete scales: e4kv summarize STATS... --out scales.json "
                          "--report report with "
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

  OverlayResult result;
  // ---- how base entries will enter the derived directory: checked before anything is created -
  const fs::path temp = parent / cat(".", out_name, kTempMarker, ::getpid());
  LinkWalk walk;
  walk.base = base;
  walk.derived = temp;  // not created yet: the dry run below writes nothing
  walk.mode = options.link;
  std::vector<std::string> top_level;
  {
    std::error_code list_ec;
    fs::directory_iterator it(base, list_ec);
    for (; !list_ec && it != fs::directory_iterator(); it.increment(list_ec)) {
      top_level.push_back(it->path().filename().string());
    }
    if (list_ec) return Status::error(cat(base.string(), ": cannot list: ", ec_text(list_ec)));
  }
  std::sort(top_level.begin(), top_level.end());
  auto link_all = [&](bool dry_run) -> Status {
    walk.dry_run = dry_run;
    walk.walked.clear();
    struct stat st {};
    if (::stat(base.c_str(), &st) == 0) walk.walked.emplace(st.st_dev, st.st_ino);
    int64_t linked = 0;
    for (const std::string& name : top_level) {
      if (name == kSafetensorsIndexName) continue;       // replaced by the merged index
      if (embedded_by_shard.count(name) != 0) continue;  // written anew below
      E4KV_RETURN_IF_ERROR(link_entry(walk, name));
      ++linked;
    }
    result.n_linked = linked;
    return ok_status();
  };
  E4KV_RETURN_IF_ERROR(link_all(/*dry_run=*/true));

  // ---- hash the base (before anything is created, so a long hash can be interrupted safely) -----
  // Every file the engine reads: the revision file, the small files (always hashed), the shards.
  std::vector<BaseFile> base_files;
  const bool sharded = ckpt.sharded();
  const std::string revision_file =
      std::string(sharded ? kSafetensorsIndexName : kSingleSafetensorsName);
  base_files.push_back({revision_file, sharded ? "index" : "shard"});
  for (std::string_view name : kEngineReadFiles) {
    E4KV_ASSIGN_OR_RETURN(const bool present, file_exists(base / name));
    if (!present) continue;
    const std::string role = name == "config.json"              ? "config"
                             : name == "generation_config.json" ? "generation"
                                                                : "tokenizer";
    base_files.push_back({std::string(name), role});
  }
  if (sharded) {
    std::vector<std::string> shard_names;
    for (const std::string& name : names) {
      std::string shard = ckpt.shard_of(name);
      if (std::find(shard_names.begin(), shard_names.end(), shard) == shard_names.end()) {
        shard_names.push_back(std::move(shard));
      }
    }
    std::sort(shard_names.begin(), shard_names.end());
    for (std::string& shard : shard_names) {
      BaseFile file{std::move(shard), "shard"};
      file.hashed = options.hash == OverlayHashScope::kAll;
      base_files.push_back(std::move(file));
    }
  }
  std::vector<fs::path> hash_paths;
  std::vector<std::string> hash_labels;
  for (BaseFile& file : base_files) {
    file.bytes = fs::file_size(base / file.name, ec);
    if (ec) {
      return Status::error(cat((base / file.name).string(), ": cannot read: ", ec_text(ec)));
    }
    if (!file.hashed) {
      ++result.n_size_only;
      continue;
    }
    hash_paths.push_back(base / file.name);
    hash_labels.push_back(file.name);
  }
  E4KV_ASSIGN_OR_RETURN(std::vector<std::string> digests,
                        hash_files(hash_paths, hash_labels, options.progress));
  size_t next_digest = 0;
  for (BaseFile& file : base_files) {
    if (!file.hashed) continue;
    file.sha256 = digests[next_digest++];
    result.hashed_bytes += file.bytes;
    ++result.n_hashed;
  }
  result.base_revision = base_files[0].sha256;
  result.revision_file = revision_file;
  result.policy = scales_file.policy;
  result.n_scales = static_cast<int64_t>(entries.size());
  result.replaced_keys.assign(embedded.begin(), embedded.end());

  // ---- build in a temporary directory beside the output -----------------------------------------
  // One overlay run per output at a time (core/output_set.h), held until the rename below is done.
  // Taken only now, so that a refusal above leaves the output's directory untouched; the rename
  // refuses an output that filled up meanwhile.
  Result<OutputLock> lock = OutputLock::acquire(lock_path_for(out), out_arg);
  if (!lock.ok()) return Status::option_error("out_dir", lock.message());
  result.removed_stale = remove_stale_temp_dirs(parent, out_name);
  if (::mkdir(temp.c_str(), 0755) != 0) {
    return Status::error(
        cat(temp.string(), ": cannot create the temporary directory: ", errno_text(errno)));
  }
  TempDirGuard guard(temp);
  crash_point("after-temp-dir");

  E4KV_RETURN_IF_ERROR(link_all(/*dry_run=*/false));

  // Base shards that hold scale keys (replace_embedded_scales): written anew without them.
  struct Rewritten {
    std::string file;
    std::vector<std::string> dropped;
    bool omitted = false;  // nothing left: the derived checkpoint has no such shard
    bool hashed = true;
    uint64_t bytes = 0;
    std::string sha256;
  };
  std::vector<Rewritten> rewritten;
  uint64_t dropped_bytes = 0;
  for (const auto& [shard_name, dropped] : embedded_by_shard) {
    const SafetensorsFile* file = nullptr;
    for (const auto& shard : ckpt.shards()) {
      if (fs::path(shard->source()).filename() == shard_name) file = shard.get();
    }
    if (file == nullptr) {
      return Status::error(cat(base.string(), ": shard ", shard_name, " is not open"));
    }
    std::vector<SafetensorsWriteTensor> kept;
    for (const SafetensorsTensor& t : file->tensors()) {
      if (embedded.count(t.name) != 0) {
        dropped_bytes += t.bytes.size();
        continue;
      }
      kept.push_back({t.name, t.dtype, t.shape, t.bytes});
    }
    Rewritten entry{shard_name, dropped};
    const bool base_hashed =
        std::any_of(base_files.begin(), base_files.end(),
                    [&](const BaseFile& f) { return f.name == shard_name && f.hashed; });
    entry.hashed = base_hashed;
    if (kept.empty()) {
      entry.omitted = true;
    } else {
      const fs::path path = temp / shard_name;
      E4KV_RETURN_IF_ERROR(write_safetensors(path, kept, file->metadata()));
      entry.bytes = fs::file_size(path, ec);
      if (ec) return Status::error(cat(path.string(), ": cannot read: ", ec_text(ec)));
      if (entry.hashed) {
        E4KV_ASSIGN_OR_RETURN(entry.sha256, sha256_file(path));
      }
      result.rewritten_shards.push_back(shard_name);
    }
    rewritten.push_back(std::move(entry));
  }
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
      {std::string(kPolicyMetadataKey), scales_file.policy},
      {std::string(kNegativeControlMetadataKey),
       options.unit_scale_negative_control ? "true" : "false"},
  };
  const fs::path scales_shard = temp / kKvScalesShardName;
  E4KV_RETURN_IF_ERROR(write_safetensors(scales_shard, tensors, metadata));
  crash_point("after-scales");

  // Merged index: the base's (metadata kept, total_size grown) or a new one for a single file.
  OrderedJson index;
  Json weight_map = Json::object();  // sorted by tensor name, as Hugging Face writes it
  const uint64_t scale_bytes = 4 * entries.size();
  if (sharded) {
    E4KV_ASSIGN_OR_RETURN(std::string text, read_file(base / kSafetensorsIndexName));
    E4KV_ASSIGN_OR_RETURN(index, parse_ordered_json(text, (base / kSafetensorsIndexName).string()));
    for (const auto& [name, shard] : index["weight_map"].items()) {
      if (embedded.count(name) == 0) weight_map[name] = shard;
    }
    if (!index.contains("metadata") || !index["metadata"].is_object()) {
      index["metadata"] = OrderedJson::object();
    }
    OrderedJson& metadata_object = index["metadata"];
    if (auto total = metadata_object.find("total_size");
        total != metadata_object.end() && total->is_number_integer() && *total >= 0) {
      const uint64_t before = total->get<uint64_t>();
      *total = (before >= dropped_bytes ? before - dropped_bytes : 0) + scale_bytes;
    }
  } else {
    uint64_t total = scale_bytes;
    for (const std::string& name : names) {
      if (embedded.count(name) != 0) continue;
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
  provenance["replace_embedded_scales"] = options.replace_embedded_scales;
  if (options.unit_scale_negative_control) {
    provenance["scales_file"] = nullptr;
  } else {
    provenance["scales_file"] = {{"path", scales_abs.string()}, {"sha256", scales_sha256}};
  }
  E4KV_ASSIGN_OR_RETURN(provenance["source"],
                        parse_ordered_json(scales_file.source_json, "the scales' source object"));
  OrderedJson scale_values = OrderedJson::object();
  for (const auto& [key, value] : entries) scale_values[key] = json_number_for(value);
  provenance["scales"] = std::move(scale_values);
  provenance["link_mode"] = overlay_link_mode_name(options.link);
  provenance["hash_scope"] = overlay_hash_scope_name(options.hash);
  OrderedJson files = OrderedJson::array();
  for (const BaseFile& file : base_files) {
    files.push_back({{"file", file.name},
                     {"role", file.role},
                     {"bytes", file.bytes},
                     {"sha256", file.hashed ? OrderedJson(file.sha256) : OrderedJson(nullptr)},
                     {"check", file.hashed ? "sha256" : "size"}});
  }
  provenance["base"] = {{"dir", base.string()},
                        {"revision", result.base_revision},
                        {"revision_file", revision_file},
                        {"files", std::move(files)}};
  OrderedJson rewritten_json = OrderedJson::array();
  for (const Rewritten& entry : rewritten) {
    OrderedJson item = {{"file", entry.file}, {"dropped", entry.dropped}};
    if (entry.omitted) {
      item["omitted"] = true;
    } else {
      item["bytes"] = entry.bytes;
      item["sha256"] = entry.hashed ? OrderedJson(entry.sha256) : OrderedJson(nullptr);
      item["check"] = entry.hashed ? "sha256" : "size";
    }
    rewritten_json.push_back(std::move(item));
  }
  provenance["derived"] = {{"scales_shard",
                            {{"file", kKvScalesShardName},
                             {"bytes", fs::file_size(scales_shard, ec)},
                             {"sha256", scales_shard_sha256}}},
                           {"rewritten_shards", std::move(rewritten_json)}};
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
    return Status::option_error(
        "out_dir", cat(out_arg, ": cannot move ", temp.string(), " into place: ", errno_text(error),
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
