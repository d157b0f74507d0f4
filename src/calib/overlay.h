// The K/V scale overlay (DESIGN.md section 7): a derived checkpoint directory that adds calibrated
// K/V scales to a base checkpoint without writing into the base.
//
//   DERIVED/
//     <every base file and folder except the index>   symlink (absolute) | hard link | copy
//     model-kvscales.safetensors      F32 scalars, canonical keys; __metadata__: format "pt",
//                                     e4kv_contract "e4kv-kv-scales/1", e4kv_base_revision,
//                                     e4kv_policy, e4kv_negative_control "true" | "false"
//     model.safetensors.index.json    the base index (or, for a single-file base, one that maps
//                                     every base tensor to model.safetensors) plus every scale key
//     kvscales-provenance.json        tool version, policy, negative_control, the scales file's
//                                     source object, every base file the engine reads (index,
//                                     shards, config.json, generation_config.json, tokenizer files:
//                                     kEngineReadFiles) with its size and SHA-256, link mode, time
//
// The base revision is the SHA-256 of the base's model.safetensors.index.json, or of its
// model.safetensors when it has no index. With --hash index-config the shards of a sharded base
// are recorded by size only (sha256 null, "check": "size"); every other recorded file is hashed.
//
// Scale keys already in the base: a plain overlay refuses them (two keys for one scale slot). With
// replace_embedded_scales (--replace-embedded-scales) the derived checkpoint leaves them out: each
// base shard holding one is written anew into the derived directory without those tensors (a shard
// left empty is omitted), the merged index drops them, and the provenance lists the dropped keys
// and the rewritten shards' sizes and digests. The base is never touched.
//
// How base entries enter the derived directory:
//   - symlink: each top-level base entry becomes an absolute link to the base's own path; nothing
//     is walked, so links inside the base (loops, links out of the base) are never followed.
//   - hardlink | copy: real directories are recreated and walked (a directory met twice, e.g.
//     through a bind mount loop, is refused); a link to a regular file is resolved and the file
//     linked or copied wherever it lies (the file the engine reads through the base: a Hugging
//     Face cache snapshot's files are links into ../../blobs); a link to a directory is never
//     descended: one that resolves inside the base is recreated as a relative link to the same
//     place in the derived tree (so a link back up the tree stays a harmless link), one that leaves
//     the base is refused naming the link (use --link symlink, or remove it from the base). A link
//     that cannot be followed (a loop, a dangling link) is refused with the real errno.
//
// make_overlay() checks everything it can before it creates anything (paths, the base checkpoint,
// key collisions, the scale gate over the would-be derived set, base hashes), builds the result in
// a temporary directory beside the output, runs the start-up gate over that directory as a
// checkpoint, and renames it into place. On any failure nothing is left at the output path.
//
// The temporary directory is `<parent>/.<name>.e4kv-overlay-tmp.<pid>`. Only a killed process
// leaves one behind; the next make_overlay() for the same output removes those whose process no
// longer exists (OverlayResult::removed_stale).
//
// A second make_overlay() for the same output while one builds it is refused: the lock
// `<parent>/.<name>.lock` (core/output_set.h) is held from the temporary directory's creation to
// the rename.
//
// Test hook (crash_point, core/output_set.h): with the environment variable E4KV_TEST_CRASH_AT set
// to one of after-temp-dir, after-links, after-scales, after-index, after-provenance,
// before-rename, the process _exit(9)s at that point, as a SIGKILL there would.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "kv/scale_gate.h"

