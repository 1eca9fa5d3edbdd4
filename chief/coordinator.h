// The chief's logic, with no gRPC in it: job state, worker registration and
// supervision, loading and watching the ps, recovery, checkpoint
// orchestration, the saved model and the end of the job; evaluators are
// answered by its Evaluators (chief/evaluators.h) with the job's state. It
// reaches the ps only through ps::Client; the chief's gRPC service
// (chief/service.h) forwards workers' calls to RegisterWorker and Report, and
// evaluators' to RegisterEvaluator and ReportEval. Tests drive it with fakes
// (tests/fakes/).
//
// Thread-safe: RegisterWorker, Report, RegisterEvaluator, ReportEval and Stop
// may be called from any thread while Run runs on one. Lock order:
// membership_mu_ before mu_; the Evaluators' lock is never held with either.
#ifndef PSFLOW_CHIEF_COORDINATOR_H_
#define PSFLOW_CHIEF_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "chief/checkpoint.h"
#include "chief/evaluators.h"
#include "chief/job_config.h"
#include "chief/metrics.h"
#include "chief/progress.h"
#include "chief/ps_witness.h"
#include "common/cluster_config.h"
#include "common/thread_pool.h"
#include "proto/chief.pb.h"
#include "proto/job.pb.h"
#include "ps/client.h"

