#include "chief/progress.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace psflow::chief {
namespace {

// A progress line's text (see progress.h); `all_reduce` names the replica
// where the ps would be.
std::string LineText(const ProgressLine& line, bool all_reduce, absl::Duration elapsed,
                     absl::Duration eta) {
  const std::string lr =
      line.learning_rate ? absl::StrFormat(" lr %.4g", *line.learning_rate) : std::string();
  const std::string staleness = line.staleness_mean
                                    ? absl::StrFormat(" | staleness mean %.1f max %d",
                                                      *line.staleness_mean, line.staleness_max)
                                    : std::string();
  return absl::StrFormat(
      "step %d/%d epoch %.2f loss %.4f acc %.3f%s | %.0f ex/s | step %.1f ms (pull %.1f compute "
      "%.1f push %.1f wait %.1f) | workers %d/%d %s %d/%d%s | elapsed %s eta %s",
      line.step, line.train_steps, line.epoch, line.loss, line.accuracy, lr, line.examples_per_sec,
      line.step_ms, line.pull_ms, line.compute_ms, line.push_ms, line.wait_ms, line.live_workers,
      line.num_workers, all_reduce ? "replica" : "ps", line.live_ps, line.num_ps, staleness,
      ShortDuration(elapsed), ShortDuration(eta));
}

}  // namespace

Progress::Progress(int64_t train_steps, int64_t steps_per_epoch, int log_every_steps,
                   int num_workers, int num_ps, std::function<int()> reachable_ps,
                   std::function<void(const std::string&)> emit,
                   std::function<double(int64_t)> learning_rate, ProgressListener* listener,
                   metrics::Registry* metrics)
    : train_steps_(train_steps),
      steps_per_epoch_(std::max<int64_t>(steps_per_epoch, 1)),
      log_every_(std::max(log_every_steps, 1)),
      num_ps_(num_ps),
      reachable_ps_(std::move(reachable_ps)),
      emit_(std::move(emit)),
      learning_rate_(std::move(learning_rate)),
      listener_(listener),
      reported_(num_workers, 0),
      last_seen_(num_workers, absl::InfinitePast()),
      member_(num_workers, true) {
  metrics::Registry* m = metrics::Registry::OrPrivate(metrics, own_metrics_);
  gauges_ = MakeGauges(m);
  gauges_.eval_step->Set(-1);
  gauges_.eval_loss->Set(std::numeric_limits<double>::quiet_NaN());
  gauges_.eval_accuracy->Set(std::numeric_limits<double>::quiet_NaN());
  m->GetGauge("psflow_workers", "Workers in the job.")->Set(num_workers);
  m->GetGauge("psflow_ps", "Parameter servers in the job.")->Set(num_ps);
  m->SetGaugeFunction(
      "psflow_live_workers",
      "Workers the synchronous steps wait for that reported within the last 10 seconds.", [this] {
        absl::MutexLock lock(&mu_);
        const absl::Time now = absl::Now();
        int live = 0;
        for (size_t w = 0; w < member_.size(); ++w)
          live += member_[w] && now - last_seen_[w] <= kLiveWindow;
        return static_cast<double>(live);
      });
  m->SetGaugeFunction("psflow_live_ps", "Parameter servers whose connection is up.", [this] {
    return static_cast<double>(reachable_ps_ ? reachable_ps_() : num_ps_);
  });
}

