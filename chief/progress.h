// The chief's progress log. Workers report per-step metrics; once every
// worker has reported up to the end of an interval of --log_every_steps, one
// line sums that interval up:
//   step 1200/2345 epoch 2.56 loss 0.3124 acc 0.887 lr 0.00095 | 9850 ex/s |
//   step 21.3 ms (pull 2.1 compute 15.0 push 1.8 wait 2.4) | workers 2/2 ps 2/2 |
//   elapsed 1m52s eta 1m47s
// A job that applies each worker's gradient alone (--mode async or ssp) adds
// the staleness of the interval's gradients (versions applied between the
// one a gradient was computed from and its own apply):
//   ... | staleness mean 1.3 max 4 | elapsed ...
// and, as its workers do not move together, its ex/s is the workers' mean
// examples per step times the live workers over the mean step time.
// lr is the learning rate of the interval's last step (given a
// `learning_rate` function of the step). The step time is the workers' mean of pull + compute +
// push + wait, and ex/s is the interval's examples over its steps times that step time.
// elapsed is the wall time since the first report; eta is the steps left at
// the wall-clock pace of the latest interval (reports included, as a user
// waits for them), so it follows slow-downs and restarts.
// Besides the text, a ProgressListener may receive each line as numbers.
// Given a metrics registry, each line's numbers also go to gauges there
// (psflow_loss, psflow_accuracy, psflow_examples_per_second,
// psflow_step_seconds{phase}), each report to counters (psflow_examples_total,
// psflow_step_phase_seconds_total{phase}, psflow_clipped_steps_total), each evaluator's result to
// psflow_eval_step, psflow_eval_loss and psflow_eval_accuracy, and the live
// workers and ps are read at each scrape (psflow_live_workers, psflow_live_ps).
// Thread-safe.
#ifndef PSFLOW_CHIEF_PROGRESS_H_
#define PSFLOW_CHIEF_PROGRESS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "proto/chief.pb.h"

namespace psflow::chief {

// Whether one step's metrics are possible for a job of `train_steps` steps and
// `batch_size` examples per worker: a step in the job, 0 < examples <= batch,
// 0 <= correct <= examples, times between 0 and an hour, and a finite,
// non-negative loss unless the step is flagged nonfinite. INVALID_ARGUMENT
// naming the first bad field otherwise. Reports are checked before Record.
absl::Status CheckStepMetrics(const StepMetrics& m, int64_t train_steps, int batch_size);

// One progress line as numbers, unrounded.
struct ProgressLine {
  int64_t step = 0;  // the interval's end step: "step <step>/<train_steps>"
  int64_t train_steps = 0;
  double epoch = 0;
  double loss = 0, accuracy = 0;        // the interval's means over its examples
  std::optional<double> learning_rate;  // of the interval's last step, when known
  double examples_per_sec = 0;
  double step_ms = 0;  // pull + compute + push + wait
  double pull_ms = 0, compute_ms = 0, push_ms = 0, wait_ms = 0;
  double input_ms = 0;  // of compute_ms: waiting for the step's input
  // Jobs that apply each gradient alone: the interval's mean and max staleness.
  std::optional<double> staleness_mean;
  int64_t staleness_max = 0;
  int live_workers = 0, num_workers = 0;
  int live_ps = 0, num_ps = 0;
  absl::Time time;  // when the line was written
};

// Receives the progress as numbers (chief/summaries.h writes them to event
// files). Progress calls it with its lock held, in the order of the lines:
// it must not call back into Progress.
class ProgressListener {
 public:
  virtual ~ProgressListener() = default;
  // The job starts, or goes back, at `step` (the steps done: every line
  // after it is of a later step). Lines already given for steps after `step`
  // no longer hold: their steps are trained again.
  virtual void OnRestart(int64_t step) = 0;
  virtual void OnLine(const ProgressLine& line) = 0;
  // An evaluator's result for the weights of `step` (a version: steps
  // applied); none by default.
  virtual void OnEval(int64_t step, double loss, double accuracy) {}
};

class Progress {
 public:
  // `metrics` (may be null) must outlive the Progress and must not be
  // rendered once it is gone (its function series read it).
  // `emit` receives each finished line (the chief logs it); `reachable_ps`
  // counts the ps whose connection is up when a line is written;
  // `learning_rate` (optional) gives the rate of a 0-based step for the
  // line's lr field, left out without it; `listener` (optional, not owned,
  // outliving this) receives every line as numbers and every Restart.
  Progress(int64_t train_steps, int64_t steps_per_epoch, int log_every_steps, int num_workers,
           int num_ps, std::function<int()> reachable_ps,
           std::function<void(const std::string&)> emit,
           std::function<double(int64_t)> learning_rate = nullptr,
           ProgressListener* listener = nullptr, metrics::Registry* metrics = nullptr);

