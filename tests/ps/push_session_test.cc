// ps::PushSession on a shard, call by call; and one protocol through both
// of its drivers: LocalPush (a ps::LocalClient) and PsService on loopback
// (a ps::GrpcClient).
#include "ps/push_session.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/ps/session_drivers.h"
#include "transport/tensor_chunks.h"

namespace psflow::ps {
namespace {

using ::testing::HasSubstr;

PushHeader Header(int worker, int64_t step, std::vector<int> slices = {}) {
  PushHeader h;
  h.set_job_id(kSessionJob);
  h.set_worker(worker);
  h.set_step(step);
  for (int i : slices) h.add_slices(i);
  return h;
}

class PushSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(shard_.Init(SessionHeader({4, 4}), SessionValues({4, 4})).ok());
  }

  // Slice `slice` at `version`, if it is there.
  std::optional<std::vector<float>> SliceAt(int slice, int64_t version) {
    absl::StatusOr<std::optional<Shard::PulledSlice>> got =
        shard_.TryPullSlice(kSessionJob, slice, version);
    if (!got.ok() || !got->has_value()) return std::nullopt;
    return *(*got)->value;
  }

  Shard shard_;
};

TEST_F(PushSessionTest, BeginRefusesAnotherJobAndBadSlices) {
  PushHeader other = Header(0, 0);
  other.set_job_id(kSessionJob + 1);
  PushSession wrong_job(&shard_);
  EXPECT_EQ(wrong_job.Begin(other, false).code(), absl::StatusCode::kFailedPrecondition);
  PushSession out_of_range(&shard_);
  EXPECT_THAT(out_of_range.Begin(Header(0, 0, {2}), false).message(),
              HasSubstr("push names slice #2; the ps holds 2 slices"));
  PushSession twice(&shard_);
  EXPECT_THAT(twice.Begin(Header(0, 0, {1, 1}), false).message(),
              HasSubstr("push names slice #1 twice"));
}

// The reactor's way: chunks decoded into the session's sinks, each slice
// handed over as soon as it is complete (and applied then, when it is the
// last of its step), the answer at the end.
TEST_F(PushSessionTest, HandsEachSliceOverAsItCompletes) {
  Shard::SliceGradient g0, g1;
  g0.slice = 0;
  g0.values.assign(4, 3);
  g1.slice = 1;
  g1.values.assign(4, 3);
  ASSERT_TRUE(shard_.PushSlices(kSessionJob, 1, 0, {std::move(g0), std::move(g1)}).ok());

  PushSession session(&shard_);
  ASSERT_TRUE(session.Begin(Header(0, 0, {1, 0}), false).ok());
  EXPECT_FALSE(session.borrows()) << "not in place";
  EXPECT_EQ(session.indices(), (std::vector<int>{1, 0}));
  std::vector<TensorSink> sinks = session.TakeSinks();
  ASSERT_EQ(sinks.size(), 2u);
  EXPECT_EQ(sinks[0].name, "s1");
  ChunkAssembler assembler(std::move(sinks));
  const std::vector<float> one(4, 1);
  ChunkSplitter splitter({{"s1", "", {4}, one.data()}, {"s0", "", {4}, one.data()}}, 16);
  google::protobuf::RepeatedPtrField<TensorChunk> chunks;
  std::vector<int> completed;
  while (splitter.Next(&chunks)) {
    for (const TensorChunk& chunk : chunks) {
      int done = -1;
      ASSERT_TRUE(assembler.Add(chunk, &done).ok());
      if (done < 0) continue;
      completed.push_back(done);
      ASSERT_TRUE(session.HandOver({done}).ok());
      if (completed.size() == 1) {
        // s1 (gradient 0) applied on its own: w - 0.5 * mean(1, 3).
        EXPECT_EQ(SliceAt(1, 1), std::vector<float>(4, 2 - 0.5f * 2));
        EXPECT_EQ(SliceAt(0, 1), std::nullopt) << "s0 still waits for worker 0";
      }
    }
    chunks.Clear();
  }
  EXPECT_EQ(completed, (std::vector<int>{0, 1}));
  ASSERT_TRUE(assembler.Finish().ok());
  absl::StatusOr<PushResponse> answer = session.End();
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->outcome(), PushResponse::ACCEPTED);
  EXPECT_EQ(answer->version(), 1);
  EXPECT_EQ(SliceAt(0, 1), std::vector<float>(4, 1 - 0.5f * 2));
}