Progress::Gauges Progress::MakeGauges(metrics::Registry* m) {
  Gauges g;
  g.loss = m->GetGauge("psflow_loss", "Mean training loss of the latest logged interval.");
  g.accuracy = m->GetGauge("psflow_accuracy", "Training accuracy of the latest logged interval.");
  g.examples_per_sec = m->GetGauge(
      "psflow_examples_per_second",
      "Examples per second of the latest logged interval, from the workers' step times.");
  const char* phases[4] = {"pull", "compute", "push", "wait"};
  for (int i = 0; i < 4; ++i) {
    g.step_seconds[i] = m->GetGauge(
        "psflow_step_seconds",
        "Workers' mean time per step in each phase (pull, compute, push, wait) over the latest "
        "logged interval.",
        {{"phase", phases[i]}});
    g.phase_seconds_total[i] = m->GetCounter(
        "psflow_step_phase_seconds_total",
        "Workers' time in each phase of their steps, summed over every reported step.",
        {{"phase", phases[i]}});
  }
  g.input_seconds = m->GetGauge(
      "psflow_step_input_seconds",
      "Of the compute phase, the workers' mean time per step waiting for their batch of input "
      "over the latest logged interval: near the compute time, the input is the bottleneck.");
  g.input_seconds_total = m->GetCounter(
      "psflow_input_wait_seconds_total",
      "Workers' time waiting for their batches of input, summed over every reported step.");
  g.clipped_total = m->GetCounter(
      "psflow_clipped_steps_total",
      "Workers' steps whose gradients were clipped to --clip_gradient_norm (one per worker and "
      "step).");
  g.examples_total = m->GetCounter("psflow_examples_total",
                                   "Training examples of every step the workers reported.");
  // NaN (and step -1) until an evaluator's first result.
  g.eval_step = m->GetGauge(
      "psflow_eval_step",
      "Step (version) of the weights of the latest evaluation the chief logged; -1 before any.");
  g.eval_loss =
      m->GetGauge("psflow_eval_loss",
                  "Test-split loss of the latest evaluation the chief logged (NaN before).");
  g.eval_accuracy =
      m->GetGauge("psflow_eval_accuracy",
                  "Test-split accuracy of the latest evaluation the chief logged (NaN before).");
  return g;
}

void Progress::SetAllReduce(bool all_reduce) {
  absl::MutexLock lock(&mu_);
  all_reduce_ = all_reduce;
}

void Progress::SetAsynchronous(bool asynchronous) {
  absl::MutexLock lock(&mu_);
  asynchronous_ = asynchronous;
}

void Progress::Finished(int worker) {
  absl::MutexLock lock(&mu_);
  if (worker < 0 || worker >= static_cast<int>(reported_.size())) return;
  reported_[worker] = train_steps_;
  EmitReadyLocked(absl::Now());
}

void Progress::SetLiveWorkers(const std::vector<int>& live) {
  absl::MutexLock lock(&mu_);
  std::fill(member_.begin(), member_.end(), false);
  for (int w : live) {
    if (w >= 0 && w < static_cast<int>(member_.size())) member_[w] = true;
  }
}

absl::Status CheckStepMetrics(const StepMetrics& m, int64_t train_steps, int batch_size) {
  constexpr int64_t kHourUs = int64_t{3600} * 1000 * 1000;
  if (m.step() < 0 || m.step() >= train_steps) {
    return absl::InvalidArgumentError(absl::StrCat("step ", m.step(), " is not in the job"));
  }
  if (m.examples() <= 0 || m.examples() > batch_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("examples ", m.examples(), " is not in [1, ", batch_size, "]"));
  }
  if (m.correct() < 0 || m.correct() > m.examples()) {
    return absl::InvalidArgumentError(
        absl::StrCat("correct ", m.correct(), " is not in [0, ", m.examples(), "]"));
  }
  for (int64_t us : {m.pull_us(), m.compute_us(), m.push_us(), m.wait_us(), m.input_us()}) {
    if (us < 0 || us > kHourUs)
      return absl::InvalidArgumentError(absl::StrCat("a step time of ", us, " us"));
  }
  if (m.staleness() < 0 || m.staleness() > train_steps) {
    return absl::InvalidArgumentError(absl::StrCat("a staleness of ", m.staleness()));
  }
  if (!m.nonfinite() && !(std::isfinite(m.loss()) && m.loss() >= 0)) {
    return absl::InvalidArgumentError(
        "a loss that is negative or not finite, not flagged nonfinite");
  }
  return absl::OkStatus();
}

void Progress::Rejoin(int worker, int64_t step) {
  absl::MutexLock lock(&mu_);
  if (worker < 0 || worker >= static_cast<int>(reported_.size())) return;
  reported_[worker] = std::max(reported_[worker], step);
}

