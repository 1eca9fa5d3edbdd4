// psflow-worker: a training worker. Takes the job from the chief and trains
// until the chief says the job is over. In a cluster without a chief task
// (ps and workers only), worker 0 also runs the chief's duties in-process
// (chief/role.h), with the chief's flags, and serves the chief's RPCs on its
// own port; the other workers call it there.
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "allreduce/grpc_peers.h"
#include "allreduce/ring.h"
#include "allreduce/service.h"
#include "chief/flags.h"
#include "chief/grpc_client.h"
#include "chief/role.h"
#include "role/cluster_flags.h"
#include "role/command_line.h"
#include "common/cpu_count.h"
#include "common/exit_codes.h"
#include "transport/grpc_util.h"
#include "common/log.h"
#include "common/metrics.h"
#include "role/process_setup.h"
#include "role/serve_role.h"
#include "role/signals.h"
#include "common/step_trace.h"
#include "ps/grpc_client.h"
#include "ps/local_client.h"
#include "ps/service.h"
#include "ps/shard.h"
#include "worker/service.h"
#include "worker/trainer.h"

ABSL_FLAG(
    std::string, device, "cpu",
    "Where to compute: cpu (oneDNN), or cuda:N (GPU N with cuDNN and cuBLAS; in builds with CUDA). "
    "Several GPUs: cuda:all (every GPU this process sees) or a list (cuda:0,cuda:1): one model "
    "replica per GPU, each on --batch_size examples, gradients averaged among the GPUs (NCCL) "
    "and pushed once; the chief's --replicas_per_worker must equal the count. The parameter "
    "servers stay on CPUs either way.");
ABSL_FLAG(
    int, ps_lanes, 0,
    "Most concurrent pulls and pushes (lanes) per ps, each over its own connection and of "
    "consecutive slices of at least 1 MiB (a ps holding less, or few large slices, gives fewer). "
    "0: up to 16 lanes in all, shared by the ps (at most 8 per ps, at least 1). 1: one "
    "stream each way per ps.");

ABSL_FLAG(bool, shared_memory, true,
          "Exchange tensors with a ps on this host through shared memory: pushes and pulls offer "
          "the ps a memory region of this process, which it maps, and their messages carry only "
          "where each tensor lies. A ps that cannot map it (another host, another container's "
          "process namespace, or a ps run with --shared_memory=false) gets the tensors over the "
          "network, as with false, and is offered memory again a minute later.");
ABSL_FLAG(bool, same_host_channels, true,
          "With --shared_memory, send the pushes and pulls to a ps of this host through "
          "channels in shared memory, where each message wakes the other side through a futex "
          "(a doorbell), instead of through gRPC's threads: the same messages and checks, a few "
          "thread wake-ups per call instead of dozens. A ps that opens no channel (--shared_"
          "memory=false or --same_host_channels=false there, or an older ps) gets them through "
          "gRPC. false: always through gRPC.");
ABSL_FLAG(bool, upload_from_shared_memory, true,
          "A GPU worker whose pulls go through shared memory (see --shared_memory): copy the "
          "pulled weights to the GPU straight from the memory the ps wrote them into, registered "
          "with the GPU (cudaHostRegister), in the wire dtype (16-bit values are widened to fp32 "
          "on the GPU), instead of decoding them into the worker's page-locked buffers first. "
          "false: always through those buffers.");
ABSL_FLAG(bool, gradients_to_shared_memory, true,
          "A GPU worker of a job with ps, with fp32 on the wire or its gradients rounded on the "
          "GPU (--narrow_on_gpu): copy the gradients from the GPU into one region of shared "
          "memory registered with the GPU, and let each push name them where they lie (a ps on "
          "this host reads them there; the worker only checks them, it does not copy them). "
          "false: copy them into page-locked buffers of the worker's, then into a region of "
          "each push. A ps that takes no shared memory (see --shared_memory) gets them over the "
          "network either way; with --shared_memory=false the worker makes no such region.");
ABSL_FLAG(bool, narrow_on_gpu, true,
          "A GPU worker (one GPU) of a job whose wire dtype (the chief's --wire_dtype) is bf16 or "
          "fp16: round each gradient to that dtype on the GPU as the backward pass completes it, "
          "so that half the bytes cross to the host and pushes send them as they lie (the same "
          "values, rounded to nearest even). false: copy fp32 gradients to the host and round "
          "them there as they are pushed.");
