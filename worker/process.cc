#include "worker/process.h"

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cpu_count.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "ps/callers.h"
#include "ps/grpc_client.h"
#include "role/command_line.h"
#include "role/serve_role.h"

namespace psflow::worker {
namespace {

// A worker told to stop waits this long at most for the pushes of its step
// in flight to be answered (they wait for the other workers' pushes of the
// step, and those workers are stopping too).
constexpr absl::Duration kStopPushWait = absl::Seconds(3);

}  // namespace

WorkerProcess::WorkerProcess(WorkerProcessOptions options)
    : options_(std::move(options)), all_reduce_(options_.cluster.cluster.AllReduce()) {
  const ClusterConfig& config = options_.cluster;
  TrainerOptions trainer = options_.trainer;
  trainer.worker_index = config.task_index;
  trainer.chief_address = absl::StrCat("chief ", config.cluster.ChiefAddress());
  trainer.on_registered = [this](bool registered) { readiness_.Set(registered); };
  if (all_reduce_) {
    MakeReplicaAndRing();
    trainer.ring = ring_.get();
    trainer.replica = local_replica_.get();
  }
  if (options_.chief.has_value()) {
    chief_role_ =
        chief::ChiefRole::Create(*options_.chief, options_.job, options_.security, &metrics_);
  }
  // Worker 0 of a chiefless cluster calls its own chief through its own port.
  chief_ = std::make_unique<chief::GrpcClient>(config.cluster.ChiefAddress(), options_.security,
                                               &metrics_, config.cluster.ChiefHostRole());
  trainer_ = std::make_unique<Trainer>(
      std::move(trainer), chief_.get(),
      [this](const std::vector<std::string>& addresses) { return MakePsClient(addresses); });
  metrics_.SetGaugeFunction(
      "psflow_worker_step",
      "The step this worker computes (the last one reached once finished); 0 before it joins.",
      [this] { return static_cast<double>(trainer_->Status().step); });
  // The worker listens on its own address too: the standard gRPC health
  // service answers there, for readiness probes and peers' connectivity checks.
  service_ = std::make_unique<StatusService>(trainer_.get());
}

WorkerProcess::~WorkerProcess() = default;

// This worker's replica of the weights (served as ps 0 on its own address;
// the chief reads worker 0's) and its ring.
void WorkerProcess::MakeReplicaAndRing() {
  const ClusterConfig& config = options_.cluster;
  // The optimizer's apply to the replica: on a CPU worker it shares the
  // cores with the worker's own compute (a quarter of them, on a machine
  // of 8 or more); a GPU worker's cores are free for it (half of them).
  const int cores = UsableCores();
  const bool on_gpu = absl::StartsWith(options_.trainer.device, "cuda");
  const int helpers = on_gpu ? std::min(16, cores / 2) : (cores >= 8 ? std::min(4, cores / 4) : 0);
  if (helpers > 0) apply_pool_ = std::make_unique<ThreadPool>(helpers);
  replica_ = std::make_unique<ps::Shard>(apply_pool_.get());
  local_replica_ = std::make_unique<ps::LocalReplica>(replica_.get());
  replica_service_ =
      std::make_unique<ps::PsService>(replica_.get(), ps::PsServiceOptions{.metrics = &metrics_});
  peers_ = std::make_unique<allreduce::GrpcPeers>(config.cluster.worker, options_.security);
  allreduce::RingOptions ring_options;
  ring_options.rank = config.task_index;
  ring_options.size = static_cast<int>(config.cluster.worker.size());
  ring_options.form_timeout = options_.trainer.startup_timeout;
  ring_ = std::make_unique<allreduce::Ring>(ring_options, peers_.get());
  ring_service_ = std::make_unique<allreduce::AllReduceService>(ring_.get());
}

std::unique_ptr<ps::Client> WorkerProcess::MakePsClient(const std::vector<std::string>& addresses) {
  // This worker's own replica is in this process: no gRPC to reach it.
  if (replica_ != nullptr && addresses == std::vector<std::string>{options_.cluster.self_address}) {
    return local_replica_->Connect();
  }
  return std::make_unique<ps::GrpcClient>(
      addresses, ps::GrpcClientOptions{.security = options_.security,
                                       .connections_per_ps = options_.trainer.lanes_per_ps,
                                       .metrics = &metrics_,
                                       .server_role = all_reduce_ ? Role::kWorker : Role::kPs,
                                       .shared_memory = !all_reduce_ && options_.shared_memory,
                                       .channels = options_.same_host_channels,
                                       .trace = options_.trainer.trace});
}

std::vector<grpc::Service*> WorkerProcess::Services(CallerRoles* callers) {
  std::vector<grpc::Service*> services = {service_.get()};
  if (chief_role_ != nullptr) {
    services.push_back(chief_role_->service());
    *callers = chief::ChiefCallers();
  }
  if (all_reduce_) {
    services.push_back(replica_service_.get());
    services.push_back(ring_service_.get());
    const ClusterConfig& config = options_.cluster;
    for (auto& [method, roles] :
         ps::ReplicaCallers(config.cluster.ChiefHostRole(), config.task_index == 0)) {
      (*callers)[method] = roles;
    }
    for (auto& [method, roles] : allreduce::AllReduceCallers()) (*callers)[method] = roles;
  }
  return services;
}

int WorkerProcess::Run() {
  CallerRoles callers;
  std::vector<grpc::Service*> services = Services(&callers);
  const bool chief_duties = chief_role_ != nullptr;
  // Calls in flight are cancelled on a signal; do not wait for more than a
  // few seconds (the chief's duties: until their checkpoint is written).
  return ServeAndRunRole(
      {.address = options_.cluster.self_address,
       .services = services,
       .callers = callers,
       .security = options_.security,
       .metrics = &metrics_,
       .readiness = &readiness_},
      {.run = [this] { return Train(); },
       .stop = [this](int sig) { Stop(sig); },
       .grace = absl::Seconds(chief_duties ? 30 : 6),
       .what = chief_duties || all_reduce_
                   ? "stopping after the call in flight"
                   : "stopping once the pushes of the step in flight are answered",
       .drain = absl::Seconds(1)});
}

absl::Status WorkerProcess::Train() {
  if (chief_role_ == nullptr) return trainer_->Run();
  PSLOG(INFO) << "the cluster has no chief: worker 0 runs the chief's duties on "
              << options_.cluster.self_address;
  // Whichever side ends with an error first decides the exit code and
  // stops the other: a coordinator that failed (a diverged job, a ps
  // gone) leaves nothing to train for; a trainer that failed leaves
  // the job without this worker, so the chief's duties checkpoint and
  // end too, and the restarted process takes both up again (adopting
  // the running job).
  absl::Mutex mu;
  absl::Status first;  // the first error, of either side
  absl::Status chief_status;
  std::thread coordinator([&] {
    chief_status = chief_role_->Run();
    if (chief_status.ok()) return;
    {
      absl::MutexLock lock(&mu);
      if (first.ok()) first = chief_status;
    }
    trainer_->Stop(SignalOf(chief_status).value_or(SIGTERM));
  });
  absl::Status s = trainer_->Run();
  if (!s.ok()) {
    {
      absl::MutexLock lock(&mu);
      if (first.ok()) first = s;
    }
    chief_role_->Stop(SignalOf(s).value_or(SIGTERM));
  }
  coordinator.join();
  absl::MutexLock lock(&mu);
  return first;
}

void WorkerProcess::Stop(int signal) {
  // With the chief's duties here, the coordinator checkpoints first
  // while this worker's trainer goes on (a stop mid-push would leave
  // the ps a step apart and the checkpoint's version out of reach);
  // its end stops the trainer. Without ps it is the other way round:
  // the trainer stops first, leaving its replica whole (a GPU worker's
  // copied from the device into its shard), and its end stops the
  // chief's duties, whose checkpoint then has the last step. Any
  // other worker stops once the pushes of its step in flight are
  // answered, for the same reason: the whole cluster may be stopping,
  // the chief's checkpoint with it.
  if (chief_role_ != nullptr && !all_reduce_) {
    chief_role_->Stop(signal);
  } else if (!all_reduce_) {
    trainer_->StopAfterPushes(signal, kStopPushWait);
  } else {
    trainer_->Stop(signal);
  }
}

void KernelThreadsNote::Log() const {
  if (failed) {
    PSLOG(WARNING) << text;
  } else if (!text.empty()) {
    PSLOG(INFO) << text;
  }
}

KernelThreadsNote SetKernelThreadWait(KernelThreadWait wait, const std::string& flag,
                                      const std::string& device, const ClusterConfig& cluster,
                                      const char* program) {
  KernelThreadsNote note;
  if (absl::StartsWith(device, "cuda")) return note;
  const int cores = UsableCores();
  const bool ps_here = PsOnThisHost(cluster);
  const std::string policy =
      WantedOmpWaitPolicy(wait, cores, ps_here, std::getenv("OMP_WAIT_POLICY"));
  const std::string why =
      absl::StrCat("--kernel_threads_wait=", flag, ", ", cores, " usable cores, ",
                   ps_here ? "a ps on this host" : "no ps on this host");
  // Returns once the environment holds the policy (after the exec), or
  // with the exec's error. The restarted worker gets its flags' values
  // rather than its arguments: a --flagfile read from a pipe is used up.
  const absl::Status s = policy.empty()
                             ? absl::OkStatus()
                             : RestartWithOmpWaitPolicy(policy, CommandLineOfFlagsNow(program));
  const char* now = std::getenv("OMP_WAIT_POLICY");
  if (!s.ok()) {
    note.failed = true;
    note.text = absl::StrCat("kernel threads keep their wait policy: ", s.message());
  } else if (now != nullptr) {
    note.text = absl::StrCat("kernel threads wait with OMP_WAIT_POLICY=", now, " (", why, ")");
  } else {
    note.text =
        absl::StrCat("kernel threads wait as libgomp's default, spinning a while (", why, ")");
  }
  return note;
}

}  // namespace psflow::worker
