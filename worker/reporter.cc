#include "worker/reporter.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/log.h"

namespace psflow::worker {

Reporter::Reporter(ReporterOptions options, chief::Client* chief,
                   std::function<void()> on_job_failed)
    : options_(options), chief_(chief), on_job_failed_(std::move(on_job_failed)) {}

void Reporter::Loop() {
  absl::Time last_ok = absl::Now();
  while (true) {
    ReportRequest request;
    request.set_worker(options_.worker_index);
    {
      absl::MutexLock lock(&mu_);
      if (released_ || job_failed_ || stopped_ || !report_error_.ok() || training_failed_) return;
      // Wake early once the last step is done, so the exit order arrives promptly.
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return finished_ || nonfinite_ || stopped_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), options_.report_every);
      // The job the metrics belong to: a registration changes both under mu_.
      request.set_job_id(job_id_);
      for (StepMetrics& m : pending_) *request.add_metrics() = std::move(m);
      pending_.clear();
      nonfinite_ = false;  // woken once for it; it travels with this report
      request.set_finished(finished_);
    }
    absl::StatusOr<ReportResponse> response =
        chief_->Report(request, absl::Now() + options_.report_timeout);
    bool failed_now = false;
    {
      absl::MutexLock lock(&mu_);
      const bool failed_before = job_failed_;
      Answered(request, response, &last_ok);
      failed_now = job_failed_ && !failed_before;
    }
    // A pull waiting for the failed step ends now.
    if (failed_now && on_job_failed_) on_job_failed_();
  }
}

void Reporter::Answered(const ReportRequest& request,
                        const absl::StatusOr<ReportResponse>& response, absl::Time* last_ok) {
  if (response.ok()) {
    *last_ok = absl::Now();
    if (response->action() == ReportResponse::EXIT) released_ = true;
    if (response->action() == ReportResponse::REGISTER) reregister_ = true;
    if (response->action() == ReportResponse::FAIL) job_failed_ = true;
    return;
  }
  // Metrics of a failed report are dropped (the log is best effort), but
  // not a non-finite step: the chief must hear of that one.
  for (const StepMetrics& m : request.metrics()) {
    if (m.nonfinite()) pending_.push_back(m);
  }
  if (stopped_) return;
  const absl::Status& s = response.status();
  if (absl::IsInvalidArgument(s)) {
    // The chief refused these metrics (values it finds impossible); the
    // heartbeat goes on with the next report.
    PSLOG(WARNING) << "the chief refused a report: " << s.message() << " ("
                   << absl::StatusCodeToString(s.code()) << ")";
    return;
  }
  if (!IsRetryable(s)) {
    report_error_ =
        absl::InternalError(absl::StrCat("cannot report to the chief: ", s.message(), " (",
                                         absl::StatusCodeToString(s.code()), ")"));
  } else if (absl::Now() - *last_ok > options_.startup_timeout) {
    report_error_ =
        absl::Status(s.code(), absl::StrCat("cannot report to the chief: ", s.message()));
  }
}

void Reporter::Registered(uint64_t job_id) {
  absl::MutexLock lock(&mu_);
  if (job_id_ != job_id) pending_.clear();
  job_id_ = job_id;
  reregister_ = false;
}

void Reporter::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

void Reporter::EndLoop() {
  absl::MutexLock lock(&mu_);
  training_failed_ = true;
}

void Reporter::Add(StepMetrics metrics) {
  absl::MutexLock lock(&mu_);
  pending_.push_back(std::move(metrics));
}

void Reporter::SetStep(int64_t step) {
  absl::MutexLock lock(&mu_);
  step_ = step;
}

void Reporter::NonFinite(StepMetrics metrics) {
  absl::MutexLock lock(&mu_);
  pending_.push_back(std::move(metrics));
  nonfinite_ = true;
  // The job's policy is to fail: wait (a little) for the chief to confirm.
  auto told = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return job_failed_ || stopped_ || !report_error_.ok();
  };
  mu_.AwaitWithTimeout(absl::Condition(&told), options_.nonfinite_wait);
}

Reporter::Order Reporter::FinishAndWait() {
  absl::MutexLock lock(&mu_);
  finished_ = true;
  PSLOG(INFO) << "reached the last step; waiting for the chief's exit order";
  auto over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return released_ || job_failed_ || stopped_ || !report_error_.ok() || reregister_;
  };
  mu_.Await(absl::Condition(&over));
  if (released_ || job_failed_) return Order::kExit;
  if (stopped_) return Order::kStopped;
  if (!report_error_.ok()) return Order::kReportFailed;
  finished_ = false;  // the chief went back to a checkpoint: train on
  return Order::kRegisterAgain;
}

bool Reporter::job_failed() const {
  absl::MutexLock lock(&mu_);
  return job_failed_;
}

bool Reporter::reregister() const {
  absl::MutexLock lock(&mu_);
  return reregister_;
}

absl::Status Reporter::report_error() const {
  absl::MutexLock lock(&mu_);
  return report_error_;
}

int64_t Reporter::step() const {
  absl::MutexLock lock(&mu_);
  return step_;
}

bool Reporter::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

}  // namespace psflow::worker
