// The psflow-worker process once its command line is checked: the trainer
// with its chief client and ps clients, its status service, and, by the
// cluster's shape, the replica it serves as a ps and its ring (a cluster
// without ps) and the chief's duties (worker 0 of a cluster without a
// chief). Serves them on the worker's address and trains until the job is
// over or a signal stops it, by the stop policy of Run.
//
// Thread-safety: made, run and destroyed on the thread of main. Owns every
// part it builds; the trace (WorkerProcessOptions::trainer.trace) is not
// owned and must outlive it.
#ifndef PSFLOW_WORKER_PROCESS_H_
#define PSFLOW_WORKER_PROCESS_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "allreduce/grpc_peers.h"
#include "allreduce/ring.h"
#include "allreduce/service.h"
#include "chief/coordinator.h"
#include "chief/grpc_client.h"
#include "chief/role.h"
#include "common/cluster_config.h"
#include "common/metrics.h"
#include "common/thread_pool.h"
#include "ps/client.h"
#include "ps/local_replica.h"
#include "ps/service.h"
#include "ps/shard.h"
#include "role/process_setup.h"
#include "transport/grpc_util.h"
#include "transport/security.h"
#include "worker/service.h"
#include "worker/trainer.h"

namespace psflow::worker {

struct WorkerProcessOptions {
  ClusterConfig cluster;
  SecurityOptions security;
  // The process sets worker_index and chief_address (from `cluster`),
  // on_registered (its readiness), and ring and replica (without ps).
  TrainerOptions trainer;
  // Offer shared memory to a ps on this host (--shared_memory), and talk to
  // it through same-host channels (--same_host_channels).
  bool shared_memory = true;
  bool same_host_channels = true;
  // Worker 0 of a cluster without a chief: the chief's settings and the job
  // BuildJobConfig made of them. Unset otherwise.
  std::optional<chief::ChiefOptions> chief;
  JobConfig job;
};

class WorkerProcess {
 public:
  explicit WorkerProcess(WorkerProcessOptions options);
  ~WorkerProcess();
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // Serves and trains until the job is over or a signal stops the process;
  // returns the exit code (1 if the servers cannot start). Once.
  int Run();

 private:
  // A cluster without ps: the replica and its service, the ring and its service.
  void MakeReplicaAndRing();
  std::unique_ptr<ps::Client> MakePsClient(const std::vector<std::string>& addresses);
  std::vector<grpc::Service*> Services(CallerRoles* callers);
  // Trains, beside the chief's duties where they run here.
  absl::Status Train();
  // The stop policy on a signal.
  void Stop(int signal);

  const WorkerProcessOptions options_;
  const bool all_reduce_;  // a cluster without ps
  // Before everything that records into it.
  metrics::Registry metrics_;
  Readiness readiness_;  // ready while registered with the chief
  std::unique_ptr<ThreadPool> apply_pool_;
  std::unique_ptr<ps::Shard> replica_;
  std::unique_ptr<ps::LocalReplica> local_replica_;  // replica_, as the trainer reaches it
  std::unique_ptr<ps::PsService> replica_service_;
  std::unique_ptr<allreduce::GrpcPeers> peers_;
  std::unique_ptr<allreduce::Ring> ring_;
  std::unique_ptr<allreduce::AllReduceService> ring_service_;
  std::unique_ptr<chief::ChiefRole> chief_role_;
  std::unique_ptr<chief::GrpcClient> chief_;
  std::unique_ptr<Trainer> trainer_;
  std::unique_ptr<StatusService> service_;
};

// What a CPU worker's kernel threads were set to wait with, to log once the
// command line is checked.
struct KernelThreadsNote {
  std::string text;     // empty: nothing to say (a GPU worker)
  bool failed = false;  // the restart failed: a warning
  void Log() const;
};

// A worker on `device` other than cuda: sets the wait policy of its kernel
// threads as `wait` (the --kernel_threads_wait `flag`) asks, which takes
// executing this program (`program`, argv[0]) again with the flags' values
// now. Call before any thread starts; returns only if no restart was needed,
// or it failed (the process then goes on as it is).
KernelThreadsNote SetKernelThreadWait(KernelThreadWait wait, const std::string& flag,
                                      const std::string& device, const ClusterConfig& cluster,
                                      const char* program);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_PROCESS_H_