ABSL_FLAG(bool, push_during_backward, true,
          "In a job with ps whose --on_nonfinite is fail (the default): each lane's push opens "
          "with the step and sends its gradients run by run, each as soon as the backward pass "
          "has completed it (a GPU worker: once its bucket is copied to the host), while the "
          "rest of the step runs; the next weights are pulled once the whole step is known "
          "finite (a GPU worker pulls beside its pushes from the step's start, each slice as "
          "the ps applies it, its copies to the GPU queued behind the step). false: push after "
          "the step. Jobs with "
          "--on_nonfinite=skip_step, jobs without ps and workers of several GPUs always push "
          "after the step.");

ABSL_FLAG(int64_t, min_push_run_bytes, int64_t{256} << 10,
          "A CPU worker pushing during the backward pass (see --push_during_backward) sends each "
          "lane's gradients in runs: a run takes in the lane's next variables, in the order the "
          "backward pass completes them, until it holds at least this many bytes (counted as "
          "fp32), and leaves once its last variable is final. So biases and small layers do not "
          "each cost a message (every message wakes a few threads on the worker and the ps, "
          "which costs most where the cores are all busy); a lane's last run may be smaller. 0: "
          "each variable's gradient leaves alone, as soon as it is final. GPU workers push the "
          "buckets their copies to the host make.");
ABSL_FLAG(
    std::string, kernel_threads_wait, "auto",
    "A CPU worker: how its kernel threads (oneDNN's, on libgomp's OpenMP) wait between "
    "parallel regions. passive: they sleep at once (OMP_WAIT_POLICY=passive), which "
    "leaves the cores to the exchange between the passes (the lanes, and ps on the same "
    "host) but costs a wake-up per region. keep: as the environment says (libgomp's "
    "default, where OMP_WAIT_POLICY is unset, spins a while before sleeping). auto: "
    "passive where the worker may use at least 8 cores (its affinity mask and cgroup CPU "
    "quota) and a ps listens on its host (a loopback address, or its own address's host), "
    "unless OMP_WAIT_POLICY names another policy; else keep. Measured: CPU jobs of 1-2 workers and "
    "1-2 ps on one 16-core host trained 7-23 % faster passive, held to 8 or 12 of its cores 10-33 "
    "% faster, to 4 or 6 of them 2-10 % slower; a 2-thread worker on 2 cores 25 % slower, and a "
    "worker training alone on 16 cores 25 % slower. libgomp reads the policy as "
    "it loads, so a worker that changes it executes "
    "itself again at once (the same process). GPU workers ignore it.");
ABSL_FLAG(std::string, trace_dir, "", psflow::kTraceDirHelp);
ABSL_FLAG(std::string, trace_steps, "100:101", psflow::kTraceStepsHelp);

