#include "calib/report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "core/output_set.h"
#include "e4kv/e4m3.h"

namespace e4kv {
namespace {

using ordered_json = nlohmann::ordered_json;

const char* tensor_letter(KvTensor tensor) {
  return tensor == KvTensor::kK ? "K" : "V";
}

std::string format_g(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*g", digits, value);
  return buffer;
}

std::string percent(double fraction) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.4f%%", 100.0 * fraction);
  return buffer;
}

ordered_json low_range_json(const LowRange& range) {
  ordered_json out;
  out["below_2^-9"] = range.below_min_subnormal;
  out["in_2^-9_2^-6"] = range.subnormal;
  return out;
}

ordered_json optional_number(const std::optional<double>& value) {
  return value ? ordered_json(*value) : ordered_json(nullptr);
}

// The histogram without its empty ends: {"first_bin_log2": -12.5, "bin_width_log2": 0.125, ...}.
ordered_json histogram_json(const KvTensorStats& stats) {
  const std::vector<int64_t> hist = stats.histogram();
  int first = 0;
  int last = kKvHistBins - 1;
  while (first <= last && hist[size_t(first)] == 0) ++first;
  while (last >= first && hist[size_t(last)] == 0) --last;
  ordered_json out;
  out["zeros"] = stats.zeros();
  out["underflow"] = stats.underflow();
  out["overflow"] = stats.overflow();
  out["bin_width_log2"] = 1.0 / kKvHistBinsPerOctave;
  out["first_bin_log2"] = first <= last ? ordered_json(kv_hist_bin_lower_log2(first)) : nullptr;
  out["counts"] = first <= last
                      ? std::vector<int64_t>(hist.begin() + first, hist.begin() + last + 1)
                      : std::vector<int64_t>();
  return out;
}

const char* const kConventions[] = {
    "histogram: 8 bins per octave over [2^-24, 2^16); bin b holds floor(8*log2|x|) = b - 192; "
    "a bin stands for its largest possible value (the largest fp32 in it, capped at absmax)",
    "percentiles: nearest rank over all finite values (zeros included), rank = count - "
    "floor(count * (1 - q)); the value of the bin where the cumulative count reaches the rank "
    "(an upper bound within one bin of the exact value)",
    "scale: the smallest fp32 s with fl(v / s) <= 448, v = absmax or the policy's percentile",
    "envelope: scale = max(new, old) per key",
    "saturation: values with fl(|x| / s) > 448 over all finite values, counted per bin when the "
    "bin's largest value saturates (an upper bound; exactly 0 under absmax)",
    "low range: non-zero values with fl(|x| / s) < 2^-9 and in [2^-9, 2^-6), over the non-zero "
    "finite values; a bin counts when its largest value is below the threshold (a lower bound; "
    "exact at scale 1.0)",
    "E4M3 rel L2: the relative L2 error of storing the values as E4M3 at the scale (encode, "
    "decode, times the scale), sqrt(sum of squared errors / sum of squares), with each bin's "
    "values spread evenly over the bin; what rounding alone costs, the floor under the attention "
    "output's error",
    "shard spread: max / min of the per-shard absmax",
};

}  // namespace

