// The state of one parameter server for one job: its variable slices, their
// optimizer slots, the version (steps applied) and the gradients pushed for
// the current step. No gRPC here: the service (ps/service.h) feeds it.
//
// Synchronous contract: the gradients of step k are summed as the live
// workers push them; when every live worker has pushed, the mean is applied
// once, the version becomes k+1 and every Pull waiting for k+1 is woken. A
// push for a step below the version is stale (dropped, counted); a second
// push of one worker for one step is a duplicate (ignored, counted).
//
// Thread-safe: every method may be called from any RPC thread.
#ifndef PSFLOW_PS_SHARD_H_
#define PSFLOW_PS_SHARD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/ps.pb.h"
#include "ps/optimizer.h"

namespace psflow::ps {

class Shard {
 public:
  // The values of one slice (and its slots in Optimizer::SlotNames() order;
  // empty slots start at zero).
  struct SliceValues {
    std::vector<float> value;
    std::vector<std::vector<float>> slots;
  };

  Shard() = default;

  // Loads a job, replacing any earlier one (waiting pulls of a job with
  // another id fail with ABORTED; those of the same id see the new state). `values` follow header.slice().
  absl::Status Init(const InitHeader& header, std::vector<SliceValues> values);

  // The slices of the current job, if `job_id` names it; FAILED_PRECONDITION
  // otherwise (no job yet, or another one).
  absl::StatusOr<std::vector<SliceSpec>> Slices(uint64_t job_id) const;

  struct Snapshot {
    int64_t version = 0;
    absl::Duration waited;
    std::vector<SliceSpec> slices;
    std::vector<std::vector<float>> values;  // follows slices
  };
  // Waits until the version reaches min_version, then copies every slice.
  // Ends early with DEADLINE_EXCEEDED at `deadline`, CANCELLED once
  // `cancelled()` is true (checked at least once a second), ABORTED when the
  // job is replaced and UNAVAILABLE after Shutdown.
  absl::StatusOr<Snapshot> Pull(uint64_t job_id, int64_t min_version, absl::Time deadline,
                                const std::function<bool()>& cancelled);

  // One worker's gradients for `step`, one vector per slice in Slices() order
  // and of the slice's size (INVALID_ARGUMENT otherwise).
  absl::StatusOr<PushResponse::Outcome> Push(uint64_t job_id, int worker, int64_t step,
                                             std::vector<std::vector<float>> grads);

  // Wakes every waiting pull with UNAVAILABLE; later calls fail the same way.
  void Shutdown();

  struct Stats {
    int64_t version = 0;
    int64_t applied = 0;
    int64_t stale = 0;
    int64_t duplicate = 0;
  };
  Stats stats() const;

 private:
  absl::Status CheckJobLocked(uint64_t job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::CondVar version_changed_;  // signalled on apply, Init and Shutdown
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<SliceSpec> slices_ ABSL_GUARDED_BY(mu_);
  std::vector<SliceValues> values_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Optimizer> optimizer_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int> live_workers_ ABSL_GUARDED_BY(mu_);
  // Gradients summed for step version_, and who has pushed them.
  std::vector<std::vector<float>> sum_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int> pushed_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_SHARD_H_
