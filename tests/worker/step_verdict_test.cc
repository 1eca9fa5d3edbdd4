#include "worker/step_verdict.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace psflow::worker {
namespace {

TEST(StepVerdictTest, WaitsForEveryPartAndTellsWhetherAllWereFinite) {
  StepVerdict verdict;
  verdict.Reset(3);
  std::atomic<int> done{0};
  std::atomic<bool> result{false};
  std::thread waiter([&] {
    result = verdict.Wait();
    done = 1;
  });
  verdict.Mark(true);
  verdict.Mark(true);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(done.load(), 0) << "returned with a part missing";
  EXPECT_FALSE(verdict.Decided());
  verdict.Mark(true);
  waiter.join();
  EXPECT_TRUE(result.load());
  EXPECT_TRUE(verdict.Decided());
  EXPECT_FALSE(verdict.Failed());
}

TEST(StepVerdictTest, ANonFinitePartEndsTheWaitAtOnce) {
  StepVerdict verdict;
  verdict.Reset(4);
  std::vector<std::thread> waiters;
  std::atomic<int> finite{0}, returned{0};
  for (int k = 0; k < 3; ++k) {
    waiters.emplace_back([&] {
      finite += verdict.Wait() ? 1 : 0;
      ++returned;
    });
  }
  verdict.Mark(true);
  EXPECT_FALSE(verdict.Failed());
  verdict.Mark(false);  // two parts never come
  EXPECT_TRUE(verdict.Failed());
  EXPECT_TRUE(verdict.Decided());
  for (std::thread& t : waiters) t.join();
  EXPECT_EQ(returned.load(), 3);
  EXPECT_EQ(finite.load(), 0);
  // A later finite part changes nothing.
  verdict.Mark(true);
  EXPECT_FALSE(verdict.Wait());
}

TEST(StepVerdictTest, ResetStartsANewStep) {
  StepVerdict verdict;
  verdict.Reset(1);
  verdict.Mark(false);
  EXPECT_FALSE(verdict.Wait());
  verdict.Reset(1);
  EXPECT_FALSE(verdict.Failed());
  verdict.Mark(true);
  EXPECT_TRUE(verdict.Wait());
  verdict.Reset(0);  // nothing to wait for
  EXPECT_TRUE(verdict.Wait());
}

}  // namespace
}  // namespace psflow::worker
