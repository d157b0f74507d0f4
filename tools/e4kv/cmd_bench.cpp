// e4kv bench MODEL: the serving matrix, FP16 KV against E4M3 KV. For each KV cache dtype (one
// model load each), each (concurrency, context) cell and each repeat, `concurrency` requests of
// `context` random prompt ids are submitted at once to a fresh Engine over the one pool, each
// generating exactly --output-tokens tokens (no stop ids: EOS is ignored), and engine.step() runs
// until all are done. What is measured, per run (wall clock, host side):
//   TTFT            mean over requests of (first token - submission)
//   prefill tok/s   prompt tokens / (last request's first token - submission)
//   decode tok/s    output tokens after each request's first / (last token - first request's
//                   first token): the rate once decoding has started, with any prefill still
//                   interleaved (continuous batching) counted against it
//   TPOT            mean over requests of (its last token - its first) / (its tokens - 1)
//   end-to-end      last token - submission; preemptions: the scheduler's count
// A cell shows the means over its repeats. A cell whose single request (context + output) cannot
// fit the pool or the max model length is skipped (capacity), never an error. The E4M3 / FP16
// figure is the geometric mean of the per-cell decode tok/s ratios over the cells both modes
// completed (all of them, and those of context >= 16K).
// Prompts are the same for every mode (the seed, the repeat and the request pick them), so cells
// are matched. One short request through each model before its matrix takes first-use costs
// (library initialisation, lazy workspaces) out of the first cell.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/check.h"
#include "core/file_io.h"
#include "core/output_set.h"
#include "engine/engine.h"
#include "kv/scale_gate.h"
#include "model_setup.h"
#include "numeric_flags.h"

namespace e4kv::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr std::string_view kBenchFileNames[] = {"bench.json", "bench.md", "bench.svg"};
constexpr int64_t kLongContext = 16 * 1024;  // the ratio's second subset: context >= 16K
constexpr int64_t kMaxConcurrency = 65536;
constexpr int64_t kMaxRepeats = 1000;

struct BenchArgs {
  ModelFlags model;  // model.kv_cache_dtype holds the comma-separated list
  std::string concurrency = "1,4,8";
  std::string context = "1k,4k,16k";
  int64_t output_tokens = 256;
  int64_t repeats = 3;
  uint64_t seed = 0;
  std::string out;
  bool force = false;
  bool progress = true;
};

// One run of one cell.
struct RunFigures {
  double ttft_ms = 0.0;
  double prefill_tok_s = 0.0;
  double decode_tok_s = 0.0;
  double tpot_ms = 0.0;
  double e2e_s = 0.0;
  double preemptions = 0.0;  // a count per run; the cell's mean may be fractional
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  // Steps replayed from a decode-step graph, and graphs captured, in the run (engine/step_graphs.h).
  double graph_replays = 0.0;
  double graph_captures = 0.0;
};

struct Cell {
  int64_t concurrency = 0;
  int64_t context = 0;
  std::string skip_reason;  // empty: completed
  std::vector<RunFigures> runs;
  RunFigures mean;
  bool completed() const { return skip_reason.empty(); }
};

struct Mode {
  KvCacheDtype dtype = KvCacheDtype::kF16;
  KvScalesMode scales = KvScalesMode::kCalibrated;
  int64_t n_blocks = 0;
  int64_t block_size = 0;
  int64_t max_model_len = 0;
  std::vector<Cell> cells;
  std::string label() const {
    std::string out(kv_cache_dtype_name(dtype));
    if (dtype == KvCacheDtype::kE4m3 && scales == KvScalesMode::kUnit) {
      out += " (unit scales: NEGATIVE CONTROL)";
    }
    return out;
  }
  int64_t capacity_tokens() const { return n_blocks * block_size; }
};

struct Ratio {
  std::optional<double> geomean;
  int64_t n_cells = 0;
};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Prompt ids of request `request` of repeat `repeat`: the same for every mode and every cell (a
// longer context extends a shorter one's prompt), distinct between requests.
std::vector<int32_t> random_prompt(uint64_t seed, int64_t repeat, int64_t request, int64_t length,
                                   int64_t vocab) {
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), uint32_t(repeat), uint32_t(request)};
  std::mt19937_64 rng(seq);
  std::uniform_int_distribution<int32_t> id(0, int32_t(vocab - 1));
  std::vector<int32_t> prompt(static_cast<size_t>(length));
  for (int32_t& token : prompt) token = id(rng);
  return prompt;
}

