#include "transport/stream_budget.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <vector>

#include <grpc/grpc.h>

#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "transport/first_message_timer.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

TEST(StreamBudgetTest, EachPeerIsBoundedAndSoAreAllTogether) {
  StreamBudget budget({.per_peer = 2, .total = 3, .pending = 3});
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
  StreamBudget budget({.per_peer = 1, .total = 1, .pending = 1});
  ASSERT_TRUE(budget.Admit("a").ok());
  EXPECT_FALSE(budget.Admit("b").ok());
  budget.LetOut("a");
  EXPECT_TRUE(budget.Admit("b").ok());
  EXPECT_FALSE(budget.Admit("a").ok());
  budget.LetOut("b");
  EXPECT_TRUE(budget.Admit("a").ok());
  EXPECT_EQ(budget.refused(), 2);
}

// Peers not vouched for share the pending part; a member's streams draw from
// the whole budget, those it had open included.
TEST(StreamBudgetTest, PendingPeersCannotTakeTheMembersPart) {
  StreamBudget budget({.per_peer = 8, .total = 6, .pending = 3});
  bool pending = false;
  ASSERT_TRUE(budget.Admit("member", &pending).ok());
  EXPECT_TRUE(pending);
  budget.Vouch("member");
  EXPECT_EQ(budget.pending(), 0);
  for (const char* stranger : {"a", "a", "b"}) {
    ASSERT_TRUE(budget.Admit(stranger, &pending).ok()) << stranger;
    EXPECT_TRUE(pending);
  }
  // The pending part is full: strangers are refused, new or not ...
  const absl::Status refused = budget.Admit("c");
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("unproven peers"));
  EXPECT_TRUE(absl::IsResourceExhausted(budget.Admit("a")));
  // ... and the member is not, up to the whole budget.
  ASSERT_TRUE(budget.Admit("member", &pending).ok());
  EXPECT_FALSE(pending);
  ASSERT_TRUE(budget.Admit("member").ok());
  EXPECT_TRUE(absl::IsResourceExhausted(budget.Admit("member")));
  EXPECT_EQ(budget.open(), 6);
  EXPECT_EQ(budget.pending(), 3);
  EXPECT_EQ(budget.refused(), 3);
  // A stranger vouched for moves its open streams to the members' part.
  budget.Vouch("a");
  EXPECT_EQ(budget.pending(), 1);
  budget.LetOut("a");
  budget.LetOut("a");
  budget.LetOut("b");
  EXPECT_EQ(budget.pending(), 0);
  EXPECT_EQ(budget.open(), 3);
  // A member is remembered after its last stream closed.
  for (int i = 0; i < 3; ++i) budget.LetOut("member");
  ASSERT_TRUE(budget.Admit("member", &pending).ok());
  EXPECT_FALSE(pending);
  ASSERT_TRUE(budget.Admit("c", &pending).ok());
  EXPECT_TRUE(pending);
}

// The log lines of a test body: what it wrote to stderr.
std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// A flood of refusals is one line as it begins and one summary per period
// while it goes on, not a line per call; so are streams cancelled for
// silence.
TEST(StreamBudgetTest, RefusalsAreLoggedOnceABurst) {
  StreamBudget budget({.per_peer = 1, .total = 1, .pending = 1}, absl::Milliseconds(300));
  ASSERT_TRUE(budget.Admit("a").ok());
  testing::internal::CaptureStderr();
  for (int i = 0; i < 500; ++i) {
    EXPECT_FALSE(budget.Admit(i % 2 == 0 ? "b" : "c").ok());
  }
  for (int i = 0; i < 100; ++i) budget.TimedOut("d");
  std::vector<std::string> lines = Lines(testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 2u) << testing::PrintToString(lines);
  EXPECT_THAT(lines[0], HasSubstr("refused a stream of b (too many streams open"));
  EXPECT_THAT(lines[1], HasSubstr("cancelled a stream of d (no valid first message within 5s)"));
  // A period later, the next call sums up what was not logged.
  absl::SleepFor(absl::Milliseconds(400));
  testing::internal::CaptureStderr();
  budget.LetOut("a");
  lines = Lines(testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 2u) << testing::PrintToString(lines);
  EXPECT_THAT(lines[0], HasSubstr("refused 499 more streams of 2 peers in the last"));
  EXPECT_THAT(lines[0], HasSubstr("(500 so far)"));
  EXPECT_THAT(lines[1], HasSubstr("cancelled 99 more streams of 1 peers in the last"));
  EXPECT_EQ(budget.refused(), 500);
  EXPECT_EQ(budget.timed_out(), 100);
  // Nothing more to say: quiet.
  testing::internal::CaptureStderr();
  ASSERT_TRUE(budget.Admit("a").ok());
  budget.LetOut("a");
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

TEST(FirstMessageTimerTest, ExpiresUnlessValidatedInTime) {
  grpc_init();  // kept: the alarms need gRPC, and its last shutdown may wait
  absl::Notification expired;
  FirstMessageTimer silent(absl::Milliseconds(50), [&] { expired.Notify(); });
  EXPECT_TRUE(expired.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_FALSE(silent.Validated());

  std::atomic<int> calls{0};
  {
    FirstMessageTimer talking(absl::Milliseconds(50), [&] { ++calls; });
    EXPECT_TRUE(talking.Validated());
    EXPECT_TRUE(talking.Validated());
    absl::SleepFor(absl::Milliseconds(200));
  }
  // Gone before its time: never expires.
  {
    FirstMessageTimer gone(absl::Milliseconds(50), [&] { ++calls; });
  }
  // None at all.
  FirstMessageTimer never(absl::ZeroDuration(), [&] { ++calls; });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_TRUE(never.Validated());
  EXPECT_EQ(calls.load(), 0);
}

}  // namespace
}  // namespace psflow
