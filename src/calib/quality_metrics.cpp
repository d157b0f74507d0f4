#include "calib/quality_metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "core/status.h"

namespace e4kv {

namespace {

OutputError finish(double diff_sq, double test_sq, double ref_sq, double dot, double max_abs,
                   int64_t n) {
  OutputError e;
  e.n = n;
  e.max_abs = max_abs;
  if (n == 0) {
    // A measure over nothing is not a number: no row was compared.
    e.rmse = e.rel_l2 = e.cosine = std::numeric_limits<double>::quiet_NaN();
    return e;
  }
  e.rmse = n > 0 ? std::sqrt(diff_sq / double(n)) : 0.0;
  if (ref_sq > 0.0) {
    e.rel_l2 = std::sqrt(diff_sq) / std::sqrt(ref_sq);
  } else {
    e.rel_l2 = diff_sq > 0.0 ? std::numeric_limits<double>::infinity() : 0.0;
  }
  if (ref_sq > 0.0 && test_sq > 0.0) {
    e.cosine = dot / (std::sqrt(test_sq) * std::sqrt(ref_sq));
  } else {
    e.cosine = (ref_sq == 0.0 && test_sq == 0.0) ? 1.0 : 0.0;
  }
  return e;
}

// Sorted distinct non-negative entries.
std::vector<int32_t> as_set(std::span<const int32_t> row) {
  std::vector<int32_t> set;
  set.reserve(row.size());
  for (const int32_t t : row) {
    if (t >= 0) set.push_back(t);
  }
  std::sort(set.begin(), set.end());
  set.erase(std::unique(set.begin(), set.end()), set.end());
  return set;
}

}  // namespace

OutputError output_error(std::span<const float> test, std::span<const float> ref) {
  OutputErrorAccumulator acc;
  acc.add(test, ref);
  return acc.result();
}

void OutputErrorAccumulator::add(std::span<const float> test, std::span<const float> ref) {
  E4KV_ASSERT(test.size() == ref.size(),
              cat("output_error: sizes differ (", test.size(), " vs ", ref.size(), ")"));
  for (size_t i = 0; i < ref.size(); ++i) {
    const double a = test[i];
    const double b = ref[i];
    diff_sq_ += (a - b) * (a - b);
    test_sq_ += a * a;
    ref_sq_ += b * b;
    dot_ += a * b;
    max_abs_ = std::max(max_abs_, std::fabs(a - b));
  }
  n_ += int64_t(ref.size());
}

void OutputErrorAccumulator::merge(const OutputErrorAccumulator& other) {
  diff_sq_ += other.diff_sq_;
  test_sq_ += other.test_sq_;
  ref_sq_ += other.ref_sq_;
  dot_ += other.dot_;
  max_abs_ = std::max(max_abs_, other.max_abs_);
  n_ += other.n_;
}

OutputError OutputErrorAccumulator::result() const {
  return finish(diff_sq_, test_sq_, ref_sq_, dot_, max_abs_, n_);
}

RowOverlap selection_row_overlap(std::span<const int32_t> ref, std::span<const int32_t> test) {
  const std::vector<int32_t> a = as_set(ref);
  const std::vector<int32_t> b = as_set(test);
  std::vector<int32_t> both;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
  RowOverlap o;
  o.n_ref = int64_t(a.size());
  o.n_test = int64_t(b.size());
  o.n_intersection = int64_t(both.size());
  o.n_union = o.n_ref + o.n_test - o.n_intersection;
  o.jaccard = o.n_union > 0 ? double(o.n_intersection) / double(o.n_union) : 1.0;
  o.recall = o.n_ref > 0 ? double(o.n_intersection) / double(o.n_ref) : 1.0;
  o.exact = a == b;
  return o;
}

SelectionOverlap selection_overlap(const int32_t* ref, const int32_t* test, int64_t n_rows,
                                   int64_t width) {
  SelectionOverlap s;
  s.n_rows = n_rows;
  if (n_rows <= 0) return s;
  double sum_jaccard = 0.0;
  double sum_recall = 0.0;
  int64_t exact_rows = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const RowOverlap o =
        selection_row_overlap(std::span<const int32_t>(ref + r * width, size_t(width)),
                              std::span<const int32_t>(test + r * width, size_t(width)));
    sum_jaccard += o.jaccard;
    sum_recall += o.recall;
    s.min_recall = std::min(s.min_recall, o.recall);
    exact_rows += o.exact ? 1 : 0;
    s.sum_intersection += o.n_intersection;
    s.sum_union += o.n_union;
  }
  s.mean_jaccard = sum_jaccard / double(n_rows);
  s.mean_recall = sum_recall / double(n_rows);
  s.exact_row_ratio = double(exact_rows) / double(n_rows);
  s.micro_jaccard = s.sum_union > 0 ? double(s.sum_intersection) / double(s.sum_union) : 1.0;
  return s;
}

double attention_mass_recall(std::span<const float> probs, std::span<const int32_t> selection) {
  double total = 0.0;
  for (const float p : probs) total += p;
  double selected = 0.0;
  for (const int32_t t : as_set(selection)) {
    E4KV_ASSERT(size_t(t) < probs.size(), cat("attention_mass_recall: token ", t, " outside ",
                                              probs.size(), " probabilities"));
    selected += probs[size_t(t)];
  }
  return total > 0.0 ? selected / total : 1.0;
}

namespace {

// log softmax of `logits` in double.
std::vector<double> log_softmax(std::span<const float> logits) {
  E4KV_ASSERT(!logits.empty(), "log_softmax: no logits");
  double max = -std::numeric_limits<double>::infinity();
  for (const float v : logits) {
    E4KV_ASSERT(std::isfinite(v), "log_softmax: a non-finite logit");
    max = std::max(max, double(v));
  }
  double sum = 0.0;
  for (const float v : logits) sum += std::exp(double(v) - max);
  const double log_z = max + std::log(sum);
  std::vector<double> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = double(logits[i]) - log_z;
  return out;
}

}  // namespace

double next_token_kl(std::span<const float> ref_logits, std::span<const float> test_logits) {
  E4KV_ASSERT(ref_logits.size() == test_logits.size(),
              cat("next_token_kl: vocabularies differ (", ref_logits.size(), " vs ",
                  test_logits.size(), ")"));
  const std::vector<double> p = log_softmax(ref_logits);
  const std::vector<double> q = log_softmax(test_logits);
  double kl = 0.0;
  for (size_t i = 0; i < p.size(); ++i) kl += std::exp(p[i]) * (p[i] - q[i]);
  return std::max(0.0, kl);
}

double next_token_nll(std::span<const float> logits, int32_t target) {
  E4KV_ASSERT(target >= 0 && size_t(target) < logits.size(),
              cat("next_token_nll: target ", target, " outside [0, ", logits.size(), ")"));
  return -log_softmax(logits)[size_t(target)];
}

}  // namespace e4kv
