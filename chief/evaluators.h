// The chief's evaluators (psflow-evaluator): their indices and results
// checked, when each was last heard from, every result logged as an `eval`
// line and handed to the progress log, and, at the end of the job, the wait
// for the evaluation of the final model. The coordinator answers evaluators'
// calls through it, handing in the job's state (JobState); it calls nothing
// back.
//
// Each registration holds a random lease that its reports must carry: a
// report without its index's lease (a forger's, who learnt the job id from
// GetState) is answered REGISTER and neither recorded nor waited for. A
// second registration of an index is refused (UNAVAILABLE) while the lease
// holder is heard from, unless callers are identified by certificate.
//
// Thread-safe. Errors: INVALID_ARGUMENT for an index the cluster lacks or an
// impossible result (nothing recorded).
#ifndef PSFLOW_CHIEF_EVALUATORS_H_
#define PSFLOW_CHIEF_EVALUATORS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "chief/progress.h"
#include "proto/chief.pb.h"

namespace psflow::chief {

// " auc 0.8123" for an evaluation result that has an AUC (a model of two
// classes), else "": what the chief's lines add after the accuracy.
std::string AucText(const EvalResult& r);

struct EvaluatorsOptions {
  // How many the cluster lists; 0: it leaves them out, and then any index
  // below 64 is taken from callers identified by certificate (`identified`),
  // none from others.
  int num_evaluators = 0;
  // Callers present certificates (TLS): the chief's service refuses calls
  // from other roles, and a new registration of an index replaces the old.
  bool identified = false;
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

  // A registration: the response's job_id, lease and when to evaluate, or
  // `done` once the job is over; the caller adds the job and the ps
  // addresses. `lease`: the caller's from its last registration (0: none),
  // which renews it. FAILED_PRECONDITION once the job failed, UNAVAILABLE
  // before it is ready or while another holder of the index is heard from.
  absl::StatusOr<RegisterEvaluatorResponse> Register(int evaluator, const JobState& job,
                                                     uint64_t lease = 0);
  // A heartbeat, with a result or not: the action for the evaluator. A
  // result of another job (reloaded since), or one without the index's
  // lease, is dropped with REGISTER; the final model's is kept
  // (final_result) and answered with EXIT.
  absl::StatusOr<ReportEvalResponse> Report(const ReportEvalRequest& request, const JobState& job);
  // Waits for the final model's evaluation when an evaluator is listed or
  // has registered, as long as one is heard from (options.silence; a
  // registration refused while another held its index counts), at most
  // options.final_wait whatever it hears, and until Cancel; while none has
  // ever registered (one listed but not run), options.unregistered_wait at
  // most.
  void WaitForFinal() ABSL_LOCKS_EXCLUDED(mu_);
  // The chief stops, or the job failed: WaitForFinal returns, now and later.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  // The evaluation of step train_steps, once one came.
  std::optional<EvalResult> final_result() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Status CheckIndex(int evaluator) const;
  // The first few reports dropped for a wrong lease are logged.
  void LogForeignReport(int evaluator) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Holder {
    uint64_t lease = 0;
    absl::Time last_heard;
  };

  const EvaluatorsOptions options_;
  Progress* const progress_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, Holder> holders_ ABSL_GUARDED_BY(mu_);  // by index
  std::optional<EvalResult> final_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;  // impossible results (the first few are logged)
  int64_t foreign_ ABSL_GUARDED_BY(mu_) = 0;  // reports without their lease
  // The latest registration refused while another held its index.
  absl::Time last_applicant_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_EVALUATORS_H_