void Progress::Restart(int64_t step) {
  absl::MutexLock lock(&mu_);
  intervals_.clear();
  std::fill(reported_.begin(), reported_.end(), step);
  if (step > 0 || logged_until_ >= 0) logged_until_ = step;
  if (listener_ != nullptr) listener_->OnRestart(step);
}

void Progress::Eval(int64_t step, double loss, double accuracy) {
  absl::MutexLock lock(&mu_);
  gauges_.eval_step->Set(static_cast<double>(step));
  gauges_.eval_loss->Set(loss);
  gauges_.eval_accuracy->Set(accuracy);
  if (listener_ != nullptr) listener_->OnEval(step, loss, accuracy);
}

void Progress::Record(int worker, const std::vector<StepMetrics>& metrics, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (worker < 0 || worker >= static_cast<int>(reported_.size())) return;
  last_seen_[worker] = now;
  for (const StepMetrics& m : metrics) {
    // A worker reports each step once, in order: a second report of a step
    // (or of one before its rejoin) is not the worker's.
    if (m.step() < reported_[worker]) {
      ++refused_;
      continue;
    }
    if (m.nonfinite()) {
      // Nothing of it was applied (a skipped step): it still counts as
      // reported, so that the interval's line is not held for it.
      if (m.step() >= 0 && m.step() < train_steps_)
        reported_[worker] = std::max(reported_[worker], m.step() + 1);
      continue;
    }
    // Steps outside the job, or of an interval already logged (a late report), are dropped.
    if (m.step() < 0 || m.step() >= train_steps_ || m.step() < logged_until_) continue;
    if (first_report_ == absl::InfinitePast()) {
      first_report_ = now;
      first_step_ = m.step();
    }
    last_report_ = now;
    // Step s (0-based) belongs to the interval ending at the next multiple of
    // log_every (or at the last step).
    int64_t end = std::min<int64_t>((m.step() / log_every_ + 1) * log_every_, train_steps_);
    Interval& in = intervals_[end];
    in.loss_sum += m.loss() * static_cast<double>(m.examples());
    in.correct += m.correct();
    in.examples += m.examples();
    in.records += 1;
    in.pull_us += m.pull_us();
    in.compute_us += m.compute_us();
    in.push_us += m.push_us();
    in.wait_us += m.wait_us();
    in.input_us += m.input_us();
    gauges_.input_seconds_total->Add(m.input_us() / 1e6);
    in.staleness_sum += m.staleness();
    in.staleness_max = std::max(in.staleness_max, m.staleness());
    total_examples_ += m.examples();
    if (m.clipped()) {
      ++clipped_;
      gauges_.clipped_total->Add(1);
    }
    gauges_.examples_total->Add(static_cast<double>(m.examples()));
    const int64_t phase_us[4] = {m.pull_us(), m.compute_us(), m.push_us(), m.wait_us()};
    for (int i = 0; i < 4; ++i) gauges_.phase_seconds_total[i]->Add(phase_us[i] / 1e6);
    reported_[worker] = std::max(reported_[worker], m.step() + 1);
  }
  EmitReadyLocked(now);
}

void Progress::EmitReadyLocked(absl::Time now) {
  // A line waits for every live worker (synchronous steps move together).
  int64_t done = train_steps_;
  int live = 0;
  for (size_t w = 0; w < reported_.size(); ++w) {
    if (!member_[w]) continue;
    done = std::min(done, reported_[w]);
    if (now - last_seen_[w] <= kLiveWindow) ++live;
  }
  while (!intervals_.empty() && intervals_.begin()->first <= done) {
    auto it = intervals_.begin();
    const int64_t end = it->first;
    const Interval& in = it->second;
    const int64_t begin = logged_until_ < 0 ? std::max<int64_t>(first_step_, 0) : logged_until_;
    const double steps = static_cast<double>(std::max<int64_t>(end - begin, 1));
    double interval_s = 0;
    const ProgressLine line = MakeLineLocked(end, in, steps, live, now, &interval_s);
    // The wall-clock pace of this interval (lines that come out together
    // keep the previous pace).
    const absl::Time since = logged_until_ < 0 ? first_report_ : last_line_;
    if (now > since) step_pace_ = (now - since) / steps;
    const absl::Duration eta = step_pace_ * static_cast<double>(train_steps_ - end);
    emit_(LineText(line, all_reduce_, now - first_report_, eta));
    if (listener_ != nullptr) listener_->OnLine(line);
    last_line_ = now;
    gauges_.loss->Set(line.loss);
    gauges_.accuracy->Set(line.accuracy);
    gauges_.examples_per_sec->Set(line.examples_per_sec);
    const double phase_ms[4] = {line.pull_ms, line.compute_ms, line.push_ms, line.wait_ms};
    for (int i = 0; i < 4; ++i) gauges_.step_seconds[i]->Set(phase_ms[i] / 1000.0);
    gauges_.input_seconds->Set(line.input_ms / 1000.0);
    if (logged_until_ >= 0) {  // the first interval holds start-up; leave it out of the mean
      steady_examples_ += in.examples;
      steady_seconds_ += interval_s;
    }
    last_loss_ = line.loss;
    last_acc_ = line.accuracy;
    logged_until_ = end;
    intervals_.erase(it);
  }
}