namespace {

// A worker told to stop waits this long at most for the pushes of its step
// in flight to be answered (they wait for the other workers' pushes of the
// step, and those workers are stopping too).
constexpr absl::Duration kStopPushWait = absl::Seconds(3);

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::BlockTerminationSignals();
  psflow::ParseFlagsOrExit(
      argc, argv,
      "a training worker of a psflow job.\n\n"
      "Configure the cluster with the flags below, or TF_CONFIG (Kubeflow), or CLUSTER_CONFIG and\n"
      "POD_NAME. The job itself (model, data, batch size, steps) comes from the chief. Example:\n"
      "  psflow-worker --job_name=worker --task_id=0 --chief_hosts=h0:2222 --ps_hosts=h1:2222 \\\n"
      "                --worker_hosts=h2:2222\n"
      "Without ps (no --ps_hosts; a TF_CONFIG or CLUSTER_CONFIG of workers only; a PyTorchJob's\n"
      "MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK) the workers average their gradients among\n"
      "themselves (a ring all-reduce over gRPC; GPU workers over NCCL) and each keeps a replica\n"
      "of the weights and the optimizer state; worker 0 (rank 0) is then the chief too.\n"
      "In a cluster without a chief (no --chief_hosts, a TF_CONFIG or CLUSTER_CONFIG that lists\n"
      "only ps and workers), worker 0 is the chief as well: give it the chief's flags below\n"
      "(--model, --epochs, --model_dir, ...; the other workers may get the same ones and ignore\n"
      "them). Example:\n"
      "  psflow-worker --job_name=worker --task_id=0 --ps_hosts=h1:2222 \\\n"
      "                --worker_hosts=h2:2222,h3:2222 --model=cnn --epochs=5 --model_dir=/tmp/run\n"
      "Exit codes: 0 done, 1 permanent error, 138 chief or ps unreachable, 140 other failure\n"
      "worth a retry, 128+n after signal n.");
  // Executed again below (for a kernel-thread wait policy), Linux would name
  // the process after /proc/self/exe: keep the name ps and top show.
  prctl(PR_SET_NAME, "psflow-worker");
  absl::StatusOr<psflow::KernelThreadWait> kernel_threads_wait =
      psflow::ParseKernelThreadWait(absl::GetFlag(FLAGS_kernel_threads_wait));
  if (!kernel_threads_wait.ok()) {
    std::fprintf(stderr, "psflow-worker: --kernel_threads_wait: %s\n",
                 std::string(kernel_threads_wait.status().message()).c_str());
    return 1;
  }
  psflow::ClusterConfig config = psflow::ResolveClusterOrExit(psflow::Role::kWorker);
  // Before anything else starts (the cluster above only read the flags and
  // the environment): a new wait policy for the kernel threads takes
  // executing this program again.
  std::string kernel_threads_note;
  bool kernel_threads_failed = false;
  if (!absl::StartsWith(absl::GetFlag(FLAGS_device), "cuda")) {
    const int cores = psflow::UsableCores();
    const bool ps_here = psflow::PsOnThisHost(config);
    const std::string policy = psflow::WantedOmpWaitPolicy(*kernel_threads_wait, cores, ps_here,
                                                           std::getenv("OMP_WAIT_POLICY"));
    const std::string flag = absl::StrCat(
        "--kernel_threads_wait=", absl::GetFlag(FLAGS_kernel_threads_wait), ", ", cores,
        " usable cores, ", ps_here ? "a ps on this host" : "no ps on this host");
    // Returns once the environment holds the policy (after the exec), or
    // with the exec's error. The restarted worker gets its flags' values
    // rather than its arguments: a --flagfile read from a pipe is used up.
    const absl::Status s = policy.empty() ? absl::OkStatus()
                                          : psflow::RestartWithOmpWaitPolicy(
                                                policy, psflow::CommandLineOfFlagsNow(argv[0]));
    const char* now = std::getenv("OMP_WAIT_POLICY");
    if (!s.ok()) {
      kernel_threads_failed = true;
      kernel_threads_note = absl::StrCat("kernel threads keep their wait policy: ", s.message());
    } else if (now != nullptr) {
      kernel_threads_note =
          absl::StrCat("kernel threads wait with OMP_WAIT_POLICY=", now, " (", flag, ")");
    } else {
      kernel_threads_note =
          absl::StrCat("kernel threads wait as libgomp's default, spinning a while (", flag, ")");
    }
  }
  const absl::Duration startup_timeout = psflow::chief::StartupTimeoutFromFlags();
  if (startup_timeout <= absl::ZeroDuration()) {
    std::fprintf(stderr, "psflow-worker: --startup_timeout must be positive\n");
    return 1;
  }
  // Worker 0 of a cluster without a chief is its chief too.
  const bool chief_here = config.cluster.ChiefInWorker0() && config.task_index == 0;
  psflow::chief::ChiefOptions chief_options;
  std::optional<psflow::JobConfig> job;
  if (chief_here) {
    chief_options.cluster = config;
    if (absl::Status s = psflow::chief::ChiefOptionsFromFlags(&chief_options); !s.ok()) {
      std::fprintf(stderr, "psflow-worker: %s\n", std::string(s.message()).c_str());
      return psflow::kExitPermanent;
    }
    absl::StatusOr<psflow::JobConfig> built = psflow::chief::BuildJobConfig(chief_options);
    if (!built.ok()) {
      psflow::SetLogTag("worker0");
      PSLOG(ERROR) << built.status().message();
      return psflow::ExitCodeFor(built.status());
    }
    job = *std::move(built);
  }
  const int lanes = absl::GetFlag(FLAGS_ps_lanes);
  if (lanes < 0 || lanes > 64) {
    std::fprintf(stderr, "psflow-worker: --ps_lanes must be in [0, 64], not %d\n", lanes);
    return 1;
  }
  psflow::SetLogTag(absl::StrCat("worker", config.task_index));
  absl::StatusOr<std::unique_ptr<psflow::StepTrace>> trace =
      psflow::StepTrace::FromFlags(absl::GetFlag(FLAGS_trace_dir), absl::GetFlag(FLAGS_trace_steps),
                                   "worker", config.task_index);
  if (!trace.ok()) {
    std::fprintf(stderr, "psflow-worker: --trace_dir/--trace_steps: %s\n",
                 std::string(trace.status().message()).c_str());
    return psflow::kExitPermanent;
  }