// Why a cell cannot run in this model's pool; empty when it can. One request alone must fit, as
// the scheduler requires (engine/scheduler.h): prompt plus output within the max model length and
// the pool.
std::string capacity_reason(const Model& model, int64_t context, int64_t output_tokens) {
  const int64_t total = context + output_tokens;
  if (total > model.max_model_len()) {
    return cat("context + output = ", total, " tokens exceed the max model length ",
               model.max_model_len());
  }
  const int64_t pool = model.n_blocks() * model.block_size();
  if (total > pool) {
    return cat("one request of ", total, " tokens exceeds the KV pool of ", pool, " tokens");
  }
  return {};
}

Result<RunFigures> run_once(Model& model, int64_t concurrency, int64_t context,
                            int64_t output_tokens, uint64_t seed, int64_t repeat,
                            bool enforce_eager) {
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t r = 0; r < concurrency; ++r) {
    prompts.push_back(random_prompt(seed, repeat, r, context, model.vocab_size()));
  }
  EngineConfig engine_config;
  engine_config.enforce_eager = enforce_eager;
  Engine engine(model, engine_config);
  RequestParams params;
  params.max_tokens = output_tokens;  // no stop ids: every request runs to max_tokens
  struct Track {
    Clock::time_point first, last;
    int64_t n_output = 0;
  };
  std::vector<Track> tracks(static_cast<size_t>(concurrency));
  std::vector<RequestId> ids;
  const Clock::time_point submitted = Clock::now();
  for (std::vector<int32_t>& prompt : prompts) {
    E4KV_ASSIGN_OR_RETURN(const RequestId id, engine.add_request(std::move(prompt), params));
    ids.push_back(id);
  }
  while (engine.has_unfinished()) {
    E4KV_ASSIGN_OR_RETURN(const std::vector<RequestUpdate> updates, engine.step());
    const Clock::time_point now = Clock::now();
    for (const RequestUpdate& u : updates) {
      // A fresh engine numbers its requests from the first one up.
      const size_t index = size_t(u.id - ids.front());
      E4KV_ASSERT(index < tracks.size(), "bench: an update for a request it did not submit");
      if (u.finish_reason == "error") {
        return Status::error(cat("concurrency ", concurrency, ", context ", context,
                                 ": a request failed: ", u.error));
      }
      if (u.new_tokens.empty()) continue;
      Track& t = tracks[index];
      if (t.n_output == 0) t.first = now;
      t.n_output += int64_t(u.new_tokens.size());
      t.last = now;
    }
  }
  RunFigures f;
  Clock::time_point last_first = submitted, first_first = Clock::time_point::max();
  Clock::time_point end = submitted;
  double ttft = 0.0, tpot = 0.0;
  for (const Track& t : tracks) {
    if (t.n_output != output_tokens) {
      return Status::error(cat("concurrency ", concurrency, ", context ", context,
                               ": a request produced ", t.n_output, " tokens, not ",
                               output_tokens));
    }
    f.output_tokens += t.n_output;
    ttft += seconds_between(submitted, t.first);
    tpot += seconds_between(t.first, t.last) / double(t.n_output - 1);
    last_first = std::max(last_first, t.first);
    first_first = std::min(first_first, t.first);
    end = std::max(end, t.last);
  }
  const double n = double(concurrency);
  f.prompt_tokens = concurrency * context;
  f.ttft_ms = ttft / n * 1e3;
  f.tpot_ms = tpot / n * 1e3;
  // The clock is steady and every step takes time, so the spans are positive; the floor only
  // keeps a division by zero out of a clock that ticks too coarsely.
  constexpr double kTick = 1e-9;
  f.prefill_tok_s = double(f.prompt_tokens) / std::max(kTick, seconds_between(submitted, last_first));
  f.decode_tok_s = double(f.output_tokens - concurrency) /
                   std::max(kTick, seconds_between(first_first, end));
  f.e2e_s = seconds_between(submitted, end);
  f.preemptions = double(engine.scheduler().n_preemptions());
  f.graph_replays = double(engine.step_graphs().stats().replays);
  f.graph_captures = double(engine.step_graphs().stats().captures);
  return f;
}

