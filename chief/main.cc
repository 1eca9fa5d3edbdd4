// psflow-chief: coordinates a psflow job. Its flags (chief/flags.h) are the
// job's single source of truth; ps and workers receive the job from it.
#include <chrono>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "chief/flags.h"
#include "chief/role.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "common/metrics.h"
#include "role/cluster_flags.h"
#include "role/flag_checks.h"
#include "role/process_setup.h"
#include "role/serve_role.h"
#include "role/signals.h"
#include "transport/grpc_util.h"

namespace {

constexpr char kUsage[] =
    "the chief of a psflow job.\n\n"
    "Configure the cluster with the flags below, or TF_CONFIG (Kubeflow; 'master' counts as\n"
    "chief), or CLUSTER_CONFIG and POD_NAME. Example:\n"
    "  psflow-chief --job_name=chief --task_id=0 --chief_hosts=h0:2222 --ps_hosts=h1:2222 \\\n"
    "               --worker_hosts=h2:2222 --model=cnn --epochs=5 --optimizer=adam \\\n"
    "               --learning_rate=0.001 --model_dir=/tmp/run\n"
    "Exit codes: 0 done, 1 bad configuration or a diverged job, 138 a ps unreachable within\n"
    "--startup_timeout, 140 other failure worth a retry, 128+n after signal n (after writing a\n"
    "checkpoint).";

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::BlockTerminationSignals();
  psflow::ParseFlagsOrExit(argc, argv, kUsage);
  psflow::chief::ChiefOptions o;
  o.cluster = psflow::ResolveClusterOrExit(psflow::Role::kChief);
  psflow::SetLogTag("chief");

  if (absl::Status s = psflow::chief::ChiefOptionsFromFlags(&o); !s.ok()) {
    return psflow::FlagError(psflow::Role::kChief, s.message());
  }
  absl::StatusOr<psflow::JobConfig> job = psflow::chief::BuildJobConfig(o);
  if (!job.ok()) {
    PSLOG(ERROR) << job.status().message();
    return psflow::ExitCodeFor(job.status());
  }
  const psflow::SecurityOptions security = psflow::LoadSecurityOrExit(o.cluster);
  // Metrics and readiness (the gRPC health service): made before, and
  // served after, everything they read.
  psflow::metrics::Registry metrics;
  psflow::Readiness readiness;  // ready while every ps holds the job
  o.coordinator.on_ready = [&readiness](bool ready) { readiness.Set(ready); };
  std::unique_ptr<psflow::chief::ChiefRole> chief =
      psflow::chief::ChiefRole::Create(o, *std::move(job), security, &metrics);
  // A signal makes the coordinator checkpoint first; give that time, not forever.
  return psflow::ServeAndRunRole(
      {.address = o.cluster.self_address,
       .services = {chief->service()},
       .callers = psflow::chief::ChiefCallers(),
       .security = security,
       .metrics = &metrics,
       .readiness = &readiness},
      {.run =
           [&] {
             PSLOG(INFO) << "listening on " << o.cluster.self_address
                         << "; loading the parameter servers";
             absl::Status s = chief->Run();
             readiness.Set(false);  // the job is over: nothing left to be ready for
             return s;
           },
       .stop = [&](int sig) { chief->Stop(sig); },
       .grace = absl::Seconds(30),
       .what = "stopping",
       .drain = absl::Seconds(2)});
}
