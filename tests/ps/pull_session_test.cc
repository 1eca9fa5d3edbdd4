// ps::PullSession on a shard, step by step; and one protocol through both of
// its drivers: LocalPull (a ps::LocalClient) and PsService on loopback
// (a ps::GrpcClient).
#include "ps/pull_session.h"

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/shard.h"
#include "tests/ps/session_drivers.h"

namespace psflow::ps {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A gradient of `value` for slice `slice` of `size` floats.
Shard::SliceGradient Grad(int slice, int64_t size, float value) {
  Shard::SliceGradient g;
  g.slice = slice;
  g.values.assign(size, value);
  return g;
}

std::vector<std::string> Names(const std::vector<TensorRef>& refs) {
  std::vector<std::string> names;
  for (const TensorRef& r : refs) names.push_back(r.name);
  return names;
}

class PullSessionTest : public ::testing::Test {
 protected:
  void Init(const std::vector<int64_t>& sizes, JobConfig::Mode mode = JobConfig::SYNC) {
    ASSERT_TRUE(shard_.Init(SessionHeader(sizes, mode), SessionValues(sizes)).ok());
  }

  // Next on `session`, the range it armed in armed_ ({-2, -2}: none).
  PullSession::Step Next(PullSession& session) {
    armed_ = {-2, -2};
    return session.Next([this](int first, int last) { armed_ = {first, last}; }, &message_);
  }

  static PullRequest Request(int64_t min_version, std::vector<int> slices = {}) {
    PullRequest r;
    r.set_job_id(kSessionJob);
    r.set_min_version(min_version);
    for (int i : slices) r.add_slices(i);
    return r;
  }

