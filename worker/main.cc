// psflow-worker: a training worker. Takes the job from the chief and trains
// until the chief says the job is over.
#include <chrono>
#include <cstdlib>
#include <future>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/cluster_flags.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "common/memory.h"
#include "common/signals.h"
#include "worker/worker.h"

ABSL_FLAG(std::string, device, "cpu",
          "Where to compute: cpu (oneDNN), or cuda:N (GPU N with cuDNN and cuBLAS; in builds with CUDA). "
          "The parameter servers stay on CPUs either way.");
ABSL_FLAG(int, startup_timeout, 300,
          "Seconds to keep retrying to reach the chief or a ps before exiting with code 138.");

int main(int argc, char** argv) {
  psflow::KeepLargeAllocationsInHeap();
  psflow::BlockTerminationSignals();
  psflow::ParseFlagsOrExit(
      argc, argv,
      "a training worker of a psflow job.\n\n"
      "Configure the cluster with the flags below, or TF_CONFIG (Kubeflow), or CLUSTER_CONFIG and\n"
      "POD_NAME. The job itself (model, data, batch size, steps) comes from the chief. Example:\n"
      "  psflow-worker --job_name=worker --task_id=0 --chief_hosts=h0:2222 --ps_hosts=h1:2222 \\\n"
      "                --worker_hosts=h2:2222\n"
      "Exit codes: 0 done, 1 permanent error, 138 chief or ps unreachable, 140 other failure\n"
      "worth a retry, 128+n after signal n.");
  psflow::ClusterConfig config = psflow::ResolveClusterOrExit(psflow::Role::kWorker);
  if (absl::GetFlag(FLAGS_startup_timeout) <= 0) {
    std::fprintf(stderr, "psflow-worker: --startup_timeout must be positive\n");
    return 1;
  }
  psflow::SetLogTag(absl::StrCat("worker", config.task_index));

  psflow::worker::WorkerOptions options;
  options.cluster = config;
  options.device = absl::GetFlag(FLAGS_device);
  options.startup_timeout = absl::Seconds(absl::GetFlag(FLAGS_startup_timeout));
  psflow::worker::Worker worker(options);
  std::promise<int> result;
  std::future<int> done = result.get_future();
  absl::Notification terminated;
  psflow::TerminationWatcher watcher([&](int sig) {
    if (!terminated.HasBeenNotified()) terminated.Notify();
    PSLOG(INFO) << "signal " << sig << ": stopping after the call in flight";
    worker.Stop(sig);
    // Calls in flight are cancelled; do not wait for more than a few seconds.
    if (done.wait_for(std::chrono::seconds(6)) != std::future_status::ready) {
      std::_Exit(psflow::ExitCodeForSignal(sig));
    }
  });
  int code = worker.Run();
  result.set_value(code);
  return psflow::FinishOrIdle(code, terminated);
}
