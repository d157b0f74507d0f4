#include "calib/compare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "calib/report.h"
#include "core/check.h"
#include "core/file_io.h"
#include "core/output_set.h"

namespace e4kv {
namespace {

using json = nlohmann::ordered_json;

std::string fmt(const char* format, double value) {
  if (!std::isfinite(value)) return "-";  // a measure over nothing, or an infinite error
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, value);
  return buf;
}

// A finite double for JSON (null otherwise).
json number(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

json error_json(const OutputError& e) {
  return {{"rel_l2", number(e.rel_l2)}, {"cosine", number(e.cosine)}, {"rmse", number(e.rmse)}};
}

json mode_json(const ModeCompare& m, bool reference, bool isolated) {
  json j;
  j["name"] = m.name;
  j["scales"] = m.scales;
  j["prompts"] = m.prompts;
  j["perplexity"] = number(m.perplexity());
  j["nll_tokens"] = m.nll_tokens;
  if (!reference) {
    j["mean_kl"] = number(m.mean_kl());
    j["kl_positions"] = m.kl_positions;
    j["first_token_equal"] = m.first_token_equal;
    const OutputError all = m.aggregate_output();
    j["attention_output"] = error_json(all);
    if (isolated) j["attention_output_isolated"] = error_json(m.aggregate_isolated());
    json layers = json::array();
    for (const LayerCompare& l : m.layers) {
      const OutputError e = l.output.result();
      json row = {{"layer", l.layer}, {"kind", l.qsa ? "qsa" : "attention"}};
      row.update(error_json(e));
      if (isolated) row["isolated"] = error_json(l.isolated.result());
      if (l.qsa && l.rows > 0) {
        row["selection"] = {
            {"rows", l.rows},
            {"mean_jaccard", l.sum_jaccard / double(l.rows)},
            {"mean_fp16_recall", l.sum_recall / double(l.rows)},
            {"min_fp16_recall", l.min_recall},
            {"exact_row_ratio", double(l.exact_rows) / double(l.rows)},
            {"micro_jaccard",
             l.sum_union > 0 ? double(l.sum_intersection) / double(l.sum_union) : 1.0}};
      }
      layers.push_back(std::move(row));
    }
    j["layers"] = std::move(layers);
    j["greedy"] = {{"prompts", m.greedy_prompts},
                   {"identical", m.greedy_identical},
                   {"first_divergence", m.first_divergence}};
  }
  json passkey = json::array();
  for (const PasskeyCell& c : m.passkey) {
    passkey.push_back({{"context", c.context},
                       {"depth", c.depth},
                       {"correct", c.correct},
                       {"total", c.total}});
  }
  j["passkey"] = std::move(passkey);
  return j;
}

}  // namespace

LayerCompare& ModeCompare::layer_entry(int64_t layer, bool qsa) {
  for (LayerCompare& l : layers) {
    if (l.layer == layer) return l;
  }
  LayerCompare l;
  l.layer = layer;
  l.qsa = qsa;
  layers.push_back(l);
  std::sort(layers.begin(), layers.end(),
            [](const LayerCompare& a, const LayerCompare& b) { return a.layer < b.layer; });
  return layer_entry(layer, qsa);
}

void ModeCompare::add_output(int64_t layer, bool qsa, std::span<const float> test,
                             std::span<const float> ref) {
  layer_entry(layer, qsa).output.add(test, ref);
}

void ModeCompare::add_isolated_output(int64_t layer, bool qsa, std::span<const float> test,
                                      std::span<const float> ref) {
  layer_entry(layer, qsa).isolated.add(test, ref);
}

void ModeCompare::add_selection(int64_t layer, std::span<const int32_t> test_tokens,
                                std::span<const int32_t> test_counts,
                                std::span<const int32_t> ref_tokens,
                                std::span<const int32_t> ref_counts, int64_t width) {
  E4KV_ASSERT(test_counts.size() == ref_counts.size(), "add_selection: row counts differ");
  LayerCompare& l = layer_entry(layer, true);
  for (size_t r = 0; r < ref_counts.size(); ++r) {
    const size_t base = r * size_t(width);
    const RowOverlap o = selection_row_overlap(
        ref_tokens.subspan(base, size_t(std::clamp<int64_t>(ref_counts[r], 0, width))),
        test_tokens.subspan(base, size_t(std::clamp<int64_t>(test_counts[r], 0, width))));
    l.rows += 1;
    l.sum_jaccard += o.jaccard;
    l.sum_recall += o.recall;
    l.min_recall = std::min(l.min_recall, o.recall);
    l.exact_rows += o.exact ? 1 : 0;
    l.sum_intersection += o.n_intersection;
    l.sum_union += o.n_union;
  }
}

void ModeCompare::add_greedy(std::span<const int32_t> test, std::span<const int32_t> ref) {
  greedy_prompts += 1;
  const size_t n = std::min(test.size(), ref.size());
  int64_t diverge = -1;
  for (size_t i = 0; i < n; ++i) {
    if (test[i] != ref[i]) {
      diverge = int64_t(i);
      break;
    }
  }
  if (diverge < 0 && test.size() != ref.size()) diverge = int64_t(n);  // one stopped earlier
  if (diverge < 0) greedy_identical += 1;
  first_divergence.push_back(diverge);
}

void ModeCompare::add_passkey(int64_t context, int64_t depth, bool correct) {
  auto it = std::find_if(passkey.begin(), passkey.end(), [&](const PasskeyCell& c) {
    return c.context == context && c.depth == depth;
  });
  if (it == passkey.end()) it = passkey.insert(passkey.end(), PasskeyCell{context, depth, 0, 0});
  it->correct += correct ? 1 : 0;
  it->total += 1;
}

OutputError ModeCompare::aggregate_output() const {
  // Pools every layer: the accumulators' sums add.
  OutputErrorAccumulator all;
  for (const LayerCompare& l : layers) all.merge(l.output);
  return all.result();
}

OutputError ModeCompare::aggregate_isolated() const {
  OutputErrorAccumulator all;
  for (const LayerCompare& l : layers) all.merge(l.isolated);
  return all.result();
}

double ModeCompare::perplexity() const {
  return nll_tokens > 0 ? std::exp(sum_nll / double(nll_tokens))
                        : std::numeric_limits<double>::quiet_NaN();
}

namespace {

double rel_l2(double sum_sq_error, double sum_sq_value) {
  return sum_sq_value > 0.0 ? std::sqrt(sum_sq_error / sum_sq_value) : 0.0;
}

PleTableCompare pooled(const PleCompare& ple) {
  PleTableCompare all;
  for (const PleTableCompare& l : ple.layers) {
    all.rows += l.rows;
    all.values += l.values;
    all.sum_sq_error += l.sum_sq_error;
    all.sum_sq_value += l.sum_sq_value;
  }
  return all;
}

json ple_json(const std::optional<PleCompare>& ple) {
  if (!ple) return nullptr;
  const PleTableCompare all = pooled(*ple);
  json j = {{"dtype", "fp8_e4m3"},
            {"scale", "fp32 per row, amax / 448"},
            {"rows_measured", "all"},
            {"checkpoint_dtype", ple->checkpoint_dtype},
            {"checkpoint_bytes", ple->checkpoint_bytes},
            {"host_bytes", ple->host_bytes},
            {"rows", all.rows},
            {"values", all.values},
            {"rel_l2", number(rel_l2(all.sum_sq_error, all.sum_sq_value))}};
  json layers = json::array();
  for (const PleTableCompare& l : ple->layers) {
    layers.push_back({{"layer", l.layer},
                      {"rows", l.rows},
                      {"values", l.values},
                      {"rel_l2", number(rel_l2(l.sum_sq_error, l.sum_sq_value))}});
  }
  j["layers"] = std::move(layers);
  return j;
}

}  // namespace

std::string compare_json(const CompareReport& report) {
  json j;
  j["format"] = "e4kv-compare/1";
  j["model"] = report.model;
  j["device"] = report.device;
  j["prompts"] = report.prompts;
  j["teacher_forced_tokens"] = report.teacher_forced_tokens;
  j["max_tokens"] = report.max_tokens;
  j["isolated"] = report.isolated;
  j["reference"] = mode_json(report.reference, true, false);
  json modes = json::array();
  for (const ModeCompare& m : report.modes) modes.push_back(mode_json(m, false, report.isolated));
  j["modes"] = std::move(modes);
  j["ple_tables"] = ple_json(report.ple);
  return j.dump(1) + "\n";
}

std::string compare_markdown(const CompareReport& report) {
  std::string md;
  md += cat("# FP16 KV vs E4M3 KV: ", report.model, "\n\n");
  md += cat(report.prompts, " prompts, ", report.teacher_forced_tokens,
            " teacher-forced tokens, greedy continuations of up to ", report.max_tokens,
            " tokens; device ", report.device, ". Definitions: DESIGN.md section 8.\n\n");
  if (report.ple) {
    const PleTableCompare all = pooled(*report.ple);
    md += cat("Every mode read the PLE n-gram tables as fp8_e4m3 (an FP32 scale per row, amax / "
              "448): relative L2 of the decoded tables against the checkpoint's ",
              report.ple->checkpoint_dtype, " values ",
              fmt("%.4g", rel_l2(all.sum_sq_error, all.sum_sq_value)), " over all ", all.rows,
              " rows (", all.values, " values) of ", report.ple->layers.size(), " table",
              report.ple->layers.size() == 1 ? "" : "s", ";");
    for (const PleTableCompare& l : report.ple->layers) {
      md += cat(" layer ", l.layer, ": ", fmt("%.4g", rel_l2(l.sum_sq_error, l.sum_sq_value)));
    }
    md += cat(". Host memory ", report.ple->host_bytes, " bytes (the checkpoint's ",
              report.ple->checkpoint_bytes, ").\n\n");
  }
  md += "| mode | scales | perplexity | mean KL | first token | greedy identical | "
        "attn rel L2 | attn cosine |\n";
  md += "|---|---|---|---|---|---|---|---|\n";
  md += cat("| fp16 | - | ", fmt("%.4f", report.reference.perplexity()), " | - | - | - | - | - |\n");
  for (const ModeCompare& m : report.modes) {
    const OutputError all = m.aggregate_output();
    md += cat("| ", m.name, " | ", m.scales, " | ", fmt("%.4f", m.perplexity()), " | ",
              fmt("%.3g", m.mean_kl()), " | ", m.first_token_equal, "/", m.prompts, " | ",
              m.greedy_identical, "/", m.greedy_prompts, " | ", fmt("%.4g", all.rel_l2), " | ",
              fmt("%.6f", all.cosine), " |\n");
  }
  for (const ModeCompare& m : report.modes) {
    md += cat("\n## ", m.name, ": per layer\n\n");
    md += "| layer | kind | rel L2 | cosine | RMSE | sel. Jaccard | FP16 recall (mean / min) | "
          "exact rows | micro Jaccard |\n";
    md += "|---|---|---|---|---|---|---|---|---|\n";
    for (const LayerCompare& l : m.layers) {
      const OutputError e = l.output.result();
      md += cat("| ", l.layer, " | ", l.qsa ? "qsa" : "attention", " | ", fmt("%.4g", e.rel_l2),
                " | ", fmt("%.6f", e.cosine), " | ", fmt("%.4g", e.rmse), " | ");
      if (l.qsa && l.rows > 0) {
        md += cat(fmt("%.4f", l.sum_jaccard / double(l.rows)), " | ",
                  fmt("%.4f", l.sum_recall / double(l.rows)), " / ", fmt("%.4f", l.min_recall),
                  " | ", fmt("%.4f", double(l.exact_rows) / double(l.rows)), " | ",
                  fmt("%.4f", l.sum_union > 0 ? double(l.sum_intersection) / double(l.sum_union)
                                              : 1.0),
                  " |\n");
      } else {
        md += "- | - | - | - |\n";
      }
    }
  }
  if (report.isolated) {
    md += "\n## Attention output on the FP16 run's inputs (--isolated)\n\n"
          "Each layer of the E4M3 run read the FP16 run's input for that layer: its cache "
          "format's own error, none carried from earlier layers.\n\n"
          "| mode | layer | kind | rel L2 | cosine | RMSE | rel L2, whole run |\n"
          "|---|---|---|---|---|---|---|\n";
    for (const ModeCompare& m : report.modes) {
      for (const LayerCompare& l : m.layers) {
        const OutputError e = l.isolated.result();
        md += cat("| ", m.name, " | ", l.layer, " | ", l.qsa ? "qsa" : "attention", " | ",
                  fmt("%.4g", e.rel_l2), " | ", fmt("%.6f", e.cosine), " | ",
                  fmt("%.4g", e.rmse), " | ", fmt("%.4g", l.output.result().rel_l2), " |\n");
      }
      const OutputError all = m.aggregate_isolated();
      md += cat("| ", m.name, " | all | - | ", fmt("%.4g", all.rel_l2), " | ",
                fmt("%.6f", all.cosine), " | ", fmt("%.4g", all.rmse), " | ",
                fmt("%.4g", m.aggregate_output().rel_l2), " |\n");
    }
  }
  if (!report.reference.passkey.empty()) {
    md += "\n## Passkey retrieval (correct / prompts)\n\n| context | depth % | fp16 |";
    for (const ModeCompare& m : report.modes) md += cat(" ", m.name, " |");
    md += "\n|---|---|---|";
    for (size_t i = 0; i < report.modes.size(); ++i) md += "---|";
    md += "\n";
    for (size_t c = 0; c < report.reference.passkey.size(); ++c) {
      const PasskeyCell& ref = report.reference.passkey[c];
      md += cat("| ", ref.context, " | ", ref.depth, " | ", ref.correct, "/", ref.total, " |");
      for (const ModeCompare& m : report.modes) {
        const PasskeyCell* cell = c < m.passkey.size() ? &m.passkey[c] : nullptr;
        md += cell ? cat(" ", cell->correct, "/", cell->total, " |") : std::string(" - |");
      }
      md += "\n";
    }
  }
  md += "\n![per-layer attention-output relative L2](compare.svg)\n";
  return md;
}

std::string compare_svg(const CompareReport& report) {
  // One group of bars per attention/QSA layer, one bar per mode: relative L2 of the output.
  constexpr double kPad = 56, kTop = 60, kPlotH = 220, kBarW = 12, kGap = 10;
  const char* colours[] = {"#1565c0", "#c62828", "#2e7d32", "#6a1b9a"};
  std::vector<int64_t> layers;
  double max_err = 0;
  for (const ModeCompare& m : report.modes) {
    for (const LayerCompare& l : m.layers) {
      if (std::find(layers.begin(), layers.end(), l.layer) == layers.end()) {
        layers.push_back(l.layer);
      }
      const double e = l.output.result().rel_l2;
      if (std::isfinite(e)) max_err = std::max(max_err, e);
    }
  }
  std::sort(layers.begin(), layers.end());
  const double n_modes = double(std::max<size_t>(1, report.modes.size()));
  const double group = n_modes * kBarW + kGap;
  const double width = 2 * kPad + std::max(1.0, double(layers.size())) * group;
  const double height = kTop + kPlotH + 50;
  const double top = max_err > 0 ? max_err * 1.1 : 1.0;
  std::string out;
  out += cat("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", fmt("%.0f", width),
             "\" height=\"", fmt("%.0f", height),
             "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n");
  out += cat("<rect width=\"100%\" height=\"100%\" fill=\"#fafafa\"/>\n");
  out += cat("<text x=\"", fmt("%.0f", kPad), "\" y=\"22\" font-size=\"14\" font-weight=\"bold\">",
             "Attention output vs FP16 KV, relative L2 per layer: ", xml_escape(report.model),
             "</text>\n");
  double lx = kPad;
  for (size_t i = 0; i < report.modes.size(); ++i) {
    out += cat("<rect x=\"", fmt("%.0f", lx), "\" y=\"34\" width=\"12\" height=\"10\" fill=\"",
               colours[i % 4], "\"/><text x=\"", fmt("%.0f", lx + 16),
               "\" y=\"43\" font-size=\"11\">", xml_escape(report.modes[i].name), "</text>\n");
    lx += 120;
  }
  const double base = kTop + kPlotH;
  out += cat("<line x1=\"", fmt("%.0f", kPad), "\" y1=\"", fmt("%.0f", base), "\" x2=\"",
             fmt("%.0f", width - kPad), "\" y2=\"", fmt("%.0f", base),
             "\" stroke=\"#333\"/>\n");
  for (int t = 0; t <= 4; ++t) {
    const double v = top * t / 4.0;
    const double y = base - kPlotH * t / 4.0;
    out += cat("<text x=\"", fmt("%.0f", kPad - 4), "\" y=\"", fmt("%.1f", y + 3),
               "\" font-size=\"9\" text-anchor=\"end\">", fmt("%.3g", v), "</text>\n");
  }
  for (size_t g = 0; g < layers.size(); ++g) {
    const double gx = kPad + double(g) * group + kGap / 2;
    for (size_t i = 0; i < report.modes.size(); ++i) {
      for (const LayerCompare& l : report.modes[i].layers) {
        if (l.layer != layers[g]) continue;
        const double e = l.output.result().rel_l2;
        const double h = std::isfinite(e) ? kPlotH * e / top : kPlotH;
        out += cat("<rect x=\"", fmt("%.1f", gx + double(i) * kBarW), "\" y=\"",
                   fmt("%.1f", base - h), "\" width=\"", fmt("%.0f", kBarW - 1), "\" height=\"",
                   fmt("%.1f", h), "\" fill=\"", colours[i % 4], "\"><title>layer ", l.layer, " ",
                   xml_escape(report.modes[i].name), ": ", fmt("%.4g", e), "</title></rect>\n");
      }
    }
    out += cat("<text x=\"", fmt("%.1f", gx + n_modes * kBarW / 2), "\" y=\"",
               fmt("%.0f", base + 14), "\" font-size=\"9\" text-anchor=\"middle\">", layers[g],
               "</text>\n");
  }
  out += cat("<text x=\"", fmt("%.0f", width / 2), "\" y=\"", fmt("%.0f", base + 34),
             "\" font-size=\"10\" text-anchor=\"middle\">layer</text>\n");
  out += "</svg>\n";
  return out;
}

Status write_compare_report(const std::filesystem::path& dir, const CompareReport& report,
                            bool replace) {
  const std::filesystem::path parent =
      std::filesystem::absolute(dir).lexically_normal().parent_path();
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
  if (ec) {
    return Status::error(cat(dir.string(), ": cannot create the compare directory's parent: ",
                             ec.message()));
  }
  return write_output_set_dir(dir,
                              {{std::string(kCompareFileNames[0]), compare_json(report)},
                               {std::string(kCompareFileNames[1]), compare_markdown(report)},
                               {std::string(kCompareFileNames[2]), compare_svg(report)}},
                              replace);
}

}  // namespace e4kv
