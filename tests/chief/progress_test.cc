#include "chief/progress.h"

#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/chief.pb.h"
#include "ps/optimizer.h"

namespace psflow::chief {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr int64_t kTrainSteps = 25;
constexpr int64_t kStepsPerEpoch = 10;
constexpr int kLogEvery = 10;
constexpr int kWorkers = 2;
constexpr int kPs = 2;

// Deterministic metrics for (worker, step); `compute_us` lets a test give
// intervals different step times.
StepMetrics Metric(int worker, int64_t step, int64_t compute_us = 5000) {
  StepMetrics m;
  m.set_step(step);
  m.set_loss(0.5 + 0.1 * worker + 0.01 * static_cast<double>(step));
  m.set_examples(8 + 4 * worker + step % 3);  // uneven, so the weighting matters
  m.set_correct((step + 3 * worker) % (m.examples() + 1));
  m.set_pull_us(1000 + 10 * step);
  m.set_compute_us(compute_us + 100 * worker);
  m.set_push_us(800 + 5 * step);
  m.set_wait_us(200 * worker + step);
  m.set_input_us(30 * step + 7 * worker);  // part of compute_us
  return m;
}

std::vector<StepMetrics> Steps(int worker, int64_t begin, int64_t end, int64_t compute_us = 5000) {
  std::vector<StepMetrics> out;
  for (int64_t s = begin; s < end; ++s) out.push_back(Metric(worker, s, compute_us));
  return out;
}

// What a line should say about the records `ms` of an interval of `steps`
// global steps (its step, epoch and counts aside), and the interval's size.
struct Expected : ProgressLine {
  int64_t examples = 0;
  double seconds = 0;  // steps * step_ms
};

Expected Expect(const std::vector<StepMetrics>& ms, int64_t steps) {
  Expected e;
  double loss_sum = 0;
  int64_t correct = 0;
  for (const StepMetrics& m : ms) {
    loss_sum += m.loss() * static_cast<double>(m.examples());
    correct += m.correct();
    e.examples += m.examples();
    e.pull_ms += m.pull_us();
    e.compute_ms += m.compute_us();
    e.push_ms += m.push_us();
    e.wait_ms += m.wait_us();
    e.input_ms += m.input_us();
  }
  const double n = static_cast<double>(ms.size());
  e.loss = loss_sum / static_cast<double>(e.examples);
  e.accuracy = static_cast<double>(correct) / static_cast<double>(e.examples);
  e.pull_ms /= n * 1000;
  e.compute_ms /= n * 1000;
  e.push_ms /= n * 1000;
  e.wait_ms /= n * 1000;
  e.input_ms /= n * 1000;
  e.step_ms = e.pull_ms + e.compute_ms + e.push_ms + e.wait_ms;
  e.seconds = static_cast<double>(steps) * e.step_ms / 1000.0;
  e.examples_per_sec = static_cast<double>(e.examples) / e.seconds;
  return e;
}

// Parses a progress line; fails the test if it does not have the documented form.
ProgressLine Parse(const std::string& text) {
  ProgressLine l;
  const int got =
      std::sscanf(text.c_str(),
                  "step %" SCNd64 "/%" SCNd64
                  " epoch %lf loss %lf acc %lf | %lf ex/s | step %lf ms (pull %lf "
                  "compute %lf push %lf "
                  "wait %lf) | workers %d/%d ps %d/%d",
                  &l.step, &l.train_steps, &l.epoch, &l.loss, &l.accuracy, &l.examples_per_sec,
                  &l.step_ms, &l.pull_ms, &l.compute_ms, &l.push_ms, &l.wait_ms, &l.live_workers,
                  &l.num_workers, &l.live_ps, &l.num_ps);
  EXPECT_EQ(got, 15) << "unparsable line: " << text;
  return l;
}

// Checks the numbers a line prints, to the precision it prints them with.
void ExpectPrintedNumbers(const ProgressLine& got, const ProgressLine& want) {
  EXPECT_NEAR(got.epoch, want.epoch, 0.005 + 1e-9);
  EXPECT_NEAR(got.loss, want.loss, 0.00005 + 1e-9);
  EXPECT_NEAR(got.accuracy, want.accuracy, 0.0005 + 1e-9);
  EXPECT_NEAR(got.examples_per_sec, want.examples_per_sec, 0.5 + 1e-9);
  EXPECT_NEAR(got.step_ms, want.step_ms, 0.05 + 1e-9);
  EXPECT_NEAR(got.pull_ms, want.pull_ms, 0.05 + 1e-9);
  EXPECT_NEAR(got.compute_ms, want.compute_ms, 0.05 + 1e-9);
  EXPECT_NEAR(got.push_ms, want.push_ms, 0.05 + 1e-9);
  EXPECT_NEAR(got.wait_ms, want.wait_ms, 0.05 + 1e-9);
}

// Checks a parsed line against expectations, within the printed precision.
void ExpectLine(const ProgressLine& l, const Expected& e, int end) {
  EXPECT_EQ(l.step, end);
  EXPECT_EQ(l.train_steps, kTrainSteps);
  ProgressLine want = e;
  want.epoch = static_cast<double>(end) / kStepsPerEpoch;
  ExpectPrintedNumbers(l, want);
  // ex/s is the interval's examples over steps * step time (as printed, to rounding).
  const int64_t steps = end - (end == kTrainSteps ? 20 : end - kLogEvery);
  EXPECT_NEAR(l.examples_per_sec,
              static_cast<double>(e.examples) / (static_cast<double>(steps) * l.step_ms / 1000.0),
              0.01 * l.examples_per_sec);
}

class ProgressTest : public ::testing::Test {
 protected:
  ProgressTest()
      : progress_(
            kTrainSteps, kStepsPerEpoch, kLogEvery, kWorkers, kPs, [this] { return reachable_; },
            [this](const std::string& line) { lines_.push_back(line); }) {}

