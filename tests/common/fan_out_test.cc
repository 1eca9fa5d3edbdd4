#include "common/fan_out.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/thread_pool.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

RetryPolicy RetryFor(absl::Duration d) {
  RetryPolicy policy;
  policy.give_up = absl::Now() + d;
  return policy;
}

TEST(WithRetriesTest, RetriesRetryableErrorsUntilSuccess) {
  int calls = 0;
  absl::Status s = WithRetries(RetryFor(absl::Seconds(10)), [&] {
    ++calls;
    if (calls == 1) return absl::UnavailableError("not up yet");
    if (calls == 2) return absl::DeadlineExceededError("slow");
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(calls, 3);
}

TEST(WithRetriesTest, AnErrorThatIsNotRetryableEndsAtOnce) {
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kFailedPrecondition,
        absl::StatusCode::kCancelled, absl::StatusCode::kAborted, absl::StatusCode::kDataLoss,
        absl::StatusCode::kInternal}) {
    int calls = 0;
    absl::Status s = WithRetries(RetryFor(absl::Seconds(10)), [&] {
      ++calls;
      return absl::Status(code, "no");
    });
    EXPECT_EQ(s.code(), code);
    EXPECT_EQ(calls, 1) << absl::StatusCodeToString(code);
  }
}

TEST(WithRetriesTest, TheDefaultPolicyNeverRetries) {
  int calls = 0;
  absl::Status s = WithRetries(RetryPolicy(), [&] {
    ++calls;
    return absl::UnavailableError("down");
  });
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_EQ(calls, 1);
}

TEST(WithRetriesTest, GivesUpWithTheLastErrorAtTheDeadline) {
  int calls = 0;
  const absl::Time start = absl::Now();
  absl::Status s = WithRetries(RetryFor(absl::Milliseconds(1000)), [&] {
    ++calls;
    return absl::UnavailableError(calls == 1 ? "first" : "later");
  });
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_EQ(s.message(), "later");
  // 50, 100, 200, 400 ms (+-20%) apart: about 750 ms; the next delay (about
  // 800 ms) would pass the deadline, so it is not slept.
  EXPECT_GE(calls, 4);
  EXPECT_LT(took, absl::Milliseconds(1000));  // never sleeps past it
}

TEST(WithRetriesTest, StopsRetryingWhenTold) {
  std::atomic<bool> stop{false};
  RetryPolicy policy = RetryFor(absl::Seconds(10));
  policy.stop = [&] { return stop.load(); };
  int calls = 0;
  absl::Status s = WithRetries(policy, [&] {
    if (++calls == 2) stop = true;
    return absl::UnavailableError("down");
  });
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_EQ(calls, 2);
}

TEST(FanOutTest, CallsEveryIndexInParallelAndRetriesEachOnItsOwn) {
  ThreadPool pool(3);
  absl::Mutex mu;
  std::vector<int> calls(4, 0);
  int running = 0, most_running = 0;
  absl::Status s = FanOut(&pool, 4, RetryFor(absl::Seconds(10)), [&](int i) {
    {
      absl::MutexLock lock(&mu);
      ++calls[i];
      most_running = std::max(most_running, ++running);
    }
    absl::SleepFor(absl::Milliseconds(20));
    absl::MutexLock lock(&mu);
    --running;
    // Index 2 fails once in a way worth a retry.
    return i == 2 && calls[i] == 1 ? absl::UnavailableError("blip") : absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(calls, (std::vector<int>{1, 1, 2, 1}));
  EXPECT_GT(most_running, 1);
}

TEST(FanOutTest, ReturnsTheErrorOfTheLowestIndexAfterAllFinished) {
  ThreadPool pool(2);
  std::atomic<int> finished{0};
  absl::Status s = FanOut(&pool, 4, RetryPolicy(), [&](int i) {
    if (i == 3) absl::SleepFor(absl::Milliseconds(30));
    ++finished;
    if (i == 1) return absl::InvalidArgumentError("one");
    if (i == 3) return absl::DataLossError("three");
    return absl::OkStatus();
  });
  EXPECT_EQ(finished, 4);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(s.message(), "one");
}

TEST(FanOutTest, RunsSequentiallyWithoutAPool) {
  std::vector<int> order;
  absl::Status s = FanOut(nullptr, 3, RetryPolicy(), [&](int i) {
    order.push_back(i);
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(
      FanOut(nullptr, 0, RetryPolicy(), [](int) { return absl::InternalError("never"); }).ok());
}

}  // namespace
}  // namespace psflow
