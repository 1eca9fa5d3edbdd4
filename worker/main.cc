// psflow-worker: a training worker. Takes the job from the chief and trains
// until the chief says the job is over. In a cluster without a chief task
// (ps and workers only), worker 0 also runs the chief's duties in-process
// (chief/role.h), with the chief's flags, and serves the chief's RPCs on its
// own port; the other workers call it there. The flags become a
// worker::WorkerProcessOptions; worker::WorkerProcess (worker/process.h) does
// the rest.
#include <sys/prctl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "chief/coordinator.h"
#include "chief/flags.h"
#include "common/cpu_count.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "common/step_trace.h"
#include "role/cluster_flags.h"
#include "role/flag_checks.h"
#include "role/process_setup.h"
#include "role/signals.h"
#include "worker/process.h"

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
ABSL_FLAG(int, input_threads, 0,
          "Threads that decode streamed training data (TFRecord, image folders, CSV) ahead of "
          "the steps. 0: half the cores this process may use, at least 1.");
ABSL_FLAG(std::string, trace_dir, "", psflow::kTraceDirHelp);
ABSL_FLAG(std::string, trace_steps, "100:101", psflow::kTraceStepsHelp);

namespace {

constexpr char kUsage[] =
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
    "worth a retry, 128+n after signal n.";

int Refuse(absl::string_view message) { return psflow::FlagError(psflow::Role::kWorker, message); }

// --startup_timeout, and in worker 0 of a cluster without a chief (its chief
// too) the chief's flags and the job they make. 0, or the exit code.
int ChiefFromFlags(psflow::worker::WorkerProcessOptions* options) {
  options->trainer.startup_timeout = psflow::chief::StartupTimeoutFromFlags();
  if (options->trainer.startup_timeout <= absl::ZeroDuration()) {
    return Refuse("--startup_timeout must be positive");
  }
  const psflow::ClusterConfig& config = options->cluster;
  if (!config.cluster.ChiefInWorker0() || config.task_index != 0) return 0;
  psflow::chief::ChiefOptions chief;
  chief.cluster = config;
  if (absl::Status s = psflow::chief::ChiefOptionsFromFlags(&chief); !s.ok()) {
    return Refuse(s.message());
  }
  absl::StatusOr<psflow::JobConfig> job = psflow::chief::BuildJobConfig(chief);
  if (!job.ok()) {
    psflow::SetLogTag("worker0");
    PSLOG(ERROR) << job.status().message();
    return psflow::ExitCodeFor(job.status());
  }
  options->chief = std::move(chief);
  options->job = *std::move(job);
  return 0;
}

// The trainer's flags, and its trace (owned by `trace`). 0, or the exit code.
int TrainerFromFlags(const psflow::ClusterConfig& config, psflow::worker::TrainerOptions* options,
                     std::unique_ptr<psflow::StepTrace>* trace) {
  const int lanes = absl::GetFlag(FLAGS_ps_lanes);
  if (lanes < 0 || lanes > 64) {
    return Refuse(absl::StrCat("--ps_lanes must be in [0, 64], not ", lanes));
  }
  psflow::SetLogTag(absl::StrCat("worker", config.task_index));
  absl::StatusOr<std::unique_ptr<psflow::StepTrace>> traced =
      psflow::StepTrace::FromFlags(absl::GetFlag(FLAGS_trace_dir), absl::GetFlag(FLAGS_trace_steps),
                                   "worker", config.task_index);
  if (!traced.ok()) {
    return Refuse(absl::StrCat("--trace_dir/--trace_steps: ", traced.status().message()));
  }
  *trace = *std::move(traced);
  options->device = absl::GetFlag(FLAGS_device);
  // About 16 streams each way keep a host's loopback and the ps busy (measured
  // with 2, 4 and 8 ps on an H100 host: docs/performance.md).
  const int ps_count = static_cast<int>(config.cluster.ps.size());
  options->lanes_per_ps = lanes > 0 ? lanes : std::clamp(16 / std::max(ps_count, 1), 1, 8);
  options->push_during_backward = absl::GetFlag(FLAGS_push_during_backward);
  const int input_threads = absl::GetFlag(FLAGS_input_threads);
  if (input_threads < 0 || input_threads > 256) {
    return Refuse(absl::StrCat("--input_threads must be in [0, 256], got ", input_threads));
  }
  options->input_threads =
      input_threads > 0 ? input_threads : std::max(psflow::UsableCores() / 2, 1);
  options->min_run_bytes = absl::GetFlag(FLAGS_min_push_run_bytes);
  if (options->min_run_bytes < 0) {
    return Refuse(
        absl::StrCat("--min_push_run_bytes must not be negative, got ", options->min_run_bytes));
  }
  options->upload_from_shared_memory = absl::GetFlag(FLAGS_upload_from_shared_memory);
  options->gradients_to_shared_memory = absl::GetFlag(FLAGS_gradients_to_shared_memory);
  options->narrow_on_device = absl::GetFlag(FLAGS_narrow_on_gpu);
  options->trace = trace->get();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::BlockTerminationSignals();
  psflow::ParseFlagsOrExit(argc, argv, kUsage);
  // Executed again below (for a kernel-thread wait policy), Linux would name
  // the process after /proc/self/exe: keep the name ps and top show.
  prctl(PR_SET_NAME, "psflow-worker");
  absl::StatusOr<psflow::KernelThreadWait> wait =
      psflow::ParseKernelThreadWait(absl::GetFlag(FLAGS_kernel_threads_wait));
  if (!wait.ok()) return Refuse(absl::StrCat("--kernel_threads_wait: ", wait.status().message()));
  psflow::worker::WorkerProcessOptions options;
  options.cluster = psflow::ResolveClusterOrExit(psflow::Role::kWorker);
  // Before anything else starts (the cluster above only read the flags and
  // the environment): a new wait policy for the kernel threads takes
  // executing this program again.
  const psflow::worker::KernelThreadsNote kernel_threads =
      psflow::worker::SetKernelThreadWait(*wait, absl::GetFlag(FLAGS_kernel_threads_wait),
                                          absl::GetFlag(FLAGS_device), options.cluster, argv[0]);
  if (const int code = ChiefFromFlags(&options); code != 0) return code;
  std::unique_ptr<psflow::StepTrace> trace;  // outlives the process
  if (const int code = TrainerFromFlags(options.cluster, &options.trainer, &trace); code != 0) {
    return code;
  }
  options.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  options.same_host_channels = absl::GetFlag(FLAGS_same_host_channels);
  options.security = psflow::LoadSecurityOrExit(options.cluster);
  kernel_threads.Log();  // once every check of the command line has passed
  psflow::worker::WorkerProcess process(std::move(options));
  return process.Run();
}