RunFigures mean_of(const std::vector<RunFigures>& runs) {
  RunFigures m;
  for (const RunFigures& r : runs) {
    m.ttft_ms += r.ttft_ms;
    m.prefill_tok_s += r.prefill_tok_s;
    m.decode_tok_s += r.decode_tok_s;
    m.tpot_ms += r.tpot_ms;
    m.e2e_s += r.e2e_s;
    m.preemptions += r.preemptions;
    m.graph_replays += r.graph_replays;
    m.graph_captures += r.graph_captures;
    m.prompt_tokens += r.prompt_tokens;
    m.output_tokens += r.output_tokens;
  }
  const double n = double(runs.size());
  m.ttft_ms /= n;
  m.prefill_tok_s /= n;
  m.decode_tok_s /= n;
  m.tpot_ms /= n;
  m.e2e_s /= n;
  m.preemptions /= n;
  m.graph_replays /= n;
  m.graph_captures /= n;
  // Token counts are the same in every run: those of one run.
  m.prompt_tokens /= int64_t(runs.size());
  m.output_tokens /= int64_t(runs.size());
  return m;
}

// Geometric mean of E4M3 / FP16 decode tok/s over the cells both completed (cell i of one mode is
// cell i of the other: the grids are the same), with context >= min_context.
Ratio decode_ratio(const Mode& f16, const Mode& e4m3, int64_t min_context) {
  Ratio ratio;
  double log_sum = 0.0;
  for (size_t i = 0; i < f16.cells.size(); ++i) {
    const Cell& a = f16.cells[i];
    const Cell& b = e4m3.cells[i];
    if (!a.completed() || !b.completed() || a.context < min_context) continue;
    log_sum += std::log(b.mean.decode_tok_s / a.mean.decode_tok_s);
    ratio.n_cells += 1;
  }
  if (ratio.n_cells > 0) ratio.geomean = std::exp(log_sum / double(ratio.n_cells));
  return ratio;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string context_label(int64_t context) {
  return context % 1024 == 0 ? cat(context / 1024, "k") : cat(context);
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

nlohmann::ordered_json figures_json(const RunFigures& f) {
  nlohmann::ordered_json j;
  j["ttft_ms"] = f.ttft_ms;
  j["prefill_tok_s"] = f.prefill_tok_s;
  j["decode_tok_s"] = f.decode_tok_s;
  j["tpot_ms"] = f.tpot_ms;
  j["e2e_s"] = f.e2e_s;
  j["preemptions"] = f.preemptions;
  j["graph_replays"] = f.graph_replays;
  j["graph_captures"] = f.graph_captures;
  j["prompt_tokens"] = f.prompt_tokens;
  j["output_tokens"] = f.output_tokens;
  return j;
}

nlohmann::ordered_json ratio_json(const Ratio& r) {
  nlohmann::ordered_json j;
  j["geomean"] = r.geomean ? nlohmann::ordered_json(*r.geomean) : nlohmann::ordered_json(nullptr);
  j["n_cells"] = r.n_cells;
  return j;
}

std::string ratio_text(const Ratio& r) {
  if (!r.geomean) return "n/a (no cell completed in both modes)";
  return cat(fixed(*r.geomean, 3), "x over ", r.n_cells, " cell", r.n_cells == 1 ? "" : "s");
}

struct Report {
  std::string model_dir;
  std::string device;
  std::string date;
  const BenchArgs* args = nullptr;
  std::vector<Mode> modes;
  std::optional<Ratio> ratio_all, ratio_long;
};

std::string markdown(const Report& r) {
  std::string md = "# e4kv bench\n\n";
  md += cat("- model: ", r.model_dir, "\n- device: ", r.device, "\n- date: ", r.date, "\n");
  md += cat("- requests: ", r.args->output_tokens,
            " output tokens each (EOS ignored), prompts of random ids (seed ", r.args->seed, "), ",
            r.args->repeats, " repeat", r.args->repeats == 1 ? "" : "s",
            " per cell (means shown)\n");
  for (const Mode& m : r.modes) {
    md += cat("- ", m.label(), ": KV pool of ", m.n_blocks, " blocks x ", m.block_size, " = ",
              m.capacity_tokens(), " tokens; max model length ", m.max_model_len, "\n");
  }
  md += "\n| KV cache | concurrency | context | TTFT ms | prefill tok/s | decode tok/s | TPOT ms | "
        "end-to-end s | preemptions |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Mode& m : r.modes) {
    for (const Cell& c : m.cells) {
      md += cat("| ", m.label(), " | ", c.concurrency, " | ", context_label(c.context), " | ");
      if (!c.completed()) {
        md += "skipped (capacity) | | | | | |\n";
        continue;
      }
      const RunFigures& f = c.mean;
      md += cat(fixed(f.ttft_ms, 1), " | ", fixed(f.prefill_tok_s, 1), " | ",
                fixed(f.decode_tok_s, 1), " | ", fixed(f.tpot_ms, 2), " | ", fixed(f.e2e_s, 3),
                " | ", fixed(f.preemptions, 1), " |\n");
    }
  }
  bool any_skipped = false;
  for (const Mode& m : r.modes) {
    for (const Cell& c : m.cells) {
      if (!c.completed()) {
        if (!any_skipped) md += "\nSkipped (capacity):\n";
        any_skipped = true;
        md += cat("- ", m.label(), ", concurrency ", c.concurrency, ", context ", c.context, ": ",
                  c.skip_reason, "\n");
      }
    }
  }
  if (r.ratio_all) {
    md += "\nE4M3 / FP16 decode tok/s (geometric mean over the cells both modes completed):\n";
    md += cat("- all cells: ", ratio_text(*r.ratio_all), "\n");
    md += cat("- context >= 16k: ", ratio_text(*r.ratio_long), "\n");
  }
  return md;
}

nlohmann::ordered_json report_json(const Report& r) {
  nlohmann::ordered_json j;
  j["command"] = "e4kv bench";
  j["model"] = r.model_dir;
  j["device"] = r.device;
  j["date"] = r.date;
  j["output_tokens"] = r.args->output_tokens;
  j["repeats"] = r.args->repeats;
  j["seed"] = r.args->seed;
  j["modes"] = nlohmann::ordered_json::array();
  for (const Mode& m : r.modes) {
    nlohmann::ordered_json mj;
    mj["kv_cache_dtype"] = std::string(kv_cache_dtype_name(m.dtype));
    mj["kv_scales"] = m.dtype == KvCacheDtype::kE4m3
                          ? nlohmann::ordered_json(std::string(kv_scales_mode_name(m.scales)))
                          : nlohmann::ordered_json(nullptr);
    mj["negative_control"] = m.dtype == KvCacheDtype::kE4m3 && m.scales == KvScalesMode::kUnit;
    mj["n_blocks"] = m.n_blocks;
    mj["block_size"] = m.block_size;
    mj["kv_capacity_tokens"] = m.capacity_tokens();
    mj["max_model_len"] = m.max_model_len;
    mj["cells"] = nlohmann::ordered_json::array();
    for (const Cell& c : m.cells) {
      nlohmann::ordered_json cj;
      cj["concurrency"] = c.concurrency;
      cj["context"] = c.context;
      cj["status"] = c.completed() ? "completed" : "skipped (capacity)";
      if (c.completed()) {
        cj["mean"] = figures_json(c.mean);
        cj["runs"] = nlohmann::ordered_json::array();
        for (const RunFigures& f : c.runs) cj["runs"].push_back(figures_json(f));
      } else {
        cj["reason"] = c.skip_reason;
      }
      mj["cells"].push_back(std::move(cj));
    }
    j["modes"].push_back(std::move(mj));
  }
  if (r.ratio_all) {
    nlohmann::ordered_json rj;
    rj["all"] = ratio_json(*r.ratio_all);
    rj["context_ge_16k"] = ratio_json(*r.ratio_long);
    j["decode_tok_s_ratio_e4m3_over_fp16"] = std::move(rj);
  } else {
    j["decode_tok_s_ratio_e4m3_over_fp16"] = nullptr;
  }
  return j;
}

// Decode tok/s per cell, one bar per mode; a skipped cell has no bar and says so.
std::string svg(const Report& r) {
  const size_t n_cells = r.modes.empty() ? 0 : r.modes[0].cells.size();
  const size_t n_modes = r.modes.size();
  const double bar = 18.0, gap = 24.0, left = 70.0, top = 40.0, plot_h = 220.0;
  const double group = bar * double(n_modes) + gap;
  const double width = left + group * double(n_cells) + 20.0;
  const double height = top + plot_h + 70.0 + 18.0 * double(n_modes);
  double max_rate = 0.0;
  for (const Mode& m : r.modes) {
    for (const Cell& c : m.cells) {
      if (c.completed()) max_rate = std::max(max_rate, c.mean.decode_tok_s);
    }
  }
  if (max_rate <= 0.0) max_rate = 1.0;
  const char* colors[] = {"#4878a8", "#e07b39", "#6aa84f", "#a64d79"};
  std::string s = cat("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", fixed(width, 0),
                      "\" height=\"", fixed(height, 0), "\" font-family=\"sans-serif\" "
                      "font-size=\"11\">\n");
  s += cat("<text x=\"", fixed(left, 0), "\" y=\"20\" font-size=\"14\">decode tok/s per cell "
           "(concurrency x context)</text>\n");
  const double base = top + plot_h;
  s += cat("<line x1=\"", fixed(left, 0), "\" y1=\"", fixed(base, 1), "\" x2=\"",
           fixed(width - 10.0, 0), "\" y2=\"", fixed(base, 1), "\" stroke=\"black\"/>\n");
  s += cat("<text x=\"", fixed(left - 6.0, 0), "\" y=\"", fixed(top + 4.0, 1),
           "\" text-anchor=\"end\">", fixed(max_rate, 1), "</text>\n");
  s += cat("<text x=\"", fixed(left - 6.0, 0), "\" y=\"", fixed(base, 1),
           "\" text-anchor=\"end\">0</text>\n");
  for (size_t i = 0; i < n_cells; ++i) {
    const double x0 = left + group * double(i) + gap / 2.0;
    for (size_t m = 0; m < n_modes; ++m) {
      const Cell& c = r.modes[m].cells[i];
      const double x = x0 + bar * double(m);
      if (!c.completed()) {
        s += cat("<text x=\"", fixed(x + bar / 2.0, 1), "\" y=\"", fixed(base - 4.0, 1),
                 "\" text-anchor=\"middle\" font-size=\"9\">skip</text>\n");
        continue;
      }
      const double h = plot_h * c.mean.decode_tok_s / max_rate;
      s += cat("<rect x=\"", fixed(x, 1), "\" y=\"", fixed(base - h, 1), "\" width=\"",
               fixed(bar - 2.0, 1), "\" height=\"", fixed(h, 1), "\" fill=\"",
               colors[m % 4], "\"><title>", fixed(c.mean.decode_tok_s, 1), "</title></rect>\n");
    }
    const Cell& c = r.modes[0].cells[i];
    s += cat("<text x=\"", fixed(x0 + bar * double(n_modes) / 2.0, 1), "\" y=\"",
             fixed(base + 14.0, 1), "\" text-anchor=\"middle\">", c.concurrency, "x",
             context_label(c.context), "</text>\n");
  }
  for (size_t m = 0; m < n_modes; ++m) {
    const double y = base + 40.0 + 18.0 * double(m);
    s += cat("<rect x=\"", fixed(left, 0), "\" y=\"", fixed(y - 10.0, 1),
             "\" width=\"12\" height=\"12\" fill=\"", colors[m % 4], "\"/>\n");
    s += cat("<text x=\"", fixed(left + 18.0, 0), "\" y=\"", fixed(y, 1), "\">",
             r.modes[m].label(), "</text>\n");
  }
  s += "</svg>\n";
  return s;
}

void show_progress(const std::string& mode, size_t done, size_t total, const Cell& cell,
                   int64_t repeat, int64_t repeats) {
  std::fprintf(stderr, "\rbench %s: run %zu/%zu, concurrency %lld, context %lld, repeat %lld/%lld ",
               mode.c_str(), done + 1, total, static_cast<long long>(cell.concurrency),
               static_cast<long long>(cell.context), static_cast<long long>(repeat + 1),
               static_cast<long long>(repeats));
  std::fflush(stderr);
}

Status run_bench(const BenchArgs& args) {
  E4KV_RETURN_IF_ERROR(validate_model_flags(args.model));
  if (args.output_tokens < 2 || args.output_tokens > kMaxTokenCount) {
    return Status::error(cat("--output-tokens: expected 2 to ", kMaxTokenCount,
                             " tokens (decode speed needs tokens after the first), got ",
                             args.output_tokens));
  }
  if (args.repeats < 1 || args.repeats > kMaxRepeats) {
    return Status::error(
        cat("--repeats: expected 1 to ", kMaxRepeats, " runs per cell, got ", args.repeats));
  }
  E4KV_ASSIGN_OR_RETURN(const std::vector<int64_t> concurrency,
                        parse_list("--concurrency", args.concurrency, false, 1, kMaxConcurrency,
                                   "a number of concurrent requests"));
  E4KV_ASSIGN_OR_RETURN(const std::vector<int64_t> contexts,
                        parse_list("--context", args.context, true, 1, kMaxTokenCount,
                                   "a prompt length in tokens"));
  E4KV_ASSIGN_OR_RETURN(const KvScalesMode scales, parse_kv_scales_mode(args.model.kv_scales));
  std::vector<KvCacheDtype> dtypes;
  {
    size_t begin = 0;
    const std::string& text = args.model.kv_cache_dtype;
    while (begin <= text.size()) {
      const size_t end = std::min(text.find(',', begin), text.size());
      std::string item = text.substr(begin, end - begin);
      while (!item.empty() && item.front() == ' ') item.erase(item.begin());
      while (!item.empty() && item.back() == ' ') item.pop_back();
      Result<KvCacheDtype> dtype = parse_kv_cache_dtype(item);
      if (!dtype.ok()) return Status::error(cat("--kv-cache-dtype: ", dtype.message()));
      if (std::find(dtypes.begin(), dtypes.end(), *dtype) != dtypes.end()) {
        return Status::error(cat("--kv-cache-dtype: ", item, " is listed twice"));
      }
      dtypes.push_back(*dtype);
      begin = end + 1;
    }
  }
  // The largest request and the most requests at once: the pool a run without a pool flag gets.
  int64_t longest = 0, widest = 0;
  for (int64_t c : contexts) longest = std::max(longest, c + args.output_tokens);
  for (int64_t c : concurrency) widest = std::max(widest, c);

  // --out: its files appear at once and one bench writes it at a time; checked before anything
  // runs, and again once the lock is held.
  std::optional<OutputLock> out_lock;
  if (!args.out.empty()) {
    OutputRules rules;
    rules.force = args.force;
    rules.force_name = "--force";
    rules.inputs = {fs::path(args.model.model_dir)};
    for (int pass = 0; pass < 2; ++pass) {
      if (Status st = check_output_set_dir(args.out, kBenchFileNames, rules); !st.ok()) {
        return Status::error(cat("--out: ", st.message()));
      }
      if (pass == 1) break;
      Result<OutputLock> lock = OutputLock::acquire(lock_path_for(args.out), args.out);
      if (!lock.ok()) return Status::error(cat("--out: ", lock.message()));
      out_lock.emplace(std::move(lock).value());
    }
  }

  Report report;
  report.model_dir = args.model.model_dir;
  report.date = utc_now();
  report.args = &args;
  const bool show = args.progress && isatty(fileno(stderr)) != 0;
  const size_t runs_per_mode = concurrency.size() * contexts.size() * size_t(args.repeats);
  for (const KvCacheDtype dtype : dtypes) {
    ModelFlags flags = args.model;
    flags.kv_cache_dtype = std::string(kv_cache_dtype_name(dtype));
    // State slots for the widest cell only: a hybrid model's per-sequence state comes out of the
    // pool budget first, and the matrix never runs more sequences than its widest concurrency.
    if (flags.max_seqs == 0) flags.max_seqs = widest;
    E4KV_ASSIGN_OR_RETURN(LoadedModel loaded, load_model(flags, longest, 0, widest));
    Model& model = *loaded.model;
    if (report.device.empty()) {
      report.device = loaded.model->backend().name();
      if (Result<DeviceMemoryInfo> info = loaded.model->backend().device_memory(); info.ok()) {
        report.device += cat(" (", info->device_name, ")");
      } else if (flags.device == "cpu") {
        report.device += flags.threads > 0
                             ? cat(" (", flags.threads, flags.threads == 1 ? " thread)" : " threads)")
                             : std::string(" (all threads)");
      }
    }
    Mode mode;
    mode.dtype = dtype;
    mode.scales = scales;
    mode.n_blocks = model.n_blocks();
    mode.block_size = model.block_size();
    mode.max_model_len = model.max_model_len();
    // First-use costs out of the matrix: one short request.
    if (capacity_reason(model, 8, 2).empty()) {
      E4KV_RETURN_IF_ERROR(run_once(model, 1, 8, 2, args.seed ^ 0x5eedULL, 0, args.model.enforce_eager)
                                   .status());
    }
    size_t done = 0;
    for (const int64_t c : concurrency) {
      for (const int64_t context : contexts) {
        Cell cell;
        cell.concurrency = c;
        cell.context = context;
        cell.skip_reason = capacity_reason(model, context, args.output_tokens);
        for (int64_t rep = 0; rep < args.repeats && cell.completed(); ++rep) {
          if (show) show_progress(mode.label(), done, runs_per_mode, cell, rep, args.repeats);
          E4KV_ASSIGN_OR_RETURN(RunFigures f,
                                run_once(model, c, context, args.output_tokens, args.seed, rep,
                                         args.model.enforce_eager));
          cell.runs.push_back(f);
          ++done;
        }
        if (!cell.completed()) done += size_t(args.repeats);
        if (cell.completed()) cell.mean = mean_of(cell.runs);
        mode.cells.push_back(std::move(cell));
      }
    }
    report.modes.push_back(std::move(mode));
  }
  if (show) std::fprintf(stderr, "\r%*s\r", 100, "");

  const Mode* f16 = nullptr;
  const Mode* e4m3 = nullptr;
  for (const Mode& m : report.modes) (m.dtype == KvCacheDtype::kF16 ? f16 : e4m3) = &m;
  if (f16 != nullptr && e4m3 != nullptr) {
    report.ratio_all = decode_ratio(*f16, *e4m3, 0);
    report.ratio_long = decode_ratio(*f16, *e4m3, kLongContext);
  }
  const std::string md = markdown(report);
  if (!args.out.empty()) {
    const std::vector<OutputSetFile> files = {
        {"bench.json", report_json(report).dump(2) + "\n"},
        {"bench.md", md},
        {"bench.svg", svg(report)},
    };
    E4KV_RETURN_IF_ERROR(write_output_set_dir(args.out, files, args.force));
  }
  std::fwrite(md.data(), 1, md.size(), stdout);
  if (!args.out.empty()) std::printf("\nwrote %s/bench.{json,md,svg}\n", args.out.c_str());
  return ok_status();
}

}  // namespace

