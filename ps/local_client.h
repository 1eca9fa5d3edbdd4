// The ps calls on a shard in this process: what the service (ps/service.cc)
// does in front of a Shard (checks the Init header, fills slices and their
// optimizer slots by name and slot, converts through the wire dtype, reports
// the version after a push), copying tensors straight between the caller's
// TensorRef/TensorSink buffers and the shard, with no gRPC. Pull, push and
// snapshot are the service's own protocol (ps/pull_session.h,
// ps/push_session.h, ps/snapshot_session.h), driven here on the calling
// thread: a pull or a snapshot blocks on a waiter of the shard's and copies
// what it is sent into the sinks; a push copies the tensors into the
// session's sinks and hands them over at once. ps::LocalClient serves a
// worker's own replica in a job without ps (JobConfig.exchange ALL_REDUCE);
// the test fake (tests/fakes/fake_ps.h) puts its faults in front of the
// same calls.
//
// Errors are the shard's own, INVALID_ARGUMENT for tensors an Init or a push
// does not fit, DATA_LOSS for a pull or snapshot that does not fit the sinks,
// and whatever `interrupted` returns (see LocalCall). None names a ps: the
// callers do (WithPs).
#ifndef PSFLOW_PS_LOCAL_CLIENT_H_
#define PSFLOW_PS_LOCAL_CLIENT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ps/client.h"
#include "ps/shard.h"

namespace psflow::ps {

// How a call may be ended from outside: `interrupted` returns a non-OK
// status once the caller wants a wait to end (a cancel, a ps taken down),
// and that status is the call's; waits look at it at least every
// `poll_every` (and at least once a second: LocalPull and LocalSnapshot wake
// that often to look).
struct LocalCall {
  std::function<absl::Status()> interrupted;
  absl::Duration poll_every = absl::InfiniteDuration();
};

absl::Status LocalInit(Shard& shard, int ps, const InitHeader& header,
                       const std::vector<TensorRef>& tensors);
// max_wait counts in whole milliseconds (rounded up), as a PullRequest's.
absl::StatusOr<Client::PullResult> LocalPull(Shard& shard, const LocalCall& call, uint64_t job_id,
                                             int64_t min_version, const std::vector<int>& slices,
                                             std::vector<TensorSink>& sinks, absl::Time deadline,
                                             absl::Duration max_wait);
absl::StatusOr<PushResponse> LocalPush(Shard& shard, const PushHeader& header,
                                       const std::vector<TensorRef>& grads);
PsState LocalState(Shard& shard, int ps);
absl::Status LocalSnapshot(Shard& shard, const LocalCall& call, uint64_t job_id, int64_t version,
                           std::vector<TensorSink>& sinks, absl::Time deadline);

// A ps::Client of one shard in this process (ps 0). Thread-safe.
class LocalClient final : public Client {
 public:
  // `shard` (not owned) must outlive the client.
  explicit LocalClient(Shard* shard);
  int num_ps() const override { return 1; }
  absl::Status Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                    absl::Time deadline) override;
  absl::StatusOr<PullResult> Pull(int ps, uint64_t job_id, int64_t min_version,
                                  std::vector<int> slices, std::vector<TensorSink> sinks,
                                  absl::Time deadline, absl::Duration max_wait) override;
  absl::StatusOr<PushResponse> Push(int ps, const PushHeader& header, std::vector<TensorRef> grads,
                                    absl::Time deadline) override;
  absl::Status Shutdown(int ps, uint64_t job_id, absl::Time deadline) override;
  // A shard in this process stops with it: nothing waits for the chief.
  // FAILED_PRECONDITION for another job, as a ps answers.
  absl::Status CheckpointTaken(int ps, uint64_t job_id, absl::Time deadline) override;
  absl::StatusOr<PsState> GetState(int ps, absl::Time deadline) override;
  absl::Status SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live,
                              int64_t from_version, absl::Time deadline) override;
  absl::Status Snapshot(int ps, uint64_t job_id, int64_t version, std::vector<TensorSink> sinks,
                        absl::Time deadline) override;
  bool Reachable(int ps) const override { return ps == 0; }
  void CancelAll() override { cancelled_ = true; }

 private:
  // OK, or why the call cannot go on (a ps index but 0, CancelAll).
  absl::Status Check(int ps) const;
  LocalCall Call() const;

  Shard* const shard_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_LOCAL_CLIENT_H_
