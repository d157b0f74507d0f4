#include "serve/metrics.h"

#include <atomic>
#include <charconv>
#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace e4kv::serve {
namespace {

// ---- a small exposition parser, written apart from the renderer ---------------------------------

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  std::string value_text;
  double value = 0.0;
};

struct Exposition {
  std::map<std::string, std::string> types;  // family -> counter | gauge | histogram
  std::map<std::string, std::string> helps;
  std::vector<Sample> samples;
};

double parse_value(const std::string& text) {
  if (text == "+Inf") return INFINITY;
  if (text == "-Inf") return -INFINITY;
  if (text == "NaN") return NAN;
  double value = 0.0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) {
    ADD_FAILURE() << "not a number: '" << text << "'";
  }
  return value;
}

bool is_name_char(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
         (!first && c >= '0' && c <= '9');
}

// The family a sample belongs to: histograms own NAME_bucket, NAME_sum and NAME_count.
std::string family_of(const Exposition& exposition, const std::string& sample_name) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s = suffix;
    if (sample_name.size() > s.size() &&
        sample_name.compare(sample_name.size() - s.size(), s.size(), s) == 0) {
      const std::string base = sample_name.substr(0, sample_name.size() - s.size());
      const auto it = exposition.types.find(base);
      if (it != exposition.types.end() && it->second == "histogram") return base;
    }
  }
  return sample_name;
}

// Parses the text format line by line; every malformed line is a test failure naming the line.
Exposition parse_exposition(const std::string& text) {
  Exposition exposition;
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "the text must end with a newline";
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) {
      const bool is_type = line[2] == 'T';
      const std::string rest = line.substr(7);
      const size_t space = rest.find(' ');
      EXPECT_NE(space, std::string::npos) << line;
      if (space == std::string::npos) continue;
      const std::string name = rest.substr(0, space);
      if (is_type) {
        EXPECT_EQ(exposition.types.count(name), 0u) << "second TYPE line: " << line;
        EXPECT_TRUE(exposition.helps.count(name)) << "TYPE before HELP: " << line;
        exposition.types[name] = rest.substr(space + 1);
      } else {
        exposition.helps[name] = rest.substr(space + 1);
      }
      continue;
    }
    EXPECT_FALSE(line.empty() || line[0] == '#') << "unexpected line: '" << line << "'";
    Sample sample;
    size_t i = 0;
    while (i < line.size() && is_name_char(line[i], i == 0)) ++i;
    sample.name = line.substr(0, i);
    EXPECT_FALSE(sample.name.empty()) << line;
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const size_t name_start = i;
        while (i < line.size() && is_name_char(line[i], i == name_start) && line[i] != ':') ++i;
        const std::string label = line.substr(name_start, i - name_start);
        if (label.empty() || line.compare(i, 2, "=\"") != 0) {
          ADD_FAILURE() << "bad label in: " << line;
          break;
        }
        i += 2;
        std::string value;
        bool closed = false;
        while (i < line.size()) {
          const char c = line[i++];
          if (c == '"') {
            closed = true;
            break;
          }
          if (c != '\\') {
            value += c;
            continue;
          }
          const char escaped = i < line.size() ? line[i++] : '\0';
          if (escaped == '\\') {
            value += '\\';
          } else if (escaped == '"') {
            value += '"';
          } else if (escaped == 'n') {
            value += '\n';
          } else {
            ADD_FAILURE() << "bad escape in: " << line;
          }
        }
        EXPECT_TRUE(closed) << "unterminated label value in: " << line;
        EXPECT_EQ(sample.labels.count(label), 0u) << "label twice in: " << line;
        sample.labels[label] = value;
        if (i < line.size() && line[i] == ',') ++i;
      }
      EXPECT_TRUE(i < line.size() && line[i] == '}') << line;
      ++i;
    }
    EXPECT_TRUE(i < line.size() && line[i] == ' ') << "no space before the value: " << line;
    sample.value_text = line.substr(std::min(i + 1, line.size()));
    sample.value = parse_value(sample.value_text);
    EXPECT_TRUE(exposition.types.count(family_of(exposition, sample.name)))
        << "sample without a TYPE line before it: " << line;
    exposition.samples.push_back(std::move(sample));
  }
  return exposition;
}

std::vector<Sample> samples_named(const Exposition& exposition, const std::string& name) {
  std::vector<Sample> out;
  for (const Sample& sample : exposition.samples) {
    if (sample.name == name) out.push_back(sample);
  }
  return out;
}