namespace psflow::chief {

// Every timeout and retry count of the chief, in one place. The defaults are
// what the binaries use; tests shorten them.
struct Timeouts {
  // How long loading the ps may wait for them to come up (--startup_timeout).
  absl::Duration startup = absl::Minutes(5);
  // A worker without a report (heartbeat) for this long is dropped from the
  // synchronous steps until it registers again (--worker_timeout).
  absl::Duration worker = absl::Seconds(30);
  // How often the supervisor looks at the ps, the workers and the clock.
  absl::Duration supervise_every = absl::Milliseconds(100);
  // A registration waits this long at most for the ps to be loaded.
  absl::Duration register_wait = absl::Seconds(10);
  // A finished worker's report is held this long (or until the job ends).
  absl::Duration report_hold = absl::Seconds(2);
  // GetState of one ps (also how a ps's health is judged).
  absl::Duration state_call = absl::Seconds(2);
  // SetLiveWorkers and Shutdown of one ps.
  absl::Duration control_call = absl::Seconds(10);
  // Snapshot of one ps for a checkpoint.
  absl::Duration snapshot_call = absl::Seconds(20);
  // The checkpoint a chief stopped by a signal takes before it exits: at
  // most this long, so that it exits within a grace period (Kubernetes
  // gives 30 s, psflow-launch 10) also when the ps are stopping too.
  absl::Duration stop_checkpoint = absl::Seconds(5);
  // The exit orders of a chief told to stop before it released a failed or
  // finished job: the ps still up take them at once, and one that is gone
  // (stopping with the cluster) is waited for no longer than this.
  absl::Duration stop_release = absl::Seconds(2);
  // Pull of the final weights when no checkpoint holds them.
  absl::Duration final_pull = absl::Minutes(1);
  // How long the workers get to collect the exit (or fail) order.
  absl::Duration release_wait = absl::Seconds(30);
  // An evaluator not heard from for this long (it beats every second) is
  // not waited for at the end of the job.
  absl::Duration evaluator = absl::Seconds(30);
  // When no evaluator ever called (one listed but not run), the end of the
  // job waits this long (at most `evaluator`) for one starting late: a
  // running one calls at least every 2 s (its registration's backoff).
  absl::Duration unregistered_evaluator = absl::Seconds(5);
  // The end of the job waits at most this long for a live evaluator's
  // evaluation of the final model (--eval_final_timeout).
  absl::Duration final_eval = absl::Minutes(10);
  // A checkpoint whose chosen step a ps passed before snapshotting is tried
  // again this many times.
  int checkpoint_attempts = 5;
  // Adopting a running job: how often to look for every ps at one step.
  int adopt_attempts = 40;
  absl::Duration adopt_retry = absl::Milliseconds(50);
  // A synchronous job with ps and --on_nonfinite=fail fails on a worker's
  // report of a step that is not finite once a ps has gone this long
  // without that worker's gradients of the step (a real one never pushes
  // them); the worker's push of the step refutes the report.
  absl::Duration nonfinite_confirm = absl::Seconds(5);
};

struct CoordinatorOptions {
  std::vector<std::string> ps_addresses;  // by ps index, handed to workers
  std::string model_dir;                  // required: checkpoints (and the saved model)
  std::string saved_model_dir;            // default <model_dir>/saved_model
  int log_every_steps = 100;
  // Checkpoints: every this many steps and/or this long (0 = not by that
  // measure), keeping the newest keep_checkpoints.
  int64_t checkpoint_every_steps = 0;
  absl::Duration checkpoint_every = absl::Minutes(10);
  int keep_checkpoints = 5;
  // Evaluators: when they evaluate (handed to them at registration; 0 = not
  // by that measure; the final model always), and how many the cluster
  // lists. The end of the job waits for an evaluation of the final model
  // when an evaluator has registered, and briefly
  // (Timeouts::unregistered_evaluator) when one is listed but none came.
  int64_t eval_every_steps = 0;
  int64_t eval_every_secs = 60;
  int num_evaluators = 0;
  // Callers present certificates (TLS): an evaluator index the cluster
  // leaves out may register, and a new registration of an index replaces
  // the old (Evaluators).
  bool identified_callers = false;
  Timeouts timeouts;
  // Where the chief's metrics go (may be null); must outlive the coordinator
  // and not be rendered once it is gone.
  metrics::Registry* metrics = nullptr;
  // Called (if set) with true once every ps holds the job and with false
  // when the chief reloads them: the chief's readiness. Called under the
  // coordinator's lock: it must only record the state.
  std::function<void(bool)> on_ready;
};

// Everything psflow-chief is configured with.
struct ChiefOptions {
  ClusterConfig cluster;
  JobOptions job;
  CoordinatorOptions coordinator;  // ps_addresses come from `cluster`
};

// Checks the coordinator's settings, then BuildJobConfig of the job's for
// the cluster's workers and ps. INVALID_ARGUMENT with one line naming the
// flag.
absl::StatusOr<JobConfig> BuildJobConfig(const ChiefOptions& options);

class Coordinator {
 public:
  // `ps` (not owned) must outlive the coordinator; so must `pool`, whose
  // threads fan calls out over the ps (at least num_ps - 1 of them help),
  // and `progress_listener` (optional), which receives the progress lines as
  // numbers (psflow-chief's writes event files: chief/summaries.h).
  Coordinator(CoordinatorOptions options, JobConfig job, ps::Client* ps, ThreadPool* pool,
              ProgressListener* progress_listener = nullptr);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Runs the job to the end: loads (or adopts) the ps, supervises, checkpoints,
  // writes the saved model and releases everyone. OK when done;
  // StoppedBySignal(n) after Stop(n) (having checkpointed); OUT_OF_RANGE when
  // the job diverged; otherwise the error that ended it (ExitCodeFor maps it).
  absl::Status Run();
  // Makes Run() checkpoint and return StoppedBySignal(signal). Thread-safe.
  void Stop(int signal);

  // A worker's registration: the job once every ps holds it. UNAVAILABLE
  // while the ps are not loaded (the worker retries), INVALID_ARGUMENT for a
  // worker not in the job.
  absl::StatusOr<RegisterWorkerResponse> RegisterWorker(int worker, absl::Time deadline);
  // A worker's metrics and heartbeat. INVALID_ARGUMENT for impossible
  // metrics (nothing recorded). A finished worker's call is held until the
  // job ends or `deadline` (at most Timeouts::report_hold).
  absl::StatusOr<ReportResponse> Report(const ReportRequest& request, absl::Time deadline);
  // An evaluator's registration: the job and when to evaluate, once the ps
  // hold it (UNAVAILABLE before; FAILED_PRECONDITION once the job failed;
  // `done` once it is over). INVALID_ARGUMENT for an evaluator index the
  // cluster does not have.
  // `lease`: the evaluator's from its last registration (Evaluators::Register).
  absl::StatusOr<RegisterEvaluatorResponse> RegisterEvaluator(int evaluator, uint64_t lease = 0);
  // An evaluator's heartbeat and result: logged as an `eval` line (and kept
  // for the closing line when it is of the final step). INVALID_ARGUMENT for
  // impossible values (nothing recorded); a result of another job (reloaded
  // since) is dropped with REGISTER.
  absl::StatusOr<ReportEvalResponse> ReportEval(const ReportEvalRequest& request);

