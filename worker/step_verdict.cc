#include "worker/step_verdict.h"

namespace psflow::worker {

void StepVerdict::Reset(int parts) {
  absl::MutexLock lock(&mu_);
  missing_ = parts;
  finite_ = true;
}

void StepVerdict::Mark(bool finite) {
  absl::MutexLock lock(&mu_);
  if (missing_ > 0) --missing_;
  finite_ = finite_ && finite;
}

bool StepVerdict::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](StepVerdict* v)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(v->mu_) { return v->missing_ == 0 || !v->finite_; },
      this));
  return finite_;
}

bool StepVerdict::Decided() {
  absl::MutexLock lock(&mu_);
  return missing_ == 0 || !finite_;
}

bool StepVerdict::Failed() {
  absl::MutexLock lock(&mu_);
  return !finite_;
}

}  // namespace psflow::worker
