// The state of one parameter server for one job: its variable slices, their
// optimizer slots, the version (steps applied) and the gradients pushed for
// the current step. No gRPC here: the service (ps/service.h) feeds it.
//
// Synchronous contract, slice by slice: a push carries one worker's
// gradients of step k for any of the shard's slices (a worker may split its
// gradients over several pushes, sent as its backward pass produces them).
// A slice whose gradient every live worker has pushed is applied at once
// (the mean, then the optimizer; for a non-trainable slice, whose pushes
// carry a statistic instead of a gradient, the moving average
// r = (1 - bn_momentum) * r + bn_momentum * mean, see
// JobConfig.bn_momentum), without waiting for the shard's other slices,
// and moves to version k+1; a pull of that slice waiting for k+1
// is woken. The shard's version becomes k+1 when its last slice does. A
// push for a step below the shard's version is stale (dropped, counted); a
// push whose every slice this worker already pushed for the step is a
// duplicate (ignored, counted); a push holding a non-finite gradient is
// refused (counted) before anything else but its job is looked at. A worker
// whose step was not finite may push skips instead (a job with
// on_nonfinite SKIP_STEP; in any other a skip push is refused, counted): a
// slice that any live worker skipped is "applied" unchanged, value and
// optimizer state, and moves to the next version as usual, so the step
// passes with no update. A push
// for step k is accepted only at version k, and a worker pushes step k only
// after pulling every slice at version k; so slices are never more than one
// version apart, and at the moment the shard's version becomes k every
// slice is exactly at k (snapshots are taken then).
//
// Asynchronous contract (JobConfig.mode ASYNC, or SSP with a staleness
// above 0): the shard applies each worker's gradient alone, in the order the
// workers' pushes complete, as a step of its own: a push names the worker's
// clock (its gradients applied here so far) instead of a version, and once
// the worker has pushed every slice of the shard for that clock the whole
// gradient is queued; the shard applies the queue one gradient at a time
// (slices concurrently, as above), each moving the version by one. So every
// version is one consistent state of the shard (snapshots are taken as in
// sync mode), version v holding exactly v gradients. A push for a clock
// whose gradient is already whole here is DUPLICATE while it waits or is
// being applied and STALE once applied (a retry is never taken again); one
// ahead of the worker's clock is FAILED_PRECONDITION, and so is a pull of a
// worker that is not live (dropped, its queued gradient discarded: it must
// register again). The shard stops at JobConfig.train_steps: gradients
// that come later are dropped (STALE). Pulls wait by clock (TryClock): for
// the puller's own last gradient, and in SSP for the slowest live worker to
// be within `staleness` of the puller. A worker joins at once (from_version
// does not apply), at least at the clock of the slowest live worker, so a
// replacement does not hold the others back. Each applied gradient's
// staleness (versions applied between the one it was computed from and its
// own) is counted.
//
// Readers do not copy: each slice's value at each version is published once,
// by the thread that applied it, as an immutable vector that every reader of
// that version shares (by shared_ptr) and reads outside the shard's lock.
// The shard keeps no other copy of its weights: the apply of a step reads
// the published value of the version before and writes the next one into a
// buffer of its own (one no reader holds any more, when there is one).
// The previous version of a slice that moved ahead stays published (with
// its optimizer slots from before the apply) until the shard's
// version catches up, so a reader of the whole shard at its version, a pull
// asking for it, and a snapshot of it see every slice at exactly that
// version, even when a step stays half applied (its workers stopped or died
// mid-push).
//
// The apply (averaging the pushes, then the optimizer) is elementwise and
// runs outside the shard's lock, over ranges of at most `apply_range`
// elements: on the thread of the push (or SetLiveWorkers) that completed the
// slice, or, given an applier pool, on one of its threads (the push then
// goes on reading its stream at once) unless the slice is small; and, given an apply pool, on that
// pool's threads too. Slices completed by different pushes are applied
// concurrently. Each
// element is computed the same way whatever the ranges, threads and order
// of arrival (the pushes are summed in worker-id order), so the values are
// bit-identical to a sequential apply of whole pushes.
//
// A synchronous shard keeps a borrowed gradient (SliceGradient::borrowed:
// values in memory the pusher may still write, a worker's shared region)
// where it lies until the apply, and lets go of its hold then (or when the
// gradient is dropped); each block of the mean is checked for NaN and
// infinity again as it is averaged, so values changed after the push's
// check count as 0 (Counters::changed_after_check) instead of reaching the
// weights. An asynchronous shard copies borrowed values as they come.
//
// Thread-safe: every method may be called from any RPC thread.
#ifndef PSFLOW_PS_SHARD_H_
#define PSFLOW_PS_SHARD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/step_trace.h"
#include "common/thread_pool.h"
#include "proto/ps.pb.h"
#include "ps/optimizer.h"
#include "ps/slice_values.h"