 private:
  struct Weights {  // full tensors (values and optimizer slots) to load the ps with
    int64_t step = 0;
    std::vector<CheckpointTensorData> tensors;
  };

  // Adopts the job the ps still hold, or loads them with InitialWeights.
  absl::Status StartJob();
  absl::StatusOr<Weights> InitialWeights();
  bool TryAdopt();
  absl::Status LoadParameterServers(const Weights& weights);
  absl::Status Supervise();
  // A ps told to stop serves on until this chief has checkpointed what it
  // holds: checkpoints (unless the last one is of `version`) and tells it.
  // False when the job failed meanwhile.
  bool CheckpointForStoppingPs(const std::vector<PsState>& states, int64_t version);
  // The checkpoint --checkpoint_every_steps or --checkpoint_every asks for.
  void CheckpointIfDue(int64_t version);
  // Stopped by a signal: the stop checkpoint, then what Supervise returns.
  absl::Status CheckpointAndStop();
  void CheckWorkers();
  // An all-reduce job's registration of worker `w`: one registering again
  // after all had breaks the group. The group's error once it is broken.
  absl::Status JoinGroup(int w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the job for a report's non-finite steps, per --on_nonfinite; in a
  // synchronous job with ps and FAIL, once the ps bear the report out
  // (ResolveNonfinite).
  void HandleNonfinite(const ReportRequest& request);
  // Whether a non-finite step reported under FAIL waits for the ps to bear
  // it out: synchronous jobs with ps (the ps know each worker's pushes).
  bool ConfirmsNonfinite() const;
  // The claims of non-finite steps against the ps's `states`: fails the job
  // for one they bear out (a ps still lacks the worker's gradients of the
  // step after Timeouts::nonfinite_confirm), drops (logged, counted) one
  // they refute (every ps has them, or the step is beyond a ps's version).
  void ResolveNonfinite(const std::vector<PsState>& states) ABSL_LOCKS_EXCLUDED(mu_);
  // A report's metrics that go to the progress log: each of a step the ps
  // have this worker's gradients of (an asynchronous job: a version the
  // ps reached), looked at afresh where the last look does not show it;
  // those of other steps are dropped (logged, counted). With FAIL, steps
  // that are not finite are ResolveNonfinite's, not progress.
  std::vector<StepMetrics> CheckedMetrics(const ReportRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // Sends the chief's live set to every ps if the set of any of `states`
  // differs from it (a broadcast that half failed, or a forged SetLiveWorkers).
  void RepairLiveSets(const std::vector<PsState>& states)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(membership_mu_);
  // Every ps's state, if every ps answers and holds a job (`job_id`, unless
  // 0); the first error otherwise. The one look at the ps.
  absl::StatusOr<std::vector<PsState>> States(uint64_t job_id) ABSL_LOCKS_EXCLUDED(mu_);
  static int64_t MaxVersion(const std::vector<PsState>& states);
  // Whether every ps holds this job at version train_steps or later.
  bool EveryPsAtTheEnd();
  bool PsHealthy(int64_t* max_version);
  absl::Status Recover();
  // On success, what was written is moved into *taken when one is given.
  absl::Status TakeCheckpoint(Checkpoint* taken = nullptr);
  // `attempt` counts from 0. A retry of an asynchronous job asks for a
  // version a few gradients past the newest even when the ps agree; from
  // the third attempt on, a synchronous job asks for two steps past it (it
  // moves faster than the chief can look and ask).
  absl::Status TakeCheckpointOnce(Checkpoint* taken, int attempt);
  // The version the ps are asked to snapshot, given their `states`.
  int64_t CheckpointTarget(const std::vector<PsState>& states, int attempt) const;
  // An asynchronous job's staleness as the ps counted it, in one log line.
  void LogStaleness();
  // Writes the saved model from the values of `final_checkpoint` (one of
  // step train_steps), or, without one, from the values pulled from the ps.
  absl::Status SaveModel(Checkpoint* final_checkpoint);
  // The end of a job trained to its last step: the final checkpoint, the
  // saved model (into *status), the evaluation of the final model while the
  // ps still hold it. False when the job failed meanwhile.
  bool Conclude(absl::Status* status);
  // The closing line of a job that ended well.
  void LogDone();
  // The job's state for the evaluators' calls.
  JobState StateForEvaluators() ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseEveryone();
  // Tells the ps `ps` that the checkpoint a stopping ps waits for is
  // written or given up (each once, within stop_release): one that was
  // told to stop exits now. Returns how many took it.
  int TellCheckpointTaken(const std::vector<int>& ps);
  absl::Status BroadcastLiveWorkers(const std::vector<int>& live, int64_t from_version);
  // Fails the job for good (it diverged): no more checkpoints, no saved
  // model, FAIL to every worker; Run returns `why`.
  void Fail(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);
  bool Failed() ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t job_id() ABSL_LOCKS_EXCLUDED(mu_);
  bool Stopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_signal_ != 0; }
  // Stopping, under the lock taken here.
  bool StopRequested() ABSL_LOCKS_EXCLUDED(mu_);
  // A job whose workers all-reduce their gradients (JobConfig.exchange):
  // its one "ps" is worker 0's replica, which hears worker 0 alone.
  bool AllReduce() const { return job_.exchange() == JobConfig::ALL_REDUCE; }
  std::string SavedModelDir() const;

  const CoordinatorOptions options_;
  const JobConfig job_;
  ps::Client* const ps_;
  ThreadPool* const pool_;
  std::unique_ptr<Progress> progress_;
  Evaluators evaluators_;
  ChiefMetrics metrics_;
  int64_t last_checkpoint_step_ = 0;  // Run's thread only
  // The stopping ps told so (Run's thread only; cleared by a reload).
  absl::flat_hash_set<int> told_stopping_;
  absl::Time last_checkpoint_time_;  // Run's thread only
  // No snapshot call of a checkpoint lasts past this (Run's thread only;
  // set when a signal stops the chief).
  absl::Time checkpoint_cutoff_ = absl::InfiniteFuture();

  // Changes of the live set are made one at a time (they call the ps).
  absl::Mutex membership_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;
  // ALL_REDUCE jobs: the workers' proof of membership in their ring
  // (RegisterWorkerResponse.ring_key), random per chief incarnation.
  const uint64_t ring_key_;
  int stop_signal_ ABSL_GUARDED_BY(mu_) = 0;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;    // every ps holds the job
  bool trained_ ABSL_GUARDED_BY(mu_) = false;  // every step applied: later reports change nothing
  bool done_ ABSL_GUARDED_BY(mu_) = false;     // the job is over: workers may exit
  bool exit_orders_out_ ABSL_GUARDED_BY(mu_) = false;       // ReleaseEveryone is telling the ps
  absl::flat_hash_set<int> live_ ABSL_GUARDED_BY(mu_);      // workers the steps wait for
  std::vector<absl::Time> last_seen_ ABSL_GUARDED_BY(mu_);  // per worker
  absl::flat_hash_set<int> finished_ ABSL_GUARDED_BY(mu_);  // saw the final version
  absl::flat_hash_set<int> released_ ABSL_GUARDED_BY(mu_);  // were told to exit (or fail)
  // Why the job failed for good (it diverged); OK while it has not.
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  // All-reduce jobs: the workers registered so far, and why the group broke
  // (a worker registered again or went silent): Run then checkpoints and
  // returns it (UNAVAILABLE: every process restarts).
  absl::flat_hash_set<int> registered_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int> reported_ ABSL_GUARDED_BY(mu_);  // since its registration
  absl::Status group_broken_ ABSL_GUARDED_BY(mu_);
  int64_t refused_reports_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<int64_t> skipped_steps_ ABSL_GUARDED_BY(mu_);  // with SKIP_STEP
  // The last look at the ps (any States call) and the reports of steps
  // that were not finite waiting for the ps to bear them out.
  PsWitness witness_;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_COORDINATOR_H_