  const absl::Time t0_ = absl::FromUnixSeconds(1700000000);
  int reachable_ = kPs;
  std::vector<std::string> lines_;
  Progress progress_;
};

// The metrics registry gets each line's numbers, each report's counts, and
// the live workers and ps at each look.
TEST(ProgressMetricsTest, LinesAndReportsGoToTheRegistry) {
  metrics::Registry registry;
  int reachable = 1;
  std::vector<std::string> lines;
  Progress progress(
      kTrainSteps, kStepsPerEpoch, kLogEvery, kWorkers, kPs, [&reachable] { return reachable; },
      [&lines](const std::string& line) { lines.push_back(line); }, nullptr,
      /*listener=*/nullptr, &registry);
  auto gauge = [&registry](const char* name, const metrics::Labels& labels = {}) {
    return registry.GetGauge(name, "", labels)->value();
  };
  EXPECT_EQ(gauge("psflow_workers"), kWorkers);
  EXPECT_EQ(gauge("psflow_ps"), kPs);
  // Workers report now (real time: liveness is judged at the scrape).
  const absl::Time now = absl::Now();
  progress.Record(0, Steps(0, 0, 10), now);
  EXPECT_EQ(registry.GetCounter("psflow_examples_total", "")->value(),
            Expect(Steps(0, 0, 10), 10).examples);
  EXPECT_THAT(registry.Render(), HasSubstr("\npsflow_live_workers 1\n"));
  progress.Record(1, Steps(1, 0, 10), now);
  ASSERT_EQ(lines.size(), 1u);
  std::vector<StepMetrics> interval = Steps(0, 0, 10);
  for (const StepMetrics& m : Steps(1, 0, 10)) interval.push_back(m);
  const Expected e = Expect(interval, 10);
  EXPECT_DOUBLE_EQ(gauge("psflow_loss"), e.loss);
  EXPECT_DOUBLE_EQ(gauge("psflow_accuracy"), e.accuracy);
  EXPECT_NEAR(gauge("psflow_examples_per_second"), e.examples_per_sec, 1e-6 * e.examples_per_sec);
  EXPECT_NEAR(gauge("psflow_step_seconds", {{"phase", "pull"}}), e.pull_ms / 1000, 1e-12);
  EXPECT_NEAR(gauge("psflow_step_seconds", {{"phase", "compute"}}), e.compute_ms / 1000, 1e-12);
  EXPECT_NEAR(gauge("psflow_step_seconds", {{"phase", "push"}}), e.push_ms / 1000, 1e-12);
  EXPECT_NEAR(gauge("psflow_step_seconds", {{"phase", "wait"}}), e.wait_ms / 1000, 1e-12);
  EXPECT_NEAR(
      registry.GetCounter("psflow_step_phase_seconds_total", "", {{"phase", "compute"}})->value(),
      e.compute_ms * 20 / 1000, 1e-9);
  // The input wait, part of the compute phase: its mean and its sum.
  EXPECT_GT(e.input_ms, 0);
  EXPECT_NEAR(gauge("psflow_step_input_seconds"), e.input_ms / 1000, 1e-12);
  EXPECT_NEAR(registry.GetCounter("psflow_input_wait_seconds_total", "")->value(),
              e.input_ms * 20 / 1000, 1e-9);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("\npsflow_live_workers 2\n"));
  EXPECT_THAT(text, HasSubstr("\npsflow_live_ps 1\n"));
  reachable = 2;
  EXPECT_THAT(registry.Render(), HasSubstr("\npsflow_live_ps 2\n"));
}

