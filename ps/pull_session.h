// The ps's pull protocol, once: what one PullRequest is answered with, step
// by step, over a Shard's non-blocking API. Its drivers own the waiting and
// the transport: PsService's reactor (ps/service.cc: chunk messages over
// gRPC, a same-host channel or a shared region) and LocalPull
// (ps/local_client.h: copies into the caller's sinks, blocking).
//
// A pull asks for slices (all when it names none), each sent as soon as it
// reaches min_version (a by_clock pull: once the worker's clock condition
// holds, Shard::TryClock, at the version the shard had then), in the order
// they are ready, those ready together at one version batched up to
// kPullBatchBytes. The first message carries ready, clock, lag and wait_us.
// A shard without slices answers with its version alone. max_wait bounds
// only the wait for the first slice: past it the answer is "not yet" (the
// shard's version, no data), past the call's deadline DEADLINE_EXCEEDED.
//
// The driver calls Next until it finishes; Next arms the driver's wake
// (through `arm`, for the range of slices still pending) before it looks at
// the shard, so a change after the look wakes the driver. Not thread-safe:
// the driver serializes its calls.
#ifndef PSFLOW_PS_PULL_SESSION_H_
#define PSFLOW_PS_PULL_SESSION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/tensor_view.h"
#include "proto/ps.pb.h"
#include "ps/shard.h"

namespace psflow::ps {

// Slices that are ready together go in one pull message up to this many
// bytes (in the wire dtype); a larger slice goes alone.
inline constexpr int64_t kPullBatchBytes = 256 << 10;

class PullSession {
 public:
  // What Next hands the driver to send: the response's fields (no chunks)
  // and the slices' values (none for an answer of the version alone).
  struct Message {
    PullResponse fields;
    std::vector<TensorRef> refs;       // in the wire dtype; moved out by the driver
    std::shared_ptr<const void> keep;  // what refs point into
    int first_slice = -1;              // the first of the slices sent (-1: none)
    size_t slices = 0;
    int64_t bytes = 0;  // of the slices, in the wire dtype
    bool last = false;  // the answer ends with this message
  };
  enum class Action { kSend, kWait, kFinish };
  struct Step {
    Action action = Action::kFinish;
    absl::Time until;     // kWait: until woken, or this time
    absl::Status status;  // kFinish
  };
  // Arms the driver's wake: by any change of the shard when `first` < 0,
  // else only by the apply of a slice from `first` to `last` (or a change
  // that is not a slice's apply).
  using Arm = absl::FunctionRef<void(int first, int last)>;

  // `shard` and `request` (its region is the driver's business) outlive the
  // session; `start` is when the call came, `deadline` when it must end.
  PullSession(Shard* shard, const PullRequest& request, absl::Time start, absl::Time deadline);

  // The request's checks, before the first Next: INVALID_ARGUMENT for a
  // dtype that is not a wire dtype or slices out of range or named twice,
  // the shard's error for a job it does not hold.
  absl::Status Prepare();
  // The next step: `message` filled to send (then Next again), a wait, or
  // the end with the call's status.
  Step Next(Arm arm, Message* message);

  // The answer is "not yet" (max_wait passed first).
  bool not_yet() const { return not_yet_; }
  // Slice bytes sent so far, in the wire dtype.
  int64_t bytes() const { return bytes_; }

 private:
  // A by_clock pull's condition: true once granted; else `step` says what next.
  bool Granted(absl::Time deadline, Message* message, Step* step);
  Step SendVersion(absl::Time deadline, Message* message);
  Step SendReadySlices(absl::Time deadline, Message* message);
  // pending_[at] (pulled as `slice`) and the next pending slices at its
  // version now, up to kPullBatchBytes.
  size_t BatchFrom(size_t at, const Shard::PulledSlice& slice, Message* message);
  // The answer's last message: `version` and no slices.
  void VersionOnly(int64_t version, Message* message);
  void SetFirst(Message* message) const;
  // The version is not there yet: wait, answer "not yet", or fail.
  Step NotThere(absl::Time deadline, Message* message);

  Shard* const shard_;
  const PullRequest& request_;
  const absl::Time start_;
  const absl::Time deadline_;
  absl::Time wait_deadline_;  // max_wait's, for the first slice
  std::shared_ptr<const std::vector<SliceSpec>> specs_;
  std::vector<int> indices_;
  DataType dtype_ = DT_FLOAT;
  // The slices asked for that are still to be sent, in the order asked.
  std::vector<int> pending_;
  bool sent_any_ = false;  // a message with slices went
  bool done_ = false;      // the last message went
  int64_t bytes_ = 0;
  // The version the slices must reach: the request's, or for a by_clock
  // pull the shard's once the clock's condition held (granted_).
  int64_t min_version_ = 0;
  bool granted_ = false;
  int64_t clock_ = 0;  // a by_clock pull's answer
  int64_t lag_ = 0;
  bool not_yet_ = false;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_PULL_SESSION_H_
