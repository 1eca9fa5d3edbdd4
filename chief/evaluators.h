// The chief's evaluators (psflow-evaluator): their indices and results
// checked, when each was last heard from, every result logged as an `eval`
// line and handed to the progress log, and, at the end of the job, the wait
// for the evaluation of the final model. The coordinator answers evaluators'
// calls through it, handing in the job's state (JobState); it calls nothing
// back.
//
// Thread-safe. Errors: INVALID_ARGUMENT for an index the cluster lacks or an
// impossible result (nothing recorded).
#ifndef PSFLOW_CHIEF_EVALUATORS_H_
#define PSFLOW_CHIEF_EVALUATORS_H_

#include <cstdint>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "chief/progress.h"
#include "proto/chief.pb.h"

namespace psflow::chief {

struct EvaluatorsOptions {
  // How many the cluster lists; 0: it leaves them out, and any index below
  // 64 is taken.
  int num_evaluators = 0;
  int64_t train_steps = 0;  // the job's: its final model is of this step
  // When to evaluate, handed to each at registration (0 = not by that
  // measure; the final model always).
  int64_t eval_every_steps = 0;
  int64_t eval_every_secs = 60;
  // One not heard from for this long is not waited for (Timeouts::evaluator).
  absl::Duration silence = absl::Seconds(30);
  // While none was ever heard from (listed, not running), the wait is this
  // long at most (Timeouts::unregistered_evaluator).
  absl::Duration unregistered_wait = absl::Seconds(5);
  // The longest wait for the final model's evaluation (Timeouts::final_eval).
  absl::Duration final_wait = absl::Minutes(10);
};

// The job's state, as the coordinator has it, that evaluators' calls are
// answered by.
struct JobState {
  absl::Status failure;  // why the job failed for good; OK while it has not
  bool done = false;     // the job is over
  bool ready = false;    // every ps holds the job
  uint64_t job_id = 0;
};

// Whether an evaluator's result is possible for a job of `train_steps` steps:
// a step in the job, examples in (0, 1e9], 0 <= correct <= examples, a finite
// non-negative loss, a duration in [0, 1 day]. INVALID_ARGUMENT naming the
// first bad field otherwise.
absl::Status CheckEvalResult(const EvalResult& r, int64_t train_steps);

class Evaluators {
 public:
  // `progress` (may be null; not owned) receives every result and must
  // outlive this.
  Evaluators(EvaluatorsOptions options, Progress* progress);
  Evaluators(const Evaluators&) = delete;
  Evaluators& operator=(const Evaluators&) = delete;

  // A registration: the response's job_id and when to evaluate, or `done`
  // once the job is over; the caller adds the job and the ps addresses.
  // FAILED_PRECONDITION once the job failed, UNAVAILABLE before it is ready.
  absl::StatusOr<RegisterEvaluatorResponse> Register(int evaluator, const JobState& job);
  // A heartbeat, with a result or not: the action for the evaluator. A
  // result of another job (reloaded since) is dropped with REGISTER; the
  // final model's is kept (final_result) and answered with EXIT.
  absl::StatusOr<ReportEvalResponse> Report(const ReportEvalRequest& request, const JobState& job);
  // Waits for the final model's evaluation when an evaluator is listed or
  // has called, as long as one is heard from (options.silence), at most
  // options.final_wait, and until Cancel; while none has ever called (one
  // listed but not run), options.unregistered_wait at most.
  void WaitForFinal() ABSL_LOCKS_EXCLUDED(mu_);
  // The chief stops, or the job failed: WaitForFinal returns, now and later.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  // The evaluation of step train_steps, once one came.
  std::optional<EvalResult> final_result() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Status CheckIndex(int evaluator) const;

  const EvaluatorsOptions options_;
  Progress* const progress_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, absl::Time> last_heard_ ABSL_GUARDED_BY(mu_);
  std::optional<EvalResult> final_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;  // impossible results (the first few are logged)
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_EVALUATORS_H_
