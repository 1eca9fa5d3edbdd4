// The logic of an evaluator (psflow-evaluator), behind interfaces: it talks
// to the chief through chief::EvaluatorClient and to the parameter servers
// through ps::Client, and knows no gRPC (evaluator/main.cc wires it).
//
// Run() registers with the chief (retrying while the chief is not up or the
// ps not loaded), which hands it the job and when to evaluate. Then it
// watches the ps's versions and picks the next version to evaluate: the next
// multiple of eval_every_steps, the next version once eval_every_secs passed
// since the last evaluation began, and always the final one (train_steps),
// whichever comes first. Versions that pass while it evaluates are skipped,
// never queued. It asks every ps at once for a snapshot of exactly that
// version (values only; each ps copies its slices the moment it gets there,
// so the weights are one consistent step across shards), evaluates them on
// the test split, and reports the loss and accuracy to the chief. A
// heartbeat goes to the chief every second, also between evaluation batches.
// Nothing in training waits for an evaluator: a ps serves a snapshot from a
// copy, and the chief waits only at the very end, for the final evaluation.
//
// Given a metrics registry, each evaluation also goes there: the step, loss
// and accuracy of the latest (psflow_evaluator_step, psflow_evaluator_loss,
// psflow_evaluator_accuracy), a count (psflow_evaluator_evaluations_total)
// and its duration, snapshot and pass over the test split together
// (psflow_evaluator_seconds).
//
// Thread-safety: Run() once, from one thread; Stop() and Status() from any
// thread, at any time.
#ifndef PSFLOW_EVALUATOR_EVALUATOR_H_
#define PSFLOW_EVALUATOR_EVALUATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "chief/client.h"
#include "common/metrics.h"
#include "common/thread_pool.h"
#include "data/mnist.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "proto/chief.pb.h"
#include "proto/evaluator.pb.h"
#include "proto/job.pb.h"
#include "ps/client.h"

namespace psflow::evaluator {

struct EvaluatorOptions {
  int evaluator_index = 0;
  std::string device = "cpu";  // kernels backend
  int compute_threads = 0;     // CPU kernel threads; 0 = the library's default
  // The test split comes from here instead of the job's data_dir when set.
  std::string data_dir;
  // Test examples of a job on the synthetic dataset (as psflow-eval's).
  // Streamed jobs: the evaluation files instead of the job's when set, and
  // the threads that decode them.
  std::string eval_files;
  int input_threads = 1;
  int64_t synthetic_examples = 2000;
  int batch_size = 500;  // examples per forward pass (psflow-eval's default)
  // Bytes the evaluation may take on the device (the network's weights and
  // forward buffers; see evaluator/evaluation.h); 0: DefaultMemoryBudget,
  // taken when the job is prepared. A batch_size that does not fit is run
  // in smaller batches; a model of which one example does not fit is a
  // permanent error.
  int64_t memory_limit = 0;
  // Only for messages: where the chief is.
  std::string chief_address = "the chief";
  // How long to keep trying to reach the chief before giving up (exit 138).
  absl::Duration startup_timeout = absl::Minutes(5);
  absl::Duration register_timeout = absl::Seconds(15);  // one registration call
  absl::Duration heartbeat_every = absl::Seconds(1);
  absl::Duration report_timeout = absl::Seconds(10);  // one heartbeat or result
  absl::Duration state_call = absl::Seconds(2);       // GetState of one ps
  // How often to look at the ps's versions while nothing is due.
  absl::Duration look_every = absl::Milliseconds(100);
  // One snapshot call: the wait for its version (then the evaluator looks
  // again) and the transfer. Well under the chief's 30 s evaluator timeout,
  // as no heartbeat goes out meanwhile.
  absl::Duration snapshot_timeout = absl::Seconds(15);
  // Where the evaluator's metrics go (may be null); must outlive the
  // evaluator and not be rendered once it is gone.
  metrics::Registry* metrics = nullptr;
  // Called (if set) with true after each registration with the chief (the
  // first once the model and the test split are loaded), and with false
  // when it registers again and when Run returns: whether it takes part in
  // a job (its readiness). Called from Run's thread.
  std::function<void(bool)> on_registered;
};

// Makes the ps client, once.
using PsClientFactory = ps::ClientFactory;

class Evaluator {
 public:
  // `chief` is not owned and must outlive the evaluator.
  Evaluator(EvaluatorOptions options, chief::EvaluatorClient* chief, PsClientFactory make_ps);
  ~Evaluator();
  Evaluator(const Evaluator&) = delete;
  Evaluator& operator=(const Evaluator&) = delete;

