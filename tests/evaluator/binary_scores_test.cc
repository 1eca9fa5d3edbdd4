// BinaryScores: the exact AUC against every pair counted by hand, ties
// included; log-loss and accuracy against hand-computed values; batches,
// merges and the undefined figures.
#include "evaluator/binary_scores.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::evaluator {
namespace {

using ::testing::HasSubstr;

// The AUC by its definition: every (positive, negative) pair, one for the
// positive above, one half for a tie.
double PairwiseAuc(const std::vector<double>& p, const std::vector<int64_t>& y) {
  double credit = 0, pairs = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    for (size_t j = 0; j < p.size(); ++j) {
      if (y[i] != 1 || y[j] != 0) continue;
      pairs += 1;
      credit += p[i] > p[j] ? 1 : p[i] == p[j] ? 0.5 : 0;
    }
  }
  return credit / pairs;
}

TEST(BinaryScoresTest, SmallCaseByHand) {
  // Positives 0.9, 0.4, 0.4; negatives 0.4, 0.2. Pairs: 0.9 beats both (2),
  // each 0.4 ties 0.4 (0.5) and beats 0.2 (1): 2 + 1.5 + 1.5 = 5 of 6.
  BinaryScores s;
  const std::vector<double> p = {0.9, 0.4, 0.4, 0.4, 0.2};
  const std::vector<int64_t> y = {1, 1, 1, 0, 0};
  ASSERT_TRUE(s.AddBatch(absl::MakeConstSpan(p), absl::MakeConstSpan(y)).ok());
  BinaryResult r = s.Result();
  EXPECT_EQ(r.examples, 5);
  EXPECT_EQ(r.positives, 3);
  EXPECT_EQ(r.negatives(), 2);
  ASSERT_TRUE(r.auc.has_value());
  EXPECT_DOUBLE_EQ(*r.auc, 5.0 / 6.0);
  const double log_loss = -(std::log(0.9) + 2 * std::log(0.4) + std::log(0.6) + std::log(0.8)) / 5;
  ASSERT_TRUE(r.log_loss.has_value());
  EXPECT_NEAR(*r.log_loss, log_loss, 1e-12);
  // Right: 0.9 (positive), 0.4 and 0.2 as negatives; the positives at 0.4 are wrong.
  EXPECT_DOUBLE_EQ(*r.accuracy, 3.0 / 5.0);
  EXPECT_EQ(r.ToString(),
            absl::StrFormat("examples=5 positives=3 auc=0.833333 log_loss=%.6f accuracy=0.600000",
                            log_loss));
}

TEST(BinaryScoresTest, MatchesEveryPairOnRandomScoresWithManyTies) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 300);
    // Scores from few levels in some trials, so ties are common.
    const int levels = trial % 2 == 0 ? 5 : 1000000;
    std::vector<double> p(n);
    std::vector<int64_t> y(n);
    for (int i = 0; i < n; ++i) {
      p[i] = static_cast<double>(rng() % levels) / levels;
      y[i] = static_cast<int64_t>(rng() % 3 == 0);
    }
    // Added in three parts to three accumulators, then merged.
    BinaryScores a, b, c;
    for (int i = 0; i < n; ++i)
      ASSERT_TRUE((i % 3 == 0 ? a : i % 3 == 1 ? b : c).Add(p[i], y[i]).ok());
    a.Merge(b);
    a.Merge(c);
    BinaryResult r = a.Result();
    ASSERT_EQ(r.examples, n);
    const int64_t positives = std::count(y.begin(), y.end(), 1);
    ASSERT_EQ(r.positives, positives);
    if (positives == 0 || positives == n) {
      EXPECT_FALSE(r.auc.has_value());
    } else {
      ASSERT_TRUE(r.auc.has_value());
      EXPECT_NEAR(*r.auc, PairwiseAuc(p, y), 1e-12) << "trial " << trial;
    }
  }
}