// An evaluator's results set the eval gauges: none (step -1, NaN) before the
// first, then the latest one.
TEST(ProgressMetricsTest, EvalResultsGoToTheirGauges) {
  metrics::Registry registry;
  Progress progress(
      kTrainSteps, kStepsPerEpoch, kLogEvery, kWorkers, kPs, [] { return kPs; },
      [](const std::string&) {}, nullptr, /*listener=*/nullptr, &registry);
  auto gauge = [&registry](const char* name) { return registry.GetGauge(name, "")->value(); };
  EXPECT_EQ(gauge("psflow_eval_step"), -1);
  EXPECT_TRUE(std::isnan(gauge("psflow_eval_loss")));
  EXPECT_TRUE(std::isnan(gauge("psflow_eval_accuracy")));
  EXPECT_THAT(registry.Render(), HasSubstr("\npsflow_eval_loss NaN\n"));
  progress.Eval(10, 0.75, 0.5);
  progress.Eval(20, 0.5, 0.625);
  EXPECT_EQ(gauge("psflow_eval_step"), 20);
  EXPECT_EQ(gauge("psflow_eval_loss"), 0.5);
  EXPECT_EQ(gauge("psflow_eval_accuracy"), 0.625);
}

TEST_F(ProgressTest, NoLineUntilEveryWorkerFinishedTheInterval) {
  progress_.Record(0, Steps(0, 0, 10), t0_);
  EXPECT_TRUE(lines_.empty());
  progress_.Record(1, Steps(1, 0, 9), t0_ + absl::Milliseconds(100));
  EXPECT_TRUE(lines_.empty());
  // Worker 0 runs ahead into the next interval: still only the first may go out.
  progress_.Record(0, Steps(0, 10, 15), t0_ + absl::Milliseconds(150));
  EXPECT_TRUE(lines_.empty());
  progress_.Record(1, Steps(1, 9, 10), t0_ + absl::Milliseconds(200));
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], StartsWith("step 10/25 epoch 1.00 "));
  EXPECT_THAT(lines_[0], HasSubstr("| workers 2/2 ps 2/2"));
}

// A report that arrives after its interval was logged (a late RPC) changes
// nothing: no second line for that interval, no step count going back.
TEST_F(ProgressTest, DropsStepsOfIntervalsAlreadyLogged) {
  progress_.Record(0, Steps(0, 0, 20), t0_);
  progress_.Record(1, Steps(1, 0, 20), t0_ + absl::Milliseconds(100));
  ASSERT_EQ(lines_.size(), 2u);
  const int64_t examples = progress_.summary().examples;
  progress_.Record(1, Steps(1, 5, 6), t0_ + absl::Milliseconds(200));
  EXPECT_EQ(lines_.size(), 2u);
  EXPECT_EQ(progress_.summary().steps, 20);
  EXPECT_EQ(progress_.summary().examples, examples);
}

// Each worker reports a step once, in order: a second report of a step (a
// forged one, say, sent before or after the worker's own) is dropped and
// counted, so the interval's figures are the worker's first report's.
TEST_F(ProgressTest, DropsASecondReportOfAStep) {
  StepMetrics forged = Metric(1, 9);
  forged.set_loss(0.001);
  forged.set_correct(forged.examples());
  progress_.Record(1, Steps(1, 0, 10), t0_);
  progress_.Record(1, {Metric(1, 3), forged}, t0_);
  progress_.Record(0, Steps(0, 0, 10), t0_);
  ASSERT_EQ(lines_.size(), 1u);
  std::vector<StepMetrics> interval = Steps(0, 0, 10);
  for (const StepMetrics& m : Steps(1, 0, 10)) interval.push_back(m);
  const ProgressLine l = Parse(lines_[0]);
  const Expected e = Expect(interval, 10);
  EXPECT_NEAR(l.loss, e.loss, 1e-4);
  EXPECT_NEAR(l.accuracy, e.accuracy, 1e-3);
  EXPECT_EQ(progress_.summary().refused, 2);
  EXPECT_EQ(progress_.summary().examples, e.examples);
}

