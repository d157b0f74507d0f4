// The one numeric comparator of the tests (STYLE.md): element i passes when
// |got[i] - ref[i]| <= atol + rtol * |ref[i]|; a NaN passes only against a NaN. The report gives
// the count of failures, the first bad index, the largest absolute error and where, the relative L2
// error ||got - ref|| / ||ref|| over the finite pairs, and the NaN count of `got`.
//
//   EXPECT_TRUE(e4kv::test::all_close(got, ref, /*atol=*/1e-6, /*rtol=*/1e-5));
//   EXPECT_LE(e4kv::test::compare(got, ref, 0.0, 0.0).rel_l2, 1e-3);  // a bound on one measure
//
// Sizes that differ make every measure infinite.
//
// got and ref: any contiguous ranges of arithmetic values (std::vector<float>,
// std::span<double>..).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <sstream>
#include <string>

namespace e4kv::test {

struct CompareReport {
  int64_t n = 0;
  int64_t n_bad = 0;
  int64_t first_bad = -1;
  double first_bad_got = 0.0;
  double first_bad_ref = 0.0;
  double max_abs_err = 0.0;
  int64_t max_abs_index = -1;
  double rel_l2 = 0.0;
  int64_t n_nan = 0;  // NaNs in got
  bool size_mismatch = false;

  bool ok() const { return !size_mismatch && n_bad == 0; }

  std::string summary() const {
    std::ostringstream out;
    out.precision(9);
    if (size_mismatch) return "sizes differ";
    out << n_bad << "/" << n << " bad";
    if (first_bad >= 0) {
      out << ", first at [" << first_bad << "]: got " << first_bad_got << ", ref " << first_bad_ref;
    }
    out << "; max |err| " << max_abs_err << " at [" << max_abs_index << "]; rel L2 " << rel_l2
        << "; NaN in got " << n_nan;
    return out.str();
  }
};

template <class Got, class Ref>
CompareReport compare(const Got& got, const Ref& ref, double atol, double rtol) {
  CompareReport report;
  const auto n_got = int64_t(std::size(got));
  const auto n_ref = int64_t(std::size(ref));
  if (n_got != n_ref) {
    // Every error measure infinite, so a bound on any of them fails.
    report.size_mismatch = true;
    report.max_abs_err = report.rel_l2 = INFINITY;
    return report;
  }
  report.n = n_ref;
  double diff_sq = 0.0;
  double ref_sq = 0.0;
  const auto* g = std::data(got);
  const auto* r = std::data(ref);
  for (int64_t i = 0; i < n_ref; ++i) {
    const double a = double(g[i]);
    const double b = double(r[i]);
    bool bad;
    if (std::isnan(a) || std::isnan(b)) {
      report.n_nan += std::isnan(a) ? 1 : 0;
      bad = !(std::isnan(a) && std::isnan(b));
    } else {
      const double err = std::fabs(a - b);
      bad = !(err <= atol + rtol * std::fabs(b));
      if (std::isfinite(err)) {
        diff_sq += err * err;
        ref_sq += b * b;
      }
      if (err > report.max_abs_err || report.max_abs_index < 0) {
        report.max_abs_err = err;
        report.max_abs_index = i;
      }
    }
    if (bad) {
      if (report.first_bad < 0) {
        report.first_bad = i;
        report.first_bad_got = a;
        report.first_bad_ref = b;
      }
      ++report.n_bad;
    }
  }
  report.rel_l2 = ref_sq > 0.0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq);
  return report;
}

template <class Got, class Ref>
::testing::AssertionResult all_close(const Got& got, const Ref& ref, double atol, double rtol) {
  const CompareReport report = compare(got, ref, atol, rtol);
  if (report.ok()) return ::testing::AssertionSuccess() << report.summary();
  return ::testing::AssertionFailure()
         << "not close (atol " << atol << ", rtol " << rtol << "): " << report.summary();
}

}  // namespace e4kv::test
