// The logic of a training worker, behind interfaces: it talks to the chief
// through chief::Client and to the parameter servers through ps::Client, and
// knows no gRPC (worker/service.h serves its status, worker/main.cc wires it
// to the network; tests drive it against the fakes of tests/fakes/).
//
// Run() registers with the chief (retrying with backoff while the chief is
// not up), takes its shard of every epoch and runs synchronous steps:
// forward and backward on its batch with the weights of step k, then the
// exchange of the job's strategy (worker/exchange.h): with the ps in lanes
// (worker/ps_exchange.h), or, in a job without ps (JobConfig.exchange
// ALL_REDUCE), on the host ring in front of this worker's own replica
// (worker/ring_exchange.h), or, GPU workers of such a job, over NCCL in
// front of the replica they keep on the device (worker/device_replica.h).
// The step's metrics go to the report loop (worker/reporter.h), which sends
// them to the chief (the reports are also its heartbeat). A ps that holds another job or none,
// drops this worker, or disagrees with its peers on the version, or a chief
// that answers REGISTER, makes it register again and train on from the step
// the chief names. When the ps reach the last step it reports `finished`
// and waits for the chief's exit order.
//
// Thread-safety: Run() once, from one thread; Stop() and Status() from any
// thread, at any time, also concurrently with Run().
#ifndef PSFLOW_WORKER_TRAINER_H_
#define PSFLOW_WORKER_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "allreduce/ring.h"
#include "chief/client.h"
#include "common/fan_out.h"
#include "common/step_trace.h"
#include "data/mnist.h"
#include "model/network.h"
#include "proto/chief.pb.h"
#include "proto/job.pb.h"
#include "ps/client.h"
#include "ps/replica.h"
#include "worker/batches.h"
#include "worker/exchange.h"
#include "worker/model_replicas.h"
#include "worker/ps_exchange.h"
#include "worker/reporter.h"
#include "worker/staging.h"

