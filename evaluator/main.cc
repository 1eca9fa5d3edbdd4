// psflow-evaluator: evaluates the job's weights on the test split while it
// trains, and the final model at its end; reports to the chief.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "chief/grpc_client.h"
#include "common/cpu_count.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "common/metrics.h"
#include "evaluator/evaluator.h"
#include "evaluator/service.h"
#include "ps/grpc_client.h"
#include "role/cluster_flags.h"
#include "role/flag_checks.h"
#include "role/process_setup.h"
#include "role/serve_role.h"
#include "role/signals.h"
#include "transport/grpc_util.h"

ABSL_FLAG(std::string, device, "cpu",
          "Where to compute: cpu (oneDNN), or cuda:N (GPU N; in builds with CUDA).");
ABSL_FLAG(std::string, eval_data_dir, "",
          "Directory with the MNIST-format test files (t10k-*) to evaluate on (idx jobs). "
          "Default: the job's --data_dir, as the chief hands it out.");
ABSL_FLAG(std::string, eval_files, "",
          "The evaluation data of a tfrecord, image_folder or csv job: comma-separated paths or "
          "glob patterns (an image folder: its root). Default: the chief's --eval_files. The "
          "whole split is decoded into memory once, at start.");
ABSL_FLAG(int, input_threads, 0,
          "Threads that decode the evaluation data at start. 0: the cores this process may use.");
ABSL_FLAG(int, batch_size, 500,
          "Examples per forward pass (psflow-eval's default, so both give the same figures for "
          "the same weights); fewer where a pass that large would not fit --eval_memory_limit.");
ABSL_FLAG(std::string, eval_memory_limit, "auto",
          "Memory the evaluation may take on --device: the model's weights and the buffers of a "
          "forward pass (the test split itself is not counted). A size such as 2GiB, 512MiB or "
          "1073741824 (bytes), or auto: half of the memory available when the job is prepared "
          "(MemAvailable or the cgroup's limit less its usage, whichever is smaller, for cpu; "
          "the GPU's free memory for cuda:N). A --batch_size that does not fit is evaluated in "
          "smaller batches; a model of which one example does not fit is refused (exit code 1), "
          "naming the memory it needs.");
ABSL_FLAG(int, compute_threads, 0,
          "CPU threads of the kernels; 0 = the cores this process may use (its CPU affinity, "
          "lowered to its cgroup's CPU quota).");
ABSL_FLAG(int64_t, synthetic_examples, 2000,
          "Test examples of a job on --data_format=synthetic (psflow-eval's default).");
ABSL_FLAG(int, startup_timeout, 300,
          "Seconds to keep retrying to reach the chief before exiting with code 138.");