  // Before everything that records into it.
  psflow::metrics::Registry metrics;
  psflow::Readiness readiness;  // ready while registered with the chief
  psflow::worker::TrainerOptions options;
  options.worker_index = config.task_index;
  options.device = absl::GetFlag(FLAGS_device);
  options.chief_address = absl::StrCat("chief ", config.cluster.ChiefAddress());
  options.startup_timeout = startup_timeout;
  options.on_registered = [&readiness](bool registered) { readiness.Set(registered); };
  // About 16 streams each way keep a host's loopback and the ps busy (measured
  // with 2, 4 and 8 ps on an H100 host: docs/performance.md).
  const int ps_count = static_cast<int>(config.cluster.ps.size());
  options.lanes_per_ps = lanes > 0 ? lanes : std::clamp(16 / std::max(ps_count, 1), 1, 8);
  options.push_during_backward = absl::GetFlag(FLAGS_push_during_backward);
  options.min_run_bytes = absl::GetFlag(FLAGS_min_push_run_bytes);
  if (options.min_run_bytes < 0) {
    std::fprintf(stderr, "psflow-worker: --min_push_run_bytes must not be negative, got %lld\n",
                 static_cast<long long>(options.min_run_bytes));
    return 1;
  }
  options.upload_from_shared_memory = absl::GetFlag(FLAGS_upload_from_shared_memory);
  options.gradients_to_shared_memory = absl::GetFlag(FLAGS_gradients_to_shared_memory);
  options.narrow_on_device = absl::GetFlag(FLAGS_narrow_on_gpu);
  options.trace = trace->get();
  const psflow::SecurityOptions security = psflow::LoadSecurityOrExit(psflow::Role::kWorker);
  // (Once every check of the command line has passed.)
  if (kernel_threads_failed) {
    PSLOG(WARNING) << kernel_threads_note;
  } else if (!kernel_threads_note.empty()) {
    PSLOG(INFO) << kernel_threads_note;
  }
  // A cluster without ps: this worker's replica of the weights (served as
  // ps 0 on its own address; the chief reads worker 0's) and its ring.
  const bool all_reduce = config.cluster.AllReduce();
  std::unique_ptr<psflow::ThreadPool> apply_pool;
  std::unique_ptr<psflow::ps::Shard> replica;
  std::unique_ptr<psflow::ps::PsService> replica_service;
  std::unique_ptr<psflow::allreduce::GrpcPeers> peers;
  std::unique_ptr<psflow::allreduce::Ring> ring;
  std::unique_ptr<psflow::allreduce::AllReduceService> ring_service;
  if (all_reduce) {
    // The optimizer's apply to the replica: on a CPU worker it shares the
    // cores with the worker's own compute (a quarter of them, on a machine
    // of 8 or more); a GPU worker's cores are free for it (half of them).
    const int cores = psflow::UsableCores();
    const bool on_gpu = absl::StartsWith(options.device, "cuda");
    const int helpers =
        on_gpu ? std::min(16, cores / 2) : (cores >= 8 ? std::min(4, cores / 4) : 0);
    if (helpers > 0) apply_pool = std::make_unique<psflow::ThreadPool>(helpers);
    replica = std::make_unique<psflow::ps::Shard>(apply_pool.get());
    replica_service = std::make_unique<psflow::ps::PsService>(
        replica.get(), psflow::ps::PsServiceOptions{.metrics = &metrics});
    peers = std::make_unique<psflow::allreduce::GrpcPeers>(config.cluster.worker, security);
    psflow::allreduce::RingOptions ring_options;
    ring_options.rank = config.task_index;
    ring_options.size = static_cast<int>(config.cluster.worker.size());
    ring_options.form_timeout = startup_timeout;
    ring = std::make_unique<psflow::allreduce::Ring>(ring_options, peers.get());
    ring_service = std::make_unique<psflow::allreduce::AllReduceService>(ring.get());
    options.ring = ring.get();
    options.replica = replica.get();
  }
  std::unique_ptr<psflow::chief::ChiefRole> chief_role;
  if (chief_here) {
    chief_role =
        psflow::chief::ChiefRole::Create(chief_options, *std::move(job), security, &metrics);
  }
  // Worker 0 of a chiefless cluster calls its own chief through its own port.
  psflow::chief::GrpcClient chief(config.cluster.ChiefAddress(), security, &metrics,
                                  config.cluster.ChiefHostRole());
  psflow::worker::Trainer trainer(
      options, &chief,
      [&security, &metrics, &config, &replica, connections = options.lanes_per_ps,
       server = all_reduce ? psflow::Role::kWorker : psflow::Role::kPs,
       shared = !all_reduce && absl::GetFlag(FLAGS_shared_memory),
       channels = absl::GetFlag(FLAGS_same_host_channels), trace = trace->get()](
          const std::vector<std::string>& addresses) -> std::unique_ptr<psflow::ps::Client> {
        // This worker's own replica is in this process: no gRPC to reach it.
        if (replica != nullptr && addresses == std::vector<std::string>{config.self_address}) {
          return std::make_unique<psflow::ps::LocalClient>(replica.get());
        }
        return std::make_unique<psflow::ps::GrpcClient>(
            addresses, psflow::ps::GrpcClientOptions{.security = security,
                                                     .connections_per_ps = connections,
                                                     .metrics = &metrics,
                                                     .server_role = server,
                                                     .shared_memory = shared,
                                                     .channels = channels,
                                                     .trace = trace});
      });
  metrics.SetGaugeFunction(
      "psflow_worker_step",
      "The step this worker computes (the last one reached once finished); 0 before it joins.",
      [&trainer] { return static_cast<double>(trainer.Status().step); });
  // The worker listens on its own address too: the standard gRPC health
  // service answers there, for readiness probes and peers' connectivity checks.
  psflow::worker::StatusService service(&trainer);
  std::vector<grpc::Service*> services = {&service};
  psflow::CallerRoles callers;
  if (chief_role != nullptr) {
    services.push_back(chief_role->service());
    callers = psflow::chief::ChiefCallers();
  }
  if (all_reduce) {
    services.push_back(replica_service.get());
    services.push_back(ring_service.get());
    for (auto& [method, roles] :
         psflow::ps::ReplicaCallers(config.cluster.ChiefHostRole(), config.task_index == 0)) {
      callers[method] = roles;
    }
    for (auto& [method, roles] : psflow::allreduce::AllReduceCallers()) callers[method] = roles;
  }
  absl::StatusOr<std::unique_ptr<psflow::RoleServers>> servers =
      psflow::ServeRole({.address = config.self_address,
                         .services = services,
                         .callers = callers,
                         .security = security,
                         .metrics = &metrics,
                         .readiness = &readiness});
  if (!servers.ok()) {
    PSLOG(ERROR) << servers.status().message();
    return psflow::kExitPermanent;
  }
  if (chief_role != nullptr) {
    PSLOG(INFO) << "the cluster has no chief: worker 0 runs the chief's duties on "
                << config.self_address;
  }
  // Calls in flight are cancelled on a signal; do not wait for more than a
  // few seconds (the chief's duties: until their checkpoint is written).
  const int code = psflow::RunRole(
      [&]() -> absl::Status {
        if (chief_role == nullptr) return trainer.Run();
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
          chief_status = chief_role->Run();
          if (chief_status.ok()) return;
          {
            absl::MutexLock lock(&mu);
            if (first.ok()) first = chief_status;
          }
          trainer.Stop(psflow::SignalOf(chief_status).value_or(SIGTERM));
        });
        absl::Status s = trainer.Run();
        if (!s.ok()) {
          {
            absl::MutexLock lock(&mu);
            if (first.ok()) first = s;
          }
          chief_role->Stop(psflow::SignalOf(s).value_or(SIGTERM));
        }
        coordinator.join();
        absl::MutexLock lock(&mu);
        return first;
      },
      [&](int sig) {
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
        if (chief_role != nullptr && !all_reduce) {
          chief_role->Stop(sig);
        } else if (!all_reduce) {
          trainer.StopAfterPushes(sig, kStopPushWait);
        } else {
          trainer.Stop(sig);
        }
      },
      absl::Seconds(chief_role != nullptr ? 30 : 6),
      chief_role != nullptr || all_reduce
          ? "stopping after the call in flight"
          : "stopping once the pushes of the step in flight are answered");
  (*servers)->Stop(absl::Seconds(1));
  psflow::LogResourceUsage();
  return code;
}
