// Quality measures of DESIGN.md section 8: the error of a test tensor (E4M3 KV) against a reference
// (FP16 KV) on identical inputs, and the overlap of QSA selections. All sums are in double.
#pragma once

#include <cstdint>
#include <span>

namespace e4kv {

// Error of `test` against `ref` (same length n).
//   rel_l2 = ||test - ref|| / ||ref||     (0 when both are zero, +inf when only ref is zero)
//   cosine = test . ref / (||test|| ||ref||)   (1 when both are zero, 0 when only one is)
//   rmse   = sqrt(sum (test - ref)^2 / n)       (0 for n = 0)
// Over no elements (n == 0) every measure is NaN: there is nothing to report.
struct OutputError {
  double rel_l2 = 0.0;
  double cosine = 1.0;
  double rmse = 0.0;
  double max_abs = 0.0;
  int64_t n = 0;
};

OutputError output_error(std::span<const float> test, std::span<const float> ref);

// Pools several pairs (for example every layer of a forward) into one measure over all their
// elements; per-pair measures come from output_error.
class OutputErrorAccumulator {
 public:
  void add(std::span<const float> test, std::span<const float> ref);
  // Pools `other`'s pairs into this one (as if they had been added here).
  void merge(const OutputErrorAccumulator& other);
  OutputError result() const;

 private:
  double diff_sq_ = 0.0;
  double test_sq_ = 0.0;
  double ref_sq_ = 0.0;
  double dot_ = 0.0;
  double max_abs_ = 0.0;
  int64_t n_ = 0;
};

// Overlap of one selection row A (reference, FP16 KV) with B (test, E4M3 KV). Entries < 0 (the -1
// padding) are ignored; rows are treated as sets (order and duplicates do not matter).
//   jaccard = |A∩B| / |A∪B|   (1 when both are empty)
//   recall  = |A∩B| / |A|     ("FP16 recall"; 1 when A is empty)
//   exact   = A == B
struct RowOverlap {
  int64_t n_ref = 0;
  int64_t n_test = 0;
  int64_t n_intersection = 0;
  int64_t n_union = 0;
  double jaccard = 1.0;
  double recall = 1.0;
  bool exact = true;
};

RowOverlap selection_row_overlap(std::span<const int32_t> ref, std::span<const int32_t> test);

// Over n_rows selection rows: means of the row measures, the exact-row ratio, and the micro
// Jaccard sum|A∩B| / sum|A∪B| (1 when every union is empty).
struct SelectionOverlap {
  int64_t n_rows = 0;
  double mean_jaccard = 1.0;
  double mean_recall = 1.0;
  double min_recall = 1.0;
  double exact_row_ratio = 1.0;
  double micro_jaccard = 1.0;
  int64_t sum_intersection = 0;
  int64_t sum_union = 0;
};

// ref, test: [n_rows, width] selection rows (token indices, -1 padding).
SelectionOverlap selection_overlap(const int32_t* ref, const int32_t* test, int64_t n_rows,
                                   int64_t width);

// Attention-mass recall of a selection: sum of probs[t] over the distinct selected tokens t
// (entries < 0 ignored) divided by the sum of all probs. probs: [n_tokens] dense attention
// probabilities of one query row and head over tokens 0..n_tokens-1 (backend/cpu/attention.h:
// dense_attention_probs); a selected token >= n_tokens is a caller error. 1 when all probs are 0.
double attention_mass_recall(std::span<const float> probs, std::span<const int32_t> selection);

// Next-token distributions from logits (softmax in double, max-subtracted):
//   kl(ref || test) = sum_i p_ref(i) (log p_ref(i) - log p_test(i))   (>= 0; 0 for equal logits)
//   nll(logits, target) = -log p(target)
// Logits of one position, [vocab] each; a non-finite logit is a caller error.
double next_token_kl(std::span<const float> ref_logits, std::span<const float> test_logits);
double next_token_nll(std::span<const float> logits, int32_t target);

}  // namespace e4kv
