#include "common/thread_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

TEST(ThreadPoolTest, ParallelForRunsEveryIndexOnce) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> runs(100);
  pool.ParallelFor(100, [&](int i) { runs[i].fetch_add(1); });
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
}

// A caller whose loop is stuck on every pool thread must not hold up
// another caller: the second one claims its own indices.
TEST(ThreadPoolTest, ConcurrentCallersDoNotWaitForEachOther) {
  ThreadPool pool(1);
  absl::Notification release;
  std::atomic<int> started{0};
  std::thread slow([&] {
    pool.ParallelFor(2, [&](int) {
      started.fetch_add(1);
      release.WaitForNotification();
    });
  });
  while (started.load() < 2) absl::SleepFor(absl::Milliseconds(1));  // both threads are stuck
  absl::Notification fast_done;
  std::thread fast([&] {
    std::atomic<int> sum{0};
    pool.ParallelFor(4, [&](int i) { sum.fetch_add(i); });
    EXPECT_EQ(sum.load(), 6);
    fast_done.Notify();
  });
  EXPECT_TRUE(fast_done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  release.Notify();
  fast.join();
  slow.join();
}

}  // namespace
}  // namespace psflow
