// A worker's reports to the chief: the metrics of its steps, sent at least
// every report_every by Loop (the reports are also its heartbeat), and what
// the chief answers (EXIT, REGISTER, FAIL). It also holds what the status
// service shows of the worker's progress (its step, whether it finished).
//
// Thread-safety: Loop runs on a thread of its own; every other method may be
// called from any thread. `chief` is not owned and outlives the reporter.
// Errors: a report that fails for good (not retryable, or the chief stayed
// unreachable for startup_timeout) ends the loop; report_error() tells it.
#ifndef PSFLOW_WORKER_REPORTER_H_
#define PSFLOW_WORKER_REPORTER_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "chief/client.h"
#include "proto/chief.pb.h"

namespace psflow::worker {

struct ReporterOptions {
  int worker_index = 0;
  // Reports go to the chief at least this often.
  absl::Duration report_every = absl::Milliseconds(250);
  // The deadline of one report call.
  absl::Duration report_timeout = absl::Seconds(10);
  // How long the chief may stay unreachable before reporting fails for good.
  absl::Duration startup_timeout = absl::Minutes(5);
  // After a step that was not finite, how long NonFinite waits for the
  // chief to confirm that the job failed.
  absl::Duration nonfinite_wait = absl::Seconds(30);
};

class Reporter {
 public:
  // `on_job_failed` (if set) runs on the loop's thread, outside the
  // reporter's lock, once the chief answered FAIL.
  Reporter(ReporterOptions options, chief::Client* chief, std::function<void()> on_job_failed);

  // Sends reports until the chief says EXIT or FAIL, Stop, EndLoop, or
  // reporting fails for good.
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // A registration with job `job_id`: metrics not yet reported of another
  // job are dropped (its steps are done again), and a REGISTER answer is
  // forgotten.
  void Registered(uint64_t job_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes every wait and ends the loop (a stop signal).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Training failed: the loop ends.
  void EndLoop() ABSL_LOCKS_EXCLUDED(mu_);

  // A step's metrics, for the next report.
  void Add(StepMetrics metrics) ABSL_LOCKS_EXCLUDED(mu_);
  // The step being computed (TrainerStatus::step).
  void SetStep(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  // Reports `metrics` (of a step that was not finite) at once and waits at
  // most nonfinite_wait for the chief's FAIL (or a stop, or a failed report).
  void NonFinite(StepMetrics metrics) ABSL_LOCKS_EXCLUDED(mu_);

  // After the last step: reports `finished` and waits for the chief's order.
  enum class Order { kExit, kStopped, kReportFailed, kRegisterAgain };
  // kExit: EXIT or FAIL (job_failed() tells them apart). kRegisterAgain:
  // the chief went back to a checkpoint (no longer finished).
  Order FinishAndWait() ABSL_LOCKS_EXCLUDED(mu_);

  bool job_failed() const ABSL_LOCKS_EXCLUDED(mu_);
  bool reregister() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status report_error() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t step() const ABSL_LOCKS_EXCLUDED(mu_);
  bool finished() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Takes the chief's answer to a report (or its failure).
  void Answered(const ReportRequest& request, const absl::StatusOr<ReportResponse>& response,
                absl::Time* last_ok) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ReporterOptions options_;
  chief::Client* const chief_;
  const std::function<void()> on_job_failed_;

  mutable absl::Mutex mu_;
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;               // the metrics' job
  std::vector<StepMetrics> pending_ ABSL_GUARDED_BY(mu_);  // not yet reported
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;          // Stop
  bool finished_ ABSL_GUARDED_BY(mu_) = false;         // saw the final version
  bool released_ ABSL_GUARDED_BY(mu_) = false;         // the chief said exit
  absl::Status report_error_ ABSL_GUARDED_BY(mu_);     // reporting failed for good
  bool training_failed_ ABSL_GUARDED_BY(mu_) = false;  // ends the loop
  bool reregister_ ABSL_GUARDED_BY(mu_) = false;       // the chief asked for a new registration
  bool nonfinite_ ABSL_GUARDED_BY(mu_) = false;        // a step was not finite: report it at once
  bool job_failed_ ABSL_GUARDED_BY(mu_) = false;       // the chief said the job failed
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_REPORTER_H_
