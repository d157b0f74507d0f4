#include "calib/kv_stats.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "core/half.h"
#include "core/json_error.h"

namespace e4kv {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// ---- exact sub-octave thresholds
// -----------------------------------------------------------------
//
// Bin j of an octave starts at 2^(j/8), irrational for j = 1..7. kSubBinThreshold[j] is the
// smallest 23-bit mantissa m with 1 + m / 2^23 >= 2^(j/8), i.e. (2^23 + m)^8 >= 2^(184 + j),
// decided in exact integer arithmetic at compile time (the 8th power needs 192 bits: six 32-bit
// limbs).

using Limbs = std::array<uint32_t, 6>;

constexpr Limbs multiply(const Limbs& a, const Limbs& b) {
  Limbs c{};
  for (size_t i = 0; i < a.size(); ++i) {
    uint64_t carry = 0;
    for (size_t j = 0; i + j < c.size(); ++j) {
      const uint64_t t = uint64_t(a[i]) * b[j] + c[i + j] + carry;
      c[i + j] = uint32_t(t);
      carry = t >> 32;
    }
  }
  return c;
}

constexpr int bit_length(const Limbs& a) {
  for (int i = int(a.size()) - 1; i >= 0; --i) {
    if (a[size_t(i)] != 0) return 32 * i + int(std::bit_width(a[size_t(i)]));
  }
  return 0;
}

// (2^23 + mantissa)^8 >= 2^(184 + j)
constexpr bool reaches_edge(uint32_t mantissa, int j) {
  Limbs n{};
  n[0] = (1u << 23) + mantissa;
  const Limbs n2 = multiply(n, n);
  const Limbs n4 = multiply(n2, n2);
  const Limbs n8 = multiply(n4, n4);
  return bit_length(n8) > 184 + j;
}

constexpr std::array<uint32_t, 9> make_sub_bin_thresholds() {
  std::array<uint32_t, 9> t{};
  t[0] = 0;
  t[8] = 1u << 23;  // the next octave
  for (int j = 1; j < 8; ++j) {
    uint32_t lo = 0;
    uint32_t hi = 1u << 23;  // reaches_edge(hi) holds: 2^(j/8) < 2
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (reaches_edge(mid, j)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    t[size_t(j)] = lo;
  }
  return t;
}

constexpr std::array<uint32_t, 9> kSubBinThreshold = make_sub_bin_thresholds();
// ceil((sqrt(2) - 1) * 2^23) = 3474676: a spot check of the integer arithmetic.
static_assert(kSubBinThreshold[4] == 3474676u);

constexpr int kFirstBinExponent = 127 + kKvHistMinLog2;  // biased fp32 exponent of 2^-24
constexpr int kEndBinExponent = 127 + kKvHistMaxLog2;    // biased fp32 exponent of 2^16

// Bin of a normal fp32 magnitude inside [2^-24, 2^16).
inline int bin_of_normal(uint32_t magnitude_bits) {
  const int exponent = int(magnitude_bits >> 23);
  return (exponent - kFirstBinExponent) * kKvHistBinsPerOctave +
         kv_hist_sub_bin(magnitude_bits & 0x7FFFFFu);
}

float float_with(int unbiased_exponent, uint32_t mantissa23) {
  return f32_from_bits(uint32_t(unbiased_exponent + 127) << 23 | mantissa23);
}

}  // namespace

// ---- bins
// ----------------------------------------------------------------------------------------

int kv_hist_sub_bin(uint32_t mantissa23) {
  int sub = 0;
  for (int j = 1; j < 8; ++j) sub += mantissa23 >= kSubBinThreshold[size_t(j)] ? 1 : 0;
  return sub;
}

int kv_hist_bin(float x) {
  const uint32_t mag = f32_bits(x) & 0x7FFFFFFFu;
  E4KV_ASSERT(mag != 0 && mag < 0x7F800000u, "kv_hist_bin needs a finite non-zero value");
  const int exponent = int(mag >> 23);
  if (exponent < kFirstBinExponent) return kKvHistUnderflow;
  if (exponent >= kEndBinExponent) return kKvHistOverflow;
  return bin_of_normal(mag);
}

int kv_hist_bin_f16(uint16_t bits) {
  const uint16_t mag = bits & 0x7FFFu;
  E4KV_ASSERT(mag != 0 && mag < 0x7C00u, "kv_hist_bin_f16 needs a finite non-zero value");
  // Every finite non-zero FP16 value is a normal fp32 in [2^-24, 65504].
  return bin_of_normal(f32_bits(f16_to_f32(mag)));
}

float kv_hist_bin_min(int b) {
  E4KV_ASSERT(b >= 0 && b < kKvHistBins, "bin out of range");
  const int octave = kKvHistMinLog2 + b / kKvHistBinsPerOctave;
  return float_with(octave, kSubBinThreshold[size_t(b % kKvHistBinsPerOctave)]);
}

float kv_hist_bin_max(int b) {
  E4KV_ASSERT(b >= 0 && b < kKvHistBins, "bin out of range");
  const int octave = kKvHistMinLog2 + b / kKvHistBinsPerOctave;
  return float_with(octave, kSubBinThreshold[size_t(b % kKvHistBinsPerOctave) + 1] - 1u);
}

// ---- KvTensorStats
// -------------------------------------------------------------------------------

const std::array<uint16_t, 32768>& KvTensorStats::f16_slots() {
  static const std::array<uint16_t, 32768> table = [] {
    std::array<uint16_t, 32768> t{};
    for (uint32_t mag = 0; mag < t.size(); ++mag) {
      int s = 0;
      if (mag == 0) {
        s = kZeroSlot;
      } else if (mag >= 0x7C00u) {
        s = kNonFiniteSlot;
      } else {
        s = kFirstBinSlot + kv_hist_bin_f16(uint16_t(mag));
      }
      t[mag] = uint16_t(s);
    }
    return t;
  }();
  return table;
}

int KvTensorStats::float_slot(uint32_t mag) {
  if (mag == 0) return kZeroSlot;
  if (mag >= 0x7F800000u) return kNonFiniteSlot;
  const int exponent = int(mag >> 23);
  if (exponent < kFirstBinExponent) return kUnderflowSlot;
  if (exponent >= kEndBinExponent) return kOverflowSlot;
  return kFirstBinSlot + bin_of_normal(mag);
}

void KvTensorStats::observe(const uint16_t* fp16_values, int64_t n) {
  const uint16_t* slots = f16_slots().data();
  uint64_t* c0 = lanes_[0].data();
  uint64_t* c1 = lanes_[1].data();
  uint64_t* c2 = lanes_[2].data();
  uint64_t* c3 = lanes_[3].data();
  // FP16 magnitudes order like their bit patterns; inf/NaN (>= 0x7C00) do not count for absmax.
  auto finite = [](uint32_t mag) { return mag < 0x7C00u ? mag : 0u; };
  uint32_t max_mag = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint32_t m0 = fp16_values[i] & 0x7FFFu;
    const uint32_t m1 = fp16_values[i + 1] & 0x7FFFu;
    const uint32_t m2 = fp16_values[i + 2] & 0x7FFFu;
    const uint32_t m3 = fp16_values[i + 3] & 0x7FFFu;
    ++c0[slots[m0]];
    ++c1[slots[m1]];
    ++c2[slots[m2]];
    ++c3[slots[m3]];
    max_mag = std::max(
        max_mag, std::max(std::max(finite(m0), finite(m1)), std::max(finite(m2), finite(m3))));
  }
  for (; i < n; ++i) {
    const uint32_t m = fp16_values[i] & 0x7FFFu;
    ++c0[slots[m]];
    max_mag = std::max(max_mag, finite(m));
  }
  absmax_ = std::max(absmax_, f16_to_f32(uint16_t(max_mag)));
}