ProgressLine Progress::MakeLineLocked(int64_t end, const Interval& in, double steps, int live,
                                      absl::Time now, double* interval_s) const {
  const double n = static_cast<double>(std::max<int64_t>(in.records, 1));
  ProgressLine line;
  line.step = end;
  line.train_steps = train_steps_;
  line.epoch = static_cast<double>(end) / static_cast<double>(steps_per_epoch_);
  line.loss = in.examples > 0 ? in.loss_sum / static_cast<double>(in.examples) : 0;
  line.accuracy =
      in.examples > 0 ? static_cast<double>(in.correct) / static_cast<double>(in.examples) : 0;
  if (learning_rate_) line.learning_rate = learning_rate_(end - 1);
  // Rates come from the workers' own step times, not from when reports
  // happen to arrive here: a step takes as long as its slowest phase chain
  // on a worker, and all workers of a synchronous step move together.
  line.pull_ms = in.pull_us / n / 1000.0;
  line.compute_ms = in.compute_us / n / 1000.0;
  line.push_ms = in.push_us / n / 1000.0;
  line.wait_ms = in.wait_us / n / 1000.0;
  line.input_ms = in.input_us / n / 1000.0;
  line.step_ms = (in.pull_us + in.compute_us + in.push_us + in.wait_us) / n / 1000.0;
  int members = 0;
  for (bool m : member_) members += m;
  // Asynchronous workers do not move together: each goes at its own pace.
  *interval_s = asynchronous_ ? n * line.step_ms / 1000.0 / std::max(members, 1)
                              : steps * line.step_ms / 1000.0;
  line.examples_per_sec = line.step_ms > 0 ? static_cast<double>(in.examples) / *interval_s : 0;
  if (asynchronous_) {
    line.staleness_mean = static_cast<double>(in.staleness_sum) / n;
    line.staleness_max = in.staleness_max;
  }
  line.live_workers = live;
  line.num_workers = static_cast<int>(reported_.size());
  line.live_ps = reachable_ps_ ? reachable_ps_() : num_ps_;
  line.num_ps = num_ps_;
  line.time = now;
  return line;
}

std::string ShortDuration(absl::Duration d) {
  const int64_t s = std::max<int64_t>(absl::ToInt64Seconds(d + absl::Milliseconds(500)), 0);
  if (s < 60) return absl::StrFormat("%ds", s);
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

Progress::Summary Progress::summary() const {
  absl::MutexLock lock(&mu_);
  Summary s;
  s.steps = logged_until_ < 0 ? 0 : logged_until_;
  s.examples = total_examples_;
  s.elapsed =
      first_report_ == absl::InfinitePast() ? absl::ZeroDuration() : last_report_ - first_report_;
  s.examples_per_sec =
      steady_seconds_ > 0 ? static_cast<double>(steady_examples_) / steady_seconds_ : 0;
  s.last_loss = last_loss_;
  s.last_accuracy = last_acc_;
  s.clipped = clipped_;
  s.refused = refused_;
  return s;
}

}  // namespace psflow::chief