// Workers' steps whose gradients were clipped are counted.
TEST(ProgressMetricsTest, ClippedStepsAreCounted) {
  metrics::Registry registry;
  Progress progress(
      kTrainSteps, kStepsPerEpoch, kLogEvery, kWorkers, kPs, [] { return kPs; },
      [](const std::string&) {}, nullptr, /*listener=*/nullptr, &registry);
  std::vector<StepMetrics> steps = Steps(0, 0, 4);
  steps[1].set_clipped(true);
  steps[3].set_clipped(true);
  progress.Record(0, steps, absl::Now());
  EXPECT_EQ(registry.GetCounter("psflow_clipped_steps_total", "")->value(), 2);
  EXPECT_EQ(progress.summary().clipped, 2);
}

TEST_F(ProgressTest, LinesCarryTheIntervalsExampleWeightedMetrics) {
  std::vector<StepMetrics> first = Steps(0, 0, 10);
  for (const StepMetrics& m : Steps(1, 0, 10)) first.push_back(m);
  std::vector<StepMetrics> second = Steps(0, 10, 20);
  for (const StepMetrics& m : Steps(1, 10, 20)) second.push_back(m);
  std::vector<StepMetrics> last = Steps(0, 20, 25);
  for (const StepMetrics& m : Steps(1, 20, 25)) last.push_back(m);

  progress_.Record(0, Steps(0, 0, 10), t0_);
  progress_.Record(1, Steps(1, 0, 10), t0_ + absl::Seconds(1));
  ASSERT_EQ(lines_.size(), 1u);
  ExpectLine(Parse(lines_[0]), Expect(first, 10), 10);

  progress_.Record(1, Steps(1, 10, 25), t0_ + absl::Seconds(2));
  EXPECT_EQ(lines_.size(), 1u);
  // One report completes both remaining intervals: two lines, in order.
  progress_.Record(0, Steps(0, 10, 25), t0_ + absl::Seconds(3));
  ASSERT_EQ(lines_.size(), 3u);
  ExpectLine(Parse(lines_[1]), Expect(second, 10), 20);
  // The last, partial interval ends at train_steps.
  ExpectLine(Parse(lines_[2]), Expect(last, 5), 25);
  EXPECT_THAT(lines_[2], StartsWith("step 25/25 epoch 2.50 "));
}

TEST_F(ProgressTest, CountsLiveWorkers) {
  progress_.Record(0, Steps(0, 0, 10), t0_);
  // Worker 1 reports after worker 0 went quiet for longer than the live window.
  progress_.Record(1, Steps(1, 0, 10), t0_ + Progress::kLiveWindow + absl::Seconds(1));
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], HasSubstr("| workers 1/2 ps 2/2"));
  const ProgressLine l = Parse(lines_[0]);
  EXPECT_EQ(l.live_workers, 1);
  EXPECT_EQ(l.num_workers, 2);

  // Both recent again (exactly at the window's edge still counts as live).
  progress_.Record(0, Steps(0, 10, 20), t0_ + absl::Seconds(12));
  progress_.Record(1, Steps(1, 10, 20), t0_ + absl::Seconds(12) + Progress::kLiveWindow);
  ASSERT_EQ(lines_.size(), 2u);
  EXPECT_THAT(lines_[1], HasSubstr("| workers 2/2 ps 2/2"));
}

TEST_F(ProgressTest, ReportsReachablePs) {
  reachable_ = 1;
  progress_.Record(0, Steps(0, 0, 10), t0_);
  progress_.Record(1, Steps(1, 0, 10), t0_);
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], HasSubstr("| workers 2/2 ps 1/2"));
}

TEST(ProgressNoCallbackTest, WithoutReachablePsCallbackAssumesAllPs) {
  std::vector<std::string> lines;
  Progress progress(kTrainSteps, kStepsPerEpoch, kLogEvery, 1, 3, nullptr,
                    [&](const std::string& line) { lines.push_back(line); });
  progress.Record(0, Steps(0, 0, 10), absl::UnixEpoch());
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("| workers 1/1 ps 3/3"));
}