namespace {

constexpr char kUsage[] =
    "the evaluator of a psflow job: evaluates consistent snapshots of the weights on the test\n"
    "split while the job trains (when is the chief's --eval_every_steps/--eval_every_secs),\n"
    "always the final model, and reports loss and accuracy to the chief, which logs them.\n"
    "Nothing in training waits for it; the end of the job waits a while for its final\n"
    "evaluation.\n\n"
    "Configure the cluster with the flags below, or TF_CONFIG (Kubeflow; the cluster may list\n"
    "only the chief), or CLUSTER_CONFIG and POD_NAME. Example:\n"
    "  psflow-evaluator --job_name=evaluator --task_id=0 --chief_hosts=h0:2222\n"
    "Exit codes: 0 done, 1 permanent error (the job failed, the data does not fit), 138 chief\n"
    "unreachable, 140 other failure worth a retry, 128+n after signal n.";

// The flags into `options`, checked. 0, or the exit code.
int OptionsFromFlags(const psflow::ClusterConfig& config,
                     psflow::evaluator::EvaluatorOptions* options) {
  if (absl::GetFlag(FLAGS_startup_timeout) <= 0 || absl::GetFlag(FLAGS_batch_size) <= 0 ||
      absl::GetFlag(FLAGS_compute_threads) < 0 || absl::GetFlag(FLAGS_synthetic_examples) <= 0) {
    return psflow::FlagError(psflow::Role::kEvaluator,
                             "--startup_timeout, --batch_size and --synthetic_examples must be "
                             "positive, --compute_threads not negative");
  }
  absl::StatusOr<int64_t> memory_limit =
      psflow::MemoryLimitFlag("--eval_memory_limit", absl::GetFlag(FLAGS_eval_memory_limit));
  if (!memory_limit.ok()) {
    return psflow::FlagError(psflow::Role::kEvaluator, memory_limit.status().message());
  }
  options->evaluator_index = config.task_index;
  options->device = absl::GetFlag(FLAGS_device);
  options->compute_threads = absl::GetFlag(FLAGS_compute_threads);
  options->data_dir = absl::GetFlag(FLAGS_eval_data_dir);
  options->batch_size = absl::GetFlag(FLAGS_batch_size);
  options->memory_limit = *memory_limit;  // 0: auto
  options->synthetic_examples = absl::GetFlag(FLAGS_synthetic_examples);
  options->eval_files = absl::GetFlag(FLAGS_eval_files);
  options->input_threads = absl::GetFlag(FLAGS_input_threads) > 0
                               ? absl::GetFlag(FLAGS_input_threads)
                               : psflow::UsableCores();
  options->chief_address = absl::StrCat("chief ", config.cluster.ChiefAddress());
  options->startup_timeout = absl::Seconds(absl::GetFlag(FLAGS_startup_timeout));
  return 0;
}

// The clients of the ps the chief names. A cluster that lists workers and no
// ps has none (its evaluator reads worker 0's replica, which the chief names
// then); one whose evaluator sees the chief alone has ps it does not list.
psflow::evaluator::PsClientFactory PsClients(const psflow::ClusterConfig& config,
                                             const psflow::SecurityOptions* security,
                                             psflow::metrics::Registry* metrics) {
  const psflow::Role server = config.cluster.AllReduce() && !config.cluster.worker.empty()
                                  ? psflow::Role::kWorker
                                  : psflow::Role::kPs;
  return [security, metrics, server](const std::vector<std::string>& addresses) {
    return std::make_unique<psflow::ps::GrpcClient>(
        addresses, psflow::ps::GrpcClientOptions{
                       .security = *security, .metrics = metrics, .server_role = server});
  };
}

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::BlockTerminationSignals();
  psflow::ParseFlagsOrExit(argc, argv, kUsage);
  psflow::ClusterConfig config = psflow::ResolveClusterOrExit(psflow::Role::kEvaluator);
  psflow::evaluator::EvaluatorOptions options;
  if (const int code = OptionsFromFlags(config, &options); code != 0) return code;
  psflow::SetLogTag(absl::StrCat("evaluator", config.task_index));
  const psflow::SecurityOptions security = psflow::LoadSecurityOrExit(config);
  // Metrics and readiness: made before everything that records into them.
  psflow::metrics::Registry metrics;
  psflow::Readiness readiness;  // ready while registered with the chief
  options.metrics = &metrics;
  options.on_registered = [&readiness](bool registered) { readiness.Set(registered); };
  psflow::chief::GrpcClient chief(config.cluster.ChiefAddress(), security, &metrics,
                                  config.cluster.ChiefHostRole());
  psflow::evaluator::Evaluator evaluator(options, &chief, PsClients(config, &security, &metrics));
  // An evaluator listed in the cluster listens on its address: the standard
  // gRPC health service answers there, for probes. One left out of the
  // cluster (TF_CONFIG's minimal form) listens on nothing, but still serves
  // /metrics with --metrics_port.
  psflow::evaluator::StatusService service(&evaluator);
  return psflow::ServeAndRunRole({.address = config.self_port > 0 ? config.self_address : "",
                                  .services = {&service},
                                  .security = security,
                                  .metrics = &metrics,
                                  .readiness = &readiness},
                                 {.run = [&] { return evaluator.Run(); },
                                  .stop = [&](int sig) { evaluator.Stop(sig); },
                                  .grace = absl::Seconds(6),
                                  .what = "stopping after the call in flight",
                                  .drain = absl::Seconds(1)});
}