// The single sample of `name` (a failure when there is not exactly one).
Sample only_sample(const Exposition& exposition, const std::string& name) {
  const std::vector<Sample> found = samples_named(exposition, name);
  EXPECT_EQ(found.size(), 1u) << name;
  return found.empty() ? Sample{} : found[0];
}

struct HistogramView {
  std::vector<std::string> le_texts;
  std::vector<double> bounds;
  std::vector<double> cumulative;
  double sum = NAN;
  double count = NAN;
};

HistogramView histogram_of(const Exposition& exposition, const std::string& name) {
  HistogramView view;
  for (const Sample& sample : samples_named(exposition, name + "_bucket")) {
    const auto le = sample.labels.find("le");
    EXPECT_NE(le, sample.labels.end()) << name << " bucket without le";
    if (le == sample.labels.end()) continue;
    view.le_texts.push_back(le->second);
    view.bounds.push_back(parse_value(le->second));
    view.cumulative.push_back(sample.value);
  }
  view.sum = only_sample(exposition, name + "_sum").value;
  view.count = only_sample(exposition, name + "_count").value;
  return view;
}

// Buckets whose bounds increase, whose counts never decrease, ending with +Inf == _count.
void expect_well_formed(const HistogramView& view, const std::string& name) {
  ASSERT_FALSE(view.bounds.empty()) << name;
  EXPECT_EQ(view.le_texts.back(), "+Inf") << name;
  for (size_t i = 1; i < view.bounds.size(); ++i) {
    EXPECT_LT(view.bounds[i - 1], view.bounds[i]) << name << " bucket " << i;
    EXPECT_LE(view.cumulative[i - 1], view.cumulative[i]) << name << " bucket " << i;
  }
  EXPECT_EQ(view.cumulative.back(), view.count) << name;
}

EngineSnapshot snapshot_with_totals(int64_t preemptions, int64_t prompt, int64_t generation,
                                    int64_t nonfinite) {
  EngineSnapshot s;
  s.running = 2;
  s.waiting = 3;
  s.kv_blocks_used = 5;
  s.kv_blocks_total = 20;
  s.block_size = 64;
  s.pool_tokens = 1280;
  s.fp16_equivalent_tokens = 640;
  s.preemptions_total = preemptions;
  s.prompt_tokens_total = prompt;
  s.generation_tokens_total = generation;
  s.kv_nonfinite_inputs_total = nonfinite;
  s.kv_cache_dtype = "fp8_e4m3";
  s.scales = "calibrated";
  return s;
}

// ---- tests
// ---------------------------------------------------------------------------------------

