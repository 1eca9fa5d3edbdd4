// psflow-worker: a training worker. Takes the job from the chief and trains
// until the chief says the job is over.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "chief/grpc_client.h"
#include "common/cluster_flags.h"
#include "common/exit_codes.h"
#include "common/grpc_util.h"
#include "common/log.h"
#include "common/memory.h"
#include "common/metrics.h"
#include "common/signals.h"
#include "ps/grpc_client.h"
#include "worker/service.h"
#include "worker/trainer.h"

ABSL_FLAG(
    std::string, device, "cpu",
    "Where to compute: cpu (oneDNN), or cuda:N (GPU N with cuDNN and cuBLAS; in builds with CUDA). "
    "The parameter servers stay on CPUs either way.");
ABSL_FLAG(
    int, ps_lanes, 0,
    "Most concurrent pulls and pushes (lanes) per ps, each over its own connection and of "
    "consecutive slices of at least 1 MiB (a ps holding less, or few large slices, gives fewer). "
    "0: up to 16 lanes in all, shared by the ps (at most 8 per ps, at least 1). 1: one "
    "stream each way per ps.");
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
  const int lanes = absl::GetFlag(FLAGS_ps_lanes);
  if (lanes < 0 || lanes > 64) {
    std::fprintf(stderr, "psflow-worker: --ps_lanes must be in [0, 64], not %d\n", lanes);
    return 1;
  }
  psflow::SetLogTag(absl::StrCat("worker", config.task_index));

  // Before everything that records into it.
  psflow::metrics::Registry metrics;
  psflow::Readiness readiness;  // ready while registered with the chief
  psflow::worker::TrainerOptions options;
  options.worker_index = config.task_index;
  options.device = absl::GetFlag(FLAGS_device);
  options.chief_address = absl::StrCat("chief ", config.cluster.chief[0]);
  options.startup_timeout = absl::Seconds(absl::GetFlag(FLAGS_startup_timeout));
  options.on_registered = [&readiness](bool registered) { readiness.Set(registered); };
  // About 16 streams each way keep a host's loopback and the ps busy (measured
  // with 2, 4 and 8 ps on an H100 host: docs/performance.md).
  const int ps_count = static_cast<int>(config.cluster.ps.size());
  options.lanes_per_ps = lanes > 0 ? lanes : std::clamp(16 / std::max(ps_count, 1), 1, 8);
  const psflow::SecurityOptions security = psflow::LoadSecurityOrExit(psflow::Role::kWorker);
  psflow::chief::GrpcClient chief(config.cluster.chief[0], security, &metrics);
  psflow::worker::Trainer trainer(
      options, &chief,
      [&security, &metrics, connections = options.lanes_per_ps](
          const std::vector<std::string>& addresses) -> std::unique_ptr<psflow::ps::Client> {
        return std::make_unique<psflow::ps::GrpcClient>(addresses, security, connections, &metrics);
      });
  metrics.SetGaugeFunction(
      "psflow_worker_step",
      "The step this worker computes (the last one reached once finished); 0 before it joins.",
      [&trainer] { return static_cast<double>(trainer.Status().step); });
  // The worker listens on its own address too: the standard gRPC health
  // service answers there, for readiness probes and peers' connectivity checks.
  psflow::worker::StatusService service(&trainer);
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      psflow::StartServer(config.self_address, &service, security);
  if (!server.ok()) {
    PSLOG(ERROR) << server.status().message();
    return psflow::kExitPermanent;
  }
  readiness.Attach(server->get());
  absl::StatusOr<std::unique_ptr<psflow::metrics::MetricsServer>> metrics_server =
      psflow::ServeMetrics(&metrics, &readiness);
  if (!metrics_server.ok()) {
    PSLOG(ERROR) << metrics_server.status().message();
    readiness.Detach();
    return psflow::kExitPermanent;
  }
  // Calls in flight are cancelled on a signal; do not wait for more than a few seconds.
  const int code =
      psflow::RunRole([&] { return trainer.Run(); }, [&](int sig) { trainer.Stop(sig); },
                      absl::Seconds(6), "stopping after the call in flight");
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  readiness.Detach();
  return code;
}
