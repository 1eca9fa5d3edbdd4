// When psflow-ps stops, and why: the job is over (the chief's Shutdown), or
// a termination signal came; after a first signal a ps that holds a job
// serves on until the chief says its checkpoint was taken (CheckpointTaken)
// and the pushes in progress then have ended, for at most a grace period.
// Thread-safe: Request, Signal and CheckpointTaken from any thread, while
// one thread blocks in Wait.
#ifndef PSFLOW_PS_STOP_STATE_H_
#define PSFLOW_PS_STOP_STATE_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ps/service.h"
#include "ps/shard.h"

namespace psflow::ps {

class StopState {
 public:
  // The job is over, or a second signal: stop now.
  void Request();
  // A signal: the first is noted, a second stops now. Returns whether it
  // was the first.
  bool Signal(int sig);
  void CheckpointTaken();
  // Blocks until the ps should stop: at once when the job is over or on a
  // second signal. After the first signal, if `shard` holds a job (and
  // `grace` is not zero): once the chief said its checkpoint was taken
  // (since `grace` before the signal; `service` says meanwhile that the ps
  // is stopping) and the pushes in progress then have ended (the workers'
  // steps in flight), or `grace` after the signal; otherwise at once. Logs
  // what it waits for and why the wait ended.
  void Wait(absl::Duration grace, const Shard& shard, PsService& service);

 private:
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int signal_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time signalled_at_ ABSL_GUARDED_BY(mu_);
  absl::Time taken_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_STOP_STATE_H_