// Outcomes over parts: DUPLICATE when every part was, STALE once the step
// is past; each push counted once, at End.
TEST_F(PushSessionTest, AnswersDuplicateAndStaleAndCountsThemOnce) {
  auto push = [&](int worker, int64_t step) -> absl::StatusOr<PushResponse> {
    PushSession session(&shard_);
    PSFLOW_RETURN_IF_ERROR(session.Begin(Header(worker, step), false));
    std::vector<TensorSink> sinks = session.TakeSinks();
    for (TensorSink& sink : sinks) std::fill_n(SinkData(sink, 4), 4, 1.0f);  // as a copy would
    PSFLOW_RETURN_IF_ERROR(session.HandOver({0}));
    PSFLOW_RETURN_IF_ERROR(session.HandOver({1}));
    return session.End();
  };
  EXPECT_EQ(push(0, 0)->outcome(), PushResponse::ACCEPTED);
  EXPECT_EQ(push(0, 0)->outcome(), PushResponse::DUPLICATE);
  absl::StatusOr<PushResponse> applied = push(1, 0);
  EXPECT_EQ(applied->outcome(), PushResponse::ACCEPTED);
  EXPECT_EQ(applied->version(), 1);
  EXPECT_EQ(push(1, 0)->outcome(), PushResponse::STALE);
  const Shard::Stats stats = shard_.stats();
  EXPECT_EQ(stats.duplicate, 1);
  EXPECT_EQ(stats.stale, 1);
}

// A skip push has no sinks; End hands its skips over. Gradients offered in
// place stay borrowed in a synchronous job, but never a skip's.
TEST_F(PushSessionTest, ASkipPushHasNoSinksAndIsNeverBorrowed) {
  PushHeader skip = Header(0, 0);
  skip.set_skip(true);
  PushSession skipped(&shard_);
  ASSERT_TRUE(skipped.Begin(skip, /*in_place=*/true).ok());
  EXPECT_FALSE(skipped.borrows());
  EXPECT_TRUE(skipped.TakeSinks().empty());
  absl::StatusOr<PushResponse> answer = skipped.End();
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->outcome(), PushResponse::ACCEPTED);

  PushSession in_place(&shard_);
  ASSERT_TRUE(in_place.Begin(Header(1, 0), /*in_place=*/true).ok());
  EXPECT_TRUE(in_place.borrows());
}

// Only a job that skips non-finite steps takes skips: in a FAIL job a skip
// push (forged: its workers send none) is refused at Begin, counted, and
// the step goes on as if it never came.
TEST_F(PushSessionTest, ASkipPushIsRefusedInAJobThatFailsOnNonFiniteSteps) {
  const InitHeader fails = SessionHeader({4, 4}, JobConfig::SYNC, JobConfig::FAIL);
  ASSERT_TRUE(shard_.Init(fails, SessionValues({4, 4})).ok());
  PushHeader skip = Header(0, 0);
  skip.set_skip(true);
  PushSession forged(&shard_);
  const absl::Status refused = forged.Begin(skip, /*in_place=*/false);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_EQ(refused.message(),
            "skip push refused: job 41 runs on_nonfinite=FAIL, only SKIP_STEP jobs skip steps");
  EXPECT_EQ(shard_.stats().refused_pushes, 1);
  for (int worker : {0, 1}) {
    PushSession session(&shard_);
    ASSERT_TRUE(session.Begin(Header(worker, 0), false).ok());
    std::vector<TensorSink> sinks = session.TakeSinks();
    for (TensorSink& sink : sinks) std::fill_n(SinkData(sink, 4), 4, 1.0f);
    ASSERT_TRUE(session.HandOverAll().ok());
    absl::StatusOr<PushResponse> answer = session.End();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->outcome(), PushResponse::ACCEPTED) << "worker " << worker;
  }
  // Both workers' gradients applied: w - 0.5 * 1.
  EXPECT_EQ(SliceAt(0, 1), std::vector<float>(4, 1 - 0.5f));
  EXPECT_EQ(shard_.stats().skipped, 0);
}

// The same pushes through LocalPush and through PsService on loopback get
// the same answers, refusals and counts.
using PushSessionDriversTest = SessionDriversTest;

