#include "transport/channel_pool.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>

#include "absl/time/clock.h"

namespace psflow {
namespace {

TEST(ChannelPoolTest, AServerThatRefusesIsNotAskedAgainUntilTheWaitIsOver) {
  std::atomic<int> asked{0};
  ChannelPool pool({.max_open = 4, .retry_after = absl::Milliseconds(200), .server_name = "ps 0"},
                   [&](const SharedRegionRef&) -> absl::StatusOr<int32_t> {
                     ++asked;
                     return absl::UnimplementedError("an older ps");
                   });
  EXPECT_EQ(pool.Take(), nullptr);
  EXPECT_EQ(pool.Take(), nullptr);
  EXPECT_EQ(asked.load(), 1);
  absl::SleepFor(absl::Milliseconds(250));
  EXPECT_EQ(pool.Take(), nullptr);
  EXPECT_EQ(asked.load(), 2);
}

TEST(ChannelPoolTest, AServerNotUpIsAskedAgainByTheNextCall) {
  std::atomic<int> asked{0};
  ChannelPool pool({.max_open = 4, .retry_after = absl::Seconds(60), .server_name = "ps 0"},
                   [&](const SharedRegionRef&) -> absl::StatusOr<int32_t> {
                     ++asked;
                     return absl::UnavailableError("not up");
                   });
  EXPECT_EQ(pool.Take(), nullptr);
  EXPECT_EQ(pool.Take(), nullptr);
  EXPECT_EQ(asked.load(), 2);
}

TEST(ChannelPoolTest, ChannelsAreReusedAndBounded) {
  std::atomic<int> opened{0};
  ChannelPool pool({.max_open = 2, .retry_after = absl::Seconds(60), .server_name = "ps 0"},
                   [&](const SharedRegionRef&) -> absl::StatusOr<int32_t> {
                     ++opened;
                     return static_cast<int32_t>(getpid());  // a live process
                   });
  std::unique_ptr<ChannelPool::Channel> a = pool.Take();
  std::unique_ptr<ChannelPool::Channel> b = pool.Take();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(pool.Take(), nullptr);  // both open, in calls
  EXPECT_EQ(opened.load(), 2);
  ChannelPool::Channel* const first = a.get();
  pool.Give(std::move(a), /*clean=*/true);
  std::unique_ptr<ChannelPool::Channel> again = pool.Take();
  EXPECT_EQ(again.get(), first);  // the idle one, not a new one
  EXPECT_EQ(opened.load(), 2);
  // A call that did not end cleanly closes its channel: room for a new one.
  pool.Give(std::move(b), /*clean=*/false);
  std::unique_ptr<ChannelPool::Channel> fresh = pool.Take();
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(opened.load(), 3);
}

}  // namespace
}  // namespace psflow