  Shard shard_;
  PullSession::Message message_;
  std::pair<int, int> armed_;
};

TEST_F(PullSessionTest, RefusesABadDtypeBadSlicesAndAnotherJob) {
  Init({4, 4});
  PullRequest bad_dtype = Request(0);
  bad_dtype.set_dtype(static_cast<DataType>(7));
  PullSession dtype(&shard_, bad_dtype, absl::Now(), SessionDeadline());
  EXPECT_EQ(dtype.Prepare().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dtype.Prepare().message(), HasSubstr("not a wire dtype"));

  const PullRequest out_of_range = Request(0, {0, 2});
  PullSession range(&shard_, out_of_range, absl::Now(), SessionDeadline());
  EXPECT_EQ(range.Prepare().code(), absl::StatusCode::kInvalidArgument);
  const PullRequest twice = Request(0, {1, 1});
  PullSession repeated(&shard_, twice, absl::Now(), SessionDeadline());
  EXPECT_EQ(repeated.Prepare().code(), absl::StatusCode::kInvalidArgument);

  PullRequest other_job = Request(0);
  other_job.set_job_id(kSessionJob + 1);
  PullSession other(&shard_, other_job, absl::Now(), SessionDeadline());
  EXPECT_EQ(other.Prepare().code(), absl::StatusCode::kFailedPrecondition);
}

// Small slices ready at one version share a message up to kPullBatchBytes;
// a larger one goes alone. Each look arms the range of the pending slices.
TEST_F(PullSessionTest, BatchesReadySlicesUpToTheLimit) {
  constexpr int64_t kBig = kPullBatchBytes / 4 + 1000;  // fp32: over the limit alone
  Init({10, 10, kBig, 10});
  const PullRequest request = Request(0);
  PullSession session(&shard_, request, absl::Now(), SessionDeadline());
  ASSERT_TRUE(session.Prepare().ok());

  ASSERT_EQ(Next(session).action, PullSession::Action::kSend);
  EXPECT_EQ(armed_, std::make_pair(0, 3));
  EXPECT_THAT(Names(message_.refs), ElementsAre("s0", "s1"));
  EXPECT_EQ(message_.first_slice, 0);
  EXPECT_EQ(message_.slices, 2u);
  EXPECT_EQ(message_.bytes, 80);
  EXPECT_TRUE(message_.fields.ready());
  EXPECT_EQ(message_.fields.version(), 0);
  EXPECT_FALSE(message_.last);
  EXPECT_EQ(message_.refs[1].data[0], 2.0f);

  ASSERT_EQ(Next(session).action, PullSession::Action::kSend);
  EXPECT_EQ(armed_, std::make_pair(2, 3));
  EXPECT_THAT(Names(message_.refs), ElementsAre("s2"));
  EXPECT_EQ(message_.bytes, kBig * 4);
  EXPECT_FALSE(message_.fields.ready());  // only the first message says so

  ASSERT_EQ(Next(session).action, PullSession::Action::kSend);
  EXPECT_EQ(armed_, std::make_pair(3, 3));
  EXPECT_THAT(Names(message_.refs), ElementsAre("s3"));

  const PullSession::Step end = Next(session);
  EXPECT_EQ(end.action, PullSession::Action::kFinish);
  EXPECT_TRUE(end.status.ok()) << end.status;
  EXPECT_EQ(armed_, std::make_pair(-2, -2)) << "finished without a look";
  EXPECT_EQ(session.bytes(), 80 + kBig * 4 + 40);
  EXPECT_FALSE(session.not_yet());
}

// A slice goes as soon as it is applied, whatever the order asked; the
// wait is armed for the slices still pending.
TEST_F(PullSessionTest, SendsEachSliceOnceItIsApplied) {
  Init({10, 10});
  const PullRequest request = Request(1, {0, 1});
  PullSession session(&shard_, request, absl::Now(), SessionDeadline());
  ASSERT_TRUE(session.Prepare().ok());
  EXPECT_EQ(Next(session).action, PullSession::Action::kWait);
  EXPECT_EQ(armed_, std::make_pair(0, 1));

  ASSERT_TRUE(shard_.PushSlices(kSessionJob, 0, 0, {Grad(1, 10, 1)}).ok());
  ASSERT_TRUE(shard_.PushSlices(kSessionJob, 1, 0, {Grad(1, 10, 3)}).ok());
  ASSERT_EQ(Next(session).action, PullSession::Action::kSend);
  EXPECT_THAT(Names(message_.refs), ElementsAre("s1"));
  EXPECT_EQ(message_.fields.version(), 1);
  EXPECT_TRUE(message_.fields.ready());
  EXPECT_EQ(message_.refs[0].data[0], 2.0f - 0.5f * 2);

  EXPECT_EQ(Next(session).action, PullSession::Action::kWait);
  EXPECT_EQ(armed_, std::make_pair(0, 0));
  ASSERT_TRUE(shard_.PushSlices(kSessionJob, 0, 0, {Grad(0, 10, 1)}).ok());
  ASSERT_TRUE(shard_.PushSlices(kSessionJob, 1, 0, {Grad(0, 10, 1)}).ok());
  ASSERT_EQ(Next(session).action, PullSession::Action::kSend);
  EXPECT_THAT(Names(message_.refs), ElementsAre("s0"));
  EXPECT_FALSE(message_.fields.ready());
  EXPECT_EQ(Next(session).action, PullSession::Action::kFinish);
}

// A by_clock pull waits (woken by any change) until the worker's clock is
// reached, then sends every slice at the version the shard had then, the
// clock and lag in its first message.
TEST_F(PullSessionTest, GrantsAByClockPullOnceTheClockIsReached) {
  Init({10, 10}, JobConfig::ASYNC);
  PullRequest request;
  request.set_job_id(kSessionJob);
  request.set_by_clock(true);
  request.set_worker(0);
  request.set_clock(1);
  PullSession session(&shard_, request, absl::Now(), SessionDeadline());
  ASSERT_TRUE(session.Prepare().ok());
  EXPECT_EQ(Next(session).action, PullSession::Action::kWait);
  EXPECT_EQ(armed_, std::make_pair(-1, -1));

  ASSERT_TRUE(shard_.PushSlices(kSessionJob, 0, 0, {Grad(0, 10, 2), Grad(1, 10, 2)}, 0).ok());
  ASSERT_EQ(Next(session).action, PullSession::Action::kSend);
  EXPECT_EQ(message_.fields.version(), 1);
  EXPECT_EQ(message_.fields.clock(), 1);
  EXPECT_EQ(message_.fields.lag(), 0);
  EXPECT_TRUE(message_.fields.ready());
  EXPECT_THAT(Names(message_.refs), ElementsAre("s0", "s1"));
  EXPECT_EQ(message_.refs[0].data[0], 1.0f - 0.5f * 2);
  EXPECT_EQ(Next(session).action, PullSession::Action::kFinish);

  // Of a synchronous job: refused.
  Init({10, 10});
  PullSession sync(&shard_, request, absl::Now(), SessionDeadline());
  ASSERT_TRUE(sync.Prepare().ok());
  const PullSession::Step refused = Next(sync);
  EXPECT_EQ(refused.action, PullSession::Action::kFinish);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kFailedPrecondition);
}