std::string report_json(const Summary& summary) {
  ordered_json out;
  out["format"] = kKvReportFormat;
  out["tool"] = cat("e4kv ", E4KV_VERSION, " summarize");
  out["policy"] = std::string(scale_policy_name(summary.policy));
  out["source"] = summary.source;
  out["synthetic"] = summary.source != "observed";
  out["model"] = summary.model;
  out["prefix"] = summary.prefix;
  out["n_layers"] = summary.n_layers;
  out["kv_layers"] = summary.kv_layers;
  out["tokens"] = summary.tokens;
  out["shards"] = summary.shards;
  ordered_json inputs = ordered_json::array();
  for (const Summary::Input& input : summary.inputs) {
    ordered_json entry;
    entry["path"] = input.path;
    entry["sha256"] = input.sha256.empty() ? ordered_json(nullptr) : ordered_json(input.sha256);
    entry["shard"] = input.shard;
    entry["tokens"] = input.tokens;
    entry["source"] = input.source;
    inputs.push_back(std::move(entry));
  }
  out["inputs"] = std::move(inputs);
  if (summary.envelope_path) {
    out["envelope"] = {{"path", *summary.envelope_path},
                       {"sha256", summary.envelope_sha256},
                       {"rule", "scale = max(new, old) per key"}};
  } else {
    out["envelope"] = nullptr;
  }

  const SummaryTotals& totals = summary.totals;
  ordered_json t;
  t["tensors"] = summary.tensors.size();
  t["count"] = totals.count;
  t["nonzero"] = totals.nonzero;
  t["non_finite"] = totals.non_finite;
  t["saturated"] = totals.saturated;
  t["saturation_ratio"] = totals.count > 0 ? double(totals.saturated) / double(totals.count) : 0.0;
  t["min_scale"] = totals.min_scale;
  t["max_scale"] = totals.max_scale;
  t["at_scale_1"] = low_range_json(totals.at_unit);
  t["at_calibrated_scale"] = low_range_json(totals.at_scale);
  out["totals"] = std::move(t);

  ordered_json tensors = ordered_json::array();
  for (const TensorSummary& ts : summary.tensors) {
    ordered_json entry;
    entry["key"] = ts.key;
    entry["layer"] = ts.layer;
    entry["tensor"] = ts.tensor == KvTensor::kK ? "k" : "v";
    entry["count"] = ts.stats.count();
    entry["nonzero"] = ts.stats.nonzero();
    entry["non_finite"] = ts.stats.non_finite();
    entry["absmax"] = ts.absmax;
    entry["p99.9"] = ts.p99_9;
    entry["p99.99"] = ts.p99_99;
    entry["policy_value"] = ts.policy_value;
    entry["scale_from_stats"] = ts.scale_from_stats;
    entry["envelope_scale"] =
        ts.envelope_scale ? ordered_json(*ts.envelope_scale) : ordered_json(nullptr);
    entry["scale"] = ts.scale;
    entry["saturated"] = ts.saturated;
    entry["saturation_ratio"] = ts.saturation_ratio;
    entry["at_scale_1"] = low_range_json(ts.at_unit);
    entry["at_calibrated_scale"] = low_range_json(ts.at_scale);
    entry["e4m3_rounding_rel_l2"] = {{"at_scale_1", ts.rounding_rel_l2_unit},
                                     {"at_calibrated_scale", ts.rounding_rel_l2}};
    ordered_json shards;
    for (const ShardAbsmax& s : ts.shard_absmax) shards[s.shard] = s.absmax;
    entry["shard_absmax"] = std::move(shards);
    entry["shard_spread"] = optional_number(ts.shard_spread);
    entry["histogram"] = histogram_json(ts.stats);
    tensors.push_back(std::move(entry));
  }
  out["tensors"] = std::move(tensors);
  out["conventions"] = std::vector<std::string>(std::begin(kConventions), std::end(kConventions));
  return out.dump(2) + "\n";
}