namespace e4kv {

inline constexpr std::string_view kKvScalesShardName = "model-kvscales.safetensors";
inline constexpr std::string_view kProvenanceName = "kvscales-provenance.json";
inline constexpr std::string_view kProvenanceFormat = "e4kv-kvscales-provenance/1";
// __metadata__ keys of model-kvscales.safetensors (kBaseRevisionMetadataKey, kPolicyMetadataKey,
// kNegativeControlMetadataKey and kUnitNegativeControlPolicy are in kv/scale_gate.h, which reads
// them).
inline constexpr std::string_view kContractMetadataKey = "e4kv_contract";

// The files besides the index and the shards that the engine reads from a model directory; those
// a base holds are bound by the provenance (and always hashed: they are small).
inline constexpr std::array<std::string_view, 6> kEngineReadFiles = {
    "config.json",           "generation_config.json",  "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"};

enum class OverlayLinkMode { kSymlink, kHardlink, kCopy };
Result<OverlayLinkMode> parse_overlay_link_mode(std::string_view name);  // symlink|hardlink|copy
std::string_view overlay_link_mode_name(OverlayLinkMode mode);

// Which base files are hashed into the provenance. kIndexConfig records the shards of a sharded
// base by size only (a single-file base's model.safetensors is its revision and is always hashed);
// the index, config.json and the other kEngineReadFiles are hashed in both scopes.
enum class OverlayHashScope { kAll, kIndexConfig };
Result<OverlayHashScope> parse_overlay_hash_scope(std::string_view name);  // all|index-config
std::string_view overlay_hash_scope_name(OverlayHashScope scope);

// Hashing progress: the file being hashed, bytes hashed so far over the whole pass, total bytes.
using FilesProgress = std::function<void(const std::string& file, uint64_t done, uint64_t total)>;

// SHA-256 of each file in `paths`, reporting progress over their total size under `labels`.
Result<std::vector<std::string>> hash_files(const std::vector<std::filesystem::path>& paths,
                                            const std::vector<std::string>& labels,
                                            const FilesProgress& progress);

struct OverlayOptions {
  std::filesystem::path base_dir;
  std::filesystem::path scales_path;  // scales.json; empty with unit_scale_negative_control
  std::filesystem::path out_dir;
  OverlayLinkMode link = OverlayLinkMode::kSymlink;
  OverlayHashScope hash = OverlayHashScope::kAll;
  // Write 1.0 for every expected key instead of reading scales_path (provenance says so).
  bool unit_scale_negative_control = false;
  // Leave the base's own K/V scale keys out of the derived checkpoint (see the top of this file)
  // instead of refusing the collision. Without such keys in the base it changes nothing.
  bool replace_embedded_scales = false;
  FilesProgress progress;  // may be empty
};

struct OverlayResult {
  std::filesystem::path out_dir;  // absolute
  std::string base_revision;      // SHA-256 hex
  std::string revision_file;      // model.safetensors.index.json or model.safetensors
  std::string policy;
  int64_t n_scales = 0;
  int64_t n_linked = 0;     // top-level base entries linked or copied
  int64_t n_hashed = 0;     // base files hashed
  int64_t n_size_only = 0;  // base files recorded by size only (--hash index-config)
  uint64_t hashed_bytes = 0;
  std::vector<std::string> replaced_keys;     // base scale keys left out (replace_embedded_scales)
  std::vector<std::string> rewritten_shards;  // base shards written anew without them
  std::vector<std::filesystem::path> removed_stale;  // leftover temporary directories removed
  KvScales scales;  // what the start-up gate reads from the derived directory
};

Result<OverlayResult> make_overlay(const OverlayOptions& options);

// A one-line hashing progress bar redrawn with '\r' on `out` (a TTY). Finishes its line when
// destroyed if it drew anything.
class HashProgressBar {
 public:
  explicit HashProgressBar(std::FILE* out) : out_(out) {}
  ~HashProgressBar();
  HashProgressBar(const HashProgressBar&) = delete;
  HashProgressBar& operator=(const HashProgressBar&) = delete;
  void update(const std::string& file, uint64_t done, uint64_t total);
  FilesProgress callback() {
    return [this](const std::string& file, uint64_t done, uint64_t total) {
      update(file, done, total);
    };
  }

 private:
  std::FILE* out_;
  bool drawn_ = false;
  int last_permille_ = -1;
  std::string last_file_;
};

}  // namespace e4kv
