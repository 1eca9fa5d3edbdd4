// The state of one parameter server for one job: its variable slices, their
// optimizer slots, the version (steps applied) and the gradients pushed for
// the current step. No gRPC here: the service (ps/service.h) feeds it.
//
// Synchronous contract: the gradients of step k are summed as the live
// workers push them; when every live worker has pushed, the mean is applied
// once, the version becomes k+1 and every Pull waiting for k+1 is woken. A
// push for a step below the version is stale (dropped, counted); a second
// push of one worker for one step is a duplicate (ignored, counted); a push
// holding a non-finite gradient is refused (counted) before anything else
// but its job is looked at.
//
// Readers do not copy: the values of a version are copied once, on its first
// Pull or SnapshotAt, into an immutable Weights that every reader of that
// version shares (by shared_ptr) and reads outside the shard's lock. A later
// apply leaves it alone and works on the shard's own masters.
//
// The apply (averaging the pushes, then the optimizer) is elementwise: it
// runs over ranges of at most `apply_range` elements of each slice, on the
// thread of the push (or SetLiveWorkers) that completes the step and, given
// an apply pool, on the pool's threads too. Each element is computed the same
// way whatever the ranges and threads (the pushes are summed in worker-id
// order), so the values are bit-identical to a sequential apply. The apply
// holds the shard's lock throughout: nobody reads a version half applied.
//
// Thread-safe: every method may be called from any RPC thread.
#ifndef PSFLOW_PS_SHARD_H_
#define PSFLOW_PS_SHARD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/thread_pool.h"
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

  // The value of every slice at one version. Immutable once published: the
  // shard copies its values once per version, on the first read of that
  // version, and every reader of the version shares that copy (readers may
  // keep it, and read it without any lock, for as long as they like).
  struct Weights {
    int64_t version = 0;
    std::shared_ptr<const std::vector<SliceSpec>> slices;  // of the job, shared
    std::vector<std::vector<float>> values;                // follows *slices
  };

  // What Pull hands back.
  struct Pulled {
    std::shared_ptr<const Weights> weights;  // never null
    absl::Duration waited;                   // time spent waiting for the version
  };

  // Everything a checkpoint needs of exactly one version: values and
  // optimizer slots. Immutable; shared by the SnapshotAt calls that wait for
  // that version together (the slots are copied once for them).
  struct Snapshot {
    std::shared_ptr<const Weights> weights;  // never null; the values pulls of the version see
    std::vector<std::string> slot_names;     // Optimizer::SlotNames()
    std::vector<std::vector<std::vector<float>>> slots;  // [slice][slot], follows slot_names
  };

  // Ranges of 32 Ki floats: the sum and the weights and slots of one range
  // stay in a core's L2 cache from the averaging to the optimizer, and an
  // 11 M-float shard makes hundreds of ranges for the threads to share.
  static constexpr int64_t kDefaultApplyRange = int64_t{1} << 15;

  // `apply_pool`, if not null, lends its threads to every apply (beside the
  // thread of the push that completes the step); it must outlive the shard
  // and must not be a pool whose threads call into the shard (ParallelFor is
  // not reentrant). Null: each apply runs on that one thread. `apply_range`
  // (> 0) is the most elements of a slice that one thread applies at once.
  explicit Shard(ThreadPool* apply_pool = nullptr, int64_t apply_range = kDefaultApplyRange);
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  // Loads a job, replacing any earlier one (waiting pulls of a job with
  // another id fail with ABORTED; those of the same id see the new state). `values` follow
  // header.slice().
  absl::Status Init(const InitHeader& header, std::vector<SliceValues> values);

  // The slices of the current job, if `job_id` names it; FAILED_PRECONDITION
  // otherwise (no job yet, or another one). Shared, never changed.
  absl::StatusOr<std::shared_ptr<const std::vector<SliceSpec>>> Slices(uint64_t job_id) const;

  // Waits until the version reaches min_version, then returns the weights at
  // the version the shard has (copied once per version, not per call).
  // Ends early with DEADLINE_EXCEEDED at `deadline`, CANCELLED once
  // `cancelled()` is true (checked at least once a second), ABORTED when the
  // job is replaced and UNAVAILABLE after Shutdown.
  absl::StatusOr<Pulled> Pull(uint64_t job_id, int64_t min_version, absl::Time deadline,
                              const std::function<bool()>& cancelled);

  // One worker's gradients for `step`, one vector per slice in Slices() order
  // and of the slice's size (INVALID_ARGUMENT otherwise). A gradient holding
  // a NaN or an infinity is refused with INVALID_ARGUMENT naming its slice
  // ("non-finite gradient"), whatever the worker and step, and counted in
  // Counters::refused_pushes; nothing of that push is kept.
  absl::StatusOr<PushResponse::Outcome> Push(uint64_t job_id, int worker, int64_t step,
                                             std::vector<std::vector<float>> grads);

  // Workers left out of `live` are dropped now, with their pushes for the
  // current step; workers added count from `from_version` on (at once if the
  // shard is there). Applies the current step if every remaining live worker
  // has pushed. An empty set is INVALID_ARGUMENT.
  absl::Status SetLiveWorkers(uint64_t job_id, const std::vector<int>& live, int64_t from_version);

  // Values and slots as of exactly `version`, taken when the shard reaches
  // it. FAILED_PRECONDITION if already past; the other errors as for Pull.
  absl::StatusOr<std::shared_ptr<const Snapshot>> SnapshotAt(
      uint64_t job_id, int64_t version, absl::Time deadline,
      const std::function<bool()>& cancelled);

  struct State {
    bool has_job = false;
    uint64_t job_id = 0;
    int64_t version = 0;
    JobConfig job;
    std::vector<int> live_workers;     // sorted
    std::vector<int> joining_workers;  // live from a later version; sorted
  };
  State state() const;

  // The dtype the job's pulls and pushes travel in (JobConfig.wire_dtype) if
  // `job_id` names the current job; FAILED_PRECONDITION otherwise. Cheap: no
  // copy of the job.
  absl::StatusOr<DataType> WireDtype(uint64_t job_id) const;

  // Wakes every waiting pull with UNAVAILABLE; later calls fail the same way.
  void Shutdown();

  // Counts since the last Init.
  struct Counters {
    int64_t applied = 0;         // steps applied
    int64_t stale = 0;           // pushes for an applied step, dropped
    int64_t duplicate = 0;       // second pushes of a worker for a step, ignored
    int64_t refused_pushes = 0;  // pushes refused for a non-finite gradient
  };
  struct Stats : Counters {
    int64_t version = 0;
  };
  Stats stats() const;

 private:
  absl::Status CheckJobLocked(uint64_t job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one wait of Pull and SnapshotAt: returns OK once `reached()` holds
  // (checked first, so a reached version is served past the deadline), or the
  // error that ends the wait (see Pull). `what` names the call in messages,
  // `version` is the version waited for.
  absl::Status WaitLocked(uint64_t job_id, int64_t version, absl::Time deadline,
                          const std::function<bool()>& cancelled, absl::string_view what,
                          absl::FunctionRef<bool()> reached) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The weights at version_, published on first use and kept until the next
  // apply or Init.
  std::shared_ptr<const Weights> WeightsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the current step if every live worker has pushed for it.
  void MaybeApplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves workers whose joining version has come into the live set, and
  // takes snapshots that wait for the current version.
  void OnVersionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ThreadPool* const apply_pool_;  // may be null; not owned
  const int64_t apply_range_;

  mutable absl::Mutex mu_;
  absl::CondVar version_changed_;  // signalled on apply, Init and Shutdown
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;  // steps applied (from the Init header's version on)
  std::shared_ptr<const std::vector<SliceSpec>> slices_
      ABSL_GUARDED_BY(mu_);                               // replaced, never changed
  std::vector<SliceValues> values_ ABSL_GUARDED_BY(mu_);  // the masters the optimizer updates
  // values_ as of version_ for readers; null until first asked for after an
  // apply or Init. Never written through: an apply drops it instead.
  std::shared_ptr<const Weights> weights_ ABSL_GUARDED_BY(mu_);
  JobConfig job_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Optimizer> optimizer_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int> live_workers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, int64_t> joining_ ABSL_GUARDED_BY(mu_);  // worker -> first version
  // Gradients pushed for the current step, by worker (kept apart so that a
  // worker dropped mid-step takes its gradient with it).
  absl::flat_hash_map<int, std::vector<std::vector<float>>> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<float>> sum_ ABSL_GUARDED_BY(mu_);  // scratch for the mean
  // Snapshots asked for, by version: filled when the shard reaches it, and
  // dropped when the last caller waiting for it leaves.
  struct PendingSnapshot {
    std::shared_ptr<const Snapshot> data;  // null until taken
    int waiters = 0;
  };
  absl::flat_hash_map<int64_t, PendingSnapshot> snapshots_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_SHARD_H_