std::string report_markdown(const Summary& summary) {
  const SummaryTotals& totals = summary.totals;
  std::string md = "# K/V scale calibration report\n\n";
  if (summary.source != "observed") {
    md += cat("> **Synthetic statistics** (source: ", summary.source,
              "): drawn by `e4kv synth-stats`, not observed on a real model's forwards. These "
              "scales exercise the tools; do not ship them.\n\n");
  }
  md += cat("- Model: `", summary.model, "` (", summary.n_layers, " layers, ",
            summary.kv_layers.size(), " with a KV cache, key prefix `", summary.prefix, "`)\n");
  md += cat("- Policy: **", scale_policy_name(summary.policy), "**",
            summary.envelope_path ? cat(", envelope with `", *summary.envelope_path,
                                        "` (scale = max(new, old) per key)")
                                  : std::string(),
            "\n");
  md += cat("- Tokens: ", summary.tokens, " over ", summary.inputs.size(), " statistics file",
            summary.inputs.size() == 1 ? "" : "s", ", shard", summary.shards.size() == 1 ? "" : "s",
            ":");
  for (const std::string& shard : summary.shards) md += " " + shard;
  md += "\n";
  for (const Summary::Input& input : summary.inputs) {
    md += cat("  - `", input.path, "`: shard ", input.shard, ", ", input.tokens, " tokens, ",
              input.source,
              input.sha256.empty() ? std::string() : cat(", sha256 `", input.sha256, "`"), "\n");
  }
  md += cat("- Values: ", totals.count, " finite (", totals.nonzero, " non-zero), ",
            totals.non_finite, " non-finite\n");
  md += cat("- Scales: ", summary.tensors.size(), " tensors, ", format_g(totals.min_scale, 9),
            " to ", format_g(totals.max_scale, 9), "\n");
  md +=
      cat("- Saturation: ", totals.saturated, " values (",
          percent(totals.count > 0 ? double(totals.saturated) / double(totals.count) : 0.0), ")\n");
  md += cat("- Low range at scale 1.0: ", percent(totals.at_unit.below_min_subnormal),
            " of non-zero values below 2^-9, ", percent(totals.at_unit.subnormal),
            " in [2^-9, 2^-6)\n");
  md += cat("- Low range at the calibrated scales: ", percent(totals.at_scale.below_min_subnormal),
            " below 2^-9, ", percent(totals.at_scale.subnormal), " in [2^-9, 2^-6)\n");
  for (KvTensor kind : {KvTensor::kK, KvTensor::kV}) {
    double lo = 0.0, hi = 0.0;
    bool any = false;
    for (const TensorSummary& t : summary.tensors) {
      if (t.tensor != kind) continue;
      lo = any ? std::min(lo, t.rounding_rel_l2) : t.rounding_rel_l2;
      hi = any ? std::max(hi, t.rounding_rel_l2) : t.rounding_rel_l2;
      any = true;
    }
    if (any) {
      md += cat("- E4M3 rounding error of ", kind == KvTensor::kK ? "K" : "V",
                " at the calibrated scales (relative L2): ", format_g(lo, 4), " to ",
                format_g(hi, 4), "\n");
    }
  }
  md += "\n";

  md += "## Per tensor\n\n";
  md +=
      "| key | absmax | p99.9 | p99.99 | scale | saturation | <2^-9 @1 | [2^-9,2^-6) @1 | "
      "<2^-9 @s | [2^-9,2^-6) @s | E4M3 rel L2 @1 | E4M3 rel L2 @s | shard spread |\n";
  md += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const TensorSummary& t : summary.tensors) {
    std::string scale = format_g(t.scale, 9);
    if (t.envelope_scale && *t.envelope_scale >= t.scale_from_stats) scale += " (old)";
    md += cat("| `", t.key, "` | ", format_g(t.absmax, 6), " | ", format_g(t.p99_9, 6), " | ",
              format_g(t.p99_99, 6), " | ", scale, " | ", percent(t.saturation_ratio), " | ",
              percent(t.at_unit.below_min_subnormal), " | ", percent(t.at_unit.subnormal), " | ",
              percent(t.at_scale.below_min_subnormal), " | ", percent(t.at_scale.subnormal), " | ",
              format_g(t.rounding_rel_l2_unit, 4), " | ", format_g(t.rounding_rel_l2, 4), " | ",
              t.shard_spread ? format_g(*t.shard_spread, 4) : std::string("n/a"), " |\n");
  }
  if (summary.envelope_path) md += "\n(old): the envelope's scale was the larger.\n";
  md += "\n## Histograms\n\n![log2 histograms of |x| with the E4M3 windows](report.svg)\n\n";
  md += "## Conventions\n\n";
  for (const char* line : kConventions) md += cat("- ", line, "\n");
  return md;
}

// ---- SVG
// -----------------------------------------------------------------------------------------

std::string xml_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

