// The exchange with the ps (worker/exchange.h). Each ps's slices travel in
// "lanes" (worker/lane_plan.h), all in parallel: a lane pushes its
// gradients of step k, then at once pulls its slices of step k+1, which the
// ps sends slice by slice as each is applied (asking again while a ps
// answers "not yet"). So one lane's pull overlaps the other lanes' pushes
// and the ps's applies, and on a GPU each variable is copied to the device
// (from page-locked memory, or straight from the pull's shared region) as
// soon as its last slice is in, while the rest still travels, and while the
// step's backward pass still runs once it is past the variable's layer.
//
// Pushing during the backward pass (where it applies: see Create), each
// lane checks and pushes its gradients as soon as the backward pass has
// completed them, while the step runs; the step's verdict (StepVerdict)
// tells the lanes whether the whole step was finite before they pull (on a
// CPU) or count the pushes.
//
// Thread-safety: the Exchange methods from one thread, one step at a time;
// the lanes run on pools of their own. Ownership: the client, network and
// backend are not owned and outlive the exchange.
#ifndef PSFLOW_WORKER_PS_EXCHANGE_H_
#define PSFLOW_WORKER_PS_EXCHANGE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "allreduce/ring.h"
#include "common/step_trace.h"
#include "common/tensor_view.h"
#include "common/thread_pool.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "proto/job.pb.h"
#include "ps/client.h"
#include "worker/exchange.h"
#include "worker/lane_plan.h"
#include "worker/step_verdict.h"

namespace psflow::worker {

struct PsExchangeOptions {
  int worker_index = 0;  // this worker (pulls by clock)
  int push_worker = 0;   // the pushes' worker: 0 to a replica of an all-reduce job
  // As TrainerOptions'.
  absl::Duration pull_wait = absl::Seconds(5);
  absl::Duration transfer_timeout = absl::Seconds(120);
  absl::Duration startup_timeout = absl::Minutes(5);
  bool upload_from_shared_memory = true;
  // Lanes per ps, their bytes and their runs' (backward_pos, bucket and
  // backward_order are filled by Create).
  LanePlanOptions plan;
  // The job applies each worker's gradient alone (pulls by clock).
  bool async = false;
  // A step that is not finite is skipped (JobConfig.on_nonfinite SKIP_STEP).
  bool skip_nonfinite = false;
  // Push during the backward pass where the buffers allow it: the job
  // fails on a step that is not finite, and the worker has one device.
  bool push_during_backward = false;
  DataType dtype = DT_FLOAT;  // of pulls and pushes
  // The job's max_gradient_abs (0: none): a gradient holding a value of it
  // or more is as diverged as one the wire dtype turns into infinity (the ps
  // would refuse it), so the step goes to the job's on_nonfinite policy.
  float max_gradient_abs = 0;
  // Where set (not owned): the lanes' spans, at the step *trace_step.
  StepTrace* trace = nullptr;
  const std::atomic<int64_t>* trace_step = nullptr;
  const std::atomic<uint64_t>* job_id = nullptr;  // the registration's (not owned)
};

// Where pulled weights land and pushed gradients lie, by variable
// (worker/staging.h).
struct PsExchangeBuffers {
  model::Network* net = nullptr;
  kernels::Backend* backend = nullptr;
  bool in_place = false;  // weights and grads are the network's own
  std::vector<float*> weights;
  std::vector<const float*> grads;
  // Gradients rounded to the 16-bit wire dtype on the device (replace grads).
  std::vector<const uint16_t*> narrowed;
  // The event each variable's upload waits for (empty: none).
  std::vector<kernels::Event*> upload_after;
  // The variables of each bucket the step copies to the host (a GPU's).
  std::vector<std::vector<int>> buckets;
};

class PsExchange final : public Exchange {
 public:
  // Cuts the placement's slices into lanes over `client` (not owned).
  // Permanent errors where the device cannot make events.
  static absl::StatusOr<std::unique_ptr<PsExchange>> Create(PsExchangeOptions options,
                                                            ExchangeHooks hooks, ps::Client* client,
                                                            const Placement& placement,
                                                            PsExchangeBuffers buffers);
  ~PsExchange() override;

