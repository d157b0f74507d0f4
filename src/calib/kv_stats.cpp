#include "calib/kv_stats.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "core/half.h"
#include "core/json.h"
#include "core/sha256.h"

namespace e4kv {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

std::string layers_text(const std::vector<int64_t>& layers) {
  std::string text = "[";
  for (size_t i = 0; i < layers.size(); ++i) text += cat(i ? ", " : "", layers[i]);
  return text + "]";
}

std::string tensor_name(KvTensor tensor) {
  return tensor == KvTensor::kK ? "k" : "v";
}

}  // namespace

KvStats::KvStats(KvStatsHeader header) : header_(std::move(header)) {
  E4KV_ASSERT(header_.n_layers > 0 && !header_.kv_layers.empty(), "KvStats needs KV-cache layers");
  for (size_t i = 0; i < header_.kv_layers.size(); ++i) {
    E4KV_ASSERT(header_.kv_layers[i] >= 0 && header_.kv_layers[i] < header_.n_layers &&
                    (i == 0 || header_.kv_layers[i] > header_.kv_layers[i - 1]),
                "kv_layers must increase inside [0, n_layers)");
  }
  tensors_.resize(header_.kv_layers.size() * 2);
}

std::string KvStats::key_at(size_t i) const {
  return canonical_scale_key(header_.prefix, layer_at(i), kind_at(i));
}

KvTensorStats* KvStats::find(int64_t layer, KvTensor tensor) {
  const auto& layers = header_.kv_layers;
  auto it = std::lower_bound(layers.begin(), layers.end(), layer);
  if (it == layers.end() || *it != layer) return nullptr;
  return &tensors_[size_t(it - layers.begin()) * 2 + (tensor == KvTensor::kK ? 0 : 1)];
}

const KvTensorStats* KvStats::find(int64_t layer, KvTensor tensor) const {
  return const_cast<KvStats*>(this)->find(layer, tensor);
}

Status KvStats::merge(const KvStats& other) {
  const KvStatsHeader& a = header_;
  const KvStatsHeader& b = other.header_;
  if (a.prefix != b.prefix || a.n_layers != b.n_layers || a.kv_layers != b.kv_layers) {
    return Status::error(cat("statistics of different models: prefix \"", a.prefix, "\", ",
                             a.n_layers, " layers, KV-cache layers ", layers_text(a.kv_layers),
                             " against prefix \"", b.prefix, "\", ", b.n_layers,
                             " layers, KV-cache layers ", layers_text(b.kv_layers)));
  }
  for (size_t i = 0; i < tensors_.size(); ++i) tensors_[i].merge(other.tensors_[i]);
  header_.tokens += b.tokens;
  if (a.shard != b.shard) header_.shard.reset();
  if (a.source != b.source) header_.source = "mixed";
  if (a.model != b.model) header_.model = "mixed";
  return ok_status();
}

// ---- serialisation
// -------------------------------------------------------------------------------

std::string kv_stats_to_jsonl(const KvStats& stats) {
  const KvStatsHeader& h = stats.header();
  ordered_json header;
  header["format"] = kKvStatsFormat;
  header["model"] = h.model;
  header["prefix"] = h.prefix;
  header["n_layers"] = h.n_layers;
  header["kv_layers"] = h.kv_layers;
  header["shard"] = h.shard ? ordered_json(*h.shard) : ordered_json(nullptr);
  header["tokens"] = h.tokens;
  header["source"] = h.source;
  header["histogram"] = {{"min_log2", kKvHistMinLog2},
                         {"max_log2", kKvHistMaxLog2},
                         {"bins_per_octave", kKvHistBinsPerOctave}};
  std::string out = header.dump() + "\n";
  for (size_t i = 0; i < stats.size(); ++i) {
    const KvTensorStats& t = stats.at(i);
    ordered_json record;
    record["layer"] = stats.layer_at(i);
    record["tensor"] = tensor_name(stats.kind_at(i));
    record["key"] = stats.key_at(i);
    record["count"] = t.count();
    record["nonzero"] = t.nonzero();
    record["non_finite"] = t.non_finite();
    record["underflow"] = t.underflow();
    record["overflow"] = t.overflow();
    record["absmax"] = double(t.absmax());  // exact; read back as the same fp32
    record["hist"] = t.histogram();
    out += record.dump() + "\n";
  }
  return out;
}

namespace {

class LineParser {
 public:
  LineParser(const std::string& source, int64_t line) : where_(cat(source, ":", line, ": ")) {}

  Status error(const std::string& message) const { return Status::error(where_ + message); }

  // A non-negative integer field that fits int64.
  Result<int64_t> count(const json& object, const char* field) const {
    auto it = object.find(field);
    if (it == object.end()) return error(cat("missing field \"", field, "\""));
    return count_value(*it, cat("\"", field, "\""));
  }