namespace {

std::string px(double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.1f", v);
  return buffer;
}

// "2<sup>-8</sup>" as SVG: the exponent raised and smaller.
std::string power_label(int base, int exponent) {
  if (exponent == 0) return "1";
  return cat(base, "<tspan dy=\"-5\" font-size=\"8\">", exponent, "</tspan>");
}

constexpr double kCellW = 330;
constexpr double kCellH = 215;
constexpr double kPlotLeft = 50;
constexpr double kPlotRight = 14;
constexpr double kPlotTop = 40;
constexpr double kPlotBottom = 38;
constexpr double kPad = 16;
constexpr double kHeaderH = 104;

const double kLog2E4m3Max = std::log2(double(kE4m3Max));  // 8.807

struct Axes {
  double x_min = 0;  // log2 |x|
  double x_max = 0;
  double y_min = 0;  // log10 fraction
  double y_max = 0;
};

// One x range for every panel, so that panels compare by eye: the data and both windows, padded
// to whole octaves; one y range from the smallest bar to 1.
Axes shared_axes(const Summary& summary) {
  double lo = -9.0;
  double hi = kLog2E4m3Max;
  double smallest = 1.0;
  for (const TensorSummary& t : summary.tensors) {
    const std::vector<int64_t> hist = t.stats.histogram();
    const double nonzero = double(t.stats.nonzero());
    for (int b = 0; b < kKvHistBins; ++b) {
      if (hist[size_t(b)] == 0) continue;
      lo = std::min(lo, kv_hist_bin_lower_log2(b));
      hi = std::max(hi, kv_hist_bin_lower_log2(b + 1));
      smallest = std::min(smallest, double(hist[size_t(b)]) / nonzero);
    }
    if (t.stats.underflow() > 0) lo = std::min(lo, double(kKvHistMinLog2 - 1));
    if (t.stats.overflow() > 0) hi = std::max(hi, double(kKvHistMaxLog2 + 1));
    const double log2_scale = std::log2(double(t.scale));
    lo = std::min(lo, log2_scale - 9.0);
    hi = std::max(hi, log2_scale + kLog2E4m3Max);
  }
  Axes axes;
  axes.x_min = std::floor(lo) - 1.0;
  axes.x_max = std::ceil(hi) + 1.0;
  axes.y_max = 0.0;
  axes.y_min = std::clamp(std::floor(std::log10(smallest)), -12.0, -3.0);
  return axes;
}

class SvgPanel {
 public:
  SvgPanel(std::string& out, const Axes& axes, double cell_x, double cell_y)
      : out_(out),
        axes_(axes),
        x0_(cell_x + kPlotLeft),
        y0_(cell_y + kPlotTop),
        w_(kCellW - kPlotLeft - kPlotRight),
        h_(kCellH - kPlotTop - kPlotBottom) {}

  double x(double log2v) const {
    const double t = (log2v - axes_.x_min) / (axes_.x_max - axes_.x_min);
    return x0_ + std::clamp(t, 0.0, 1.0) * w_;
  }
  double y(double log10f) const {
    const double t = (axes_.y_max - log10f) / (axes_.y_max - axes_.y_min);
    return y0_ + std::clamp(t, 0.0, 1.0) * h_;
  }
  double left() const { return x0_; }
  double right() const { return x0_ + w_; }
  double top() const { return y0_; }
  double bottom() const { return y0_ + h_; }

  // A full-height band over [a, b] in log2 units.
  void band(double a, double b, const char* fill, double opacity) {
    const double xa = x(a);
    const double xb = x(b);
    if (xb <= xa) return;
    out_ +=
        cat("<rect x=\"", px(xa), "\" y=\"", px(top()), "\" width=\"", px(xb - xa), "\" height=\"",
            px(h_), "\" fill=\"", fill, "\" fill-opacity=\"", opacity, "\"/>\n");
  }
  void vline(double log2v, const char* stroke, const char* dash, double width) {
    if (log2v < axes_.x_min || log2v > axes_.x_max) return;
    const double xv = x(log2v);
    out_ += cat("<line x1=\"", px(xv), "\" y1=\"", px(top()), "\" x2=\"", px(xv), "\" y2=\"",
                px(bottom()), "\" stroke=\"", stroke, "\" stroke-width=\"", width, "\"",
                dash[0] ? cat(" stroke-dasharray=\"", dash, "\"") : std::string(), "/>\n");
  }
  // The histogram as one filled step outline over consecutive bins: bin i spans
  // [edges[i], edges[i + 1]) in log2 units and holds fractions[i] (0: empty).
  void histogram(const std::vector<double>& edges, const std::vector<double>& fractions,
                 const char* fill) {
    if (fractions.empty()) return;
    std::string d = cat("M", px(x(edges[0])), ",", px(bottom()));
    for (size_t i = 0; i < fractions.size(); ++i) {
      const double top_y = fractions[i] > 0.0 ? y(std::log10(fractions[i])) : bottom();
      d += cat("V", px(top_y), "H", px(x(edges[i + 1])));
    }
    d += cat("V", px(bottom()), "Z");
    out_ += cat("<path d=\"", d, "\" fill=\"", fill, "\"/>\n");
  }

