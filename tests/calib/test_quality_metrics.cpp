// Quality measures of DESIGN.md section 8 against values computed by hand.
#include "calib/quality_metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace e4kv {
namespace {

TEST(QualityMetrics, OutputErrorByHand) {
  // test - ref = (0, 0, -1); ||ref||^2 = 21, ||test||^2 = 14, test . ref = 17.
  const std::vector<float> test = {1, 2, 3};
  const std::vector<float> ref = {1, 2, 4};
  const OutputError e = output_error(test, ref);
  EXPECT_EQ(e.n, 3);
  EXPECT_DOUBLE_EQ(e.rel_l2, 1.0 / std::sqrt(21.0));
  EXPECT_DOUBLE_EQ(e.cosine, 17.0 / std::sqrt(14.0 * 21.0));
  EXPECT_DOUBLE_EQ(e.rmse, std::sqrt(1.0 / 3.0));
  EXPECT_DOUBLE_EQ(e.max_abs, 1.0);
}

TEST(QualityMetrics, OutputErrorOfOppositeAndEqualVectors) {
  const std::vector<float> a = {1, -2, 0.5f};
  const std::vector<float> minus_a = {-1, 2, -0.5f};
  EXPECT_DOUBLE_EQ(output_error(minus_a, a).cosine, -1.0);
  EXPECT_DOUBLE_EQ(output_error(minus_a, a).rel_l2, 2.0);
  const OutputError same = output_error(a, a);
  EXPECT_EQ(same.rel_l2, 0.0);
  EXPECT_DOUBLE_EQ(same.cosine, 1.0);
  EXPECT_EQ(same.rmse, 0.0);
}

TEST(QualityMetrics, OutputErrorWithZeroVectors) {
  const std::vector<float> zero = {0, 0};
  const std::vector<float> one = {1, 0};
  EXPECT_EQ(output_error(zero, zero).rel_l2, 0.0);
  EXPECT_EQ(output_error(zero, zero).cosine, 1.0);
  EXPECT_EQ(output_error(one, zero).rel_l2, std::numeric_limits<double>::infinity());
  EXPECT_EQ(output_error(one, zero).cosine, 0.0);
  EXPECT_EQ(output_error(zero, one).rel_l2, 1.0);
  EXPECT_EQ(output_error(zero, one).cosine, 0.0);
  // Over no elements there is no measure: NaN, never a perfect 0 or 1.
  const OutputError empty = output_error({}, {});
  EXPECT_EQ(empty.n, 0);
  EXPECT_TRUE(std::isnan(empty.rmse));
  EXPECT_TRUE(std::isnan(empty.rel_l2));
  EXPECT_TRUE(std::isnan(empty.cosine));
  EXPECT_TRUE(std::isnan(OutputErrorAccumulator().result().cosine));
}

TEST(QualityMetrics, AccumulatorPoolsElements) {
  OutputErrorAccumulator acc;
  acc.add(std::vector<float>{1, 2}, std::vector<float>{1, 2});
  acc.add(std::vector<float>{3}, std::vector<float>{4});
  const OutputError pooled = acc.result();
  const OutputError whole = output_error(std::vector<float>{1, 2, 3}, std::vector<float>{1, 2, 4});
  EXPECT_EQ(pooled.n, 3);
  EXPECT_DOUBLE_EQ(pooled.rel_l2, whole.rel_l2);
  EXPECT_DOUBLE_EQ(pooled.cosine, whole.cosine);
  EXPECT_DOUBLE_EQ(pooled.rmse, whole.rmse);
  EXPECT_DOUBLE_EQ(pooled.max_abs, 1.0);
}

TEST(QualityMetrics, RowOverlapIgnoresPaddingOrderAndDuplicates) {
  const std::vector<int32_t> ref = {0, 1, 2, 3, -1, -1};
  const std::vector<int32_t> test = {5, 4, 3, 2, 2, -1};
  const RowOverlap o = selection_row_overlap(ref, test);
  EXPECT_EQ(o.n_ref, 4);
  EXPECT_EQ(o.n_test, 4);
  EXPECT_EQ(o.n_intersection, 2);
  EXPECT_EQ(o.n_union, 6);
  EXPECT_DOUBLE_EQ(o.jaccard, 2.0 / 6.0);
  EXPECT_DOUBLE_EQ(o.recall, 0.5);
  EXPECT_FALSE(o.exact);
  const std::vector<int32_t> reordered = {3, 2, 1, 0, -1, -1};
  EXPECT_TRUE(selection_row_overlap(ref, reordered).exact);
  const std::vector<int32_t> empty = {-1, -1};
  EXPECT_EQ(selection_row_overlap(empty, empty).jaccard, 1.0);
  EXPECT_EQ(selection_row_overlap(empty, test).recall, 1.0);
  EXPECT_EQ(selection_row_overlap(empty, test).jaccard, 0.0);
}

TEST(QualityMetrics, SelectionOverlapOverRows) {
  // Width 4, three rows:
  //   row 0: A = {0,1,2,3}, B = {0,1,2,3}  -> |∩| 4, |∪| 4, J 1,   recall 1,   exact
  //   row 1: A = {0,1,2},   B = {0,1,5,6}  -> |∩| 2, |∪| 5, J 0.4, recall 2/3
  //   row 2: A = {7},       B = {8,9}      -> |∩| 0, |∪| 3, J 0,   recall 0
  const std::vector<int32_t> ref = {0, 1, 2, 3, 0, 1, 2, -1, 7, -1, -1, -1};
  const std::vector<int32_t> test = {0, 1, 2, 3, 0, 1, 5, 6, 8, 9, -1, -1};
  const SelectionOverlap s = selection_overlap(ref.data(), test.data(), 3, 4);
  EXPECT_EQ(s.n_rows, 3);
  EXPECT_DOUBLE_EQ(s.mean_jaccard, (1.0 + 0.4 + 0.0) / 3.0);
  EXPECT_DOUBLE_EQ(s.mean_recall, (1.0 + 2.0 / 3.0 + 0.0) / 3.0);
  EXPECT_DOUBLE_EQ(s.min_recall, 0.0);
  EXPECT_DOUBLE_EQ(s.exact_row_ratio, 1.0 / 3.0);
  EXPECT_EQ(s.sum_intersection, 6);
  EXPECT_EQ(s.sum_union, 12);
  EXPECT_DOUBLE_EQ(s.micro_jaccard, 0.5);
  const SelectionOverlap none = selection_overlap(nullptr, nullptr, 0, 4);
  EXPECT_EQ(none.n_rows, 0);
  EXPECT_EQ(none.micro_jaccard, 1.0);
}

TEST(QualityMetrics, AttentionMassRecall) {
  const std::vector<float> probs = {0.1f, 0.2f, 0.3f, 0.4f};
  EXPECT_NEAR(attention_mass_recall(probs, std::vector<int32_t>{1, 3, -1}), 0.6, 1e-7);
  EXPECT_NEAR(attention_mass_recall(probs, std::vector<int32_t>{3, 3, 1}), 0.6, 1e-7);
  EXPECT_NEAR(attention_mass_recall(probs, std::vector<int32_t>{0, 1, 2, 3}), 1.0, 1e-12);
  EXPECT_EQ(attention_mass_recall(probs, std::vector<int32_t>{-1, -1}), 0.0);
  // Unnormalised weights are normalised by their sum.
  EXPECT_DOUBLE_EQ(attention_mass_recall(std::vector<float>{1, 3}, std::vector<int32_t>{1}), 0.75);
  EXPECT_EQ(attention_mass_recall(std::vector<float>{0, 0}, std::vector<int32_t>{0}), 1.0);
}

// Hand-computed: logits {0, ln 3} -> p = {1/4, 3/4}; logits {0, 0} -> q = {1/2, 1/2}.
// KL(p || q) = 1/4 ln(1/2) + 3/4 ln(3/2); NLL of token 1 under p = -ln(3/4).
TEST(QualityMetrics, NextTokenKlAndNll) {
  const std::vector<float> p = {0.0f, float(std::log(3.0))};
  const std::vector<float> q = {0.0f, 0.0f};
  EXPECT_NEAR(next_token_kl(p, q), 0.25 * std::log(0.5) + 0.75 * std::log(1.5), 1e-7);
  EXPECT_EQ(next_token_kl(p, p), 0.0);
  // A shift of every logit changes nothing.
  const std::vector<float> shifted = {100.0f, 100.0f + float(std::log(3.0))};
  EXPECT_NEAR(next_token_kl(p, shifted), 0.0, 1e-6);
  EXPECT_NEAR(next_token_nll(p, 1), -std::log(0.75), 1e-7);
  EXPECT_NEAR(next_token_nll(q, 0), std::log(2.0), 1e-12);
  // Large logits stay finite (max-subtracted).
  EXPECT_NEAR(next_token_nll(std::vector<float>{1000.0f, 0.0f}, 1), 1000.0, 1e-9);
}

}  // namespace
}  // namespace e4kv
