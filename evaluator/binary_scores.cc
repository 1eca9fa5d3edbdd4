#include "evaluator/binary_scores.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace psflow::evaluator {
namespace {

absl::Status CheckExample(double probability, int64_t label) {
  if (!(probability >= 0 && probability <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("probability ", probability, " is not in [0, 1]"));
  }
  if (label != 0 && label != 1) {
    return absl::InvalidArgumentError(absl::StrCat("label ", label, " is not 0 or 1"));
  }
  return absl::OkStatus();
}

std::string Figure(const std::optional<double>& value) {
  return value.has_value() ? absl::StrFormat("%.6f", *value) : "undefined";
}

}  // namespace

std::string BinaryResult::ToString() const {
  return absl::StrCat("examples=", examples, " positives=", positives, " auc=", Figure(auc),
                      " log_loss=", Figure(log_loss), " accuracy=", Figure(accuracy));
}

std::optional<double> MannWhitneyAuc(std::vector<double>* positive_scores,
                                     std::vector<double>* negative_scores) {
  if (positive_scores->empty() || negative_scores->empty()) return std::nullopt;
  std::sort(positive_scores->begin(), positive_scores->end());
  std::sort(negative_scores->begin(), negative_scores->end());
  // Twice the credit, in integers, so that ties' halves add up exactly: for
  // each positive, 2 per negative below it and 1 per negative equal to it.
  // Both walks only move forward, so this is linear after the sorts.
  unsigned __int128 twice_credit = 0;
  size_t below = 0, not_above = 0;
  const std::vector<double>& neg = *negative_scores;
  for (const double p : *positive_scores) {
    while (below < neg.size() && neg[below] < p) ++below;
    if (not_above < below) not_above = below;
    while (not_above < neg.size() && neg[not_above] <= p) ++not_above;
    twice_credit += below + not_above;
  }
  const long double pairs =
      static_cast<long double>(positive_scores->size()) * static_cast<long double>(neg.size());
  return static_cast<double>(static_cast<long double>(twice_credit) / (2 * pairs));
}

void BinaryScores::AddChecked(double probability, bool positive) {
  const double p = std::clamp(probability, kLogLossEpsilon, 1 - kLogLossEpsilon);
  log_loss_sum_ -= positive ? std::log(p) : std::log1p(-p);
  if ((probability > 0.5) == positive) ++correct_;
  (positive ? positive_scores_ : negative_scores_).push_back(probability);
}

absl::Status BinaryScores::Add(double probability, int64_t label) {
  if (absl::Status s = CheckExample(probability, label); !s.ok()) return s;
  AddChecked(probability, label == 1);
  return absl::OkStatus();
}

template <typename T>
absl::Status BinaryScores::AddAll(absl::Span<const T> probabilities,
                                  absl::Span<const int64_t> labels) {
  if (probabilities.size() != labels.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(probabilities.size(), " probabilities but ", labels.size(), " labels"));
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    if (absl::Status s = CheckExample(probabilities[i], labels[i]); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("example ", i, ": ", s.message()));
    }
  }
  for (size_t i = 0; i < labels.size(); ++i) AddChecked(probabilities[i], labels[i] == 1);
  return absl::OkStatus();
}

absl::Status BinaryScores::AddBatch(absl::Span<const float> probabilities,
                                    absl::Span<const int64_t> labels) {
  return AddAll(probabilities, labels);
}

absl::Status BinaryScores::AddBatch(absl::Span<const double> probabilities,
                                    absl::Span<const int64_t> labels) {
  return AddAll(probabilities, labels);
}

void BinaryScores::Merge(const BinaryScores& other) {
  if (&other == this) {
    const BinaryScores copy = other;  // insert() may not read the vector it grows
    Merge(copy);
    return;
  }
  positive_scores_.insert(positive_scores_.end(), other.positive_scores_.begin(),
                          other.positive_scores_.end());
  negative_scores_.insert(negative_scores_.end(), other.negative_scores_.begin(),
                          other.negative_scores_.end());
  log_loss_sum_ += other.log_loss_sum_;
  correct_ += other.correct_;
}

BinaryResult BinaryScores::Result() {
  BinaryResult r;
  r.examples = examples();
  r.positives = static_cast<int64_t>(positive_scores_.size());
  r.auc = MannWhitneyAuc(&positive_scores_, &negative_scores_);
  if (r.examples > 0) {
    const double n = static_cast<double>(r.examples);
    r.log_loss = log_loss_sum_ / n;
    r.accuracy = static_cast<double>(correct_) / n;
  }
  return r;
}

}  // namespace psflow::evaluator
