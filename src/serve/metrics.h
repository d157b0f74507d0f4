// The server's metrics, rendered for GET /metrics in the Prometheus text exposition format 0.0.4.
// Plain C++ (no HTTP, no engine): the server feeds it, the HTTP layer serves render()'s text.
// Thread-safe: HTTP threads observe latencies, the engine thread sets its state, /metrics renders,
// all at once. Every metric family has its own mutex; a family is always rendered whole (a
// histogram's buckets, _sum and _count agree with one another).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace e4kv::serve {

// Label name/value pairs, rendered in this order.
using Labels = std::vector<std::pair<std::string, std::string>>;

// A sample value as Prometheus parses it: "NaN", "+Inf", "-Inf", integers without an exponent
// where the double holds them exactly (|v| < 2^53), otherwise the shortest text that reads back
// to the same double. Never depends on the C or C++ locale.
std::string format_metric_value(double value);

// A label value escaped for the text format: backslash, double quote and newline.
std::string escape_label_value(std::string_view value);

// What counters and gauges share: a family of `name{const_labels,labels} value` series, one per
// label set, under one mutex.
class SeriesFamily {
 public:
  double value(const Labels& labels = {}) const;

 protected:
  SeriesFamily(std::string name, std::string help, Labels const_labels);
  // Appends `# HELP`, `# TYPE name <type>` and the series.
  void render_as(std::string& out, const char* type) const;

  std::string name_, help_;
  Labels const_labels_;
  mutable std::mutex mutex_;
  std::map<Labels, double> series_;
};

// A monotonic counter family: one series per label set, each `name{const_labels,labels} value`.
// Values are doubles; integer totals (token counts) stay exact up to 2^53.
class Counter : public SeriesFamily {
 public:
  Counter(std::string name, std::string help, Labels const_labels = {});
  // Adds `by` (>= 0) to the series of `labels`.
  void inc(double by = 1.0, const Labels& labels = {});
  // Raises the series of `labels` to `total`, a running total kept elsewhere; a smaller total is
  // ignored, so the counter never goes back.
  void raise_to(double total, const Labels& labels = {});
  // Creates the series of `labels` at 0 (so it is rendered before its first increment).
  void touch(const Labels& labels = {});
  // Appends `# HELP`, `# TYPE ... counter` and the series.
  void render(std::string& out) const { render_as(out, "counter"); }
};

// A gauge family: one series per label set, set to the latest value.
class Gauge : public SeriesFamily {
 public:
  Gauge(std::string name, std::string help, Labels const_labels = {});
  void set(double value, const Labels& labels = {});
  // Drops every series (an info gauge whose labels change).
  void clear();
  void render(std::string& out) const { render_as(out, "gauge"); }
};

// A histogram with fixed upper bounds (finite, strictly increasing; `+Inf` is added). Renders
// cumulative `name_bucket{...,le="B"}` lines ending with le="+Inf", then `name_sum`, `name_count`.
class Histogram {
 public:
  Histogram(std::string name, std::string help, std::span<const double> upper_bounds,
            Labels const_labels = {});
  // Counts `value` in the first bucket whose bound is >= value. A NaN is ignored: it would make
  // _sum NaN for the rest of the process.
  void observe(double value);
  uint64_t count() const;
  double sum() const;
  void render(std::string& out) const;

 private:
  std::string name_, help_;
  Labels const_labels_;
  std::vector<double> upper_bounds_;
  mutable std::mutex mutex_;
  std::vector<uint64_t> bucket_counts_;  // [upper_bounds_.size() + 1], not cumulative; last: +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

// Bucket bounds in seconds, those of vLLM's histograms of the same names so dashboards carry over.
inline constexpr double kTimeToFirstTokenBuckets[] = {
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
    1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
inline constexpr double kInterTokenLatencyBuckets[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                                       0.3,  0.4,   0.5,  0.75,  1.0, 2.5,  5.0,
                                                       7.5,  10.0,  20.0, 40.0,  80.0};
// End-to-end latency and queue time.
inline constexpr double kRequestLatencyBuckets[] = {
    0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

// What the engine reports, read on its thread and handed to ServerMetrics::set_engine_state.
// The *_total fields are the engine's running totals since it started.
struct EngineSnapshot {
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t kv_blocks_used = 0;
  int64_t kv_blocks_total = 0;
  int64_t block_size = 0;              // tokens per KV block
  int64_t pool_tokens = 0;             // tokens the KV pool holds
  int64_t fp16_equivalent_tokens = 0;  // tokens an fp16 pool of the same bytes would hold
  int64_t preemptions_total = 0;
  int64_t prompt_tokens_total = 0;
  int64_t generation_tokens_total = 0;
  int64_t kv_nonfinite_inputs_total = 0;
  std::string kv_cache_dtype;  // "fp8_e4m3" | "fp16"
  std::string scales;          // "calibrated" | "unit" | "none"
};

// Exactly the series of the server's contract (`e4kv:` names, label model_name="NAME").
class ServerMetrics {
 public:
  explicit ServerMetrics(std::string model_name);

  // The gauges, the kv_cache_info series and the engine's running totals (a total smaller than
  // the one already counted is ignored). kv_cache_info is rendered once this has been called.
  void set_engine_state(const EngineSnapshot& snapshot);

  void observe_ttft(double seconds);
  void observe_inter_token(double seconds);
  void observe_e2e(double seconds);
  void observe_queue_time(double seconds);
  // Counts a finished request under e4kv:request_success_total{finished_reason=...}: "stop",
  // "length", "abort", "error" (all four are rendered from the start, at 0). "tool_calls" is the
  // API's name for a stop and is counted as "stop"; any other reason is counted under its own name.
  void count_finished(std::string_view reason);

  // The whole exposition, every family with its # HELP and # TYPE lines.
  std::string render() const;

 private:
  // Held by set_engine_state and render, so one rendering shows one snapshot whole.
  mutable std::mutex engine_state_mutex_;
  Gauge num_requests_running_, num_requests_waiting_, kv_cache_usage_perc_, kv_cache_blocks_used_,
      kv_cache_blocks_free_, kv_cache_blocks_total_, kv_cache_pool_tokens_,
      kv_cache_fp16_equivalent_tokens_, kv_cache_info_;
  Counter num_preemptions_, prompt_tokens_, generation_tokens_, request_success_,
      kv_nonfinite_inputs_;
  Histogram time_to_first_token_, inter_token_latency_, e2e_request_latency_, request_queue_time_;
};

}  // namespace e4kv::serve