  absl::Status Pull(int64_t min_version, ExchangeRound* out) override;
  void BeginStep(const StepPush& push, ExchangeRound* out) override;
  absl::Status StepQueued() override;
  void GradientsOnHost(const std::vector<int>& variables) override;
  void EndCompute(const absl::StatusOr<double>& loss) override;
  void Abandon() override;
  absl::Status Reduce(int64_t step, float* mean_loss) override { return absl::OkStatus(); }
  absl::Status PushStep(const StepPush& push, StepVerdictKind* verdict,
                        ExchangeRound* out) override;

  bool pushes_during_step() const { return push_early_; }
  int lanes() const { return static_cast<int>(lanes_.size()); }

 private:
  // Consecutive slices of one ps that travel together.
  struct Lane {
    LaneSpec spec;                  // its ps, slices and runs
    std::vector<TensorSink> sinks;  // where the slices' weights land
    std::vector<TensorRef> refs;    // the slices' gradients
    // Each slice's first float within its variable (its rows' start).
    std::vector<int64_t> first_float;
    // Pulls that leave weights in the pull's shared region (borrow_pulls_):
    // where each slice's values are after a pull (null: in its sink), the
    // region's hold until the uploads from it are done, and their event.
    std::vector<const void*> borrowed;
    std::shared_ptr<const void> hold;
    std::unique_ptr<kernels::Event> uploaded;
  };
  // What a lane's pull found: its version, its wait (on "not yet" answers
  // and the ps's wait for the version), and in an asynchronous job the
  // clock and the staleness.
  struct LanePull {
    int64_t version = -1, wait_us = 0, clock = 0, lag = 0;
  };
  struct LaneRound;
  struct Round;

  PsExchange(PsExchangeOptions options, ExchangeHooks hooks, ps::Client* client,
             PsExchangeBuffers buffers);
  // Lanes from the plan, with their sinks and refs; the pools.
  absl::Status MakeLanes(const Placement& placement);
  // Where pulled weights go to the device: each slice's offset, the pulls'
  // regions borrowed (pinned for the GPU) and their events.
  absl::Status PrepareUploads();
  // Pushes every lane's gradients of `push_step` when it is >= 0 (skips
  // instead, with `skip`), each lane then pulling its slices of
  // min_version. With `verdict` (pushes during the backward pass), each
  // lane first waits until grads_ready_ holds its gradients, checks them
  // and marks the verdict, and pushes them only if finite. It pulls once
  // the verdict says the whole step is finite where the pull lands in the
  // network's own buffers (a CPU's); where weights are staged on the host
  // (a GPU's), it pulls at once, its copies to the device queued behind
  // the step, and gives up asking the ps once the verdict is not finite.
  // on_pushed runs after the verdict. A lane that stops on a step that is
  // not finite returns OK (the caller asks the verdict).
  absl::Status RunLanes(int64_t push_step, int64_t min_version, bool skip,
                        const OnPushed& on_pushed, ExchangeRound* out,
                        StepVerdict* verdict = nullptr);
  // One lane's part of a round: its check, push and pull.
  absl::Status RunLane(Round& round, int l);
  // Pushing during the backward pass, whole: waits for the lane's
  // gradients, checks them and marks the verdict. False: not to be pushed.
  absl::StatusOr<bool> CheckBeforePush(Round& round, int l);
  // The lane's push (with its pull beside it where weights are staged).
  absl::Status PushLane(Round& round, int l);
  absl::StatusOr<PushResponse> SendPush(Round& round, int l);
  // Pushing in runs: waits for run g's gradients; marks the lane's part of
  // the verdict from run g's check.
  absl::Status WaitRun(Round& round, int l, int g);
  absl::Status MarkRun(Round& round, int l, int g, bool finite);
  // The lane's part of the verdict, still owed after a push that ended
  // before its last run.
  void MarkOwed(Round& round, int l);
  // What both do: waits until lane `l`'s gradients are final (or a stop or
  // a failed verdict ends the wait: *ready false), marks the verdict with
  // whether they are finite, and returns that.
  bool WaitAndMark(Round& round, int l, bool* ready);
  // Once per lane whose push was answered (and found finite): the last one
  // runs on_pushed.
  void CountPush(Round& round, int l);
  // The versions the lanes pulled, into `out`.
  absl::Status Collect(const Round& round, ExchangeRound* out);
  // Pulls lane `l`'s slices of min_version (asking again while the ps
  // answers "not yet"), then copies to the device each variable whose last
  // slice this was. In an asynchronous job min_version is this worker's
  // clock to wait for (PullByClock). With `open_verdict` (a pull before the
  // step's verdict), each "not yet" comes after at most 100 ms while the
  // verdict is open, and the lane stops asking (OK, version -1) once it
  // failed. Once `give_up` holds, it stops asking (CANCELLED).
  absl::Status PullLane(int l, int64_t min_version, StepVerdict* open_verdict, LanePull* out,
                        const std::atomic<bool>* give_up = nullptr);
  absl::StatusOr<ps::Client::ClockedPull> AskLane(int l, int64_t min_version,
                                                  absl::Duration max_wait, absl::Time deadline,
                                                  const std::atomic<bool>* give_up);
  // Copies the lane's pulled weights to the device: from the pull's region
  // (borrowed) or the staging buffers.
  absl::Status UploadBorrowed(Lane& lane, std::shared_ptr<const void> hold);
  absl::Status UploadStaged(const Lane& lane);
  // Lets go of the lane's region once the uploads from it are done.
  absl::Status ReleaseHold(Lane& lane);
  // Whether lane `l`'s gradients are finite in the exchange's dtype (what
  // it cannot hold counts as infinite).
  bool LaneFinite(int l) const;
  // The magnitude a pushed value must stay below: the wire dtype's
  // overflow, or the job's max_gradient_abs where that is lower.
  float GradientLimit() const;
  // Whether the step the lanes exchange beside has been queued (pushing
  // during the backward pass, the lanes start before it): a lane queues its
  // uploads only after that, so that each waits for this step's record of
  // its event, not the step's before (which would let it overwrite weights
  // the queued step still reads). True outside such an exchange.
  void SetStepQueued(bool queued) ABSL_LOCKS_EXCLUDED(queued_mu_);
  void WaitStepQueued() ABSL_LOCKS_EXCLUDED(queued_mu_);
  absl::Status FromPs(const absl::Status& s) const;
  uint64_t job_id() const { return options_.job_id->load(); }
  int64_t trace_step() const { return options_.trace_step->load(); }