TEST(ServeMetrics, RendersEveryContractSeriesWithItsType) {
  ServerMetrics metrics("tiny");
  metrics.set_engine_state(snapshot_with_totals(1, 100, 50, 0));
  metrics.observe_ttft(0.02);
  metrics.observe_inter_token(0.05);
  metrics.observe_e2e(1.5);
  metrics.observe_queue_time(0.001);
  metrics.count_finished("stop");
  const Exposition exposition = parse_exposition(metrics.render());

  const std::map<std::string, std::string> contract = {
      {"e4kv:num_requests_running", "gauge"},
      {"e4kv:num_requests_waiting", "gauge"},
      {"e4kv:kv_cache_usage_perc", "gauge"},
      {"e4kv:kv_cache_blocks_used", "gauge"},
      {"e4kv:kv_cache_blocks_free", "gauge"},
      {"e4kv:kv_cache_blocks_total", "gauge"},
      {"e4kv:kv_cache_pool_tokens", "gauge"},
      {"e4kv:kv_cache_fp16_equivalent_tokens", "gauge"},
      {"e4kv:kv_cache_info", "gauge"},
      {"e4kv:num_preemptions_total", "counter"},
      {"e4kv:prompt_tokens_total", "counter"},
      {"e4kv:generation_tokens_total", "counter"},
      {"e4kv:request_success_total", "counter"},
      {"e4kv:kv_nonfinite_inputs_total", "counter"},
      {"e4kv:time_to_first_token_seconds", "histogram"},
      {"e4kv:inter_token_latency_seconds", "histogram"},
      {"e4kv:e2e_request_latency_seconds", "histogram"},
      {"e4kv:request_queue_time_seconds", "histogram"},
  };
  EXPECT_EQ(exposition.types, contract);
  for (const auto& [name, type] : contract) {
    EXPECT_TRUE(exposition.helps.count(name) && !exposition.helps.at(name).empty()) << name;
  }
  for (const Sample& sample : exposition.samples) {
    EXPECT_EQ(sample.labels.count("model_name") ? sample.labels.at("model_name") : "<none>", "tiny")
        << sample.name;
  }

  const std::map<std::string, double> single = {
      {"e4kv:num_requests_running", 2},     {"e4kv:num_requests_waiting", 3},
      {"e4kv:kv_cache_usage_perc", 0.25},   {"e4kv:kv_cache_blocks_used", 5},
      {"e4kv:kv_cache_blocks_free", 15},    {"e4kv:kv_cache_blocks_total", 20},
      {"e4kv:kv_cache_pool_tokens", 1280},  {"e4kv:kv_cache_fp16_equivalent_tokens", 640},
      {"e4kv:num_preemptions_total", 1},    {"e4kv:prompt_tokens_total", 100},
      {"e4kv:generation_tokens_total", 50}, {"e4kv:kv_nonfinite_inputs_total", 0},
  };
  for (const auto& [name, value] : single) {
    const Sample sample = only_sample(exposition, name);
    EXPECT_EQ(sample.value, value) << name;
    EXPECT_EQ(sample.labels.size(), 1u) << name;
  }
  EXPECT_EQ(only_sample(exposition, "e4kv:prompt_tokens_total").value_text, "100");

  const Sample info = only_sample(exposition, "e4kv:kv_cache_info");
  const std::map<std::string, std::string> info_labels = {{"model_name", "tiny"},
                                                          {"kv_cache_dtype", "fp8_e4m3"},
                                                          {"scales", "calibrated"},
                                                          {"block_size", "64"}};
  EXPECT_EQ(info.labels, info_labels);
  EXPECT_EQ(info.value_text, "1");

  std::map<std::string, double> finished;
  for (const Sample& s : samples_named(exposition, "e4kv:request_success_total")) {
    finished[s.labels.count("finished_reason") ? s.labels.at("finished_reason") : "<none>"] =
        s.value;
  }
  const std::map<std::string, double> expected_finished = {
      {"stop", 1}, {"length", 0}, {"abort", 0}, {"error", 0}};
  EXPECT_EQ(finished, expected_finished);

  for (const char* name : {"e4kv:time_to_first_token_seconds", "e4kv:inter_token_latency_seconds",
                           "e4kv:e2e_request_latency_seconds", "e4kv:request_queue_time_seconds"}) {
    const HistogramView view = histogram_of(exposition, name);
    expect_well_formed(view, name);
    EXPECT_EQ(view.count, 1.0) << name;
  }
}

TEST(ServeMetrics, HistogramBucketsHoldEveryValueAtOrBelowTheirBound) {
  const double bounds[] = {0.5, 1.0, 2.5};
  Histogram histogram("h_seconds", "test", bounds, {{"model_name", "m"}});
  // Values on the bounds belong to that bucket (le is "less than or equal"). All are multiples
  // of 1/4, so their sum is exact in any order.
  const std::vector<double> values = {0.25, 0.5, 0.75, 1.0, 1.0, 2.5, 3.0, 100.0, -1.0};
  double expected_sum = 0.0;
  for (const double v : values) {
    histogram.observe(v);
    expected_sum += v;
  }
  histogram.observe(NAN);  // ignored

  std::string text;
  histogram.render(text);
  const Exposition exposition = parse_exposition(text);
  EXPECT_EQ(exposition.types.at("h_seconds"), "histogram");
  const HistogramView view = histogram_of(exposition, "h_seconds");
  expect_well_formed(view, "h_seconds");
  const std::vector<std::string> le_texts = {"0.5", "1", "2.5", "+Inf"};
  EXPECT_EQ(view.le_texts, le_texts);
  ASSERT_EQ(view.cumulative.size(), 4u);
  for (size_t b = 0; b < 4; ++b) {
    double at_or_below = 0;
    for (const double v : values) at_or_below += v <= view.bounds[b] ? 1 : 0;
    EXPECT_EQ(view.cumulative[b], at_or_below) << "le=" << view.le_texts[b];
  }
  EXPECT_EQ(view.count, double(values.size()));
  EXPECT_EQ(view.sum, expected_sum);
  EXPECT_EQ(histogram.count(), values.size());
}