namespace psflow::ps {

// One slice's apply, claimed under the shard's lock and computed without
// it (ps/slice_apply.h).
struct SliceApply;

class Shard {
 public:
  // The values of one slice with its slots (ps/slice_values.h).
  using SliceValues = ps::SliceValues;

  // One slice's value at one version, as published (see above): readers may
  // keep it, and read it without any lock, for as long as they like.
  using Value = std::shared_ptr<const std::vector<float>>;
  // The same value in the job's 16-bit wire dtype (see SetWireCopies), as
  // published with it.
  using Halves = std::shared_ptr<const std::vector<uint16_t>>;

  // The value of every slice at one version (the slices' published values).
  struct Weights {
    int64_t version = 0;
    std::shared_ptr<const std::vector<SliceSpec>> slices;  // of the job, shared
    std::vector<Value> values;                             // follows *slices; never null
  };

  // One slice as a pull gets it (TryPullSlice).
  struct PulledSlice {
    int64_t version = 0;  // the slice's version: min_version or one more
    Value value;          // never null
    // `value` in `halves_dtype` (the job's wire dtype), or null: a shard
    // with wire copies (SetWireCopies) and a 16-bit job.
    Halves halves;
    DataType halves_dtype = DT_FLOAT;
  };

  // A gradient's values left where a push put them (a worker's shared
  // region), readable while `hold` lives: `count` of them in `dtype`
  // (16-bit ones are widened to fp32 block by block as they are read).
  struct Borrowed {
    const void* data = nullptr;
    int64_t count = 0;
    DataType dtype = DT_FLOAT;
    std::shared_ptr<const void> hold = nullptr;

    bool empty() const { return data == nullptr; }
    // Values [begin, begin + n) in fp32: where they lie, or widened into
    // `scratch`, which holds n floats.
    const float* Floats(int64_t begin, int64_t n, float* scratch) const;
  };

  // One gradient of a push: `slice` indexes Slices(). A skip (the worker's
  // step was not finite, and the job skips such steps) has no values: the
  // slice keeps its value and optimizer state through the step.
  struct SliceGradient {
    int slice = 0;
    std::vector<float> values;
    bool skip = false;
    // Set where the values were checked as they were decoded (PushSlices
    // then trusts non_finite instead of reading every value again).
    bool finite_checked = false;
    bool non_finite = false;
    // Instead of `values`, where borrowed.data is set. A synchronous shard
    // applies them there and drops the hold once it has (or once it drops
    // the gradient); an asynchronous one copies them. The apply checks each
    // block it averages again, so values changed to a NaN or an infinity
    // after the push was checked never reach the weights.
    Borrowed borrowed{};

    int64_t count() const {
      return borrowed.empty() ? static_cast<int64_t>(values.size()) : borrowed.count;
    }
  };

  // A worker's gradient of one slice while the shard keeps it: its own
  // values, or borrowed ones. A skip has neither.
  struct Gradient {
    std::vector<float> values;
    Borrowed borrowed;

    // Its values [begin, begin + n) in fp32 (see Borrowed::Floats).
    const float* Floats(int64_t begin, int64_t n, float* scratch) const {
      return borrowed.empty() ? values.data() + begin : borrowed.Floats(begin, n, scratch);
    }
    bool empty() const { return borrowed.empty() && values.empty(); }
  };