  // Evaluates until the chief says the job is over (OK). Errors, by the exit
  // code common/exit_codes.h gives them: 1 a permanent error (the chief
  // refused registration or failed the job, the device or the data does not
  // fit the model); 138 the chief stayed unreachable for startup_timeout;
  // 140 another failure worth a retry (the chief now runs another job
  // configuration); StoppedBySignal(n) after Stop(n).
  absl::Status Run();
  // Makes Run() return StoppedBySignal(signal) soon; calls in flight are
  // cancelled.
  void Stop(int signal);
  // What it evaluated last (step -1 before the first evaluation).
  EvaluatorStatus Status() const;

 private:
  // Registers (again); sets *done when the job is already over.
  absl::Status Register(bool* done);
  absl::Status Prepare();
  // Evaluates until the job is over (OK) or a status that IsRegisterAgain
  // or ends Run.
  absl::Status EvaluateJob();
  // The lowest version of the ps; RegisterAgain when a ps holds another job.
  absl::StatusOr<int64_t> Version();
  // The next version to evaluate, given the ps's version `v`; none while
  // nothing is due.
  std::optional<int64_t> Target(int64_t v, absl::Time now) const;
  // Snapshots `version` from every ps into values_ and evaluates it.
  absl::Status EvaluateVersion(int64_t version);
  // Sends a heartbeat (or `result`) and turns the chief's answer into a
  // status: OK to go on, Done() for EXIT, RegisterAgain, or the failure.
  absl::Status Report(const EvalResult* result);
  // A heartbeat when one is due.
  absl::Status MaybeHeartbeat();
  int stop_signal() const ABSL_LOCKS_EXCLUDED(mu_);
  // Tells options_.on_registered, if set.
  void SetRegistered(bool registered) const;

  const EvaluatorOptions options_;
  chief::EvaluatorClient* const chief_;
  const PsClientFactory make_ps_;
  std::unique_ptr<metrics::Registry> own_metrics_;  // when none is given
  struct Metrics {
    metrics::Gauge *step, *loss, *accuracy;  // of the latest evaluation
    metrics::Counter* evaluations;
    metrics::Histogram* seconds;
  } metrics_;

  // Run's thread only.
  uint64_t job_id_ = 0;
  uint64_t lease_ = 0;  // of its registration, which its reports carry
  JobConfig job_;
  int64_t every_steps_ = 0;
  int64_t every_secs_ = 0;
  std::unique_ptr<ps::Client> ps_;
  std::unique_ptr<ThreadPool> pool_;  // snapshots of every ps at once
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<model::Network> net_;  // forward-only
  int64_t memory_budget_ = 0;            // options_.memory_limit or the default
  data::Dataset test_;
  std::vector<std::vector<float>> values_;  // by variable
  int64_t last_step_ = -1;                  // the latest version evaluated
  int64_t newest_version_ = 0;              // the highest of the ps's at the last Version()
  absl::Time last_start_;                   // when its evaluation began
  absl::Time last_heartbeat_ = absl::InfinitePast();

  mutable absl::Mutex mu_;
  int stop_signal_ ABSL_GUARDED_BY(mu_) = 0;
  ps::Client* ps_for_stop_ ABSL_GUARDED_BY(mu_) = nullptr;
  EvaluatorStatus status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace psflow::evaluator

#endif  // PSFLOW_EVALUATOR_EVALUATOR_H_