TEST_F(ProgressTest, SummaryLeavesTheFirstIntervalOutOfTheRate) {
  EXPECT_EQ(progress_.summary().steps, 0);
  EXPECT_EQ(progress_.summary().examples, 0);
  EXPECT_EQ(progress_.summary().examples_per_sec, 0);

  // A slow start-up interval, then faster ones with different step times.
  std::vector<StepMetrics> first, second, last;
  for (int w = 0; w < kWorkers; ++w) {
    for (const StepMetrics& m : Steps(w, 0, 10, 50000)) first.push_back(m);
    for (const StepMetrics& m : Steps(w, 10, 20, 2000)) second.push_back(m);
    for (const StepMetrics& m : Steps(w, 20, 25, 3000)) last.push_back(m);
  }
  for (int w = 0; w < kWorkers; ++w)
    progress_.Record(w, Steps(w, 0, 10, 50000), t0_ + absl::Seconds(w));
  // After only the first line there is no steady rate yet.
  EXPECT_EQ(progress_.summary().examples_per_sec, 0);
  for (int w = 0; w < kWorkers; ++w)
    progress_.Record(w, Steps(w, 10, 20, 2000), t0_ + absl::Seconds(5 + w));
  for (int w = 0; w < kWorkers; ++w)
    progress_.Record(w, Steps(w, 20, 25, 3000), t0_ + absl::Seconds(8 + w));
  ASSERT_EQ(lines_.size(), 3u);

  const Expected e1 = Expect(first, 10), e2 = Expect(second, 10), e3 = Expect(last, 5);
  const Progress::Summary s = progress_.summary();
  EXPECT_EQ(s.steps, 25);
  EXPECT_EQ(s.examples, e1.examples + e2.examples + e3.examples);
  EXPECT_EQ(s.elapsed, absl::Seconds(9));
  const double steady = static_cast<double>(e2.examples + e3.examples) / (e2.seconds + e3.seconds);
  EXPECT_NEAR(s.examples_per_sec, steady, 1e-6 * steady);
  // Including the start-up interval would give a clearly different (lower) rate.
  const double all = static_cast<double>(e1.examples + e2.examples + e3.examples) /
                     (e1.seconds + e2.seconds + e3.seconds);
  EXPECT_GT(s.examples_per_sec, 1.5 * all);
  EXPECT_DOUBLE_EQ(s.last_loss, e3.loss);
  EXPECT_DOUBLE_EQ(s.last_accuracy, e3.accuracy);
}

TEST_F(ProgressTest, IgnoresOutOfRangeWorkersAndSteps) {
  progress_.Record(-1, Steps(0, 0, 10), t0_);
  progress_.Record(kWorkers, Steps(1, 0, 10), t0_);
  progress_.Record(1000, Steps(1, 0, 25), t0_);
  EXPECT_TRUE(lines_.empty());
  EXPECT_EQ(progress_.summary().examples, 0);

  progress_.Record(0, Steps(0, 0, 10), t0_);
  // Steps outside [0, train_steps) from a valid worker count for nothing.
  progress_.Record(1, {Metric(1, -1), Metric(1, -100), Metric(1, kTrainSteps), Metric(1, 1000)},
                   t0_);
  EXPECT_TRUE(lines_.empty());
  Progress::Summary s = progress_.summary();
  EXPECT_EQ(s.steps, 0);
  int64_t examples = 0;
  for (const StepMetrics& m : Steps(0, 0, 10)) examples += m.examples();
  EXPECT_EQ(s.examples, examples);

  // Worker 1's real steps still complete the interval normally.
  progress_.Record(1, Steps(1, 0, 10), t0_);
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], StartsWith("step 10/25 "));
}

TEST_F(ProgressTest, EmptyReportIsAHeartbeat) {
  progress_.Record(0, Steps(0, 0, 10), t0_);
  progress_.Record(1, Steps(1, 0, 9), t0_);
  progress_.Record(0, {}, t0_ + absl::Seconds(15));  // worker 0 is alive, just idle
  EXPECT_TRUE(lines_.empty());
  progress_.Record(1, Steps(1, 9, 10), t0_ + absl::Seconds(16));
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], HasSubstr("| workers 2/2 "));
}

TEST(CheckStepMetricsTest, AcceptsRealMetricsAndRefusesImpossibleOnes) {
  constexpr int kBatch = 64;
  EXPECT_TRUE(CheckStepMetrics(Metric(1, 3), kTrainSteps, kBatch).ok());
  auto refused = [&](void (*spoil)(StepMetrics*)) {
    StepMetrics m = Metric(0, 4);
    spoil(&m);
    return CheckStepMetrics(m, kTrainSteps, kBatch);
  };
  for (auto spoil : std::vector<void (*)(StepMetrics*)>{
           [](StepMetrics* m) { m->set_step(-1); },
           [](StepMetrics* m) { m->set_step(kTrainSteps); },
           [](StepMetrics* m) { m->set_examples(0); },
           [](StepMetrics* m) { m->set_examples(int64_t{1} << 62); },
           [](StepMetrics* m) { m->set_correct(-1); },
           [](StepMetrics* m) { m->set_correct(m->examples() + 1); },
           [](StepMetrics* m) { m->set_compute_us(-5); },
           [](StepMetrics* m) { m->set_wait_us(int64_t{1} << 50); },
           [](StepMetrics* m) { m->set_loss(std::nan("")); },
           [](StepMetrics* m) { m->set_loss(-0.5); },
           [](StepMetrics* m) { m->set_loss(HUGE_VAL); },
       }) {
    absl::Status s = refused(spoil);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  }
  // A step flagged non-finite may carry any loss: it is the policy's business.
  StepMetrics flagged = Metric(0, 4);
  flagged.set_loss(std::nan(""));
  flagged.set_nonfinite(true);
  EXPECT_TRUE(CheckStepMetrics(flagged, kTrainSteps, kBatch).ok());
}