TEST(ServeMetrics, ServerHistogramsUseTheDocumentedBounds) {
  ServerMetrics metrics("m");
  const Exposition exposition = parse_exposition(metrics.render());
  const auto expect_bounds = [&](const std::string& name, std::span<const double> bounds) {
    const HistogramView view = histogram_of(exposition, name);
    expect_well_formed(view, name);
    ASSERT_EQ(view.bounds.size(), bounds.size() + 1) << name;
    for (size_t i = 0; i < bounds.size(); ++i) EXPECT_EQ(view.bounds[i], bounds[i]) << name;
    EXPECT_EQ(view.count, 0.0);
    EXPECT_EQ(view.sum, 0.0);
  };
  expect_bounds("e4kv:time_to_first_token_seconds", kTimeToFirstTokenBuckets);
  expect_bounds("e4kv:inter_token_latency_seconds", kInterTokenLatencyBuckets);
  expect_bounds("e4kv:e2e_request_latency_seconds", kRequestLatencyBuckets);
  expect_bounds("e4kv:request_queue_time_seconds", kRequestLatencyBuckets);
  EXPECT_EQ(kTimeToFirstTokenBuckets[0], 0.001);
  EXPECT_EQ(std::size(kTimeToFirstTokenBuckets), 22u);
  EXPECT_EQ(kTimeToFirstTokenBuckets[21], 2560.0);
  EXPECT_EQ(kRequestLatencyBuckets[20], 7680.0);
  // No kv_cache_info series before the engine has reported its configuration.
  EXPECT_TRUE(samples_named(exposition, "e4kv:kv_cache_info").empty());
}

TEST(ServeMetrics, EscapesLabelValues) {
  const std::string model = "a\\b\"c\nd";
  ServerMetrics metrics(model);
  const std::string text = metrics.render();
  EXPECT_NE(text.find("model_name=\"a\\\\b\\\"c\\nd\""), std::string::npos) << text;
  const Exposition exposition = parse_exposition(text);
  ASSERT_FALSE(exposition.samples.empty());
  for (const Sample& sample : exposition.samples) EXPECT_EQ(sample.labels.at("model_name"), model);
  EXPECT_EQ(escape_label_value("plain"), "plain");
  EXPECT_EQ(escape_label_value("\\\"\n"), "\\\\\\\"\\n");
}

TEST(ServeMetrics, CountersNeverGoBackwards) {
  ServerMetrics metrics("m");
  metrics.set_engine_state(snapshot_with_totals(7, 100, 50, 3));
  EngineSnapshot smaller = snapshot_with_totals(1, 10, 5, 0);
  smaller.running = 0;  // gauges follow the engine both ways
  metrics.set_engine_state(smaller);
  Exposition exposition = parse_exposition(metrics.render());
  EXPECT_EQ(only_sample(exposition, "e4kv:num_preemptions_total").value, 7);
  EXPECT_EQ(only_sample(exposition, "e4kv:prompt_tokens_total").value, 100);
  EXPECT_EQ(only_sample(exposition, "e4kv:generation_tokens_total").value, 50);
  EXPECT_EQ(only_sample(exposition, "e4kv:kv_nonfinite_inputs_total").value, 3);
  EXPECT_EQ(only_sample(exposition, "e4kv:num_requests_running").value, 0);

  metrics.set_engine_state(snapshot_with_totals(8, 4096, 51, 4));
  exposition = parse_exposition(metrics.render());
  EXPECT_EQ(only_sample(exposition, "e4kv:num_preemptions_total").value, 8);
  EXPECT_EQ(only_sample(exposition, "e4kv:prompt_tokens_total").value, 4096);
  EXPECT_EQ(only_sample(exposition, "e4kv:generation_tokens_total").value, 51);
  EXPECT_EQ(only_sample(exposition, "e4kv:kv_nonfinite_inputs_total").value, 4);
  EXPECT_EQ(only_sample(exposition, "e4kv:num_requests_running").value, 2);
}

TEST(ServeMetrics, CountsFinishedRequestsByReason) {
  ServerMetrics metrics("m");
  for (const char* reason : {"stop", "tool_calls", "length", "abort", "error", "error"}) {
    metrics.count_finished(reason);
  }
  const Exposition exposition = parse_exposition(metrics.render());
  std::map<std::string, double> finished;
  for (const Sample& s : samples_named(exposition, "e4kv:request_success_total")) {
    finished[s.labels.at("finished_reason")] = s.value;
  }
  const std::map<std::string, double> expected = {
      {"stop", 2}, {"length", 1}, {"abort", 1}, {"error", 2}};
  EXPECT_EQ(finished, expected);
}

TEST(ServeMetrics, KvCacheInfoKeepsOnlyTheLatestConfiguration) {
  ServerMetrics metrics("m");
  metrics.set_engine_state(snapshot_with_totals(0, 0, 0, 0));
  EngineSnapshot fp16 = snapshot_with_totals(0, 0, 0, 0);
  fp16.kv_cache_dtype = "fp16";
  fp16.scales = "none";
  fp16.block_size = 16;
  fp16.kv_blocks_total = 0;  // no pool: usage reads 0, not NaN
  fp16.kv_blocks_used = 0;
  metrics.set_engine_state(fp16);
  const Exposition exposition = parse_exposition(metrics.render());
  const Sample info = only_sample(exposition, "e4kv:kv_cache_info");
  EXPECT_EQ(info.labels.at("kv_cache_dtype"), "fp16");
  EXPECT_EQ(info.labels.at("scales"), "none");
  EXPECT_EQ(info.labels.at("block_size"), "16");
  EXPECT_EQ(only_sample(exposition, "e4kv:kv_cache_usage_perc").value_text, "0");
}