  // Everything a checkpoint needs of exactly one version: values and
  // optimizer slots. Immutable; shared by the snapshot tickets that wait for
  // that version together (the slots are copied once for them).
  struct Snapshot {
    std::shared_ptr<const Weights> weights;  // never null; the values pulls of the version see
    std::vector<std::string> slot_names;     // Optimizer::SlotNames()
    std::vector<std::vector<std::vector<float>>> slots;  // [slice][slot], follows slot_names
  };

  // Ranges of 32 Ki floats: an 11 M-float shard makes hundreds of ranges for
  // the threads to share.
  static constexpr int64_t kDefaultApplyRange = int64_t{1} << 15;
  // Within a range, the workers' mean is taken and applied in blocks of this
  // many floats (16 KiB), whose mean never leaves the core's L1 cache.
  static constexpr int64_t kMeanBlock = 4096;

  // The default of `inline_apply_floats` below: a hand-off would cost more
  // than the apply of such a slice (a few microseconds), on the path of the
  // step's last slices (the first layers' small ones).
  static constexpr int64_t kInlineApplyFloats = 16 << 10;

  // `apply_pool`, if not null, lends its threads to every apply (beside the
  // thread that applies the slice); it must outlive the shard and must not be
  // a pool whose threads call into the shard (ParallelFor is not reentrant).
  // Null: each apply runs on that one thread. `apply_range` (> 0) is the most
  // elements of a slice that one thread applies at once. `appliers`, if not
  // null, runs each slice's apply instead of the thread that completed it
  // (so a push or SetLiveWorkers returns before its slices are applied; a
  // pull waits for them as ever), but for slices of at most
  // `inline_apply_floats` elements; it must outlive the shard and differ
  // from `apply_pool`. An applier runs the work the waiters deferred
  // (common/deferred_work.h) once it has let go of the shard's lock. `trace` (may be null; must
  // outlive the shard) gets a span of each slice's apply.
  explicit Shard(ThreadPool* apply_pool = nullptr, int64_t apply_range = kDefaultApplyRange,
                 ThreadPool* appliers = nullptr, StepTrace* trace = nullptr,
                 int64_t inline_apply_floats = kInlineApplyFloats);
  // Waits for the applies in flight.
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  // With `on` (off by default; set before Init), a job whose wire dtype is
  // bf16 or fp16 gets each published value in that dtype too
  // (PulledSlice::halves): written once per version, by the apply as it
  // writes the value (from Init for the first), so that its pulls send
  // those bytes as they lie instead of encoding the value for each worker.
  void SetWireCopies(bool on);

  // Loads a job, replacing any earlier one (waiting pulls of a job with
  // another id fail with ABORTED; those of the same id see the new state). `values` follow
  // header.slice().
  absl::Status Init(const InitHeader& header, std::vector<SliceValues> values);

  // The slices of the current job, if `job_id` names it; FAILED_PRECONDITION
  // otherwise (no job yet, or another one). Shared, never changed.
  absl::StatusOr<std::shared_ptr<const std::vector<SliceSpec>>> Slices(uint64_t job_id) const;

  // A push in 2 + n calls, each under the lock once (n: the PushSlices
  // calls of its parts; ps/push_session.h drives them): BeginPush, then
  // PushSlices per part, then FinishPush.
  //
  // BeginPush: what the push's header needs of the shard, if `job_id` names
  // the current job (FAILED_PRECONDITION otherwise, UNAVAILABLE after
  // Shutdown; a `skip` push is INVALID_ARGUMENT, counted in
  // Counters::refused_pushes, unless the job runs on_nonfinite SKIP_STEP):
  // the slices, the indices `asked` names (SliceIndices' errors),
  // the job's wire dtype, whether the gradients stay borrowed (`borrow`
  // asked, in a synchronous job: an asynchronous one copies borrowed values
  // as they come) and, for a push that neither borrows nor skips, a buffer
  // per index an earlier step's apply is done with (stale contents; empty
  // where there is none of the slice's size): it saves the push the
  // allocation, the zeroing and the page faults of fresh memory.
  struct PushStart {
    std::shared_ptr<const std::vector<SliceSpec>> slices;  // of the job, shared
    std::vector<int> indices;
    DataType dtype = DT_FLOAT;
    // The job's max_gradient_abs (infinity: none), for the sinks' checks.
    float magnitude_limit = std::numeric_limits<float>::infinity();
    bool borrow = false;
    std::vector<std::vector<float>> buffers;  // follows indices, or empty
  };
  absl::StatusOr<PushStart> BeginPush(uint64_t job_id, absl::Span<const int32_t> asked, bool skip,
                                      bool borrow);
  // FinishPush: counts the push's outcome in Counters (stale, duplicate)
  // and returns the shard's version, for the answer.
  int64_t FinishPush(PushResponse::Outcome outcome);