TEST_F(ProgressTest, NonFiniteStepsAreNotLogged) {
  std::vector<StepMetrics> w0 = Steps(0, 0, 10);
  w0[4].set_nonfinite(true);
  w0[4].set_loss(std::nan(""));
  progress_.Record(0, w0, t0_);
  progress_.Record(1, Steps(1, 0, 10), t0_);
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], Not(HasSubstr("nan"))) << lines_[0];
}

}  // namespace
}  // namespace psflow::chief

namespace psflow::chief {
namespace {

TEST(ProgressLearningRateTest, LinesShowTheRateOfTheIntervalsLastStep) {
  // Warmup over 4 steps, then cosine from 0.001 to 0 over the 20 steps after it.
  OptimizerConfig optimizer;
  optimizer.set_learning_rate(0.001f);
  optimizer.set_lr_warmup_steps(4);
  optimizer.set_lr_decay(OptimizerConfig::COSINE);
  optimizer.set_lr_decay_steps(20);
  std::vector<std::string> lines;
  Progress progress(
      kTrainSteps, kStepsPerEpoch, kLogEvery, 1, kPs, nullptr,
      [&](const std::string& line) { lines.push_back(line); },
      [&](int64_t step) { return ps::LearningRate(optimizer, step); });
  const absl::Time t0 = absl::FromUnixSeconds(1700000000);
  progress.Record(0, Steps(0, 0, kTrainSteps), t0);
  ASSERT_EQ(lines.size(), 3u);
  // Step 9 is t = 5 of 20: 0.0005 (1 + cos(pi / 4)) = 0.00085355; step 19 is t = 15:
  // 0.0005 (1 + cos(3 pi / 4)) = 0.00014645; step 24 (t = 20) has 0.
  EXPECT_THAT(lines[0], HasSubstr("acc "));
  EXPECT_THAT(lines[0], HasSubstr(" lr 0.0008536 | "));
  EXPECT_THAT(lines[1], HasSubstr(" lr 0.0001464 | "));
  EXPECT_THAT(lines[2], HasSubstr(" lr 0 | "));
  // The rest of the line is unchanged.
  ProgressLine l =
      Parse(lines[0].substr(0, lines[0].find(" lr ")) + lines[0].substr(lines[0].find(" | ")));
  EXPECT_EQ(l.step, 10);
}

TEST_F(ProgressTest, NoRateWithoutALearningRateFunction) {
  progress_.Record(0, Steps(0, 0, 10), t0_);
  progress_.Record(1, Steps(1, 0, 10), t0_);
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], Not(HasSubstr(" lr ")));
}

// Records what a ProgressListener receives, restarts as "restart <step>".
class RecordingListener : public ProgressListener {
 public:
  void OnRestart(int64_t step) override { events.push_back("restart " + std::to_string(step)); }
  void OnLine(const ProgressLine& line) override {
    events.push_back("line " + std::to_string(line.step));
    lines.push_back(line);
  }
  std::vector<std::string> events;
  std::vector<ProgressLine> lines;
};

// `got` holds the numbers `text` prints, to the text's precision, and the
// learning rate of its step.
void ExpectNumbersOfText(const ProgressLine& got, const std::string& text,
                         const OptimizerConfig& optimizer) {
  const ProgressLine l = Parse(text.substr(0, text.find(" lr ")) + text.substr(text.find(" | ")));
  EXPECT_EQ(got.step, l.step);
  EXPECT_EQ(got.train_steps, kTrainSteps);
  ExpectPrintedNumbers(got, l);
  EXPECT_NEAR(got.step_ms, got.pull_ms + got.compute_ms + got.push_ms + got.wait_ms, 1e-9);
  EXPECT_EQ(got.live_workers, l.live_workers);
  EXPECT_EQ(got.num_workers, kWorkers);
  EXPECT_EQ(got.live_ps, l.live_ps);
  EXPECT_EQ(got.num_ps, kPs);
  ASSERT_TRUE(got.learning_rate.has_value());
  EXPECT_DOUBLE_EQ(*got.learning_rate, ps::LearningRate(optimizer, got.step - 1));
  EXPECT_THAT(text, HasSubstr(absl::StrFormat(" lr %.4g | ", *got.learning_rate)));
}