namespace psflow::worker {

struct TrainerOptions {
  int worker_index = 0;
  std::string device = "cpu";  // kernels backend
  // Only for messages: where the chief is.
  std::string chief_address = "the chief";
  // How long to keep trying to reach the chief or a ps before giving up
  // (UNAVAILABLE or DEADLINE_EXCEEDED: exit code 138).
  absl::Duration startup_timeout = absl::Minutes(5);
  // The deadline of one registration call (a chief that is not up yet is
  // waited for that long before the next attempt).
  absl::Duration register_timeout = absl::Seconds(15);
  // How long a ps may hold a pull while the other workers finish the step
  // before answering "not yet" (the trainer then asks again).
  absl::Duration pull_wait = absl::Seconds(5);
  // Allowance for moving one shard's tensors, on top of any waiting.
  absl::Duration transfer_timeout = absl::Seconds(120);
  // Reports (and heartbeats) go to the chief at least this often.
  absl::Duration report_every = absl::Milliseconds(250);
  // The deadline of one report call.
  absl::Duration report_timeout = absl::Seconds(10);
  // After a step that was not finite, how long to wait for the chief to
  // confirm that the job failed before exiting anyway.
  absl::Duration nonfinite_wait = absl::Seconds(30);
  // A ps's slices travel in at most this many lanes (concurrent pulls and
  // pushes, each over its own connection when the ps client has as many:
  // worker/main.cc makes them match), of at least lane_bytes each.
  int lanes_per_ps = 4;
  // Threads that decode streamed training data (TFRecord, image folders,
  // CSV): the input pipeline's own pool (data/pipeline.h).
  int input_threads = 1;
  int64_t lane_bytes = int64_t{1} << 20;
  // Each lane checks and pushes its gradients as soon as the backward pass
  // has completed them (and a GPU has copied them to the host), while the
  // rest of the step runs; it pulls once the whole step is known finite.
  // Only in jobs with ps whose on_nonfinite is FAIL, for workers of one
  // device whose backend computes in host memory or copies gradients out
  // bucket by bucket: a step that is not finite fails the job, so finite
  // gradients of it pushed before that was known are harmless. SKIP_STEP
  // needs the whole step's verdict before the first push. False: every
  // push waits for the end of the step.
  bool push_during_backward = true;
  // Pushing during the backward pass on a CPU (whose variables each become
  // final alone), a run of a lane's slices goes on to the lane's next
  // variable while it holds fewer than this many bytes (counted as fp32):
  // small gradients (biases, small layers) travel with the next ones instead
  // of as messages of their own, each of which costs the worker and the ps a
  // few thread wake-ups. A lane's last run may be smaller. 0: a run per
  // variable. GPU buckets are runs of their own either way.
  int64_t min_run_bytes = int64_t{256} << 10;
  // A GPU worker uploads pulled weights straight from the shared memory the
  // ps wrote them into (registered with the GPU; 16-bit values widened on
  // the GPU), instead of decoding them into its page-locked buffers first.
  // False: always through those buffers.
  bool upload_from_shared_memory = true;
  // A GPU worker of a job with ps, copying its gradients out during the
  // step (one GPU), with fp32 on the wire or gradients rounded on the GPU:
  // the copies land in one shared region registered with the GPU, which
  // pushes offer to the ps and name the gradients in where they lie (the
  // check reads them there, nothing copies them). False: in page-locked
  // buffers of its own, copied into a region of the ps client by each push.
  bool gradients_to_shared_memory = true;
  // A GPU worker of a job with ps and a 16-bit wire dtype, copying its
  // gradients out during the step (one GPU): rounds them to the wire dtype
  // on the GPU, so that half the bytes cross to the host and its pushes send
  // them as they lie. False: copies the fp32 gradients and encodes them on
  // the host as they are pushed. (Not in jobs that clip gradients: the norm
  // is taken in fp32 on the host.)
  bool narrow_on_device = true;
  // A job without ps (JobConfig.exchange ALL_REDUCE) needs both: the ring
  // of this worker and its peers, and this worker's own replica, the one
  // its ps service serves in this process (neither owned; both outliving
  // the trainer). The trainer loads the replica (worker 0's is the chief's
  // to load) and reaches it in-process (ps::Replica::Connect). A GPU worker
  // keeps its replica's weights and optimizer state on the device and
  // applies the optimizer there (see worker/device_replica.h); the served
  // replica gets the state (ps::Replica::Mirror) when a snapshot asks for a
  // step, every kReplicaPublishSteps steps on worker 0 (whose replica the
  // chief and the evaluator read), at a stop and at the end.
  allreduce::Ring* ring = nullptr;
  ps::Replica* replica = nullptr;
  // Called (if set) with true after each registration with the chief, and
  // with false when the worker registers again or Run returns: whether it
  // takes part in a job (its readiness). Called from Run's thread.
  std::function<void(bool)> on_registered;
  // Where set (not owned; outliving the trainer), the steps it wants are
  // traced: each step, its input, compute and wait after the pass, the
  // buckets' arrival on the host, each lane's push, runs and pull.
  StepTrace* trace = nullptr;
};

// Makes the ps client, once, at the first registration.
using PsClientFactory = ps::ClientFactory;

// What the status service reports.
struct TrainerStatus {
  int worker = 0;
  uint64_t job_id = 0;    // 0 before registration
  int64_t step = 0;       // the step being computed (or reached, once finished)
  bool finished = false;  // saw the final version; waiting for the exit order
};

class Trainer {
 public:
  // `chief` is not owned and must outlive the trainer.
  Trainer(TrainerOptions options, chief::Client* chief, PsClientFactory make_ps);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains until the chief says the job is over (OK). Errors, by the exit
  // code common/exit_codes.h gives them:
  //   1   a permanent error: the chief refused registration or sent an
  //       inconsistent job, the device or the data does not fit, a step was
  //       not finite (with on_nonfinite FAIL), or the chief failed the job
  //       (ReportResponse::FAIL);
  //   138 the chief or a ps stayed unreachable for startup_timeout;
  //   140 another failure worth a retry (the chief now runs another job
  //       configuration, a step failed, a ps refused a call for good);
  //   StoppedBySignal(n) after Stop(n).
  absl::Status Run();
  // Makes Run() return StoppedBySignal(signal) after the call in flight;
  // calls waiting on a ps are cancelled. The first signal wins.
  void Stop(int signal);
  // Stop(signal) once the pushes of the step in flight are answered (at
  // once if none is in flight), waiting at most `max_wait` for them (then
  // Stop all the same): a worker told to stop with the whole cluster leaves
  // every ps at the same step, whole, for the chief's stop checkpoint
  // (otherwise the ps its pushes reached may apply a step the others never
  // get). Blocks until then.
  void StopAfterPushes(int signal, absl::Duration max_wait);
  TrainerStatus Status() const;