 private:
  std::string& out_;
  const Axes& axes_;
  double x0_, y0_, w_, h_;
};

const char* kHistFill = "#3b6fb6";
const char* kUnitFill = "#9e9e9e";
const char* kUnitStroke = "#424242";
const char* kScaledFill = "#f28e2b";
const char* kScaledStroke = "#c0530c";
const char* kAbsmaxStroke = "#d62728";

void svg_panel(std::string& out, const Axes& axes, const TensorSummary& t, double cell_x,
               double cell_y, bool first_column) {
  SvgPanel p(out, axes, cell_x, cell_y);
  out += cat("<g>\n<title>", xml_escape(t.key), "</title>\n");
  // Title: the tensor, then its scale and figures.
  const std::string saturation = t.saturated == 0 ? std::string("0") : percent(t.saturation_ratio);
  out += cat("<text x=\"", px(cell_x + 8), "\" y=\"", px(cell_y + 14),
             "\" font-size=\"12\"><tspan font-weight=\"bold\">layer ", t.layer, " ",
             tensor_letter(t.tensor), "</tspan><tspan dx=\"7\" font-size=\"10\" fill=\"#333\">",
             "s ", format_g(t.scale, 6), " · absmax ", format_g(t.absmax, 4), " · sat ", saturation,
             "</tspan></text>\n");
  out +=
      cat("<text x=\"", px(cell_x + 8), "\" y=\"", px(cell_y + 29),
          "\" font-size=\"9.5\" fill=\"#555\">below 2<tspan dy=\"-4\" font-size=\"7\">-9</tspan>",
          "<tspan dy=\"4\">: ", percent(t.at_unit.below_min_subnormal), " at 1 → ",
          percent(t.at_scale.below_min_subnormal), " at s · p99.99 ", format_g(t.p99_99, 4),
          "</tspan></text>\n");

  // Frame and grid.
  out += cat("<rect x=\"", px(p.left()), "\" y=\"", px(p.top()), "\" width=\"",
             px(p.right() - p.left()), "\" height=\"", px(p.bottom() - p.top()),
             "\" fill=\"#ffffff\" stroke=\"none\"/>\n");
  const double x_range = axes.x_max - axes.x_min;
  const int x_step = x_range > 32 ? 8 : (x_range > 16 ? 4 : 2);
  const int y_step = axes.y_max - axes.y_min > 6 ? 2 : 1;
  for (int e = int(std::ceil(axes.x_min / x_step)) * x_step; e <= axes.x_max; e += x_step) {
    p.vline(e, "#e6e6e6", "", 1);
  }
  for (int d = int(axes.y_max); d >= axes.y_min; d -= y_step) {
    out += cat("<line x1=\"", px(p.left()), "\" y1=\"", px(p.y(d)), "\" x2=\"", px(p.right()),
               "\" y2=\"", px(p.y(d)), "\" stroke=\"#e6e6e6\"/>\n");
  }

  // The E4M3 windows: [2^-9, 448] at scale 1.0 and [s 2^-9, s 448] at the calibrated scale, each
  // with its subnormal part [2^-9, 2^-6) darker.
  const double log2_scale = std::log2(double(t.scale));
  p.band(-9.0, kLog2E4m3Max, kUnitFill, 0.16);
  p.band(-9.0, -6.0, kUnitFill, 0.22);
  p.band(log2_scale - 9.0, log2_scale + kLog2E4m3Max, kScaledFill, 0.18);
  p.band(log2_scale - 9.0, log2_scale - 6.0, kScaledFill, 0.25);

  // The histogram: fraction of the non-zero values per 1/8-octave bin, from the first non-empty
  // bin to the last; underflow and overflow as one more bin of an octave at each end.
  {
    const std::vector<int64_t> hist = t.stats.histogram();
    const double nonzero = double(t.stats.nonzero());
    std::vector<double> edges;
    std::vector<double> fractions;
    if (t.stats.underflow() > 0) {
      edges.push_back(kKvHistMinLog2 - 1.0);
      fractions.push_back(double(t.stats.underflow()) / nonzero);
    }
    int first = 0;
    int last = kKvHistBins - 1;
    if (t.stats.underflow() == 0) {
      while (first < last && hist[size_t(first)] == 0) ++first;
    }
    if (t.stats.overflow() == 0) {
      while (last > first && hist[size_t(last)] == 0) --last;
    }
    for (int b = first; b <= last; ++b) {
      edges.push_back(kv_hist_bin_lower_log2(b));
      fractions.push_back(double(hist[size_t(b)]) / nonzero);
    }
    edges.push_back(kv_hist_bin_lower_log2(last + 1));
    if (t.stats.overflow() > 0) {
      fractions.push_back(double(t.stats.overflow()) / nonzero);
      edges.push_back(kKvHistMaxLog2 + 1.0);
    }
    p.histogram(edges, fractions, kHistFill);
  }

  // Window edges and the absmax.
  p.vline(-9.0, kUnitStroke, "4 3", 1.2);
  p.vline(kLog2E4m3Max, kUnitStroke, "4 3", 1.2);
  p.vline(log2_scale - 9.0, kScaledStroke, "", 1.4);
  p.vline(log2_scale + kLog2E4m3Max, kScaledStroke, "", 1.4);
  p.vline(std::log2(double(t.absmax)), kAbsmaxStroke, "2 2", 1.4);

  // Axes, ticks and labels.
  out += cat("<rect x=\"", px(p.left()), "\" y=\"", px(p.top()), "\" width=\"",
             px(p.right() - p.left()), "\" height=\"", px(p.bottom() - p.top()),
             "\" fill=\"none\" stroke=\"#222\"/>\n");
  for (int e = int(std::ceil(axes.x_min / x_step)) * x_step; e <= axes.x_max; e += x_step) {
    const double xv = p.x(e);
    out += cat("<line x1=\"", px(xv), "\" y1=\"", px(p.bottom()), "\" x2=\"", px(xv), "\" y2=\"",
               px(p.bottom() + 4), "\" stroke=\"#222\"/>\n");
    out += cat("<text x=\"", px(xv), "\" y=\"", px(p.bottom() + 16),
               "\" font-size=\"10\" text-anchor=\"middle\">", power_label(2, e), "</text>\n");
  }
  for (int d = int(axes.y_max); d >= axes.y_min; d -= y_step) {
    const double yv = p.y(d);
    out += cat("<line x1=\"", px(p.left() - 4), "\" y1=\"", px(yv), "\" x2=\"", px(p.left()),
               "\" y2=\"", px(yv), "\" stroke=\"#222\"/>\n");
    out += cat("<text x=\"", px(p.left() - 6), "\" y=\"", px(yv + 3.5),
               "\" font-size=\"10\" text-anchor=\"end\">", power_label(10, d), "</text>\n");
  }
  out += cat("<text x=\"", px((p.left() + p.right()) / 2), "\" y=\"", px(p.bottom() + 31),
             "\" font-size=\"10\" text-anchor=\"middle\" fill=\"#333\">|x| (log2 axis)</text>\n");
  if (first_column) {
    const double cx = cell_x + 11;
    const double cy = (p.top() + p.bottom()) / 2;
    out += cat("<text x=\"", px(cx), "\" y=\"", px(cy), "\" font-size=\"10\" fill=\"#333\" ",
               "text-anchor=\"middle\" transform=\"rotate(-90 ", px(cx), " ", px(cy),
               ")\">fraction per bin</text>\n");
  }
  out += "</g>\n";
}

void svg_legend_item(std::string& out, double x, double y, const std::string& swatch,
                     const std::string& label) {
  out += cat("<g transform=\"translate(", px(x), " ", px(y), ")\">", swatch,
             "<text x=\"26\" y=\"9\"", " font-size=\"11\">", label, "</text></g>\n");
}

}  // namespace