// The listener gets every line as the numbers the text prints, and every
// restart, in order.
TEST(ProgressListenerTest, GetsTheLinesNumbersAndTheRestarts) {
  OptimizerConfig optimizer;
  optimizer.set_learning_rate(0.001f);
  optimizer.set_lr_decay(OptimizerConfig::EXPONENTIAL);
  optimizer.set_lr_decay_steps(5);
  optimizer.set_lr_decay_rate(0.5f);
  std::vector<std::string> text;
  RecordingListener listener;
  int reachable = 1;
  Progress progress(
      kTrainSteps, kStepsPerEpoch, kLogEvery, kWorkers, kPs, [&] { return reachable; },
      [&](const std::string& line) { text.push_back(line); },
      [&](int64_t step) { return ps::LearningRate(optimizer, step); }, &listener);
  const absl::Time t0 = absl::FromUnixSeconds(1700000000);
  progress.Restart(0);
  progress.Record(0, Steps(0, 0, 20), t0);
  progress.Record(1, Steps(1, 0, 20), t0 + absl::Seconds(1));
  ASSERT_EQ(text.size(), 2u);
  ASSERT_EQ(listener.lines.size(), 2u);
  // Back to step 10 (a ps restored from a checkpoint): step 20 comes again.
  progress.Restart(10);
  reachable = 2;
  progress.Record(0, Steps(0, 10, 20), t0 + absl::Seconds(2));
  progress.Record(1, Steps(1, 10, 20), t0 + absl::Seconds(3));
  ASSERT_EQ(text.size(), 3u);
  EXPECT_EQ(listener.events,
            (std::vector<std::string>{"restart 0", "line 10", "line 20", "restart 10", "line 20"}));

  for (size_t i = 0; i < text.size(); ++i) {
    SCOPED_TRACE(text[i]);
    ASSERT_NO_FATAL_FAILURE(ExpectNumbersOfText(listener.lines[i], text[i], optimizer));
  }
  // Exact values: the first interval's example-weighted means.
  std::vector<StepMetrics> first = Steps(0, 0, 10);
  for (const StepMetrics& m : Steps(1, 0, 10)) first.push_back(m);
  const Expected e = Expect(first, 10);
  EXPECT_DOUBLE_EQ(listener.lines[0].loss, e.loss);
  EXPECT_DOUBLE_EQ(listener.lines[0].accuracy, e.accuracy);
  EXPECT_NEAR(listener.lines[0].examples_per_sec, e.examples_per_sec, 1e-6);
  EXPECT_EQ(listener.lines[0].time, t0 + absl::Seconds(1));
  EXPECT_EQ(listener.lines[2].time, t0 + absl::Seconds(3));
  EXPECT_EQ(listener.lines[0].live_ps, 1);
  EXPECT_EQ(listener.lines[2].live_ps, 2);
}

TEST(ProgressListenerTest, NoRateWithoutALearningRateFunction) {
  RecordingListener listener;
  Progress progress(
      kTrainSteps, kStepsPerEpoch, kLogEvery, 1, kPs, nullptr, [](const std::string&) {}, nullptr,
      &listener);
  progress.Record(0, Steps(0, 0, 10), absl::FromUnixSeconds(1700000000));
  ASSERT_EQ(listener.lines.size(), 1u);
  EXPECT_FALSE(listener.lines[0].learning_rate.has_value());
}

TEST_F(ProgressTest, LinesEndWithTheElapsedTimeAndAnEtaAtTheLatestPace) {
  progress_.Record(0, Steps(0, 0, 10), t0_);
  progress_.Record(1, Steps(1, 0, 10), t0_ + absl::Seconds(10));
  // 10 steps in the 10 s since the first report: 15 steps left take 15 s.
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], EndsWith("| workers 2/2 ps 2/2 | elapsed 10s eta 15s"));
  progress_.Record(0, Steps(0, 10, 20), t0_ + absl::Seconds(20));
  progress_.Record(1, Steps(1, 10, 20), t0_ + absl::Seconds(30));
  // The pace slowed to 2 s a step: 5 steps left take 10 s.
  ASSERT_EQ(lines_.size(), 2u);
  EXPECT_THAT(lines_[1], EndsWith("| elapsed 30s eta 10s"));
  progress_.Record(0, Steps(0, 20, 25), t0_ + absl::Seconds(3700));
  progress_.Record(1, Steps(1, 20, 25), t0_ + absl::Seconds(3700));
  ASSERT_EQ(lines_.size(), 3u);
  EXPECT_THAT(lines_[2], EndsWith("| elapsed 1h01m eta 0s"));
  ExpectLine(Parse(lines_[2]),
             Expect(
                 [] {
                   std::vector<StepMetrics> last = Steps(0, 20, 25);
                   for (const StepMetrics& m : Steps(1, 20, 25)) last.push_back(m);
                   return last;
                 }(),
                 5),
             25);
}