void KvTensorStats::observe(const float* values, int64_t n) {
  uint32_t max_mag = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t mag = f32_bits(values[i]) & 0x7FFFFFFFu;
    ++lanes_[size_t(i & (kLanes - 1))][size_t(float_slot(mag))];
    if (mag < 0x7F800000u) max_mag = std::max(max_mag, mag);
  }
  absmax_ = std::max(absmax_, f32_from_bits(max_mag));
}

void KvTensorStats::merge(const KvTensorStats& other) {
  for (int s = 0; s < kSlots; ++s) lanes_[0][size_t(s)] += uint64_t(other.slot(s));
  absmax_ = std::max(absmax_, other.absmax_);
}

int64_t KvTensorStats::slot(int s) const {
  uint64_t total = 0;
  for (const auto& lane : lanes_) total += lane[size_t(s)];
  return int64_t(total);
}

int64_t KvTensorStats::count() const {
  int64_t total = 0;
  for (int s = 0; s < kNonFiniteSlot; ++s) total += slot(s);
  return total;
}

int64_t KvTensorStats::nonzero() const {
  return count() - slot(kZeroSlot);
}

int64_t KvTensorStats::non_finite() const {
  return slot(kNonFiniteSlot);
}

int64_t KvTensorStats::underflow() const {
  return slot(kUnderflowSlot);
}

int64_t KvTensorStats::overflow() const {
  return slot(kOverflowSlot);
}

