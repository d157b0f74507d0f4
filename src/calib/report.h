// The calibration report (DESIGN.md section 6): the figures of a Summary as JSON for machines,
// Markdown for people and an SVG chart for eyes.
//
// report.json  {"format": "e4kv-kv-report/1", policy, model, inputs, totals, conventions, and per
//              tensor: absmax, p99.9, p99.99, scale, saturation, the low-range fractions at scale
//              1.0 and at the scale, per-shard absmax and spread, and the trimmed histogram}
// report.md    a summary, one table row per tensor, the conventions, a link to report.svg
// report.svg   small multiples, one panel per tensor (rows of K and V): the log2 histogram of |x|
//              (fraction of values per 1/8-octave bin, log scale), the E4M3 window [2^-9, 448] at
//              scale 1.0 and the window [s 2^-9, s 448] at the calibrated scale, each with its
//              subnormal part [2^-9, 2^-6) shaded darker, and the absmax.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "calib/summarize.h"
#include "core/status.h"

namespace e4kv {

inline constexpr const char* kKvReportFormat = "e4kv-kv-report/1";

std::string report_json(const Summary& summary);
std::string report_markdown(const Summary& summary);
std::string report_svg(const Summary& summary);

// `text` with &, <, > and " as XML entities (SVG text and attributes).
std::string xml_escape(std::string_view text);

// Creates `dir` if needed and writes report.json, report.md and report.svg into it (each through a
// temporary file and a rename). Errors name the file.
Status write_report(const std::filesystem::path& dir, const Summary& summary);

}  // namespace e4kv
