// Whether one step's gradients are all finite, when several threads decide
// it together: a worker that pushes while its backward pass runs lets each
// lane check its own gradients (and push them if finite) as soon as they
// exist, and the training thread check the step's loss. A lane pulls the next
// weights only once every part is known to be finite. Thread-safe.
#ifndef PSFLOW_WORKER_STEP_VERDICT_H_
#define PSFLOW_WORKER_STEP_VERDICT_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace psflow::worker {

class StepVerdict {
 public:
  // A new step, whose verdict takes `parts` calls of Mark.
  void Reset(int parts) ABSL_LOCKS_EXCLUDED(mu_);
  // One part's finding: whether what it checked was finite.
  void Mark(bool finite) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until every part is marked (true: all finite) or one part was
  // not finite (false, without waiting for the rest).
  bool Wait() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a part was found not finite already (does not wait).
  bool Failed() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether Wait would return at once (does not wait).
  bool Decided() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  int missing_ ABSL_GUARDED_BY(mu_) = 0;
  bool finite_ ABSL_GUARDED_BY(mu_) = true;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_STEP_VERDICT_H_
