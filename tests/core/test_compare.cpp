// The tests' shared comparator (testing/compare.h) against hand-computed reports.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "testing/compare.h"

namespace e4kv::test {
namespace {

TEST(Compare, ReportsFirstBadIndexMaxErrorAndRelativeL2) {
  const std::vector<float> ref{3.0f, 4.0f, 0.0f, 1.0f};
  const std::vector<float> got{3.0f, 4.5f, 0.0f, 0.5f};
  const CompareReport r = compare(got, ref, 0.1, 0.0);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.n, 4);
  EXPECT_EQ(r.n_bad, 2);
  EXPECT_EQ(r.first_bad, 1);
  EXPECT_EQ(r.first_bad_got, 4.5);
  EXPECT_DOUBLE_EQ(r.max_abs_err, 0.5);
  EXPECT_EQ(r.max_abs_index, 1);
  // sqrt((0.25 + 0.25) / (9 + 16 + 1))
  EXPECT_DOUBLE_EQ(r.rel_l2, std::sqrt(0.5 / 26.0));
  EXPECT_TRUE(compare(got, ref, 0.5, 0.0).ok());
  // rtol scales with |ref|: 0.5 <= 0.125 * 4 passes, 0.5 > 0.125 * 1 does not.
  EXPECT_EQ(compare(got, ref, 0.0, 0.125).n_bad, 1);
}

TEST(Compare, NanPassesOnlyAgainstNan) {
  const std::vector<double> ref{NAN, 1.0, 2.0};
  EXPECT_TRUE(compare(std::vector<double>{NAN, 1.0, 2.0}, ref, 0.0, 0.0).ok());
  const CompareReport r = compare(std::vector<double>{1.0, NAN, 2.0}, ref, 1e9, 1e9);
  EXPECT_EQ(r.n_bad, 2);
  EXPECT_EQ(r.n_nan, 1);
}

TEST(Compare, SizesThatDifferFailEveryMeasure) {
  const CompareReport r = compare(std::vector<float>{1.0f}, std::vector<float>{1.0f, 2.0f}, 1, 1);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(std::isinf(r.rel_l2));
  EXPECT_TRUE(std::isinf(r.max_abs_err));
  EXPECT_FALSE(all_close(std::vector<float>{}, std::vector<float>{0.0f}, 1, 1));
}

}  // namespace
}  // namespace e4kv::test
