// A pull's mailbox in a region's header: messages posted by the ps's side
// and taken by the worker's, a full ring, forged positions on either side,
// and the futex wake between two processes.
#include "common/region_mailbox.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

namespace psflow {
namespace {

class RegionMailboxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(4096);
    ASSERT_TRUE(made.ok()) << made.status();
    region_ = *std::move(made);
    reader_ = std::make_unique<MailboxReader>(region_->header());
    reader_->Reset();
  }

  // The int64 control word at `at` bytes into the mailbox.
  int64_t* Word(int64_t at) {
    return reinterpret_cast<int64_t*>(region_->header() + kMailboxOffset + at);
  }

  std::unique_ptr<SharedRegion> region_;
  std::unique_ptr<MailboxReader> reader_;
};

TEST_F(RegionMailboxTest, MessagesComeOutInOrderAcrossTheRingsEnd) {
  MailboxWriter writer(region_->header());
  std::string taken;
  EXPECT_FALSE(*reader_->Take(&taken));
  // Each round posts three messages of odd sizes and takes them: the
  // positions wrap around the ring many times.
  int posted = 0;
  for (int round = 0; round < 200; ++round) {
    std::vector<std::string> sent;
    for (int k = 0; k < 3; ++k) {
      sent.push_back(std::string(static_cast<size_t>(1 + (round * 37 + k * 101) % 3000),
                                 static_cast<char>('a' + (round + k) % 26)));
      ASSERT_TRUE(writer.Post(sent.back())) << "round " << round;
      ++posted;
    }
    for (const std::string& s : sent) {
      absl::StatusOr<bool> got = reader_->Take(&taken);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(*got);
      EXPECT_EQ(taken, s);
    }
    EXPECT_FALSE(*reader_->Take(&taken));
  }
  EXPECT_EQ(posted, 600);
  EXPECT_EQ(reader_->announced(), 0);
  writer.Announce();
  writer.Announce();
  EXPECT_EQ(reader_->announced(), 2);
  // A new call starts empty.
  reader_->Reset();
  EXPECT_EQ(reader_->announced(), 0);
  EXPECT_FALSE(*reader_->Take(&taken));
}

TEST_F(RegionMailboxTest, AFullRingRefusesAPostUntilTheReaderTakes) {
  MailboxWriter writer(region_->header());
  const std::string big(static_cast<size_t>(kMailboxBytes / 3), 'x');
  ASSERT_TRUE(writer.Post(big));
  ASSERT_TRUE(writer.Post(big));
  EXPECT_FALSE(writer.Post(big));  // no room: the caller sends it on the stream
  EXPECT_FALSE(writer.Post(std::string(static_cast<size_t>(kMailboxBytes), 'y')));
  std::string taken;
  ASSERT_TRUE(*reader_->Take(&taken));
  EXPECT_EQ(taken, big);
  EXPECT_TRUE(writer.Post(big));
  ASSERT_TRUE(*reader_->Take(&taken));
  ASSERT_TRUE(*reader_->Take(&taken));
  EXPECT_EQ(taken, big);
  EXPECT_FALSE(*reader_->Take(&taken));
}

TEST_F(RegionMailboxTest, ForgedPositionsAreDataLossForTheReaderAndNoRoomForTheWriter) {
  MailboxWriter writer(region_->header());
  ASSERT_TRUE(writer.Post("hello"));
  std::string taken;
  // A head past a full ring, behind the tail, or not at a record's end.
  for (int64_t head : {kMailboxBytes * 2, int64_t{-8}, int64_t{12}}) {
    MailboxReader reader(region_->header());
    const int64_t saved = *Word(8);
    *Word(8) = head;
    absl::StatusOr<bool> got = reader.Take(&taken);
    EXPECT_TRUE(absl::IsDataLoss(got.status())) << head << ": " << got.status();
    *Word(8) = saved;
  }
  // A length longer than what was posted.
  uint32_t length = 1 << 20;
  std::memcpy(region_->header() + kMailboxOffset + 64, &length, sizeof(length));
  EXPECT_TRUE(absl::IsDataLoss(reader_->Take(&taken).status()));
  // The writer keeps its own head: a tail set ahead of it, or far behind,
  // counts as a full ring, and nothing is written.
  MailboxWriter other(region_->header());
  *Word(16) = 1 << 30;
  EXPECT_FALSE(other.Post("x"));
  *Word(16) = -(int64_t{1} << 30);
  EXPECT_FALSE(other.Post("x"));
}

TEST_F(RegionMailboxTest, WaitReturnsAtTheTimeoutWhenNothingComes) {
  std::string taken;
  EXPECT_FALSE(*reader_->Take(&taken));
  const absl::Time start = absl::Now();
  reader_->Wait(absl::Milliseconds(50));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));
}

TEST_F(RegionMailboxTest, APostInAnotherProcessWakesTheWaiter) {
  std::string taken;
  EXPECT_FALSE(*reader_->Take(&taken));
  // The child shares the mapping (MAP_SHARED survives fork), as a ps that
  // mapped the worker's region does; it posts after a pause.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::usleep(100 * 1000);
    MailboxWriter writer(region_->header());
    _exit(writer.Post("from the ps") ? 0 : 1);
  }
  const absl::Time start = absl::Now();
  bool got = false;
  while (!got && absl::Now() - start < absl::Seconds(30)) {
    reader_->Wait(absl::Seconds(10));
    absl::StatusOr<bool> took = reader_->Take(&taken);
    ASSERT_TRUE(took.ok()) << took.status();
    got = *took;
  }
  // Woken by the post, long before the wait's 10 s.
  EXPECT_TRUE(got);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(taken, "from the ps");
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST_F(RegionMailboxTest, AnAnnouncementWakesAWaitingThread) {
  std::string taken;
  EXPECT_FALSE(*reader_->Take(&taken));
  const int64_t seen = reader_->announced();
  std::thread ps([this] {
    absl::SleepFor(absl::Milliseconds(50));
    MailboxWriter(region_->header()).Announce();
  });
  const absl::Time start = absl::Now();
  while (reader_->announced() == seen && absl::Now() - start < absl::Seconds(30)) {
    reader_->Wait(absl::Seconds(10));
  }
  ps.join();
  EXPECT_EQ(reader_->announced(), seen + 1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace psflow