 private:
  absl::Status Register();
  // Tells options_.on_registered, if set.
  void SetRegistered(bool registered) const;
  // Checks the job, loads the data, and makes the model's replicas, their
  // staging on the host and the exchange of the job's strategy.
  absl::Status Prepare();
  absl::Status CheckJob() const;
  absl::Status LoadData();
  // The exchange of the job's strategy (after the staging): a replica on
  // the device where the job keeps one (MakeDeviceReplica; else null).
  absl::Status MakeExchange();
  absl::StatusOr<std::unique_ptr<PsExchange>> MakeLanes();
  absl::StatusOr<std::unique_ptr<Exchange>> MakeDeviceReplica();
  ExchangeHooks Hooks();
  // A step's pushes start, and end (all answered, or given up): the end
  // carries out a StopAfterPushes that waits for it.
  void OpenPushes();
  void ClosePushes();
  // A StopAfterPushes waits for the pushes in flight.
  bool StopPending() const;
  // All-reduce jobs, workers but 0: loads this worker's replica with worker
  // 0's (values and optimizer state, at its version) and trains on it.
  absl::Status LoadReplica();
  // All-reduce jobs: logs a CRC-32C of this worker's replica (values and
  // optimizer state) at the final step; equal on every worker.
  void LogReplicaDigest();
  // All-reduce jobs: whether to stop waiting for the group (a stop, or the
  // ring's group left: a member failed).
  bool GroupAbandoned() const;
  bool AllReduce() const { return job_.exchange() == JobConfig::ALL_REDUCE; }
  // Whether the job applies each worker's gradient alone (JobConfig.mode).
  bool Async() const;
  // Trains from `start` to the last step (OK), or ends with a status that
  // IsRegisterAgain or that ends Run; the exchange's Finish says which.
  absl::Status Train(int64_t start);
  struct Position;
  // The chief failed the job or asks for a registration (or, with
  // `stop`, a stop): the status that ends Train (else OK).
  absl::Status Interrupted(bool stop) const;
  // The status Train ends with after an exchange that returned `s` (OK: go
  // on); `what` names the exchange.
  absl::Status ExchangeFailure(const absl::Status& s, absl::string_view what) const;
  // The first pull of a Train, and one step with its exchange.
  absl::Status FirstPull(Position* at);
  absl::Status TrainStep(WorkerBatches& batches, Position* at);
  // The step's forward and backward pass on the model's replicas.
  absl::StatusOr<model::Network::Result> Compute(const WorkerBatches& batches);
  // JobConfig.clip_gradient_norm, after Reduce: clips the step's trainable
  // gradients (the host buffers, or the exchange's on the device);
  // *clipped: they were scaled.
  absl::Status Clip(bool* clipped);
  bool Clipping() const { return job_.clip_gradient_norm() > 0; }
  // The step's push and the pull that follows, with the step's verdict.
  absl::Status PushStep(const StepPush& push, ExchangeRound* got);
  // The times of a step's metrics: its wait and pull (before it), compute
  // (t1 to t2) and push (to pushed_at).
  static void SetTimes(const Position& at, absl::Time t1, absl::Time t2, absl::Time pushed_at,
                       StepMetrics* m);
  // After step `step`'s exchange: the next position, and the metrics of
  // an asynchronous job's step (else null) reported with their staleness.
  void Advance(int64_t step, absl::Time pushed_at, StepMetrics* async_metrics, Position* at);
  // After a step that was not finite: waits for the chief's verdict.
  absl::Status NonFinite(int64_t step);
  absl::Status TrainAndWait();
  // Whether calls in flight were cancelled on purpose: Stop, or the chief's FAIL.
  bool Stopping() const ABSL_LOCKS_EXCLUDED(mu_);
  // worker::FromPs, with this worker's Stopping.
  absl::Status FromPs(const absl::Status& s) const ABSL_LOCKS_EXCLUDED(mu_);
  int stop_signal() const ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels the ps calls in flight (the chief failed the job).
  void CancelPs() ABSL_LOCKS_EXCLUDED(mu_);
  // The ps client (null before the first registration); set once.
  ps::Client* ps() const ABSL_LOCKS_EXCLUDED(mu_);

  const TrainerOptions options_;
  // The step the training thread is on, for the spans of the lanes' threads
  // (options_.trace).
  std::atomic<int64_t> trace_step_{-1};
  chief::Client* const chief_;
  const PsClientFactory make_ps_;

  // Set at each registration by the training thread; read anywhere.
  std::atomic<uint64_t> job_id_{0};
  uint64_t ring_key_ = 0;  // the chief's RegisterWorkerResponse.ring_key
  // The report loop, and what the chief answers it.
  Reporter reporter_;

  // The training thread's own state, made by Prepare. Each is declared
  // after what it uses: destroyed before it.
  JobConfig job_;
  int64_t start_step_ = 0;  // from the latest registration
  // The training data: held whole (IDX, synthetic), or the streamed data
  // set the batches read from.
  data::Dataset data_;
  std::unique_ptr<data::DataFormat> format_;
  std::unique_ptr<ModelReplicas> model_;
  std::unique_ptr<HostStaging> staging_;
  // The exchange of the job's strategy (ps lanes, the host ring, or the
  // replica on the device).
  std::unique_ptr<Exchange> exchange_;
  Backoff register_backoff_;  // between registrations that end in no step

  mutable absl::Mutex mu_;
  std::unique_ptr<ps::Client> ps_ ABSL_GUARDED_BY(mu_);
  int stop_signal_ ABSL_GUARDED_BY(mu_) = 0;
  // A step's pushes are in flight (from the start of the exchange until
  // every lane's push is answered or it returns), and the signal to stop
  // with once they are (StopAfterPushes).
  bool pushes_open_ ABSL_GUARDED_BY(mu_) = false;
  int stop_after_pushes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_TRAINER_H_