TEST(BinaryScoresTest, AllTiedIsOneHalfAndOrderingGivesZeroAndOne) {
  BinaryScores tied;
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(tied.Add(0.3, i % 2).ok());
  EXPECT_DOUBLE_EQ(*tied.Result().auc, 0.5);
  BinaryScores perfect, reversed;
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(perfect.Add(i / 10.0, i >= 5).ok());
    ASSERT_TRUE(reversed.Add(i / 10.0, i < 5).ok());
  }
  EXPECT_DOUBLE_EQ(*perfect.Result().auc, 1.0);
  EXPECT_DOUBLE_EQ(*reversed.Result().auc, 0.0);
}

TEST(BinaryScoresTest, OneClassOrNothingLeavesFiguresUndefined) {
  BinaryScores none;
  BinaryResult empty = none.Result();
  EXPECT_EQ(empty.examples, 0);
  EXPECT_FALSE(empty.auc.has_value());
  EXPECT_FALSE(empty.log_loss.has_value());
  EXPECT_FALSE(empty.accuracy.has_value());
  EXPECT_EQ(empty.ToString(),
            "examples=0 positives=0 auc=undefined log_loss=undefined accuracy=undefined");
  BinaryScores negatives;
  ASSERT_TRUE(negatives.Add(0.2, 0).ok());
  ASSERT_TRUE(negatives.Add(0.7, 0).ok());
  BinaryResult r = negatives.Result();
  EXPECT_FALSE(r.auc.has_value());
  EXPECT_THAT(r.ToString(), HasSubstr("auc=undefined"));
  EXPECT_NEAR(*r.log_loss, -(std::log(0.8) + std::log(0.3)) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(*r.accuracy, 0.5);
}

TEST(BinaryScoresTest, LogLossClipsCertainMistakes) {
  BinaryScores s;
  ASSERT_TRUE(s.Add(0.0, 1).ok());
  ASSERT_TRUE(s.Add(1.0, 1).ok());
  BinaryResult r = s.Result();
  EXPECT_NEAR(*r.log_loss, -(std::log(1e-7) + std::log1p(-1e-7)) / 2, 1e-12);
  // Exactly 0.5 predicts the negative class.
  BinaryScores half;
  ASSERT_TRUE(half.Add(0.5, 0).ok());
  ASSERT_TRUE(half.Add(0.5, 1).ok());
  EXPECT_DOUBLE_EQ(*half.Result().accuracy, 0.5);
}

TEST(BinaryScoresTest, MergingItselfDoublesEverything) {
  BinaryScores s;
  ASSERT_TRUE(s.Add(0.8, 1).ok());
  ASSERT_TRUE(s.Add(0.1, 0).ok());
  s.Merge(s);
  BinaryResult r = s.Result();
  EXPECT_EQ(r.examples, 4);
  EXPECT_EQ(r.positives, 2);
  EXPECT_DOUBLE_EQ(*r.auc, 1.0);
}

TEST(BinaryScoresTest, RefusesBadExamplesAndKeepsNothingOfABadBatch) {
  BinaryScores s;
  EXPECT_THAT(s.Add(std::nan(""), 1).message(), HasSubstr("is not in [0, 1]"));
  EXPECT_THAT(s.Add(1.5, 1).message(), HasSubstr("probability 1.5 is not in [0, 1]"));
  EXPECT_THAT(s.Add(0.5, 2).message(), HasSubstr("label 2 is not 0 or 1"));
  const std::vector<float> p = {0.1f, 0.2f, 0.3f};
  const std::vector<int64_t> bad = {0, 1, -1};
  absl::Status status = s.AddBatch(absl::MakeConstSpan(p), absl::MakeConstSpan(bad));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("example 2: label -1 is not 0 or 1"));
  const std::vector<int64_t> short_labels = {0, 1};
  EXPECT_THAT(s.AddBatch(absl::MakeConstSpan(p), absl::MakeConstSpan(short_labels)).message(),
              HasSubstr("3 probabilities but 2 labels"));
  EXPECT_EQ(s.examples(), 0);
}

}  // namespace
}  // namespace psflow::evaluator