  // A worker counts as live ("workers live/total") if it reported within this.
  static constexpr absl::Duration kLiveWindow = absl::Seconds(10);

  // Records a worker's metrics (a report is also its heartbeat) and emits
  // every line that became complete. A step the worker reported already (or
  // one before the step it rejoined at) is dropped and counted
  // (Summary::refused): each worker reports a step once, in order.
  void Record(int worker, const std::vector<StepMetrics>& metrics, absl::Time now);

  // The workers the synchronous steps wait for; lines wait for these only.
  void SetLiveWorkers(const std::vector<int>& live);
  // A worker that (re)joins at `step` reports nothing before it.
  void Rejoin(int worker, int64_t step);
  // The job applies each worker's gradient alone (see above).
  void SetAsynchronous(bool asynchronous);
  // The job has no ps (its workers all-reduce): the lines count worker 0's
  // replica ("replica 1/1") where they would count the ps.
  void SetAllReduce(bool all_reduce);
  // A worker saw the last step applied: it reports no more steps (in an
  // asynchronous job its last step may be well before the end).
  void Finished(int worker);
  // The job went back to (or started at) `step`: forget what is not logged.
  void Restart(int64_t step);
  // An evaluator's result (the chief logs its line): to the listener and
  // the eval gauges.
  void Eval(int64_t step, double loss, double accuracy);

  struct Summary {
    int64_t steps = 0;
    int64_t examples = 0;
    absl::Duration elapsed;       // from the first reported step to the last
    double examples_per_sec = 0;  // over every logged interval but the first (start-up)
    double last_loss = 0, last_accuracy = 0;
    int64_t clipped = 0;  // workers' steps whose gradients were clipped
    int64_t refused = 0;  // second reports of a step, dropped
  };
  Summary summary() const;

 private:
  struct Interval {
    double loss_sum = 0;  // loss * examples
    int64_t correct = 0, examples = 0, records = 0;
    int64_t pull_us = 0, compute_us = 0, push_us = 0, wait_us = 0;
    int64_t input_us = 0;  // of compute_us
    int64_t staleness_sum = 0, staleness_max = 0;
  };
  void EmitReadyLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The line of interval `in`, ending at `end` after `steps` steps;
  // *interval_s: its duration by the workers' step times.
  ProgressLine MakeLineLocked(int64_t end, const Interval& in, double steps, int live,
                              absl::Time now, double* interval_s) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t train_steps_, steps_per_epoch_;
  const int log_every_;
  const int num_ps_;
  std::function<int()> reachable_ps_;
  std::function<void(const std::string&)> emit_;
  std::function<double(int64_t)> learning_rate_;
  ProgressListener* const listener_;
  // Where the numbers go besides the log (a private registry without one).
  std::unique_ptr<metrics::Registry> own_metrics_;
  struct Gauges {
    metrics::Gauge *loss, *accuracy, *examples_per_sec;
    metrics::Gauge* step_seconds[4];           // pull, compute, push, wait
    metrics::Counter* phase_seconds_total[4];  // the same order
    metrics::Counter* examples_total;
    metrics::Counter* clipped_total;  // psflow_clipped_steps_total
    // Of the compute phase, waiting for input: the latest interval's mean
    // per step, and the sum.
    metrics::Gauge* input_seconds;
    metrics::Counter* input_seconds_total;
    metrics::Gauge *eval_step, *eval_loss, *eval_accuracy;  // the latest evaluation
  } gauges_;
  static Gauges MakeGauges(metrics::Registry* m);

  mutable absl::Mutex mu_;
  std::vector<int64_t> reported_ ABSL_GUARDED_BY(mu_);  // per worker: steps reported (next step)
  std::vector<absl::Time> last_seen_ ABSL_GUARDED_BY(mu_);  // per worker
  std::vector<bool> member_ ABSL_GUARDED_BY(mu_);           // in the live set
  bool asynchronous_ ABSL_GUARDED_BY(mu_) = false;
  bool all_reduce_ ABSL_GUARDED_BY(mu_) = false;
  std::map<int64_t, Interval> intervals_ ABSL_GUARDED_BY(mu_);  // by interval end step
  int64_t logged_until_ ABSL_GUARDED_BY(mu_) = -1;  // end step of the last line, -1 before any
  absl::Time first_report_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_report_ ABSL_GUARDED_BY(mu_);
  int64_t first_step_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t total_examples_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steady_examples_ ABSL_GUARDED_BY(mu_) = 0;
  double steady_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double last_loss_ ABSL_GUARDED_BY(mu_) = 0, last_acc_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t clipped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_line_ ABSL_GUARDED_BY(mu_);      // when the latest line was written
  absl::Duration step_pace_ ABSL_GUARDED_BY(mu_);  // wall time per step, latest interval
};

// "45s", "3m07s", "2h05m": the precision a progress line needs.
std::string ShortDuration(absl::Duration d);

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_PROGRESS_H_