TEST(ShortDurationTest, SecondsMinutesHours) {
  EXPECT_EQ(ShortDuration(absl::ZeroDuration()), "0s");
  EXPECT_EQ(ShortDuration(absl::Milliseconds(59400)), "59s");
  EXPECT_EQ(ShortDuration(absl::Milliseconds(59600)), "1m00s");
  EXPECT_EQ(ShortDuration(absl::Seconds(3599)), "59m59s");
  EXPECT_EQ(ShortDuration(absl::Seconds(7260)), "2h01m");
  EXPECT_EQ(ShortDuration(-absl::Seconds(5)), "0s");
}

// An asynchronous job: workers report the versions they read (not in step),
// the line shows the interval's staleness, ex/s counts the workers as going
// at their own pace, and a worker that saw the end holds no line back.
TEST_F(ProgressTest, AsynchronousLinesShowStalenessAndFinishedWorkersHoldNothing) {
  progress_.SetAsynchronous(true);
  progress_.SetLiveWorkers({0, 1});
  std::vector<StepMetrics> w0, w1;
  for (int64_t s = 0; s < 10; s += 2) {
    StepMetrics a = Metric(0, s);
    a.set_staleness(s == 4 ? 3 : 1);
    w0.push_back(a);
    StepMetrics b = Metric(1, s + 1);
    b.set_staleness(0);
    w1.push_back(b);
  }
  progress_.Record(0, w0, t0_);
  progress_.Record(1, w1, t0_ + absl::Seconds(1));
  EXPECT_TRUE(lines_.empty()) << "worker 0 has not reported past step 9 yet";
  // Its next step read a version of the next interval: every worker is past it.
  progress_.Record(0, {Metric(0, 10)}, t0_ + absl::Seconds(1));
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], HasSubstr("| staleness mean 0.7 max 3 |"));  // 7 over 10 records
  std::vector<StepMetrics> all = w0;
  all.insert(all.end(), w1.begin(), w1.end());
  const Expected e = Expect(all, 10);
  const ProgressLine l = Parse(lines_[0]);
  // Each record is one worker's step; the 2 workers go side by side.
  EXPECT_NEAR(l.examples_per_sec,
              static_cast<double>(e.examples) / (10.0 * e.step_ms / 1000.0 / kWorkers),
              0.01 * l.examples_per_sec);
  // Worker 0 takes the rest of the job's steps; worker 1's last read was
  // step 9: once it says it saw the end, the last lines come out.
  progress_.Record(0, Steps(0, 11, kTrainSteps), t0_ + absl::Seconds(2));
  EXPECT_EQ(lines_.size(), 1u);
  progress_.Finished(1);
  ASSERT_EQ(lines_.size(), 3u);
  EXPECT_THAT(lines_[2], StartsWith("step 25/25 "));
  EXPECT_THAT(lines_[2], HasSubstr("| staleness mean 0.0 max 0 |"));
}

TEST_F(ProgressTest, SynchronousLinesHaveNoStaleness) {
  progress_.Record(0, Steps(0, 0, 10), t0_);
  progress_.Record(1, Steps(1, 0, 10), t0_);
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_THAT(lines_[0], Not(HasSubstr("staleness")));
}

TEST(StepMetricsCheckTest, StalenessOutsideTheJobIsRefused) {
  StepMetrics m = Metric(0, 1);
  m.set_staleness(-1);
  EXPECT_THAT(CheckStepMetrics(m, kTrainSteps, 64).message(), HasSubstr("staleness"));
  m.set_staleness(kTrainSteps + 1);
  EXPECT_FALSE(CheckStepMetrics(m, kTrainSteps, 64).ok());
  m.set_staleness(3);
  EXPECT_TRUE(CheckStepMetrics(m, kTrainSteps, 64).ok());
}

}  // namespace
}  // namespace psflow::chief
