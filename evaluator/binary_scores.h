// The figures of a binary classifier on a test set: exact ROC AUC, log-loss,
// accuracy at 0.5 and counts, accumulated batch by batch and mergeable (each
// worker or thread scores its share, then one merges them). Knows nothing of
// models, kernels or the network, so the evaluator, psflow-eval, the worker
// and the data tools share it.
//
// The AUC is exact, not binned: every score is kept (8 bytes an example) and
// Result() sorts them. It is the Mann-Whitney statistic, the probability that
// a random positive scores above a random negative, a tie counting one half
// (sklearn's roc_auc_score and TensorFlow's AUC with many thresholds agree
// with it up to their binning).
//
// Thread-safety: none; one BinaryScores per thread, merged afterwards.
#ifndef PSFLOW_EVALUATOR_BINARY_SCORES_H_
#define PSFLOW_EVALUATOR_BINARY_SCORES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace psflow::evaluator {

// Probabilities are clipped to [kLogLossEpsilon, 1 - kLogLossEpsilon] for the
// log-loss, so one confident mistake costs at most -log(1e-7) ≈ 16.1.
inline constexpr double kLogLossEpsilon = 1e-7;

struct BinaryResult {
  int64_t examples = 0;
  int64_t positives = 0;
  // Undefined (nullopt) unless both classes occur.
  std::optional<double> auc;
  // Mean over the examples; undefined (nullopt) without examples.
  std::optional<double> log_loss;
  // Share of examples whose prediction (positive iff probability > 0.5) is
  // the label; undefined without examples.
  std::optional<double> accuracy;

  int64_t negatives() const { return examples - positives; }
  // "examples=N positives=P auc=0.812345 log_loss=0.443210 accuracy=0.790000",
  // with "undefined" for a figure that has none.
  std::string ToString() const;
};

class BinaryScores {
 public:
  // One example: the predicted probability of the positive class and the
  // label (0 or 1). INVALID_ARGUMENT, leaving the scores as they were, for a
  // probability outside [0, 1] (NaN included) or another label.
  absl::Status Add(double probability, int64_t label);
  // A batch, probabilities[i] with labels[i]. The same errors, naming the
  // index, and then nothing of the batch is kept; unequal lengths too.
  absl::Status AddBatch(absl::Span<const float> probabilities, absl::Span<const int64_t> labels);
  absl::Status AddBatch(absl::Span<const double> probabilities, absl::Span<const int64_t> labels);
  // Adds every example of `other`, as if added here.
  void Merge(const BinaryScores& other);

  int64_t examples() const {
    return static_cast<int64_t>(positive_scores_.size() + negative_scores_.size());
  }
  // Sorts the kept scores (O(n log n)); the scores stay usable.
  BinaryResult Result();

 private:
  template <typename T>
  absl::Status AddAll(absl::Span<const T> probabilities, absl::Span<const int64_t> labels);
  void AddChecked(double probability, bool positive);

  std::vector<double> positive_scores_, negative_scores_;
  double log_loss_sum_ = 0;
  int64_t correct_ = 0;
};

// The Mann-Whitney AUC of scores split by class: the share of (positive,
// negative) pairs in which the positive scores higher, ties counting one half.
// Sorts both. Undefined when either is empty. Scores may be any non-NaN reals.
std::optional<double> MannWhitneyAuc(std::vector<double>* positive_scores,
                                     std::vector<double>* negative_scores);

}  // namespace psflow::evaluator

#endif  // PSFLOW_EVALUATOR_BINARY_SCORES_H_
