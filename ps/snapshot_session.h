// The ps's snapshot protocol, once: one SnapshotRequest over a Shard's
// non-blocking snapshot calls (RequestSnapshot, PollSnapshot,
// ReleaseSnapshot). Its drivers own the waiting and the transport:
// PsService's reactor (ps/service.cc: chunks over gRPC) and LocalSnapshot
// (ps/local_client.h: copies into the caller's sinks, blocking on a waiter
// of the shard's). No gRPC here.
//
// The snapshot is asked for at Request (taken at once if the shard is at
// that version), then the driver calls Next until it sends or finishes; Next
// arms the driver's wake (for any change of the shard) before it looks, so
// a change after the look wakes the driver. Past the deadline with the
// version not reached: DEADLINE_EXCEEDED. The ticket is released by
// Release or the destructor, whichever comes first.
//
// Not thread-safe: the driver serializes its calls.
#ifndef PSFLOW_PS_SNAPSHOT_SESSION_H_
#define PSFLOW_PS_SNAPSHOT_SESSION_H_

#include <memory>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/ps.pb.h"
#include "ps/shard.h"
#include "transport/tensor_chunks.h"

namespace psflow::ps {

class SnapshotSession {
 public:
  enum class Action { kSend, kWait, kFinish };
  struct Step {
    Action action = Action::kFinish;
    absl::Time until;     // kWait: until woken, or this time
    absl::Status status;  // kFinish
  };

  // `shard` outlives the session; `deadline` is when the call must end.
  SnapshotSession(Shard* shard, const SnapshotRequest& request, absl::Time deadline);
  ~SnapshotSession() { Release(); }
  SnapshotSession(const SnapshotSession&) = delete;
  SnapshotSession& operator=(const SnapshotSession&) = delete;

  // Asks the shard for the version: the shard's error for another job,
  // FAILED_PRECONDITION for a version it is past.
  absl::Status Request();
  // kSend once the snapshot is taken (snapshot() and Refs() then hold it),
  // a wait, or the end: the shard's error (FAILED_PRECONDITION if it went
  // past the version first, ABORTED after an Init, UNAVAILABLE after
  // Shutdown), or DEADLINE_EXCEEDED. `arm` arms the driver's wake.
  Step Next(absl::FunctionRef<void()> arm);
  // The snapshot's values and, unless the request is values_only, its
  // optimizer slots, in fp32; they point into snapshot().
  std::vector<TensorRef> Refs() const;
  const std::shared_ptr<const Shard::Snapshot>& snapshot() const { return snapshot_; }
  // Lets the shard forget the request (once; later calls do nothing).
  void Release();

 private:
  Shard* const shard_;
  const SnapshotRequest request_;
  const absl::Time deadline_;
  std::optional<Shard::SnapshotTicket> ticket_;  // from Request until Release
  std::shared_ptr<const Shard::Snapshot> snapshot_;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_SNAPSHOT_SESSION_H_