  Result<int64_t> count_value(const json& value, const std::string& what) const {
    if (value.is_number_unsigned()) {
      if (value.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
        return error(cat(what, " is too large: ", json_excerpt(value)));
      }
      return int64_t(value.get<uint64_t>());
    }
    if (value.is_number_integer()) {
      return error(cat(what, " must not be negative, got ", json_excerpt(value)));
    }
    return error(cat(what, " must be a non-negative integer, got ", json_excerpt(value)));
  }

  Result<std::string> string(const json& object, const char* field) const {
    auto it = object.find(field);
    if (it == object.end()) return error(cat("missing field \"", field, "\""));
    if (!it->is_string())
      return error(cat("\"", field, "\" must be a string, got ", json_excerpt(*it)));
    return it->get<std::string>();
  }

 private:
  std::string where_;
};

Result<KvStatsHeader> parse_header(const json& root, const LineParser& p) {
  if (!root.is_object()) return p.error("the header must be a JSON object");
  auto format = root.find("format");
  if (format == root.end()) {
    return p.error(cat("missing \"format\"; expected \"", kKvStatsFormat,
                       "\" (is this an e4kv statistics file?)"));
  }
  if (!format->is_string() || format->get<std::string>() != kKvStatsFormat) {
    return p.error(cat("unsupported format ", json_excerpt(*format), "; expected \"",
                       kKvStatsFormat, "\" (written by a different e4kv version?)"));
  }
  auto geometry = root.find("histogram");
  if (geometry == root.end() || !geometry->is_object() ||
      geometry->value("min_log2", json()) != json(kKvHistMinLog2) ||
      geometry->value("max_log2", json()) != json(kKvHistMaxLog2) ||
      geometry->value("bins_per_octave", json()) != json(kKvHistBinsPerOctave)) {
    return p.error(cat(
        "\"histogram\" must be {\"min_log2\": ", kKvHistMinLog2, ", \"max_log2\": ", kKvHistMaxLog2,
        ", \"bins_per_octave\": ", kKvHistBinsPerOctave, "}, got ",
        geometry == root.end() ? std::string("nothing") : json_excerpt(*geometry, 120)));
  }
  KvStatsHeader h;
  E4KV_ASSIGN_OR_RETURN(h.model, p.string(root, "model"));
  E4KV_ASSIGN_OR_RETURN(h.prefix, p.string(root, "prefix"));
  E4KV_ASSIGN_OR_RETURN(h.source, p.string(root, "source"));
  if (h.source != "observed" && h.source != "synthetic" && h.source != "mixed") {
    return p.error(
        cat("\"source\" must be \"observed\", \"synthetic\" or \"mixed\", got \"", h.source, "\""));
  }
  E4KV_ASSIGN_OR_RETURN(h.n_layers, p.count(root, "n_layers"));
  if (h.n_layers == 0) return p.error("\"n_layers\" must be positive");
  E4KV_ASSIGN_OR_RETURN(h.tokens, p.count(root, "tokens"));
  auto shard = root.find("shard");
  if (shard == root.end()) return p.error("missing field \"shard\" (an integer, or null)");
  if (!shard->is_null()) {
    E4KV_ASSIGN_OR_RETURN(h.shard, p.count_value(*shard, "\"shard\""));
  }
  auto layers = root.find("kv_layers");
  if (layers == root.end() || !layers->is_array() || layers->empty()) {
    return p.error("\"kv_layers\" must be a non-empty array of layer indices");
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    E4KV_ASSIGN_OR_RETURN(const int64_t layer,
                          p.count_value((*layers)[i], cat("kv_layers[", i, "]")));
    if (layer >= h.n_layers) {
      return p.error(cat("kv_layers[", i, "] = ", layer, " is not below n_layers = ", h.n_layers));
    }
    if (!h.kv_layers.empty() && layer <= h.kv_layers.back()) {
      return p.error(cat("kv_layers must increase: ", layer, " after ", h.kv_layers.back()));
    }
    h.kv_layers.push_back(layer);
  }
  return h;
}

// Parses one record into `stats`; `seen` marks the records already read.
Status parse_record(const json& root, const LineParser& p, KvStats& stats,
                    std::vector<bool>& seen) {
  if (!root.is_object()) return p.error("a record must be a JSON object");
  E4KV_ASSIGN_OR_RETURN(const int64_t layer, p.count(root, "layer"));
  E4KV_ASSIGN_OR_RETURN(const std::string tensor_text, p.string(root, "tensor"));
  if (tensor_text != "k" && tensor_text != "v") {
    return p.error(cat("\"tensor\" must be \"k\" or \"v\", got \"", tensor_text, "\""));
  }
  const KvTensor tensor = tensor_text == "k" ? KvTensor::kK : KvTensor::kV;
  const std::vector<int64_t>& kv_layers = stats.header().kv_layers;
  auto it = std::lower_bound(kv_layers.begin(), kv_layers.end(), layer);
  if (it == kv_layers.end() || *it != layer) {
    return p.error(cat("layer ", layer, " is not one of the header's KV-cache layers ",
                       layers_text(kv_layers)));
  }
  const size_t index = size_t(it - kv_layers.begin()) * 2 + (tensor == KvTensor::kK ? 0 : 1);
  if (seen[index]) return p.error(cat("a second record for layer ", layer, " ", tensor_text));
  if (auto key = root.find("key"); key != root.end()) {
    const std::string expected = stats.key_at(index);
    if (!key->is_string() || key->get<std::string>() != expected) {
      return p.error(cat("\"key\" ", json_excerpt(*key, 120), " does not match layer ", layer, " ",
                         tensor_text, " under prefix \"", stats.header().prefix, "\" (expected \"",
                         expected, "\")"));
    }
  }
  E4KV_ASSIGN_OR_RETURN(const int64_t count, p.count(root, "count"));
  E4KV_ASSIGN_OR_RETURN(const int64_t nonzero, p.count(root, "nonzero"));
  E4KV_ASSIGN_OR_RETURN(const int64_t non_finite, p.count(root, "non_finite"));
  E4KV_ASSIGN_OR_RETURN(const int64_t underflow, p.count(root, "underflow"));
  E4KV_ASSIGN_OR_RETURN(const int64_t overflow, p.count(root, "overflow"));
  auto absmax_it = root.find("absmax");
  if (absmax_it == root.end() || !absmax_it->is_number()) {
    return p.error("\"absmax\" must be a number");
  }
  const double absmax_d = absmax_it->get<double>();
  const float absmax = float(absmax_d);
  if (!std::isfinite(absmax_d) || absmax_d < 0.0 || double(absmax) != absmax_d) {
    return p.error(
        cat("\"absmax\" must be a finite non-negative fp32 value, got ", json_excerpt(*absmax_it)));
  }
  auto hist_it = root.find("hist");
  if (hist_it == root.end() || !hist_it->is_array()) {
    return p.error(cat("\"hist\" must be an array of ", kKvHistBins, " counts"));
  }
  if (hist_it->size() != size_t(kKvHistBins)) {
    return p.error(cat("\"hist\" has ", hist_it->size(), " bins; expected ", kKvHistBins,
                       " (8 per octave over 2^-24 .. 2^16)"));
  }
  std::vector<int64_t> hist(kKvHistBins);
  int64_t sum = 0;
  bool sum_overflow = __builtin_add_overflow(underflow, overflow, &sum);
  int top = -2;  // highest non-empty slot: -1 underflow, bins, kKvHistBins overflow
  if (underflow > 0) top = -1;
  for (int b = 0; b < kKvHistBins; ++b) {
    E4KV_ASSIGN_OR_RETURN(hist[size_t(b)],
                          p.count_value((*hist_it)[size_t(b)], cat("hist[", b, "]")));
    sum_overflow |= __builtin_add_overflow(sum, hist[size_t(b)], &sum);
    if (hist[size_t(b)] > 0) top = b;
  }
  if (overflow > 0) top = kKvHistBins;
  if (sum_overflow) return p.error("the counts add up to more than 2^63");
  if (sum != nonzero) {
    return p.error(cat("\"nonzero\" = ", nonzero, " but underflow + overflow + sum(hist) = ", sum));
  }
  if (nonzero > count) {
    return p.error(cat("\"nonzero\" = ", nonzero, " exceeds \"count\" = ", count));
  }
  if (nonzero == 0) {
    if (absmax != 0.0f) return p.error(cat("\"absmax\" is ", absmax, " but no value is non-zero"));
  } else {
    const int absmax_bin = absmax == 0.0f ? -2 : kv_hist_bin(absmax);
    if (absmax_bin != top) {
      return p.error(
          cat("\"absmax\" = ", absmax, " does not lie in the highest non-empty histogram bin"));
    }
  }
  stats.at(index) =
      KvTensorStats::from_counts(count, non_finite, underflow, overflow, absmax, hist);
  seen[index] = true;
  return ok_status();
}

}  // namespace