  // One worker's gradients for `step`, for any of the shard's slices, each of
  // its slice's size and named once (INVALID_ARGUMENT otherwise, before
  // anything is kept). A gradient holding a NaN or an infinity is refused
  // with INVALID_ARGUMENT naming its slice ("non-finite gradient"), whatever
  // the worker and step, and counted in Counters::refused_pushes; nothing of
  // that push is kept. Slices this worker already pushed for the step (or
  // that were applied without it) are ignored; the push is DUPLICATE if that
  // is all of it. A shard with no slices counts an empty push as the
  // worker's whole step. A push may take several calls (one per slice as
  // its chunks arrive), so stale and duplicate outcomes are not counted
  // here: the caller counts each push once with FinishPush.
  // In an asynchronous job `step` is the worker's clock and `read_version`
  // the version the gradients were computed from (see above).
  absl::StatusOr<PushResponse::Outcome> PushSlices(uint64_t job_id, int worker, int64_t step,
                                                   std::vector<SliceGradient> grads,
                                                   int64_t read_version = 0);
  // PushSlices of every slice, counted: one vector per slice in Slices()
  // order (INVALID_ARGUMENT for another count).
  absl::StatusOr<PushResponse::Outcome> Push(uint64_t job_id, int worker, int64_t step,
                                             std::vector<std::vector<float>> grads);

  // Workers left out of `live` are dropped now, with their pushes for the
  // current step; workers added count from `from_version` on (at once if the
  // shard is there). Applies the current step if every remaining live worker
  // has pushed. An empty set is INVALID_ARGUMENT.
  absl::Status SetLiveWorkers(uint64_t job_id, const std::vector<int>& live, int64_t from_version);

  // A replica of a job without ps whose state lives elsewhere (a GPU
  // worker's device) publishes it here as of `version`: the values and slots
  // of every slice (SliceValues as for Init, slots in full) replace the
  // shard's, and the shard is at `version`, as if the steps between had been
  // applied. A snapshot asked for at `version` is taken; those of versions
  // in between can no longer be (FAILED_PRECONDITION, as for a shard that
  // passed them); pulls waiting for it see it. FAILED_PRECONDITION for
  // another job, for a version behind the shard's, or while pushes are
  // pending (a mirrored shard takes none); INVALID_ARGUMENT for values that
  // do not fit the slices.
  absl::Status Mirror(uint64_t job_id, int64_t version, std::vector<SliceValues> values);
  // The lowest version at or after `from` that a snapshot still waits for
  // (asked for and not yet taken), if any: what a mirrored shard's owner
  // publishes next.
  std::optional<int64_t> WantedSnapshot(int64_t from) const;

