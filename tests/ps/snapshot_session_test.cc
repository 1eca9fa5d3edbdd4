// ps::SnapshotSession on a shard, step by step; and one protocol through
// both of its drivers: LocalSnapshot (a ps::LocalClient) and PsService on
// loopback (a ps::GrpcClient).
#include "ps/snapshot_session.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/ps/session_drivers.h"

namespace psflow::ps {
namespace {

using ::testing::HasSubstr;

SnapshotRequest Request(int64_t version, bool values_only = false) {
  SnapshotRequest r;
  r.set_job_id(kSessionJob);
  r.set_version(version);
  r.set_values_only(values_only);
  return r;
}

class SnapshotSessionTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(shard_.Init(SessionHeader({4}), SessionValues({4})).ok()); }
  // Both workers push `g` for `step`.
  void Step(int64_t step, float g) {
    for (int w : {0, 1}) {
      Shard::SliceGradient grad;
      grad.values.assign(4, g);
      ASSERT_TRUE(shard_.PushSlices(kSessionJob, w, step, {grad}).ok());
    }
  }
  SnapshotSession::Step Next(SnapshotSession& session) {
    armed_ = false;
    return session.Next([this] { armed_ = true; });
  }

  Shard shard_;
  bool armed_ = false;
};

// Asked before the version exists: a wait (armed), then, once the shard is
// there, the snapshot, values and slots.
TEST_F(SnapshotSessionTest, WaitsForTheVersionThenSendsIt) {
  SnapshotSession session(&shard_, Request(1), SessionDeadline());
  ASSERT_TRUE(session.Request().ok());
  const SnapshotSession::Step wait = Next(session);
  EXPECT_EQ(wait.action, SnapshotSession::Action::kWait);
  EXPECT_TRUE(armed_) << "armed before the look";
  Step(0, 2);
  ASSERT_EQ(Next(session).action, SnapshotSession::Action::kSend);
  EXPECT_EQ(session.snapshot()->weights->version, 1);
  const std::vector<TensorRef> refs = session.Refs();
  ASSERT_EQ(refs.size(), 2u);
  EXPECT_EQ(refs[0].slot, "");
  EXPECT_EQ(refs[0].data[0], 1 - 0.5f * 2);
  EXPECT_EQ(refs[1].slot, "momentum");
  EXPECT_EQ(refs[1].data[0], 2);

  SnapshotSession values(&shard_, Request(1, /*values_only=*/true), SessionDeadline());
  ASSERT_TRUE(values.Request().ok());
  ASSERT_EQ(Next(values).action, SnapshotSession::Action::kSend);
  EXPECT_EQ(values.Refs().size(), 1u);
}

TEST_F(SnapshotSessionTest, RefusesAPastVersionAndAnotherJob) {
  Step(0, 2);
  SnapshotSession past(&shard_, Request(0), SessionDeadline());
  EXPECT_EQ(past.Request().code(), absl::StatusCode::kFailedPrecondition);
  SnapshotRequest other = Request(1);
  other.set_job_id(kSessionJob + 1);
  SnapshotSession wrong_job(&shard_, other, SessionDeadline());
  EXPECT_EQ(wrong_job.Request().code(), absl::StatusCode::kFailedPrecondition);
}

// Past the deadline: DEADLINE_EXCEEDED; after an Init: ABORTED; the shard
// forgets a released request (a later Init or push finds nothing waiting).
TEST_F(SnapshotSessionTest, EndsAtTheDeadlineOrAnInit) {
  SnapshotSession late(&shard_, Request(1), absl::Now() - absl::Milliseconds(1));
  ASSERT_TRUE(late.Request().ok());
  const SnapshotSession::Step failed = Next(late);
  EXPECT_EQ(failed.action, SnapshotSession::Action::kFinish);
  EXPECT_EQ(failed.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(failed.status.message(), HasSubstr("version 1 not reached; ps is at 0"));
  EXPECT_EQ(shard_.WantedSnapshot(0), 1) << "asked for until released";
  late.Release();
  EXPECT_EQ(shard_.WantedSnapshot(0), std::nullopt);

  SnapshotSession reloaded(&shard_, Request(1), SessionDeadline());
  ASSERT_TRUE(reloaded.Request().ok());
  ASSERT_TRUE(shard_.Init(SessionHeader({4}), SessionValues({4})).ok());
  const SnapshotSession::Step aborted = Next(reloaded);
  EXPECT_EQ(aborted.action, SnapshotSession::Action::kFinish);
  EXPECT_EQ(aborted.status.code(), absl::StatusCode::kAborted);
}

// The same snapshot through LocalSnapshot and through PsService on
// loopback: asked before its version exists, it waits, and is served once
// both workers' pushes are applied, values and slots alike.
using SnapshotSessionDriversTest = SessionDriversTest;

TEST_P(SnapshotSessionDriversTest, ServesAVersionAskedBeforeItExists) {
  ASSERT_TRUE(InitJob({4, 8}).ok());
  std::vector<float> s0(4, -1), s0_momentum(4, -1), s1(8, -1), s1_momentum(8, -1);
  absl::Status taken;
  absl::Time answered;
  std::thread taker([&] {
    taken = client_->Snapshot(0, kSessionJob, 1,
                              {{"s0", "", {4}, s0.data()},
                               {"s0", "momentum", {4}, s0_momentum.data()},
                               {"s1", "", {8}, s1.data()},
                               {"s1", "momentum", {8}, s1_momentum.data()}},
                              SessionDeadline());
    answered = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(50));  // (the snapshot waits meanwhile)
  const absl::Time pushed = absl::Now();
  for (int w : {0, 1}) {
    PushHeader h;
    h.set_job_id(kSessionJob);
    h.set_worker(w);
    h.set_step(0);
    const std::vector<float> g0(4, 2), g1(8, 2);
    absl::StatusOr<PushResponse> r = client_->Push(
        0, h, {{"s0", "", {4}, g0.data()}, {"s1", "", {8}, g1.data()}}, SessionDeadline());
    ASSERT_TRUE(r.ok()) << r.status();
  }
  taker.join();
  ASSERT_TRUE(taken.ok()) << taken;
  // Woken by the apply, not found by a poll (LocalSnapshot looks once a second).
  EXPECT_LT(answered - pushed, absl::Milliseconds(900));
  EXPECT_EQ(s0, std::vector<float>(4, 1 - 0.5f * 2));
  EXPECT_EQ(s0_momentum, std::vector<float>(4, 2));
  EXPECT_EQ(s1, std::vector<float>(8, 2 - 0.5f * 2));
  EXPECT_EQ(s1_momentum, std::vector<float>(8, 2));

  // A version it is past: refused alike.
  std::vector<float> again(4);
  const absl::Status past =
      client_->Snapshot(0, kSessionJob, 0, {{"s0", "", {4}, again.data()}}, SessionDeadline());
  EXPECT_EQ(past.code(), absl::StatusCode::kFailedPrecondition) << past;
}

INSTANTIATE_TEST_SUITE_P(LocalAndGrpc, SnapshotSessionDriversTest, ::testing::Bool(),
                         SessionDriversTest::DriverName);

}  // namespace
}  // namespace psflow::ps