// Past max_wait before the first slice: "not yet" (the shard's version, no
// data, the last message); past the call's deadline: DEADLINE_EXCEEDED.
TEST_F(PullSessionTest, AnswersNotYetAfterMaxWaitAndFailsAtTheDeadline) {
  Init({10, 10});
  PullRequest request = Request(1);
  request.set_max_wait_ms(1);
  const absl::Time start = absl::Now();
  PullSession session(&shard_, request, start, SessionDeadline());
  ASSERT_TRUE(session.Prepare().ok());
  const PullSession::Step wait = Next(session);
  EXPECT_EQ(wait.action, PullSession::Action::kWait);
  EXPECT_EQ(wait.until, start + absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(Next(session).action, PullSession::Action::kSend);
  EXPECT_TRUE(session.not_yet());
  EXPECT_TRUE(message_.last);
  EXPECT_EQ(message_.fields.version(), 0);
  EXPECT_FALSE(message_.fields.ready());
  EXPECT_TRUE(message_.refs.empty());

  const PullRequest no_max_wait = Request(1);
  PullSession late(&shard_, no_max_wait, absl::Now(), absl::Now() + absl::Milliseconds(1));
  ASSERT_TRUE(late.Prepare().ok());
  absl::SleepFor(absl::Milliseconds(5));
  const PullSession::Step failed = Next(late);
  EXPECT_EQ(failed.action, PullSession::Action::kFinish);
  EXPECT_EQ(failed.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(failed.status.message(), HasSubstr("version 1 not reached; ps is at 0"));
  EXPECT_FALSE(late.not_yet());
}

TEST_F(PullSessionTest, AShardWithoutSlicesAnswersItsVersion) {
  Init({});
  const PullRequest request = Request(0);
  PullSession session(&shard_, request, absl::Now(), SessionDeadline());
  ASSERT_TRUE(session.Prepare().ok());
  ASSERT_EQ(Next(session).action, PullSession::Action::kSend);
  EXPECT_EQ(armed_, std::make_pair(-1, -1));
  EXPECT_TRUE(message_.last);
  EXPECT_TRUE(message_.fields.ready());
  EXPECT_EQ(message_.fields.version(), 0);
  EXPECT_EQ(message_.slices, 0u);
}

// The same pull through LocalPull and through PsService on loopback:
// answered "not yet" once max_wait passes, then, asked again, served once
// both workers' pushes are applied.
class PullSessionDriversTest : public SessionDriversTest {
 protected:
  absl::StatusOr<Client::PullResult> Pull(absl::Duration max_wait) {
    return client_->Pull(0, kSessionJob, 1, {},
                         {{"s0", "", {10}, s0_.data()}, {"s1", "", {20}, s1_.data()}},
                         SessionDeadline(), max_wait);
  }
  absl::StatusOr<PushResponse> Push(int worker, float g) {
    PushHeader h;
    h.set_job_id(kSessionJob);
    h.set_worker(worker);
    h.set_step(0);
    const std::vector<float> g0(10, g), g1(20, g);
    return client_->Push(0, h, {{"s0", "", {10}, g0.data()}, {"s1", "", {20}, g1.data()}},
                         SessionDeadline());
  }

  std::vector<float> s0_ = std::vector<float>(10, -1), s1_ = std::vector<float>(20, -1);
};

TEST_P(PullSessionDriversTest, APullNotYetIsServedWhenAskedAgain) {
  const absl::Status init = InitJob({10, 20});
  ASSERT_TRUE(init.ok()) << init;
  ASSERT_TRUE(Push(0, 1).ok());  // version 1 waits for worker 1

  absl::StatusOr<Client::PullResult> not_yet = Pull(absl::Milliseconds(20));
  ASSERT_TRUE(not_yet.ok()) << not_yet.status();
  EXPECT_EQ(not_yet->version, 0);
  EXPECT_EQ(s0_, std::vector<float>(10, -1)) << "sinks untouched";
  EXPECT_EQ(s1_, std::vector<float>(20, -1));

  absl::StatusOr<Client::PullResult> served;
  absl::Time answered;
  std::thread puller([&] {
    served = Pull(absl::ZeroDuration());
    answered = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(20));  // (the pull waits meanwhile)
  const absl::Time pushed = absl::Now();
  ASSERT_TRUE(Push(1, 3).ok());
  puller.join();
  ASSERT_TRUE(served.ok()) << served.status();
  // Woken by the apply, not found by a poll (a LocalPull looks once a second).
  EXPECT_LT(answered - pushed, absl::Milliseconds(900));
  EXPECT_EQ(served->version, 1);
  // Momentum's first step: w - lr * mean(1, 3).
  EXPECT_EQ(s0_, std::vector<float>(10, 1 - 0.5f * 2));
  EXPECT_EQ(s1_, std::vector<float>(20, 2 - 0.5f * 2));
}

INSTANTIATE_TEST_SUITE_P(LocalAndGrpc, PullSessionDriversTest, ::testing::Bool(),
                         SessionDriversTest::DriverName);

}  // namespace
}  // namespace psflow::ps