void add_bench_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "bench", "Serving benchmark: concurrency x context cells through the engine, FP16 vs E4M3 KV");
  auto args = std::make_shared<BenchArgs>();
  args->model.kv_cache_dtype = "fp16,fp8_e4m3";
  add_model_flags(cmd, args->model);
  add_pool_flags(cmd, args->model);
  cmd->get_option("--kv-cache-dtype")
      ->description("KV cache dtypes, comma-separated (fp16, fp8_e4m3): one model load each");
  cmd->add_option("--concurrency", args->concurrency,
                  "Requests submitted at once, comma-separated (one cell each)")
      ->capture_default_str();
  cmd->add_option("--context", args->context,
                  "Prompt tokens per request, comma-separated (1k = 1024)")
      ->capture_default_str();
  cmd->add_option("--output-tokens", args->output_tokens,
                  "Tokens each request generates (EOS ignored), at least 2")
      ->transform(decimal_integer<int64_t>(2, kMaxTokenCount))
      ->capture_default_str();
  cmd->add_option("--repeats", args->repeats, "Runs per cell (the table shows their mean)")
      ->transform(decimal_integer<int64_t>(1, kMaxRepeats))
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Seed of the random prompt ids")
      ->transform(decimal_integer<uint64_t>())
      ->capture_default_str();
  cmd->add_option("--out", args->out,
                  "Directory for bench.json, bench.md and bench.svg, which appear at once (built "
                  "beside it, then renamed onto it); new or empty, or with --force one holding "
                  "only those files");
  cmd->add_flag("--force", args->force, "Replace existing bench files in --out");
  cmd->add_flag("!--no-progress", args->progress, "No progress line on a terminal");
  cmd->callback([args, &result] { result = run_bench(*args); });
}

}  // namespace e4kv::cli