TEST_P(PushSessionDriversTest, GiveTheSameAnswers) {
  ASSERT_TRUE(InitJob({4, 8}).ok());
  auto push = [&](const PushHeader& h, float g) {
    const std::vector<float> g0(4, g), g1(8, g);
    std::vector<TensorRef> grads;
    if (!h.skip()) grads = {{"s0", "", {4}, g0.data()}, {"s1", "", {8}, g1.data()}};
    return client_->Push(0, h, grads, SessionDeadline());
  };
  auto answer = [](const absl::StatusOr<PushResponse>& r) {
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::make_pair(r->outcome(), r->version())
                  : std::make_pair(PushResponse::Outcome{}, int64_t{-1});
  };
  using Answer = std::pair<PushResponse::Outcome, int64_t>;
  EXPECT_EQ(answer(push(Header(0, 0), 1)), Answer(PushResponse::ACCEPTED, 0));
  EXPECT_EQ(answer(push(Header(0, 0), 1)), Answer(PushResponse::DUPLICATE, 0));

  absl::StatusOr<PushResponse> refused = push(Header(1, 0, {5}), 3);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("push names slice #5; the ps holds 2"));
  refused = push(Header(1, 0), std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("non-finite gradient for 's0'"));
  PushHeader other = Header(1, 0);
  other.set_job_id(kSessionJob + 1);
  EXPECT_EQ(push(other, 3).status().code(), absl::StatusCode::kFailedPrecondition);

  EXPECT_EQ(answer(push(Header(1, 0), 3)), Answer(PushResponse::ACCEPTED, 1));
  EXPECT_EQ(answer(push(Header(1, 0), 3)), Answer(PushResponse::STALE, 1));
  PushHeader skip0 = Header(0, 1), skip1 = Header(1, 1);
  skip0.set_skip(true);
  skip1.set_skip(true);
  EXPECT_EQ(answer(push(skip0, 0)), Answer(PushResponse::ACCEPTED, 1));
  EXPECT_EQ(answer(push(skip1, 0)), Answer(PushResponse::ACCEPTED, 2));

  const Shard::Stats stats = shard_.stats();
  EXPECT_EQ(stats.version, 2);
  EXPECT_EQ(stats.duplicate, 1);
  EXPECT_EQ(stats.stale, 1);
  EXPECT_EQ(stats.refused_pushes, 1);
  // Momentum: buf = mean(1, 3) = 2, w -= 0.5 buf; the skipped step changes nothing.
  std::vector<float> s0(4), s1(8);
  absl::StatusOr<Client::PullResult> pulled =
      client_->Pull(0, kSessionJob, 2, {}, {{"s0", "", {4}, s0.data()}, {"s1", "", {8}, s1.data()}},
                    SessionDeadline(), absl::ZeroDuration());
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(s0, std::vector<float>(4, 1 - 0.5f * 2));
  EXPECT_EQ(s1, std::vector<float>(8, 2 - 0.5f * 2));
}

// A forged skip push of a FAIL job is refused the same way through both
// drivers; the job's own pushes then step as usual.
TEST_P(PushSessionDriversTest, RefuseASkipPushOfAJobThatFailsOnNonFiniteSteps) {
  ASSERT_TRUE(InitJob({4, 8}, JobConfig::FAIL).ok());
  PushHeader skip = Header(0, 0);
  skip.set_skip(true);
  absl::StatusOr<PushResponse> refused = client_->Push(0, skip, {}, SessionDeadline());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("skip push refused: job 41 runs "
                                                    "on_nonfinite=FAIL, only SKIP_STEP jobs skip "
                                                    "steps"));
  EXPECT_EQ(shard_.stats().refused_pushes, 1);
  const std::vector<float> g0(4, 1), g1(8, 1);
  for (int worker : {0, 1}) {
    absl::StatusOr<PushResponse> r =
        client_->Push(0, Header(worker, 0),
                      {{"s0", "", {4}, g0.data()}, {"s1", "", {8}, g1.data()}}, SessionDeadline());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->outcome(), PushResponse::ACCEPTED) << "worker " << worker;
  }
  const Shard::Stats stats = shard_.stats();
  EXPECT_EQ(stats.version, 1);
  EXPECT_EQ(stats.skipped, 0);
  EXPECT_EQ(stats.refused_pushes, 1);
}

INSTANTIATE_TEST_SUITE_P(LocalAndGrpc, PushSessionDriversTest, ::testing::Bool(),
                         SessionDriversTest::DriverName);

}  // namespace
}  // namespace psflow::ps