std::string report_svg(const Summary& summary) {
  const size_t n = summary.tensors.size();
  const size_t cols = std::max<size_t>(1, std::min<size_t>(4, n));
  const size_t rows = (n + cols - 1) / cols;
  const double width = 2 * kPad + double(cols) * kCellW;
  const double height = kHeaderH + double(rows) * kCellH + kPad;
  const Axes axes = shared_axes(summary);

  std::string out;
  out += cat("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", px(width), "\" height=\"",
             px(height), "\" viewBox=\"0 0 ", px(width), " ", px(height),
             "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n");
  out += cat("<rect width=\"", px(width), "\" height=\"", px(height), "\" fill=\"#fafafa\"/>\n");
  const SummaryTotals& totals = summary.totals;
  out += cat("<text x=\"", px(kPad), "\" y=\"24\" font-size=\"16\" font-weight=\"bold\">",
             "K/V calibration: ", xml_escape(summary.model), " · policy ",
             scale_policy_name(summary.policy), summary.envelope_path ? " + envelope" : "", " · ",
             n, " tensors · ", summary.tokens, " tokens · ", summary.shards.size(), " shard",
             summary.shards.size() == 1 ? "" : "s", "</text>\n");
  out += cat("<text x=\"", px(kPad), "\" y=\"42\" font-size=\"11\" fill=\"#333\">scales ",
             format_g(totals.min_scale, 6), " … ", format_g(totals.max_scale, 6), " · saturation ",
             percent(totals.count ? double(totals.saturated) / totals.count : 0),
             " · non-zero values below 2<tspan dy=\"-4\" font-size=\"8\">-9</tspan><tspan dx=\"4\" "
             "dy=\"4\">",
             "at scale 1.0: ", percent(totals.at_unit.below_min_subnormal),
             ", at the calibrated scales: ", percent(totals.at_scale.below_min_subnormal),
             "</tspan></text>\n");
  if (summary.source != "observed") {
    out += cat("<text x=\"", px(width - kPad), "\" y=\"24\" font-size=\"13\" font-weight=\"bold\" ",
               "fill=\"#c62828\" text-anchor=\"end\">SYNTHETIC statistics, not a real "
               "calibration</text>\n");
  }
  // Legend.
  const double ly = 56;
  svg_legend_item(out, kPad, ly, cat("<rect width=\"20\" height=\"10\" fill=\"", kHistFill, "\"/>"),
                  "|x| per 1/8-octave bin (fraction of non-zero values)");
  svg_legend_item(
      out, kPad + 350, ly,
      cat("<rect width=\"20\" height=\"10\" fill=\"", kUnitFill, "\" fill-opacity=\"0.35\" ",
          "stroke=\"", kUnitStroke, "\" stroke-dasharray=\"4 3\"/>"),
      "E4M3 window at scale 1.0: [2<tspan dy=\"-4\" font-size=\"8\">-9</tspan><tspan dy=\"4\">, "
      "448]</tspan>");
  svg_legend_item(out, kPad + 620, ly,
                  cat("<rect width=\"20\" height=\"10\" fill=\"", kScaledFill,
                      "\" fill-opacity=\"0.35\" stroke=\"", kScaledStroke, "\"/>"),
                  "E4M3 window at the calibrated scale s: [s·2<tspan dy=\"-4\" "
                  "font-size=\"8\">-9</tspan><tspan dy=\"4\">, s·448]</tspan>");
  svg_legend_item(
      out, kPad, ly + 20,
      cat("<rect width=\"20\" height=\"10\" fill=\"", kUnitFill, "\" fill-opacity=\"0.6\"/>"),
      "darker part: E4M3 subnormals [2<tspan dy=\"-4\" font-size=\"8\">-9</tspan>"
      "<tspan dy=\"4\">, 2</tspan><tspan dy=\"-4\" font-size=\"8\">-6</tspan>"
      "<tspan dy=\"4\">) (times s)</tspan>");
  svg_legend_item(out, kPad + 350, ly + 20,
                  cat("<line x1=\"0\" y1=\"5\" x2=\"20\" y2=\"5\" stroke=\"", kAbsmaxStroke,
                      "\" stroke-width=\"1.6\" stroke-dasharray=\"2 2\"/>"),
                  "absmax");
  for (size_t i = 0; i < n; ++i) {
    const double cx = kPad + double(i % cols) * kCellW;
    const double cy = kHeaderH + double(i / cols) * kCellH;
    svg_panel(out, axes, summary.tensors[i], cx, cy, i % cols == 0);
  }
  out += "</svg>\n";
  return out;
}

// ---- files
// ---------------------------------------------------------------------------------------

Status write_report(const std::filesystem::path& dir, const Summary& summary, bool replace) {
  const std::filesystem::path parent =
      std::filesystem::absolute(dir).lexically_normal().parent_path();
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
  if (ec) {
    return Status::error(cat(dir.string(), ": cannot create the report directory's parent: ",
                             ec.message()));
  }
  return write_output_set_dir(dir,
                              {{std::string(kReportFileNames[0]), report_json(summary)},
                               {std::string(kReportFileNames[1]), report_markdown(summary)},
                               {std::string(kReportFileNames[2]), report_svg(summary)}},
                              replace);
}

}  // namespace e4kv
