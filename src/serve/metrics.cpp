#include "serve/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>

#include "core/check.h"

namespace e4kv::serve {
namespace {

bool is_metric_name(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool is_label_name(std::string_view name) {
  return is_metric_name(name) && name.find(':') == std::string_view::npos;
}

void check_labels(const Labels& labels) {
  for (const auto& [name, value] : labels) {
    E4KV_ASSERT(is_label_name(name), "metrics: bad label name '" + name + "'");
  }
}

void check_names(const std::string& name, const Labels& const_labels) {
  E4KV_ASSERT(is_metric_name(name), "metrics: bad metric name '" + name + "'");
  check_labels(const_labels);
}

// HELP text escapes only backslash and newline (a double quote stays as it is).
std::string escape_help(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void append_header(std::string& out, const std::string& name, const std::string& help,
                   std::string_view type) {
  out += "# HELP " + name + " " + escape_help(help) + "\n";
  out += "# TYPE " + name + " ";
  out += type;
  out += "\n";
}

// `name{const_labels,labels[,le="..."]} value\n`; no braces when there is no label at all.
void append_sample(std::string& out, std::string_view name, const Labels& const_labels,
                   const Labels& labels, std::optional<double> le, double value) {
  out += name;
  bool first = true;
  const auto append_label = [&](std::string_view label, std::string_view label_value) {
    out += first ? "{" : ",";
    first = false;
    out += label;
    out += "=\"";
    out += label_value;
    out += "\"";
  };
  for (const auto& [label, label_value] : const_labels) {
    append_label(label, escape_label_value(label_value));
  }
  for (const auto& [label, label_value] : labels) {
    append_label(label, escape_label_value(label_value));
  }
  if (le) append_label("le", format_metric_value(*le));
  if (!first) out += "}";
  out += " " + format_metric_value(value) + "\n";
}

}  // namespace

std::string format_metric_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[64];
  std::to_chars_result result;
  // Below 2^53 every integer-valued double is an exact int64: print it without an exponent.
  if (std::trunc(value) == value && std::fabs(value) < 0x1p53) {
    result = std::to_chars(buffer, buffer + sizeof(buffer), static_cast<int64_t>(value));
  } else {
    result = std::to_chars(buffer, buffer + sizeof(buffer), value);  // shortest round trip
  }
  E4KV_ASSERT(result.ec == std::errc(), "metrics: cannot format a value");
  return std::string(buffer, result.ptr);
}

std::string escape_label_value(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (const char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// ---- SeriesFamily -------------------------------------------------------------------------------

SeriesFamily::SeriesFamily(std::string name, std::string help, Labels const_labels)
    : name_(std::move(name)), help_(std::move(help)), const_labels_(std::move(const_labels)) {
  check_names(name_, const_labels_);
}

double SeriesFamily::value(const Labels& labels) const {
  std::lock_guard lock(mutex_);
  const auto it = series_.find(labels);
  return it == series_.end() ? 0.0 : it->second;
}

void SeriesFamily::render_as(std::string& out, const char* type) const {
  append_header(out, name_, help_, type);
  std::lock_guard lock(mutex_);
  for (const auto& [labels, value] : series_) {
    append_sample(out, name_, const_labels_, labels, std::nullopt, value);
  }
}

// ---- Counter ------------------------------------------------------------------------------------

Counter::Counter(std::string name, std::string help, Labels const_labels)
    : SeriesFamily(std::move(name), std::move(help), std::move(const_labels)) {}

void Counter::inc(double by, const Labels& labels) {
  E4KV_ASSERT(by >= 0.0, "metrics: counter " + name_ + " cannot go down");
  check_labels(labels);
  std::lock_guard lock(mutex_);
  series_[labels] += by;
}

void Counter::raise_to(double total, const Labels& labels) {
  check_labels(labels);
  std::lock_guard lock(mutex_);
  double& current = series_[labels];
  if (total > current) current = total;  // also ignores a NaN
}

void Counter::touch(const Labels& labels) {
  check_labels(labels);
  std::lock_guard lock(mutex_);
  series_.try_emplace(labels, 0.0);
}

// ---- Gauge --------------------------------------------------------------------------------------

Gauge::Gauge(std::string name, std::string help, Labels const_labels)
    : SeriesFamily(std::move(name), std::move(help), std::move(const_labels)) {}

void Gauge::set(double value, const Labels& labels) {
  check_labels(labels);
  std::lock_guard lock(mutex_);
  series_[labels] = value;
}

void Gauge::clear() {
  std::lock_guard lock(mutex_);
  series_.clear();
}


// ---- Histogram ----------------------------------------------------------------------------------

Histogram::Histogram(std::string name, std::string help, std::span<const double> upper_bounds,
                     Labels const_labels)
    : name_(std::move(name)),
      help_(std::move(help)),
      const_labels_(std::move(const_labels)),
      upper_bounds_(upper_bounds.begin(), upper_bounds.end()),
      bucket_counts_(upper_bounds.size() + 1, 0) {
  check_names(name_, const_labels_);
  for (const auto& [label, value] : const_labels_) {
    E4KV_ASSERT(label != "le", "metrics: histogram " + name_ + " cannot have a label 'le'");
  }
  for (size_t i = 0; i < upper_bounds_.size(); ++i) {
    E4KV_ASSERT(std::isfinite(upper_bounds_[i]),
                "metrics: histogram " + name_ + ": bound not finite");
    E4KV_ASSERT(i == 0 || upper_bounds_[i - 1] < upper_bounds_[i],
                "metrics: histogram " + name_ + ": bounds must increase strictly");
  }
}

void Histogram::observe(double value) {
  if (std::isnan(value)) return;
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin());
  std::lock_guard lock(mutex_);
  ++bucket_counts_[bucket];
  sum_ += value;
  ++count_;
}

uint64_t Histogram::count() const {
  std::lock_guard lock(mutex_);
  return count_;
}

double Histogram::sum() const {
  std::lock_guard lock(mutex_);
  return sum_;
}

void Histogram::render(std::string& out) const {
  append_header(out, name_, help_, "histogram");
  const std::string bucket_name = name_ + "_bucket";
  std::lock_guard lock(mutex_);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bucket_counts_.size(); ++i) {
    cumulative += bucket_counts_[i];
    const double le = i < upper_bounds_.size() ? upper_bounds_[i] : INFINITY;
    append_sample(out, bucket_name, const_labels_, {}, le, static_cast<double>(cumulative));
  }
  append_sample(out, name_ + "_sum", const_labels_, {}, std::nullopt, sum_);
  append_sample(out, name_ + "_count", const_labels_, {}, std::nullopt,
                static_cast<double>(count_));
}

// ---- ServerMetrics ------------------------------------------------------------------------------

namespace {
const char* const kFinishedReasons[] = {"stop", "length", "abort", "error"};
}  // namespace

ServerMetrics::ServerMetrics(std::string model_name)
    : num_requests_running_("e4kv:num_requests_running",
                            "Number of requests running on the engine.",
                            {{"model_name", model_name}}),
      num_requests_waiting_("e4kv:num_requests_waiting",
                            "Number of requests waiting to be scheduled.",
                            {{"model_name", model_name}}),
      kv_cache_usage_perc_("e4kv:kv_cache_usage_perc",
                           "KV cache usage: the fraction of KV blocks in use (0 to 1).",
                           {{"model_name", model_name}}),
      kv_cache_blocks_used_("e4kv:kv_cache_blocks_used", "KV cache blocks in use.",
                            {{"model_name", model_name}}),
      kv_cache_blocks_free_("e4kv:kv_cache_blocks_free", "KV cache blocks free.",
                            {{"model_name", model_name}}),
      kv_cache_blocks_total_("e4kv:kv_cache_blocks_total", "KV cache blocks in the pool.",
                             {{"model_name", model_name}}),
      kv_cache_pool_tokens_("e4kv:kv_cache_pool_tokens", "Tokens the KV cache pool holds.",
                            {{"model_name", model_name}}),
      kv_cache_fp16_equivalent_tokens_("e4kv:kv_cache_fp16_equivalent_tokens",
                                       "Tokens an fp16 KV cache of the same memory would hold.",
                                       {{"model_name", model_name}}),
      kv_cache_info_("e4kv:kv_cache_info",
                     "KV cache configuration: element type, scales and block size (tokens).",
                     {{"model_name", model_name}}),
      num_preemptions_("e4kv:num_preemptions_total", "Cumulative number of preemptions.",
                       {{"model_name", model_name}}),
      prompt_tokens_("e4kv:prompt_tokens_total", "Number of prefill tokens processed.",
                     {{"model_name", model_name}}),
      generation_tokens_("e4kv:generation_tokens_total", "Number of generation tokens processed.",
                         {{"model_name", model_name}}),
      request_success_("e4kv:request_success_total",
                       "Count of finished requests, by the reason they finished.",
                       {{"model_name", model_name}}),
      kv_nonfinite_inputs_("e4kv:kv_nonfinite_inputs_total",
                           "K/V values that were NaN or infinite when written to the KV cache.",
                           {{"model_name", model_name}}),
      time_to_first_token_("e4kv:time_to_first_token_seconds",
                           "Histogram of time to first token in seconds.", kTimeToFirstTokenBuckets,
                           {{"model_name", model_name}}),
      inter_token_latency_("e4kv:inter_token_latency_seconds",
                           "Histogram of inter-token latency in seconds.",
                           kInterTokenLatencyBuckets, {{"model_name", model_name}}),
      e2e_request_latency_("e4kv:e2e_request_latency_seconds",
                           "Histogram of end-to-end request latency in seconds.",
                           kRequestLatencyBuckets, {{"model_name", model_name}}),
      request_queue_time_("e4kv:request_queue_time_seconds",
                          "Histogram of time spent waiting in the queue in seconds.",
                          kRequestLatencyBuckets, {{"model_name", model_name}}) {
  // The gauges and totals read 0 until the engine reports, rather than being absent.
  for (Gauge* gauge : {&num_requests_running_, &num_requests_waiting_, &kv_cache_usage_perc_,
                       &kv_cache_blocks_used_, &kv_cache_blocks_free_, &kv_cache_blocks_total_,
                       &kv_cache_pool_tokens_, &kv_cache_fp16_equivalent_tokens_}) {
    gauge->set(0.0);
  }
  for (Counter* counter :
       {&num_preemptions_, &prompt_tokens_, &generation_tokens_, &kv_nonfinite_inputs_}) {
    counter->touch();
  }
  for (const char* reason : kFinishedReasons) request_success_.touch({{"finished_reason", reason}});
}

void ServerMetrics::set_engine_state(const EngineSnapshot& snapshot) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  std::lock_guard lock(engine_state_mutex_);
  num_requests_running_.set(d(snapshot.running));
  num_requests_waiting_.set(d(snapshot.waiting));
  kv_cache_usage_perc_.set(snapshot.kv_blocks_total > 0
                               ? d(snapshot.kv_blocks_used) / d(snapshot.kv_blocks_total)
                               : 0.0);
  kv_cache_blocks_used_.set(d(snapshot.kv_blocks_used));
  kv_cache_blocks_free_.set(d(snapshot.kv_blocks_total - snapshot.kv_blocks_used));
  kv_cache_blocks_total_.set(d(snapshot.kv_blocks_total));
  kv_cache_pool_tokens_.set(d(snapshot.pool_tokens));
  kv_cache_fp16_equivalent_tokens_.set(d(snapshot.fp16_equivalent_tokens));
  // One info series: the latest configuration replaces any earlier one.
  kv_cache_info_.clear();
  kv_cache_info_.set(1.0, {{"kv_cache_dtype", snapshot.kv_cache_dtype},
                           {"scales", snapshot.scales},
                           {"block_size", std::to_string(snapshot.block_size)}});
  num_preemptions_.raise_to(d(snapshot.preemptions_total));
  prompt_tokens_.raise_to(d(snapshot.prompt_tokens_total));
  generation_tokens_.raise_to(d(snapshot.generation_tokens_total));
  kv_nonfinite_inputs_.raise_to(d(snapshot.kv_nonfinite_inputs_total));
}

void ServerMetrics::observe_ttft(double seconds) {
  time_to_first_token_.observe(seconds);
}
void ServerMetrics::observe_inter_token(double seconds) {
  inter_token_latency_.observe(seconds);
}
void ServerMetrics::observe_e2e(double seconds) {
  e2e_request_latency_.observe(seconds);
}
void ServerMetrics::observe_queue_time(double seconds) {
  request_queue_time_.observe(seconds);
}

void ServerMetrics::count_finished(std::string_view reason) {
  if (reason == "tool_calls") reason = "stop";
  request_success_.inc(1.0, {{"finished_reason", std::string(reason)}});
}

std::string ServerMetrics::render() const {
  std::string out;
  std::lock_guard lock(engine_state_mutex_);
  for (const Gauge* gauge :
       {&num_requests_running_, &num_requests_waiting_, &kv_cache_usage_perc_,
        &kv_cache_blocks_used_, &kv_cache_blocks_free_, &kv_cache_blocks_total_,
        &kv_cache_pool_tokens_, &kv_cache_fp16_equivalent_tokens_, &kv_cache_info_}) {
    gauge->render(out);
  }
  for (const Counter* counter : {&num_preemptions_, &prompt_tokens_, &generation_tokens_,
                                 &request_success_, &kv_nonfinite_inputs_}) {
    counter->render(out);
  }
  for (const Histogram* histogram : {&time_to_first_token_, &inter_token_latency_,
                                     &e2e_request_latency_, &request_queue_time_}) {
    histogram->render(out);
  }
  return out;
}

}  // namespace e4kv::serve
