// `e4kv compare`'s measures (DESIGN.md section 8): FP16 KV (the reference) against E4M3 KV modes on
// identical token ids, accumulated prompt by prompt, and the report (JSON, Markdown, an SVG chart of
// the per-layer attention-output error). Plain C++: the command feeds it what the models produce.
//
// Conventions:
// - Attention output: per attention/QSA layer, the output before o_proj of every teacher-forced
//   row, pooled over rows and prompts (OutputErrorAccumulator: relative L2, cosine, RMSE); the
//   aggregate pools every layer.
// - Isolated attention output (compare --isolated): the same measure from a second teacher-forced
//   pass in which every attention/QSA layer of the E4M3 run reads the FP16 run's input for that
//   layer, so each layer's figure is its cache format's own error (with whatever selection the
//   format itself causes), none carried from earlier layers.
// - Selection overlap (QSA layers): per row, the E4M3 selection against the FP16 one as token sets
//   (selection_row_overlap); means over rows, the exact-row ratio, the micro Jaccard.
// - Next token: per teacher-forced position t < T-1 of a prompt, KL(p_fp16 || p_mode) of the next
//   token distributions and the mode's NLL of token t+1; perplexity = exp(mean NLL). The first
//   token: the argmax after the last prompt token, equal or not.
// - Free-running: greedy continuations of up to --max-tokens; identical or the first position where
//   they differ (0-based, in generated tokens).
// - Retrieval (passkey): per (context, depth) the prompts whose continuation holds the key.
// - PLE tables (compare --ple-dtype fp8_e4m3, where every mode reads the E4M3 tables): the relative
//   L2 of the decoded tables against the checkpoint's values, over every value of every row of
//   every table (the conversion at load visits them all anyway), per PLE layer and pooled.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "calib/quality_metrics.h"
#include "core/status.h"

namespace e4kv {

struct LayerCompare {
  int64_t layer = 0;
  bool qsa = false;
  OutputErrorAccumulator output;
  OutputErrorAccumulator isolated;  // compare --isolated; empty (n == 0) otherwise
  // Selection overlap sums (QSA layers).
  int64_t rows = 0;
  double sum_jaccard = 0.0;
  double sum_recall = 0.0;
  double min_recall = 1.0;
  int64_t exact_rows = 0;
  int64_t sum_intersection = 0;
  int64_t sum_union = 0;
};

struct PasskeyCell {
  int64_t context = 0;  // prompt tokens asked for
  int64_t depth = 0;    // percent
  int64_t correct = 0;
  int64_t total = 0;
};

// One mode's measures: the FP16 reference ("fp16": its own perplexity and retrieval only) or an E4M3
// mode against it ("e4m3": calibrated scales; "unit": unit scales, the negative control).
struct ModeCompare {
  std::string name;
  std::string scales;  // how the mode's scales were obtained (the gate's summary line)
  std::vector<LayerCompare> layers;  // attention and QSA layers, in layer order
  double sum_kl = 0.0;
  int64_t kl_positions = 0;
  double sum_nll = 0.0;
  int64_t nll_tokens = 0;
  int64_t prompts = 0;
  int64_t first_token_equal = 0;
  int64_t greedy_prompts = 0;
  int64_t greedy_identical = 0;
  std::vector<int64_t> first_divergence;  // per greedy prompt: -1 identical, else the position
  std::vector<PasskeyCell> passkey;

  // Adds one teacher-forced layer output / selection (rows of one forward).
  void add_output(int64_t layer, bool qsa, std::span<const float> test, std::span<const float> ref);
  void add_selection(int64_t layer, std::span<const int32_t> test_tokens,
                     std::span<const int32_t> test_counts, std::span<const int32_t> ref_tokens,
                     std::span<const int32_t> ref_counts, int64_t width);
  // Adds one layer output of the isolated pass (the layer read the reference's input).
  void add_isolated_output(int64_t layer, bool qsa, std::span<const float> test,
                           std::span<const float> ref);
  // Adds a greedy pair: the mode's continuation against the reference's.
  void add_greedy(std::span<const int32_t> test, std::span<const int32_t> ref);
  void add_passkey(int64_t context, int64_t depth, bool correct);

  LayerCompare& layer_entry(int64_t layer, bool qsa);
  OutputError aggregate_output() const;
  OutputError aggregate_isolated() const;  // n == 0 without an isolated pass
  // NaN without positions (a measure over nothing is not a number; reports print "-" / null).
  double mean_kl() const {
    return kl_positions > 0 ? sum_kl / double(kl_positions)
                            : std::numeric_limits<double>::quiet_NaN();
  }
  double perplexity() const;  // exp(mean NLL); NaN without tokens
};

// One PLE layer's n-gram table in E4M3 against the checkpoint's values.
struct PleTableCompare {
  int64_t layer = 0;  // the model layer
  int64_t rows = 0;
  int64_t values = 0;
  double sum_sq_error = 0.0;  // sum (decoded - value)^2
  double sum_sq_value = 0.0;  // sum value^2
};

struct PleCompare {
  std::string checkpoint_dtype;  // "BF16", ...
  int64_t checkpoint_bytes = 0;  // the tables in the checkpoint
  int64_t host_bytes = 0;        // the E4M3 codes and scales
  std::vector<PleTableCompare> layers;
};

struct CompareReport {
  std::string model;
  std::string device;
  int64_t prompts = 0;
  int64_t teacher_forced_tokens = 0;
  int64_t max_tokens = 0;
  bool isolated = false;           // the modes hold isolated-pass figures
  ModeCompare reference;           // "fp16"
  std::vector<ModeCompare> modes;  // "e4m3", then "unit" when asked
  std::optional<PleCompare> ple;   // the PLE tables were E4M3 (--ple-dtype fp8_e4m3)
};

std::string compare_json(const CompareReport& report);
std::string compare_markdown(const CompareReport& report);
std::string compare_svg(const CompareReport& report);
// The files of a compare directory, written as one set.
inline constexpr std::array<std::string_view, 3> kCompareFileNames = {"compare.json", "compare.md",
                                                                      "compare.svg"};
// Writes compare.json, compare.md and compare.svg as one set (write_output_set_dir,
// core/output_set.h): built beside `dir` and renamed onto it once. `dir` must be new or empty, or,
// with `replace`, hold only compare files. Creates the parent directories if needed.
Status write_compare_report(const std::filesystem::path& dir, const CompareReport& report,
                            bool replace = false);

}  // namespace e4kv