  const PsExchangeOptions options_;
  const ExchangeHooks hooks_;
  ps::Client* const client_;
  const PsExchangeBuffers buffers_;
  std::vector<Lane> lanes_;
  // By variable: its number of slices, and during a round of pulls the
  // number still to come (the lane that brings the last one uploads it).
  std::vector<int> slices_of_;
  std::unique_ptr<std::atomic<int>[]> to_come_;
  // GPU workers: pulled weights are uploaded straight from the pulls' shared
  // regions (pinned for the GPU) where the ps writes them, in the wire
  // dtype (16-bit values widened on the GPU), not decoded into the staging
  // buffers first.
  bool borrow_pulls_ = false;
  std::atomic<bool> told_borrow_{false};  // the log said a pull's weights were borrowed
  int num_ps_ = 0;
  // Asynchronous jobs: the version each ps's slices were last pulled at
  // (the lowest of its lanes'), which its next push names.
  std::vector<int64_t> ps_versions_;
  std::unique_ptr<ThreadPool> pool_;  // for the lanes' pulls and pushes
  // The lanes' pulls that run beside their pushes.
  std::unique_ptr<ThreadPool> pullers_;
  // Pushes during the backward pass: each variable's position in the
  // backward order, the positions whose gradients are on the host and
  // final this step, the step's verdict, and the thread that runs the lanes
  // meanwhile, with the outcome of its round.
  bool push_early_ = false;
  std::vector<int> backward_pos_;
  allreduce::PieceReadiness grads_ready_;
  StepVerdict verdict_;
  bool early_ = false;  // BeginStep started the lanes
  std::unique_ptr<absl::Notification> exchanged_;
  absl::Status exchange_status_;
  absl::Mutex queued_mu_;
  bool step_queued_ ABSL_GUARDED_BY(queued_mu_) = true;
  // Runs a step's lanes beside its compute; declared last, so that its
  // thread is joined before the state above that a round uses goes.
  std::unique_ptr<ThreadPool> exchange_caller_;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_PS_EXCHANGE_H_
