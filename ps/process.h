// The psflow-ps process once its command line is checked: the shard with its
// thread pools and metrics, its gRPC service on the ps's address, and the
// stop policy (ps/stop_state.h): it serves until the chief says the job is
// done, or after a signal until the chief's stop checkpoint (for at most
// the grace period), then exits.
//
// Thread-safety: made, run and destroyed on the thread of main. Owns every
// part it builds; the trace is not owned and must outlive it.
#ifndef PSFLOW_PS_PROCESS_H_
#define PSFLOW_PS_PROCESS_H_

#include <atomic>
#include <memory>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/cluster_config.h"
#include "common/metrics.h"
#include "common/step_trace.h"
#include "common/thread_pool.h"
#include "ps/service.h"
#include "ps/shard.h"
#include "ps/stop_state.h"
#include "transport/grpc_util.h"
#include "transport/security.h"

namespace psflow::ps {

struct PsProcessOptions {
  ClusterConfig cluster;
  SecurityOptions security;
  // Threads that apply a step (the pushing thread counts); 0: the cores
  // this process may use, shared evenly by the ps of its host.
  int apply_threads = 0;
  StreamLimits limits;
  // PsServiceOptions::shared_memory, channels, apply_in_place and
  // spread_wakes; Shard::SetWireCopies.
  bool shared_memory = true;
  bool same_host_channels = true;
  bool apply_in_place = true;
  bool parallel_pull_answers = true;
  bool wire_copies = true;
  // After a first signal, how long at most to serve on for the chief's
  // checkpoint (StopState::Wait); 0: exit at once.
  absl::Duration stop_grace = absl::Seconds(10);
  StepTrace* trace = nullptr;  // may be null
};

class PsProcess {
 public:
  explicit PsProcess(PsProcessOptions options);
  ~PsProcess();
  PsProcess(const PsProcess&) = delete;
  PsProcess& operator=(const PsProcess&) = delete;

  // Serves until the job is over or a signal stops the process; returns the
  // exit code (1 if the servers cannot start). Once.
  int Run();

 private:
  const PsProcessOptions options_;
  const int apply_threads_;
  // The thread of the push that completes a step applies too: the pool adds
  // the others.
  std::unique_ptr<ThreadPool> apply_pool_;
  // Slices are applied off the threads that read the pushes, so that a push
  // stream goes on while its slices are applied; a few at once.
  ThreadPool appliers_;
  // Before the shard and the service, which record into it; its function
  // series read the shard until the metrics server stops.
  metrics::Registry metrics_;
  Readiness readiness_;  // ready once the ps holds a job
  Shard shard_;
  StopState stop_;
  std::atomic<int> exit_code_{0};  // of the signal, if one came
  // A woken pull encodes its next slice on the wakers (a few threads: pulls
  // beside pushes wait for most slices); push messages are decoded on the
  // pushers (CPU work: about as many threads as cores).
  ThreadPool wakers_;
  ThreadPool pushers_;
  PsService service_;
  absl::Notification terminated_;  // by a signal
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_PROCESS_H_