  // Nothing here waits: a call that must wait (a pull, a snapshot) holds no
  // thread of the shard's, only a waiter whose `wake` runs at every change such a call may wait for
  // (a slice applied, a new version, a new job, shutdown), until it is
  // removed, with the index of the slice applied, or -1 for any other
  // change (a call that waits for another slice may sleep on). `wake` runs
  // under the shard's lock, so it must only hand work elsewhere (schedule
  // it, or defer it to the thread's DeferredWork scope: an applier has one
  // open), never call the shard.
  int64_t AddWaiter(std::function<void(int slice)> wake);
  void RemoveWaiter(int64_t id);
  // Slice `slice` (an index into Slices()) if it reached min_version: at the
  // shard's version if that is min_version or more (so that the slices of
  // one pull agree), else at the slice's own; nullopt if not yet.
  // FAILED_PRECONDITION for another job, UNAVAILABLE after Shutdown,
  // INVALID_ARGUMENT for an index out of range.
  absl::StatusOr<std::optional<PulledSlice>> TryPullSlice(uint64_t job_id, int slice,
                                                          int64_t min_version);
  // TryPullSlice of the first of `slices` (in their order) that reached
  // min_version, with its position in `slices`; nullopt if none has yet.
  absl::StatusOr<std::optional<std::pair<size_t, PulledSlice>>> TryPullFirstReady(
      uint64_t job_id, absl::Span<const int> slices, int64_t min_version);
  // The shard's version if it reached min_version, nullopt if not yet.
  absl::StatusOr<std::optional<int64_t>> TryVersion(uint64_t job_id, int64_t min_version);
  // An asynchronous job's pull condition (see above) for `worker` at
  // `clock`: the shard's version once it holds (or once the job's last step
  // is applied), with the worker's clock here and the staleness of its
  // latest applied gradient; nullopt if not yet. FAILED_PRECONDITION for a
  // synchronous job.
  struct ClockGrant {
    int64_t version = 0;
    int64_t clock = 0;
    int64_t lag = 0;
  };
  absl::StatusOr<std::optional<ClockGrant>> TryClock(uint64_t job_id, int worker, int64_t clock);
  // Values and slots as of exactly one version, taken when the shard
  // reaches it (and no slice is being applied), in three calls
  // (ps/snapshot_session.h drives them): RequestSnapshot asks for `version`
  // (taken at once if the shard is there; FAILED_PRECONDITION if past);
  // PollSnapshot gives it once taken (null while not yet;
  // FAILED_PRECONDITION if the shard went past it first, ABORTED after an
  // Init, even of the same job; UNAVAILABLE after Shutdown); every ticket
  // is released once, whatever happened.
  struct SnapshotTicket {
    uint64_t job_id = 0;
    int64_t version = 0;
    int64_t generation = 0;
  };
  absl::StatusOr<SnapshotTicket> RequestSnapshot(uint64_t job_id, int64_t version);
  absl::StatusOr<std::shared_ptr<const Snapshot>> PollSnapshot(const SnapshotTicket& ticket);
  void ReleaseSnapshot(const SnapshotTicket& ticket);

  struct State {
    bool has_job = false;
    uint64_t job_id = 0;
    int64_t version = 0;
    JobConfig job;
    std::vector<int> live_workers;     // sorted
    std::vector<int> joining_workers;  // live from a later version; sorted
    // Asynchronous jobs (PsState has the meaning of each).
    std::vector<int64_t> clocks;  // by worker index
    int64_t lag_count = 0, lag_sum = 0, lag_max = 0, clock_gap_max = 0;
    // Synchronous jobs, by worker index: the latest step whose gradients
    // of every slice the shard received from the worker (-1: none since
    // Init). PsState.pushed_steps.
    std::vector<int64_t> pushed_steps;
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
    int64_t applied = 0;    // steps applied
    int64_t stale = 0;      // pushes for an applied step, dropped
    int64_t duplicate = 0;  // second pushes of a worker for a step, ignored
    // Pushes refused for a non-finite gradient, or for a skip in a job that
    // does not skip steps.
    int64_t refused_pushes = 0;
    // Applies that found a NaN or an infinity in borrowed gradients that had
    // been checked finite (the worker changed its region after the push):
    // those values counted as 0.
    int64_t changed_after_check = 0;
    int64_t skipped = 0;  // steps a worker skipped (no update)
  };
  struct Stats : Counters {
    int64_t version = 0;
    // Asynchronous jobs (0 otherwise): the staleness of the applied
    // gradients (sum and max of versions behind), and the largest lead of a
    // served pull's clock over the slowest live worker.
    int64_t staleness_sum = 0, staleness_max = 0, clock_lead_max = 0;
  };
  Stats stats() const;

