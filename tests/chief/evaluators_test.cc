// The chief's bookkeeping of evaluators (chief/evaluators.h) on its own: the
// answers to their calls for each state of the job, the results it keeps,
// and the wait for the final model's evaluation.
#include "chief/evaluators.h"

#include <atomic>
#include <cmath>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace psflow::chief {
namespace {

constexpr int64_t kSteps = 10;

EvaluatorsOptions Options(int num_evaluators) {
  EvaluatorsOptions o;
  o.num_evaluators = num_evaluators;
  o.train_steps = kSteps;
  o.eval_every_steps = 3;
  o.eval_every_secs = 7;
  o.silence = absl::Seconds(5);
  o.final_wait = absl::Seconds(5);
  return o;
}

JobState Ready(uint64_t job_id) {
  JobState s;
  s.ready = true;
  s.job_id = job_id;
  return s;
}

// A report of evaluator `e` for job `job_id`, with a result of `step` unless
// it is negative, carrying `lease`.
ReportEvalRequest Result(uint64_t job_id, int64_t step, int e = 0, double loss = 0.5,
                         uint64_t lease = 0) {
  ReportEvalRequest r;
  r.set_job_id(job_id);
  r.set_evaluator(e);
  r.set_lease(lease);
  if (step >= 0) {
    EvalResult* result = r.mutable_result();
    result->set_step(step);
    result->set_loss(loss);
    result->set_correct(90);
    result->set_examples(100);
    result->set_duration_us(1000);
  }
  return r;
}

// Evaluator `e`'s lease from a registration for job `job_id` (0 if refused).
uint64_t Lease(Evaluators& evaluators, uint64_t job_id, int e = 0) {
  absl::StatusOr<RegisterEvaluatorResponse> r = evaluators.Register(e, Ready(job_id));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->lease() : 0;
}

TEST(EvaluatorsTest, RegistrationFollowsTheJobsState) {
  Evaluators evaluators(Options(2), nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(evaluators.Register(2, Ready(7)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(evaluators.Register(-1, Ready(7)).status()));
  EXPECT_TRUE(absl::IsUnavailable(evaluators.Register(0, JobState{}).status()));
  JobState failed = Ready(7);
  failed.failure = absl::OutOfRangeError("diverged");
  absl::Status refused = evaluators.Register(0, failed).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_NE(refused.message().find("diverged"), absl::string_view::npos);

  absl::StatusOr<RegisterEvaluatorResponse> r = evaluators.Register(1, Ready(7));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->done());
  EXPECT_EQ(r->job_id(), 7u);
  EXPECT_EQ(r->eval_every_steps(), 3);
  EXPECT_EQ(r->eval_every_secs(), 7);
  EXPECT_NE(r->lease(), 0u);

  // After the end: no lease, so nothing it reports is recorded.
  JobState done = Ready(7);
  done.done = true;
  r = evaluators.Register(0, done);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->done());
  EXPECT_EQ(r->lease(), 0u);
}

// A cluster that leaves its evaluators out takes any index below 64 from
// callers with certificates, and none from others (anyone could call).
TEST(EvaluatorsTest, AClusterWithoutEvaluatorsTakesSmallIndicesOnlyFromIdentifiedCallers) {
  EvaluatorsOptions o = Options(0);
  o.identified = true;
  Evaluators identified(o, nullptr);
  EXPECT_TRUE(identified.Register(63, Ready(1)).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(identified.Register(64, Ready(1)).status()));
  Evaluators plaintext(Options(0), nullptr);
  absl::Status refused = plaintext.Register(0, Ready(1)).status();
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_NE(refused.message().find("lists no evaluators"), absl::string_view::npos) << refused;
}

// Without certificates an index has one holder at a time: a second
// registration is refused while the first is heard from, its reports
// without the lease are dropped (REGISTER) and never waited for, and the
// holder renews its own registration with its lease.
TEST(EvaluatorsTest, OneLeaseHolderPerIndexAndForgedReportsDropped) {
  EvaluatorsOptions o = Options(1);
  o.silence = absl::Milliseconds(400);
  Evaluators evaluators(o, nullptr);
  const uint64_t lease = Lease(evaluators, 1);
  ASSERT_NE(lease, 0u);
  absl::Status second = evaluators.Register(0, Ready(1)).status();
  EXPECT_TRUE(absl::IsUnavailable(second)) << second;
  absl::StatusOr<RegisterEvaluatorResponse> renewed = evaluators.Register(0, Ready(1), lease);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_EQ(renewed->lease(), lease);

  for (uint64_t forged : {uint64_t{0}, lease + 1}) {
    absl::StatusOr<ReportEvalResponse> r =
        evaluators.Report(Result(1, kSteps, 0, 0.01, forged), Ready(1));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->action(), ReportEvalResponse::REGISTER);
  }
  EXPECT_FALSE(evaluators.final_result().has_value());

