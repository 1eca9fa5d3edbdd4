#include "transport/stream_budget.h"

#include <gtest/gtest.h>

namespace psflow {
namespace {

TEST(StreamBudgetTest, EachPeerIsBoundedAndSoAreAllTogether) {
  StreamBudget budget({.per_peer = 2, .total = 3});
  EXPECT_TRUE(budget.Admit("a").ok());
  EXPECT_TRUE(budget.Admit("a").ok());
  const absl::Status third = budget.Admit("a");
  EXPECT_TRUE(absl::IsResourceExhausted(third)) << third;
  EXPECT_TRUE(budget.Admit("b").ok());
  // Three in all: another peer is refused too.
  EXPECT_TRUE(absl::IsResourceExhausted(budget.Admit("c")));
  EXPECT_EQ(budget.refused(), 2);
}

TEST(StreamBudgetTest, AStreamLetOutMakesRoom) {
  StreamBudget budget({.per_peer = 1, .total = 1});
  ASSERT_TRUE(budget.Admit("a").ok());
  EXPECT_FALSE(budget.Admit("b").ok());
  budget.LetOut("a");
  EXPECT_TRUE(budget.Admit("b").ok());
  EXPECT_FALSE(budget.Admit("a").ok());
  budget.LetOut("b");
  EXPECT_TRUE(budget.Admit("a").ok());
  EXPECT_EQ(budget.refused(), 2);
}

}  // namespace
}  // namespace psflow