 private:
  // A slice's progress in the current step.
  struct SliceState {
    int64_t version = 0;    // version_, or version_ + 1 once applied
    bool applying = false;  // claimed by a thread that applies it outside the lock
    // Gradients pushed for the current step and not yet applied, by worker
    // (kept apart so that a worker dropped mid-step takes its gradient away);
    // a skip is empty.
    absl::flat_hash_map<int, Gradient> pushes;
    Value published;  // the value at `version`
    Value previous;   // once applied: the value at version_, for whole-shard readers
    // Their copies in the wire dtype (with wire copies, else null), and a
    // buffer for the next one that no reader holds any more (or null).
    Halves published_halves, previous_halves;
    std::shared_ptr<std::vector<uint16_t>> spare_halves;
    // The optimizer slots (SliceValues::slots) at `version`. While the slice
    // is applying, its applier reads them without the lock (and writes the
    // next ones into previous_slots); Init and Mirror wait until no slice
    // is applying. (The weights themselves are the published values: an
    // apply reads one version's and writes the next one's into another
    // buffer.)
    std::vector<std::vector<float>> slots;
    // Once applied: the slots at version_ (for snapshots). Before: buffers
    // the slice's next apply writes its new slots into (no copy of the old
    // ones is made; FinishLocked swaps these with the slice's slots).
    std::vector<std::vector<float>> previous_slots;
    // A buffer of the slice's size that no reader holds any more, reused for
    // the next published value (or null).
    std::shared_ptr<std::vector<float>> spare;
    // Pushed gradients an apply is done with, for BeginPush (at most
    // one per live worker).
    std::vector<std::vector<float>> spare_grads;
  };