  // Forged heartbeats keep nobody's registration alive: the wait ends once
  // the holder is silent, and a new registration then takes the index.
  std::atomic<bool> stop{false};
  std::thread forger([&] {
    while (!stop) {
      ASSERT_TRUE(evaluators.Report(Result(1, -1, 0, 0.5, lease + 1), Ready(1)).ok());
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  const absl::Time start = absl::Now();
  evaluators.WaitForFinal();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  stop = true;
  forger.join();
  const uint64_t next = Lease(evaluators, 1);
  EXPECT_NE(next, lease);
  absl::StatusOr<ReportEvalResponse> old =
      evaluators.Report(Result(1, -1, 0, 0.5, lease), Ready(1));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->action(), ReportEvalResponse::REGISTER);
}

// With certificates a new registration of an index replaces the old one
// (its holder restarted).
TEST(EvaluatorsTest, IdentifiedCallersReplaceARegistration) {
  EvaluatorsOptions o = Options(1);
  o.identified = true;
  Evaluators evaluators(o, nullptr);
  const uint64_t first = Lease(evaluators, 1);
  const uint64_t second = Lease(evaluators, 1);
  EXPECT_NE(first, second);
  absl::StatusOr<ReportEvalResponse> r = evaluators.Report(Result(1, -1, 0, 0.5, first), Ready(1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::REGISTER);
}

TEST(EvaluatorsTest, ReportsAreCheckedAnsweredAndTheFinalResultKept) {
  Evaluators evaluators(Options(1), nullptr);
  const uint64_t lease = Lease(evaluators, 1);
  auto leased = [lease](ReportEvalRequest r) {
    r.set_lease(lease);
    return r;
  };
  EXPECT_TRUE(
      absl::IsInvalidArgument(evaluators.Report(leased(Result(1, 2, 1)), Ready(1)).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(evaluators.Report(leased(Result(1, kSteps + 1)), Ready(1)).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(evaluators.Report(leased(Result(1, 2, 0, NAN)), Ready(1)).status()));
  // An AUC outside [0, 1] is as impossible; one inside is kept and shown.
  ReportEvalRequest bad_auc = leased(Result(1, 2));
  bad_auc.mutable_result()->set_auc(1.5);
  EXPECT_TRUE(absl::IsInvalidArgument(evaluators.Report(bad_auc, Ready(1)).status()));
  bad_auc.mutable_result()->set_auc(0.75);
  EXPECT_EQ(AucText(bad_auc.result()), " auc 0.7500");
  EXPECT_EQ(AucText(Result(1, 2).result()), "");

  absl::StatusOr<ReportEvalResponse> r = evaluators.Report(leased(Result(1, -1)), Ready(1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::CONTINUE);
  r = evaluators.Report(leased(Result(2, 4)), Ready(1));  // another job's
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::REGISTER);
  r = evaluators.Report(leased(Result(1, 4)), JobState{.job_id = 1});  // the ps not loaded
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::REGISTER);
  r = evaluators.Report(leased(Result(1, 4)), Ready(1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::CONTINUE);
  EXPECT_FALSE(evaluators.final_result().has_value());

  r = evaluators.Report(leased(Result(1, kSteps, 0, 0.25)), Ready(1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::EXIT);
  ASSERT_TRUE(evaluators.final_result().has_value());
  EXPECT_EQ(evaluators.final_result()->loss(), 0.25);

  JobState failed = Ready(1);
  failed.failure = absl::OutOfRangeError("diverged");
  r = evaluators.Report(leased(Result(1, -1)), failed);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::FAIL);
  JobState done = Ready(1);
  done.done = true;
  r = evaluators.Report(leased(Result(1, -1)), done);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::EXIT);
}

TEST(EvaluatorsTest, NoEvaluatorNoWait) {
  Evaluators evaluators(Options(0), nullptr);
  const absl::Time start = absl::Now();
  evaluators.WaitForFinal();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(EvaluatorsTest, TheWaitEndsWithTheFinalResult) {
  Evaluators evaluators(Options(1), nullptr);
  const uint64_t lease = Lease(evaluators, 1);
  std::thread evaluator([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(evaluators.Report(Result(1, kSteps, 0, 0.5, lease), Ready(1)).ok());
  });
  const absl::Time start = absl::Now();
  evaluators.WaitForFinal();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_TRUE(evaluators.final_result().has_value());
  evaluator.join();
}

// A registered evaluator that goes silent is waited for no longer than
// options.silence; a listed one that never came, likewise.
TEST(EvaluatorsTest, TheWaitEndsWhenNoEvaluatorIsHeardFrom) {
  EvaluatorsOptions o = Options(1);
  o.silence = absl::Milliseconds(300);
  Evaluators evaluators(o, nullptr);
  ASSERT_TRUE(evaluators.Register(0, Ready(1)).ok());
  const absl::Time start = absl::Now();
  evaluators.WaitForFinal();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_FALSE(evaluators.final_result().has_value());
}

// Heartbeats alone (a registered evaluator that never delivers, or an
// impostor holding a listed index) hold the end for final_wait at most.
TEST(EvaluatorsTest, TheWaitEndsAfterFinalWait) {
  EvaluatorsOptions o = Options(1);
  o.final_wait = absl::Milliseconds(300);
  Evaluators evaluators(o, nullptr);
  const uint64_t lease = Lease(evaluators, 1);
  std::atomic<bool> stop{false};
  std::thread heartbeats([&] {
    while (!stop) {
      absl::StatusOr<ReportEvalResponse> r =
          evaluators.Report(Result(1, -1, 0, 0.5, lease), Ready(1));
      ASSERT_TRUE(r.ok());
      ASSERT_EQ(r->action(), ReportEvalResponse::CONTINUE);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  const absl::Time start = absl::Now();
  evaluators.WaitForFinal();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  stop = true;
  heartbeats.join();
}

TEST(EvaluatorsTest, CancelEndsTheWait) {
  Evaluators evaluators(Options(1), nullptr);
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(100));
    evaluators.Cancel();
  });
  const absl::Time start = absl::Now();
  evaluators.WaitForFinal();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  stopper.join();
  // For good: a later wait returns at once.
  evaluators.WaitForFinal();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

}  // namespace
}  // namespace psflow::chief
