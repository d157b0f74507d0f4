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

#include <array>
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

// The files of a report directory, written as one set.
inline constexpr std::array<std::string_view, 3> kReportFileNames = {"report.json", "report.md",
                                                                     "report.svg"};

// Writes report.json, report.md and report.svg as one set (write_output_set_dir,
// core/output_set.h): built beside `dir` and renamed onto it once, so `dir` holds the old report or
// the new one, never a mix. `dir` must be new or empty, or, with `replace`, hold only report files.
// Creates the parent directories if needed. Errors name the file.
Status write_report(const std::filesystem::path& dir, const Summary& summary,
                    bool replace = false);

}  // namespace e4kv