  absl::Status CheckJobLocked(uint64_t job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every slice's published value at version_.
  std::shared_ptr<const Weights> WeightsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a push of `worker` for the current step: notes the step in
  // pushed_steps_ once every slice holds its gradient (or was applied).
  void NotePushLocked(int worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies slice `i` if every live worker has pushed it for the current
  // step: hands it to the appliers, or computes it here, releasing the lock
  // meanwhile (the slice is marked applying), so callers must look at the
  // state afresh afterwards.
  void MaybeApplySliceLocked(int i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A spare gradient buffer of slice `slice` of `n` floats, or an empty
  // vector (see BeginPush).
  std::vector<float> GradientBufferLocked(int slice, int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Claims slice `i` for its apply if it is complete (null otherwise).
  std::shared_ptr<SliceApply> ClaimLocked(int i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes the applied slice; the shard's version moves with the last.
  void FinishLocked(SliceApply& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FinishLocked under the lock, taken here; traced as "publish", with the
  // wait for the lock.
  void Publish(SliceApply& job) ABSL_LOCKS_EXCLUDED(mu_);
  // Every slice, and for a shard without slices the empty pushes.
  void MaybeApplyAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `worker` pushed slice `s` for the current step: with the live
  // workers (sync), or the one whose gradient the step applies (async).
  bool StepCompleteLocked(const SliceState& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Asynchronous jobs: a push, and the start of the next queued gradient's
  // step when none is in progress.
  absl::StatusOr<PushResponse::Outcome> PushAsyncLocked(int worker, int64_t clock,
                                                        int64_t read_version,
                                                        std::vector<SliceGradient> grads)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartRoundLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The lowest clock of the live workers other than `except` (nullopt: none).
  std::optional<int64_t> SlowestClockLocked(int except) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::optional<ClockGrant>> TryClockLocked(uint64_t job_id, int worker,
                                                           int64_t clock)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The current step is applied to every slice: version_ + 1.
  void AdvanceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves workers whose joining version has come into the live set, and
  // takes the snapshot of the current version if one waits for it.
  void OnVersionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the snapshot of version_ if one waits for it and no slice is
  // being applied.
  void TakeSnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wakes the blocked waits and every waiter (telling them `slice`: the one
  // applied, or -1).
  void WakeLocked(int slice = -1) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Slice `s` (at min_version or more) as a pull gets it: at the shard's
  // version if that is min_version or more, else at the slice's own.
  PulledSlice SliceAtLocked(const SliceState& s, int64_t min_version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::optional<PulledSlice>> TryPullSliceLocked(uint64_t job_id, int slice,
                                                                int64_t min_version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<SnapshotTicket> RequestSnapshotLocked(uint64_t job_id, int64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<const Snapshot>> PollSnapshotLocked(const SnapshotTicket& ticket)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseSnapshotLocked(const SnapshotTicket& ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ThreadPool* const apply_pool_;  // may be null; not owned
  const int64_t apply_range_;
  ThreadPool* const appliers_;  // may be null; not owned
  const int64_t inline_apply_floats_;
  StepTrace* const trace_;  // may be null; not owned

  mutable absl::Mutex mu_;
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;  // steps applied (from the Init header's version on)
  std::shared_ptr<const std::vector<SliceSpec>> slices_
      ABSL_GUARDED_BY(mu_);                             // replaced, never changed
  std::vector<SliceState> slice_ ABSL_GUARDED_BY(mu_);  // follows *slices_
  int applied_ ABSL_GUARDED_BY(mu_) = 0;                // slices at version_ + 1
  int applying_ ABSL_GUARDED_BY(mu_) = 0;               // slices being applied outside the lock
  // A shard without slices: the live workers that pushed for the current step.
  absl::flat_hash_set<int> empty_pushes_ ABSL_GUARDED_BY(mu_);
  bool step_skipped_ ABSL_GUARDED_BY(mu_) = false;  // a slice of the current step was skipped
  JobConfig job_ ABSL_GUARDED_BY(mu_);
  bool wire_copies_ ABSL_GUARDED_BY(mu_) = false;
  // The dtype of the published values' copies: the job's 16-bit wire dtype
  // with wire copies, else DT_FLOAT (none).
  DataType halves_dtype_ ABSL_GUARDED_BY(mu_) = DT_FLOAT;
  std::unique_ptr<Optimizer> optimizer_ ABSL_GUARDED_BY(mu_);
  float bn_momentum_ ABSL_GUARDED_BY(mu_) = kDefaultBnMomentum;  // of non-trainable slices
  absl::flat_hash_set<int> live_workers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, int64_t> joining_ ABSL_GUARDED_BY(mu_);  // worker -> first version
  // Synchronous jobs: the latest step each worker pushed whole here (every
  // slice), since Init (State::pushed_steps).
  absl::flat_hash_map<int, int64_t> pushed_steps_ ABSL_GUARDED_BY(mu_);
  // Snapshots asked for, by version: filled when the shard reaches it, and
  // dropped when the last caller waiting for it leaves.
  struct PendingSnapshot {
    std::shared_ptr<const Snapshot> data;  // null until taken
    int waiters = 0;
  };
  absl::flat_hash_map<int64_t, PendingSnapshot> snapshots_ ABSL_GUARDED_BY(mu_);
  // Counts Inits: a snapshot asked for before one is abandoned (ABORTED),
  // whatever the job id, since Init drops the waiting entries.
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  Counters counters_ ABSL_GUARDED_BY(mu_);
  // The job's max_gradient_abs (infinity: none), read by PushSlices outside
  // the lock.
  std::atomic<float> magnitude_limit_{std::numeric_limits<float>::infinity()};
  // Asynchronous jobs.
  bool async_ ABSL_GUARDED_BY(mu_) = false;
  int64_t staleness_ ABSL_GUARDED_BY(mu_) = -1;  // SSP's bound; -1: none (ASYNC)
  struct AsyncPush {
    int64_t clock = 0;
    int64_t read_version = 0;
    std::vector<std::optional<std::vector<float>>> grads;  // by slice; a skip is empty
    int received = 0;
    bool queued = false;  // complete, waiting in ready_
  };
  absl::flat_hash_map<int, AsyncPush> pending_ ABSL_GUARDED_BY(mu_);  // by worker
  std::vector<int> ready_ ABSL_GUARDED_BY(mu_);  // complete pushes, in order of completion
  int round_owner_ ABSL_GUARDED_BY(mu_) = -1;    // the worker whose gradient is being applied
  int64_t round_lag_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<int, int64_t> clocks_ ABSL_GUARDED_BY(mu_);  // gradients applied, by worker
  // Gradients accepted whole (queued, being applied or applied), by worker:
  // the clock its next push must name.
  absl::flat_hash_map<int, int64_t> accepted_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, int64_t> last_lag_ ABSL_GUARDED_BY(mu_);  // of the latest, by worker
  int64_t lag_count_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lag_sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lag_max_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t clock_gap_max_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<int64_t, std::function<void(int)>> waiters_ ABSL_GUARDED_BY(mu_);
  int64_t next_waiter_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_SHARD_H_