TEST(ServeMetrics, FormatsNumbersPrometheusParses) {
  EXPECT_EQ(format_metric_value(0.0), "0");
  EXPECT_EQ(format_metric_value(-0.0), "0");
  EXPECT_EQ(format_metric_value(3.0), "3");
  EXPECT_EQ(format_metric_value(-2.0), "-2");
  EXPECT_EQ(format_metric_value(1e15), "1000000000000000");
  EXPECT_EQ(format_metric_value(9007199254740991.0), "9007199254740991");  // 2^53 - 1
  EXPECT_EQ(format_metric_value(0.25), "0.25");
  EXPECT_EQ(format_metric_value(0.1), "0.1");
  EXPECT_EQ(format_metric_value(INFINITY), "+Inf");
  EXPECT_EQ(format_metric_value(-INFINITY), "-Inf");
  EXPECT_EQ(format_metric_value(NAN), "NaN");
  // Whatever the shape, the text reads back to the same double.
  for (const double v : {1e-9, 0.001, 2560.0, 1.0 / 3.0, 0x1p53, 1e300, -7.5e-5}) {
    const std::string text = format_metric_value(v);
    EXPECT_EQ(parse_value(text), v) << text;
    EXPECT_EQ(text.find(','), std::string::npos) << text;
  }
}

TEST(ServeMetrics, ConcurrentObservationsAreAllCounted) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 10000;
  ServerMetrics metrics("m");
  // Values are multiples of 1/256 below 0.5: every partial sum is exact, so _sum must equal the
  // exact total whatever order the threads run in.
  const auto value_of = [](int thread, int i) { return double((thread * 31 + i) % 128) / 256.0; };

  std::atomic<bool> done{false};
  std::atomic<int> renders{0};
  std::thread reader([&] {
    // Every rendering taken while observations land must already be well formed.
    while (!done.load()) {
      const Exposition exposition = parse_exposition(metrics.render());
      expect_well_formed(histogram_of(exposition, "e4kv:time_to_first_token_seconds"), "ttft");
      renders.fetch_add(1);
    }
  });
  std::thread engine([&] {
    for (int64_t step = 1; step <= 2000; ++step) {
      metrics.set_engine_state(snapshot_with_totals(0, step * 10, step, 0));
    }
  });
  std::vector<std::thread> observers;
  for (int t = 0; t < kThreads; ++t) {
    observers.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        metrics.observe_ttft(value_of(t, i));
        metrics.observe_inter_token(value_of(t, i));
        if (i % 100 == 0) metrics.count_finished("length");
      }
    });
  }
  for (std::thread& observer : observers) observer.join();
  engine.join();
  done.store(true);
  reader.join();
  EXPECT_GT(renders.load(), 0);

  double expected_sum = 0.0;
  std::vector<double> all_values;
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kPerThread; ++i) {
      expected_sum += value_of(t, i);
      all_values.push_back(value_of(t, i));
    }
  }
  const Exposition exposition = parse_exposition(metrics.render());
  for (const char* name :
       {"e4kv:time_to_first_token_seconds", "e4kv:inter_token_latency_seconds"}) {
    const HistogramView view = histogram_of(exposition, name);
    expect_well_formed(view, name);
    EXPECT_EQ(view.count, double(kThreads * kPerThread)) << name;
    EXPECT_EQ(view.sum, expected_sum) << name;
    for (size_t b = 0; b < view.bounds.size(); ++b) {
      double at_or_below = 0;
      for (const double v : all_values) at_or_below += v <= view.bounds[b] ? 1 : 0;
      EXPECT_EQ(view.cumulative[b], at_or_below) << name << " le=" << view.le_texts[b];
    }
  }
  for (const Sample& s : samples_named(exposition, "e4kv:request_success_total")) {
    if (s.labels.at("finished_reason") == "length") {
      EXPECT_EQ(s.value, kThreads * kPerThread / 100);
    }
  }
  EXPECT_EQ(only_sample(exposition, "e4kv:prompt_tokens_total").value, 20000);
  EXPECT_EQ(only_sample(exposition, "e4kv:generation_tokens_total").value, 2000);
}

}  // namespace
}  // namespace e4kv::serve
