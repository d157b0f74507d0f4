// Calibration statistics files of DESIGN.md section 6: per (layer, K|V, shard) the magnitude
// statistics of kv/kv_histogram.h, as JSON lines.
//
// File format (JSON lines, one file per shard):
//   {"format":"e4kv-kv-stats/1","model":"ckpt","prefix":"model","n_layers":8,"kv_layers":[3,7],
//    "shard":0,"tokens":2048,"source":"synthetic",
//    "histogram":{"min_log2":-24,"max_log2":16,"bins_per_octave":8}}
//   {"layer":3,"tensor":"k","key":"model.layers.3.self_attn.k_scale","count":..,"nonzero":..,
//    "non_finite":..,"underflow":..,"overflow":..,"absmax":7.5,"hist":[320 counts]}
//   ... one line per (KV-cache layer, K|V), 2 * len(kv_layers) lines in all.
// "shard" is null for statistics merged from several shards; "source" is "observed" (the cache
// write of real forwards), "synthetic" (e4kv synth-stats) or "mixed".
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "kv/kv_histogram.h"
#include "kv/scale_keys.h"

namespace e4kv {

inline constexpr const char* kKvStatsFormat = "e4kv-kv-stats/1";

struct KvStatsHeader {
  std::string model;                // informational: the model directory's name
  std::string prefix;               // scale-key prefix ("model", "model.language_model", ...)
  int64_t n_layers = 0;             // layers of the model
  std::vector<int64_t> kv_layers;   // layers with a main KV cache, strictly increasing
  std::optional<int64_t> shard;     // nullopt: merged from several shards
  int64_t tokens = 0;               // tokens whose K/V rows were observed
  std::string source = "observed";  // "observed", "synthetic" or "mixed"
};

// The statistics of every KV-cache layer's K and V on one shard (or merged).
class KvStats {
 public:
  // Asserts a valid layout (n_layers > 0, kv_layers non-empty, increasing, inside n_layers).
  explicit KvStats(KvStatsHeader header);

  const KvStatsHeader& header() const { return header_; }
  void add_tokens(int64_t n) { header_.tokens += n; }

  // Tensors in file order: layer kv_layers[i] K at 2i, V at 2i + 1.
  size_t size() const { return tensors_.size(); }
  int64_t layer_at(size_t i) const { return header_.kv_layers[i / 2]; }
  KvTensor kind_at(size_t i) const { return i % 2 == 0 ? KvTensor::kK : KvTensor::kV; }
  std::string key_at(size_t i) const;
  const KvTensorStats& at(size_t i) const { return tensors_[i]; }
  KvTensorStats& at(size_t i) { return tensors_[i]; }

  // nullptr when `layer` has no KV cache.
  KvTensorStats* find(int64_t layer, KvTensor tensor);
  const KvTensorStats* find(int64_t layer, KvTensor tensor) const;

  // Adds `other`: an error (naming both layouts) unless prefix, n_layers and kv_layers agree.
  // Tokens add; the shard stays when both agree, else becomes nullopt; sources that differ become
  // "mixed"; the model name stays when both agree, else becomes "mixed".
  Status merge(const KvStats& other);

 private:
  KvStatsHeader header_;
  std::vector<KvTensorStats> tensors_;
};

// JSON lines (format above), ending in a newline.
std::string kv_stats_to_jsonl(const KvStats& stats);
// Parses JSON lines text. Every error names `source` and the 1-based line: invalid JSON, a wrong
// format string or histogram geometry, a bad header field, a record for a layer that is not in
// kv_layers or given twice, a missing record, negative or non-integer counts, a histogram of the
// wrong length and counts that contradict each other. Blank lines are skipped.
Result<KvStats> parse_kv_stats(std::string_view text, const std::string& source);
Result<KvStats> read_kv_stats(const std::filesystem::path& path);
// Writes atomically (temporary file in the same directory, then rename).
Status write_kv_stats(const std::filesystem::path& path, const KvStats& stats);

// What `e4kv calibrate --shard I/N --out DIR` writes for one shard, as one set:
//   DIR/kv-stats-shard-I-of-N.jsonl   the statistics (written first)
//   DIR/calibrate-shard-I-of-N.json   the run file (written last): what ran, and
//                                     "statistics_bytes" / "statistics_sha256" of the statistics
// Each is renamed into place on its own, so the run file is the manifest: a statistics file is one
// calibrate run's only when its run file exists and records its size and SHA-256. A kill between
// the two renames leaves statistics without a run file, or (replacing an earlier run with --force)
// beside the earlier run's file; check_calibrate_run_file refuses both.
std::string calibrate_stats_name(int64_t index, int64_t count);
std::string calibrate_run_name(int64_t index, int64_t count);
inline constexpr const char* kRunStatisticsBytesKey = "statistics_bytes";
inline constexpr const char* kRunStatisticsSha256Key = "statistics_sha256";

// For a statistics file named as calibrate names one (kv-stats-shard-I-of-N.jsonl) with contents
// `text`: an error naming both files, saying to re-run that shard, unless the run file beside it
// exists and records exactly this size and SHA-256. Files named otherwise (e4kv synth-stats
// outputs, statistics copied under another name) are not calibrate's set and pass.
Status check_calibrate_run_file(const std::filesystem::path& stats_path, std::string_view text);

}  // namespace e4kv
