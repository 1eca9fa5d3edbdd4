// How a worker's synchronous step meets the other workers': the weights of
// step k come in (Pull), the step's gradients go out and the weights of
// step k+1 come back (PushStep), with hooks around the step's compute for
// an exchange that overlaps it, and Finish when the loop ends. One
// implementation per strategy: through the ps in lanes
// (worker/ps_exchange.h), the host ring all-reduce in front of a replica in
// this process (worker/ring_exchange.h), and a GPU worker's replica on the
// device, averaged over NCCL (worker/device_replica.h). The trainer's step
// loop (worker/trainer.cc) does not know which one runs.
//
// Thread-safety: one step at a time, from the training thread; an
// implementation may run its work on threads of its own in between.
// Errors: absl::Status; a ps's own cancellation of a call comes back as
// UNAVAILABLE (FromPs), a stop as CANCELLED.
#ifndef PSFLOW_WORKER_EXCHANGE_H_
#define PSFLOW_WORKER_EXCHANGE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace psflow::worker {

// What the exchange asks of the worker that runs it. Every function is set
// and may be called from any thread.
struct ExchangeHooks {
  std::function<int()> stop_signal;    // 0 until Stop
  std::function<bool()> stopping;      // Stop, or the chief failed the job
  std::function<bool()> stop_pending;  // a StopAfterPushes waits for the pushes
  // A step's pushes start, and end (all answered, or given up).
  std::function<void()> open_pushes, close_pushes;
};

// A ps call's status, with a cancellation this worker did not make
// (`stopping` false: a ps shutting down cancels the calls it serves) turned
// into UNAVAILABLE: a ps going away, worth a retry.
absl::Status FromPs(const absl::Status& s, bool stopping);

// What a round of pulls gives the step that follows.
struct ExchangeRound {
  int64_t version = 0;  // the lowest of the ps's
  int64_t wait_us = 0;  // the longest wait for a version, of any lane
  // Asynchronous jobs: this worker's clock (the lowest of the ps's) and the
  // staleness of its latest gradient (the highest of the ps's).
  int64_t clock = 0;
  int64_t lag = 0;
};

// Runs once every push of a step was answered (on whichever thread saw the
// last answer), with the time of the last answer and whether the step was
// skipped (not finite, with JobConfig.on_nonfinite SKIP_STEP); not at all
// if a push failed.
using OnPushed = std::function<void(absl::Time last_answer, bool skipped)>;

// One step's exchange: the gradients of `push_step`, then the weights of
// `min_version` (in an asynchronous job this worker's clock and the next).
struct StepPush {
  int64_t step = 0;  // for messages
  int64_t push_step = 0;
  int64_t min_version = 0;
  double loss = 0;      // this worker's
  float mean_loss = 0;  // after Reduce: the group's mean (else the loss)
  OnPushed on_pushed;   // may be empty
};

// What PushStep found of the step's gradients.
enum class StepVerdictKind {
  kFinite,
  kSkipped,  // not finite; skipped (pushed as a skip)
  // Not finite: nothing was pushed.
  kNotFinite,
  // Not finite, found while pushing during the backward pass: lanes of
  // finite gradients may have pushed them.
  kNotFiniteAfterPushes,
  // The group's mean loss or mean gradients are not finite: nothing
  // applied (a replica on the device).
  kNotFiniteMean,
  // Pushing during the backward pass, a stop or the chief's FAIL ended the
  // lanes before the verdict (ExchangeHooks::stopping): not judged.
  kInterrupted,
};

class Exchange {
 public:
  virtual ~Exchange() = default;

  // Pulls the weights of min_version (no push).
  virtual absl::Status Pull(int64_t min_version, ExchangeRound* out) = 0;
  // The step is about to be computed: an exchange that overlaps it starts
  // now (`push` as for PushStep, its losses not yet known; `out` is written
  // by PushStep's return). Not called when the step's input failed.
  virtual void BeginStep(const StepPush& push, ExchangeRound* out) = 0;
  // The step's graph is queued on the device (or ran): pulled weights may
  // now wait for its events, and work of the exchange's may queue behind
  // it. A failure ends the step there (its compute goes no further).
  virtual absl::Status StepQueued() = 0;
  // A bucket of gradients is on the host (a GPU's), final for this step.
  virtual void GradientsOnHost(const std::vector<int>& variables) = 0;
  // The step's compute ended: its loss, or why it failed. After BeginStep
  // (and also without it).
  virtual void EndCompute(const absl::StatusOr<double>& loss) = 0;
  // After a failed step: waits for what BeginStep started.
  virtual void Abandon() = 0;
  // Whether the step's gradients must be in the host buffers before
  // Reduce: false where they stay on the device.
  virtual bool NeedsHostGradients() const { return true; }
  // Averages the gradients and `*mean_loss` with the other workers where
  // the strategy does (else OK at once): a failure ends the training.
  virtual absl::Status Reduce(int64_t step, float* mean_loss) = 0;
  // Where the gradients stay on the device (NeedsHostGradients false):
  // clips them to global norm `bound` after Reduce, as worker/clip.h does
  // to host gradients (*clipped: they were scaled). A step that is not
  // finite is left to PushStep's verdict. Elsewhere the trainer clips the
  // host buffers itself: OK, nothing done.
  virtual absl::Status ClipOnDevice(float bound, bool* clipped) {
    *clipped = false;
    return absl::OkStatus();
  }
  // Checks the step's gradients, pushes them (or the skip) and pulls the
  // weights of push.min_version into `out`; or, after BeginStep, waits for
  // that. `*verdict` says what was found (set on every return).
  virtual absl::Status PushStep(const StepPush& push, StepVerdictKind* verdict,
                                ExchangeRound* out) = 0;
  // The step loop ended with `trained` (OK: the last step reached), once
  // per loop: the status training ends with. Where nothing outlives the
  // steps, `trained`.
  virtual absl::Status Finish(const absl::Status& trained) { return trained; }
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_EXCHANGE_H_
