#include "ps/stop_state.h"

#include <cstdint>

#include "common/log.h"

namespace psflow::ps {

void StopState::Request() {
  absl::MutexLock lock(&mu_);
  stop_ = true;
}

bool StopState::Signal(int sig) {
  absl::MutexLock lock(&mu_);
  if (signal_ != 0) {
    stop_ = true;
    return false;
  }
  signal_ = sig;
  signalled_at_ = absl::Now();
  return true;
}

void StopState::CheckpointTaken() {
  absl::MutexLock lock(&mu_);
  taken_at_ = absl::Now();
}

void StopState::Wait(absl::Duration grace, const Shard& shard, PsService& service) {
  absl::MutexLock lock(&mu_);
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || signal_ != 0; };
  mu_.Await(absl::Condition(&stopping));
  if (stop_) return;
  auto taken = [this, grace]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return taken_at_ >= signalled_at_ - grace;
  };
  if (grace <= absl::ZeroDuration() || !shard.state().has_job) {
    PSLOG(INFO) << "signal " << signal_ << ": finishing in-flight calls and exiting";
    return;
  }
  const absl::Time until = signalled_at_ + grace;
  if (taken()) {
    PSLOG(INFO) << "signal " << signal_ << ": the chief took its checkpoint "
                << absl::FormatDuration(
                       absl::Trunc(signalled_at_ - taken_at_, absl::Milliseconds(1)))
                << " before it; exiting once the pushes in progress end";
  } else {
    service.SetStopping();
    PSLOG(INFO) << "signal " << signal_ << ": serving on until the chief has taken a "
                << "checkpoint, for at most " << absl::FormatDuration(grace)
                << " (a second signal: exit now)";
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || taken(); };
    mu_.AwaitWithDeadline(absl::Condition(&done), until);
    if (!taken()) {
      if (!stop_) {
        PSLOG(WARNING) << "no word from the chief within " << absl::FormatDuration(grace)
                       << ": finishing in-flight calls and exiting";
      }
      return;
    }
    PSLOG(INFO) << "the chief has taken its checkpoint: exiting once the pushes in progress "
                   "end";
  }
  // Workers that are stopping too stop once their step's pushes are
  // answered: let those end, rather than fail them (each would wait for
  // this ps to come back). Pushes that start later are not waited for
  // (workers that go on training).
  const int64_t in_progress = service.pushes_admitted();
  while (!stop_ && service.pushes_open_up_to(in_progress) && absl::Now() < until) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(5));
  }
  if (!stop_ && service.pushes_open_up_to(in_progress)) {
    PSLOG(WARNING) << "pushes still in progress after " << absl::FormatDuration(grace)
                   << ": exiting";
  }
}

}  // namespace psflow::ps