int64_t KvTensorStats::bin(int b) const {
  E4KV_ASSERT(b >= 0 && b < kKvHistBins, "bin out of range");
  return slot(kFirstBinSlot + b);
}

std::vector<int64_t> KvTensorStats::histogram() const {
  std::vector<int64_t> h(kKvHistBins);
  for (int b = 0; b < kKvHistBins; ++b) h[size_t(b)] = slot(kFirstBinSlot + b);
  return h;
}

KvTensorStats KvTensorStats::from_counts(int64_t count, int64_t non_finite, int64_t underflow,
                                         int64_t overflow, float absmax,
                                         const std::vector<int64_t>& histogram) {
  E4KV_ASSERT(histogram.size() == size_t(kKvHistBins), "histogram length");
  KvTensorStats stats;
  auto& lane = stats.lanes_[0];
  int64_t nonzero = underflow + overflow;
  for (int b = 0; b < kKvHistBins; ++b) {
    lane[size_t(kFirstBinSlot + b)] = uint64_t(histogram[size_t(b)]);
    nonzero += histogram[size_t(b)];
  }
  E4KV_ASSERT(count >= nonzero && non_finite >= 0 && underflow >= 0 && overflow >= 0,
              "inconsistent counts");
  lane[kZeroSlot] = uint64_t(count - nonzero);
  lane[kUnderflowSlot] = uint64_t(underflow);
  lane[kOverflowSlot] = uint64_t(overflow);
  lane[kNonFiniteSlot] = uint64_t(non_finite);
  stats.absmax_ = absmax;
  return stats;
}

bool operator==(const KvTensorStats& a, const KvTensorStats& b) {
  for (int s = 0; s < KvTensorStats::kSlots; ++s) {
    if (a.slot(s) != b.slot(s)) return false;
  }
  return a.absmax_ == b.absmax_;
}

// ---- KvStats
// -------------------------------------------------------------------------------------

namespace {

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

// "parse error at line 1, column 5: syntax error while parsing value - invalid literal; last
// read: ..." -> "syntax error while parsing value - invalid literal".
std::string json_error_reason(const json::parse_error& e) {
  std::string text = e.what();
  if (size_t pos = text.find("] "); pos != std::string::npos) text = text.substr(pos + 2);
  if (size_t pos = text.find("; last read:"); pos != std::string::npos) text.resize(pos);
  if (size_t pos = text.find("column "); pos != std::string::npos) {
    if (size_t colon = text.find(": ", pos); colon != std::string::npos) {
      text = text.substr(colon + 2);
    }
  }
  return text;
}

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
        return error(cat(what, " is too large: ", value.dump()));
      }
      return int64_t(value.get<uint64_t>());
    }
    if (value.is_number_integer()) {
      return error(cat(what, " must not be negative, got ", value.dump()));
    }
    return error(cat(what, " must be a non-negative integer, got ", value.dump()));
  }

  Result<std::string> string(const json& object, const char* field) const {
    auto it = object.find(field);
    if (it == object.end()) return error(cat("missing field \"", field, "\""));
    if (!it->is_string()) return error(cat("\"", field, "\" must be a string, got ", it->dump()));
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
    return p.error(cat("unsupported format ", format->dump(), "; expected \"", kKvStatsFormat,
                       "\" (written by a different e4kv version?)"));
  }
  auto geometry = root.find("histogram");
  if (geometry == root.end() || !geometry->is_object() ||
      geometry->value("min_log2", json()) != json(kKvHistMinLog2) ||
      geometry->value("max_log2", json()) != json(kKvHistMaxLog2) ||
      geometry->value("bins_per_octave", json()) != json(kKvHistBinsPerOctave)) {
    return p.error(cat("\"histogram\" must be {\"min_log2\": ", kKvHistMinLog2, ", \"max_log2\": ",
                       kKvHistMaxLog2, ", \"bins_per_octave\": ", kKvHistBinsPerOctave, "}, got ",
                       geometry == root.end() ? std::string("nothing") : geometry->dump()));
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
      return p.error(cat("\"key\" ", key->dump(), " does not match layer ", layer, " ", tensor_text,
                         " under prefix \"", stats.header().prefix, "\" (expected \"", expected,
                         "\")"));
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
        cat("\"absmax\" must be a finite non-negative fp32 value, got ", absmax_it->dump()));
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
    json root;
    try {
      root = json::parse(line.begin(), line.end());
    } catch (const json::parse_error& e) {
      return p.error(cat("invalid JSON at column ", e.byte, ": ", json_error_reason(e)));
    } catch (const json::exception& e) {
      return p.error(cat("invalid JSON: ", json_exception_reason(e)));
    }
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

}  // namespace e4kv