Result<KvStats> parse_kv_stats(std::string_view text, const std::string& source) {
  std::optional<KvStats> stats;
  std::vector<bool> seen;
  int64_t line_no = 0;
  size_t records = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const LineParser p(source, line_no);
    E4KV_ASSIGN_OR_RETURN(const json root, parse_json(line, cat(source, ":", line_no)));
    if (!stats) {
      E4KV_ASSIGN_OR_RETURN(KvStatsHeader header, parse_header(root, p));
      stats.emplace(std::move(header));
      seen.assign(stats->size(), false);
      continue;
    }
    if (records == stats->size()) {
      return p.error(cat("more records than the header's ", stats->header().kv_layers.size(),
                         " KV-cache layers x 2 (K, V) = ", stats->size()));
    }
    E4KV_RETURN_IF_ERROR(parse_record(root, p, *stats, seen));
    ++records;
  }
  if (!stats) return Status::error(cat(source, ": empty statistics file (no header line)"));
  if (records != stats->size()) {
    std::string missing;
    for (size_t i = 0; i < seen.size(); ++i) {
      if (!seen[i]) {
        missing += cat(missing.empty() ? "" : ", ", "layer ", stats->layer_at(i), " ",
                       tensor_name(stats->kind_at(i)));
      }
    }
    return Status::error(cat(source, ":", line_no, ": the file ends after ", records,
                             " records; the header's ", stats->header().kv_layers.size(),
                             " KV-cache layers need ", stats->size(), " (missing: ", missing, ")"));
  }
  return std::move(*stats);
}

