// What the chief holds workers' reports against: its latest look at the ps
// (their highest version and, by worker, the latest step every ps received
// whole from it), and the reports that a step was not finite still waiting
// for the ps to bear them out. Anyone who learnt the job id can send a
// report; only what the ps saw is evidence.
//
// Thread-safe; its lock is a leaf (nothing is called under it but logging).
#ifndef PSFLOW_CHIEF_PS_WITNESS_H_
#define PSFLOW_CHIEF_PS_WITNESS_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/ps.pb.h"

namespace psflow::chief {

class PsWitness {
 public:
  // `asynchronous`: the job applies each gradient alone (a step is the
  // version its worker read, not one the ps count per worker).
  explicit PsWitness(bool asynchronous) : asynchronous_(asynchronous) {}

  // Takes a look at every ps (one job's states, in ps order). Looks that
  // overlap may end out of order: within a job each ps's figures only grow,
  // so the larger view stays. States of different jobs are no view.
  void Observe(const std::vector<PsState>& states) ABSL_LOCKS_EXCLUDED(mu_);

  // Whether the last look is of job `job_id` and some ps reached `step`.
  bool Reached(uint64_t job_id, int64_t step) const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the last look shows worker `w`'s step `step` in job `job_id`:
  // every ps has its gradients of it (an asynchronous job: a ps reached
  // that version).
  bool HasStep(uint64_t job_id, int w, int64_t step) const ABSL_LOCKS_EXCLUDED(mu_);

  // A report that worker `w`'s step `step` of job `job_id` was not finite.
  // kKnown: already waiting; kRefuted: the last look refutes it (no ps is
  // at the step, or every ps has the worker's gradients of it; logged and
  // counted); kWaiting: held until Resolve settles it (logged).
  enum class ClaimVerdict { kKnown, kRefuted, kWaiting };
  ClaimVerdict Claim(uint64_t job_id, int w, int64_t step, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  struct Confirmed {
    int worker = 0;
    int64_t step = 0;
  };
  // Settles the waiting claims against `states` (of job `job_id`): a claim
  // of another job is dropped; one whose step no ps reached, or whose
  // gradients every ps has, is refuted (logged, counted); one a ps still
  // lacks the gradients of after `wait` is confirmed and returned.
  std::vector<Confirmed> Resolve(uint64_t job_id, const std::vector<PsState>& states,
                                 absl::Time now, absl::Duration wait) ABSL_LOCKS_EXCLUDED(mu_);

  // Counts worker `w`'s metrics of step `step` refused for want of the ps's
  // evidence, logging the first ten and then every thousandth.
  void RefuseMetrics(int w, int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct View {
    uint64_t job_id = 0;
    int64_t max_version = -1;
    std::vector<int64_t> pushed;  // by worker (PsState.pushed_steps; synchronous jobs)
  };
  struct Waiting {
    uint64_t job_id = 0;
    int worker = 0;
    int64_t step = 0;
    absl::Time since;
  };
  bool HasStepLocked(uint64_t job_id, int w, int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void LogRefutedLocked(int w, int64_t step, const char* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const bool asynchronous_;
  mutable absl::Mutex mu_;
  View view_ ABSL_GUARDED_BY(mu_);
  std::vector<Waiting> waiting_ ABSL_GUARDED_BY(mu_);
  int64_t refuted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_metrics_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_PS_WITNESS_H_
