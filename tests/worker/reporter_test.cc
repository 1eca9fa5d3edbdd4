// Reporter against an in-memory chief (tests/fakes): the metrics it sends
// with their job, and what it makes of the chief's answers.
#include "worker/reporter.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/fakes/fake_chief.h"

namespace psflow::worker {
namespace {

using fakes::FakeChief;

ReporterOptions FastOptions() {
  ReporterOptions o;
  o.report_every = absl::Milliseconds(10);
  o.report_timeout = absl::Seconds(5);
  o.nonfinite_wait = absl::Seconds(30);
  return o;
}

StepMetrics Step(int64_t step, bool nonfinite = false) {
  StepMetrics m;
  m.set_step(step);
  m.set_examples(8);
  m.set_nonfinite(nonfinite);
  return m;
}

TEST(ReporterTest, SendsTheMetricsOfTheLatestJobAndExitsWhenTheChiefSaysSo) {
  FakeChief chief{RegisterWorkerResponse()};
  Reporter reporter(FastOptions(), &chief, nullptr);
  reporter.Registered(1);
  reporter.Add(Step(1));  // of a job that is gone at the next registration
  reporter.Registered(2);
  reporter.Add(Step(5));
  reporter.SetStep(6);
  std::thread loop([&] { reporter.Loop(); });
  EXPECT_EQ(reporter.FinishAndWait(), Reporter::Order::kExit);  // EXIT to `finished`
  loop.join();
  const std::vector<StepMetrics> metrics = chief.metrics();
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_EQ(metrics[0].step(), 5);
  for (const ReportRequest& r : chief.reports()) EXPECT_EQ(r.job_id(), 2u);
  EXPECT_TRUE(chief.reports().back().finished());
  EXPECT_EQ(reporter.step(), 6);
  EXPECT_TRUE(reporter.finished());
  EXPECT_FALSE(reporter.job_failed());
}

TEST(ReporterTest, TheChiefsFailEndsTheWaitAfterANonFiniteStep) {
  FakeChief chief{RegisterWorkerResponse()};  // FAILs a report with a non-finite step
  std::atomic<bool> told{false};
  Reporter reporter(FastOptions(), &chief, [&] { told = true; });
  reporter.Registered(1);
  std::thread loop([&] { reporter.Loop(); });
  const absl::Time start = absl::Now();
  reporter.NonFinite(Step(3, /*nonfinite=*/true));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the whole nonfinite_wait
  loop.join();                                        // ends on FAIL
  EXPECT_TRUE(reporter.job_failed());
  EXPECT_TRUE(told);
  EXPECT_EQ(reporter.FinishAndWait(), Reporter::Order::kExit);  // Run tells FAIL apart
}

TEST(ReporterTest, RegisterIsRememberedUntilTheNextRegistration) {
  FakeChief chief{RegisterWorkerResponse()};
  chief.SetAction(ReportResponse::REGISTER, 1);
  Reporter reporter(FastOptions(), &chief, nullptr);
  reporter.Registered(1);
  std::thread loop([&] { reporter.Loop(); });
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!reporter.reregister() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(reporter.reregister());
  reporter.Stop();  // (the chief answers REGISTER until the worker registers)
  loop.join();
  reporter.Registered(1);
  EXPECT_FALSE(reporter.reregister());
}

TEST(ReporterTest, StopEndsTheLoopAndTheWaitForTheExitOrder) {
  FakeChief chief{RegisterWorkerResponse()};
  chief.ExitWhenFinished(false);
  Reporter reporter(FastOptions(), &chief, nullptr);
  reporter.Registered(1);
  std::thread loop([&] { reporter.Loop(); });
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(50));
    reporter.Stop();
  });
  EXPECT_EQ(reporter.FinishAndWait(), Reporter::Order::kStopped);
  stopper.join();
  loop.join();
}

TEST(ReporterTest, AReportRefusedForGoodEndsTheLoopWithAnError) {
  FakeChief chief{RegisterWorkerResponse()};
  chief.FailCalls(absl::StatusCode::kPermissionDenied, -1);
  Reporter reporter(FastOptions(), &chief, nullptr);
  reporter.Registered(1);
  reporter.Loop();  // returns once reporting failed for good
  EXPECT_FALSE(reporter.report_error().ok());
  EXPECT_EQ(reporter.FinishAndWait(), Reporter::Order::kReportFailed);
}

}  // namespace
}  // namespace psflow::worker