Result<KvStats> read_kv_stats(const std::filesystem::path& path) {
  E4KV_ASSIGN_OR_RETURN(const std::string text, read_file(path));
  return parse_kv_stats(text, path.string());
}

Status write_kv_stats(const std::filesystem::path& path, const KvStats& stats) {
  return write_file_atomic(path, kv_stats_to_jsonl(stats));
}

std::string calibrate_stats_name(int64_t index, int64_t count) {
  return cat("kv-stats-shard-", index, "-of-", count, ".jsonl");
}

std::string calibrate_run_name(int64_t index, int64_t count) {
  return cat("calibrate-shard-", index, "-of-", count, ".json");
}

namespace {

// "kv-stats-shard-I-of-N.jsonl" -> {I, N}, digits only (as calibrate prints them).
std::optional<std::pair<int64_t, int64_t>> calibrate_shard_of(const std::string& name) {
  constexpr std::string_view kPrefix = "kv-stats-shard-", kMiddle = "-of-", kSuffix = ".jsonl";
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) return std::nullopt;
  const std::string body =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  const size_t middle = body.find(kMiddle);
  if (middle == std::string::npos) return std::nullopt;
  const std::string index = body.substr(0, middle), count = body.substr(middle + kMiddle.size());
  auto digits = [](const std::string& t) {
    return !t.empty() && t.size() <= 18 &&
           std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (!digits(index) || !digits(count)) return std::nullopt;
  return std::make_pair(std::stoll(index), std::stoll(count));
}

}  // namespace

Status check_calibrate_run_file(const std::filesystem::path& stats_path, std::string_view text) {
  const auto shard = calibrate_shard_of(stats_path.filename().string());
  if (!shard) return ok_status();
  const std::filesystem::path run_path =
      stats_path.parent_path() / calibrate_run_name(shard->first, shard->second);
  const std::string rerun = cat("; re-run that shard (e4kv calibrate --shard ", shard->first, "/",
                                shard->second, " --force --out ",
                                stats_path.has_parent_path() ? stats_path.parent_path().string()
                                                             : std::string("."),
                                " ...)");
  E4KV_ASSIGN_OR_RETURN(const std::optional<std::string> run_text, read_optional_file(run_path));
  if (!run_text) {
    return Status::error(cat(stats_path.string(), ": its run file ", run_path.string(),
                             " is missing, so the calibrate run that wrote it did not finish",
                             rerun));
  }
  Result<json> parsed = parse_json(*run_text, run_path.string());
  if (!parsed.ok()) {
    return Status::error(cat(parsed.message(), "; so it cannot vouch for ", stats_path.string(),
                             rerun));
  }
  const json run = std::move(parsed).value();
  const auto bytes = run.is_object() ? run.find(kRunStatisticsBytesKey) : run.end();
  const auto sha = run.is_object() ? run.find(kRunStatisticsSha256Key) : run.end();
  if (!run.is_object() || bytes == run.end() || !bytes->is_number_unsigned() ||
      sha == run.end() || !sha->is_string() || !is_sha256_hex(sha->get<std::string>())) {
    return Status::error(cat(run_path.string(), ": records no \"", kRunStatisticsBytesKey,
                             "\" and \"", kRunStatisticsSha256Key, "\" of ",
                             stats_path.string(), ", so the two cannot be matched", rerun));
  }
  const std::string actual = sha256_hex(text);
  if (bytes->get<uint64_t>() != text.size() || sha->get<std::string>() != actual) {
    return Status::error(cat(
        stats_path.string(), " (", text.size(), " bytes, SHA-256 ", actual.substr(0, 12),
        "...) is not the statistics file its run file ", run_path.string(), " records (",
        bytes->get<uint64_t>(), " bytes, SHA-256 ", sha->get<std::string>().substr(0, 12),
        "...): the two come from different calibrate runs, one of them interrupted", rerun));
  }
  return ok_status();
}

}  // namespace e4kv
