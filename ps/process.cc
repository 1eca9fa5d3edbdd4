#include "ps/process.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cpu_count.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "ps/callers.h"
#include "role/cluster_flags.h"
#include "role/process_setup.h"
#include "role/serve_role.h"
#include "role/signals.h"

namespace psflow::ps {
namespace {

// apply_threads 0: the cores shared evenly by the ps of this host (in a
// synchronous job the workers wait while the ps apply, so the cores are free).
int ApplyThreads(const PsProcessOptions& options) {
  if (options.apply_threads > 0) return options.apply_threads;
  const ClusterConfig& config = options.cluster;
  std::string self_host, host;
  int port = 0;
  int ps_here = 0;
  if (ParseHostPort(config.self_address, &self_host, &port).ok()) {
    for (const std::string& address : config.cluster.ps) {
      if (ParseHostPort(address, &host, &port).ok() && host == self_host) ++ps_here;
    }
  }
  return std::max(1, UsableCores() / std::max(1, ps_here));
}

// The shard's own counts (since its last Init, so a reload starts them again
// at 0: a counter reset to Prometheus) and version, read at each scrape.
void AddShardMetrics(const Shard& shard, metrics::Registry& metrics) {
  using Stats = Shard::Stats;
  auto read = [&shard](int64_t Stats::*field) {
    return [&shard, field] { return static_cast<double>(shard.stats().*field); };
  };
  metrics.SetGaugeFunction("psflow_ps_version",
                           "Steps this ps has applied to every one of its slices (its version).",
                           read(&Stats::version));
  metrics.SetCounterFunction("psflow_ps_applied_steps_total",
                             "Steps applied since this ps last took a job.", read(&Stats::applied));
  metrics.SetCounterFunction(
      "psflow_ps_stale_pushes_total",
      "Pushes for a step already applied, dropped, since this ps last took a job.",
      read(&Stats::stale));
  metrics.SetCounterFunction(
      "psflow_ps_duplicate_pushes_total",
      "Repeated pushes of a worker for a step (retries), ignored, since this ps last took a job.",
      read(&Stats::duplicate));
  metrics.SetCounterFunction(
      "psflow_ps_refused_pushes_total",
      "Pushes refused (a non-finite gradient, or a skip in a job that does not skip steps) since "
      "this ps last took a job.",
      read(&Stats::refused_pushes));
  metrics.SetCounterFunction(
      "psflow_ps_gradients_changed_after_check_total",
      "Applies that found a NaN or an infinity in gradients left in a worker's shared memory "
      "after they had been checked finite (the worker changed them; those values counted as 0), "
      "since this ps last took a job.",
      read(&Stats::changed_after_check));
  // Jobs in --mode=async or ssp (0 in sync mode, where nothing is stale).
  metrics.SetCounterFunction(
      "psflow_ps_staleness_versions_total",
      "Asynchronous jobs: the versions each applied gradient was behind (applied after the one "
      "it was computed from), summed since this ps last took a job; over "
      "psflow_ps_applied_steps_total, the mean staleness.",
      read(&Stats::staleness_sum));
  metrics.SetGaugeFunction("psflow_ps_staleness_max",
                           "Asynchronous jobs: the most versions an applied gradient was behind.",
                           read(&Stats::staleness_max));
  metrics.SetGaugeFunction(
      "psflow_ps_worker_lead_max",
      "Asynchronous jobs: the largest lead of a worker's step over the slowest live worker's "
      "when this ps served its pull (ssp keeps it at or below --staleness).",
      read(&Stats::clock_lead_max));
}

}  // namespace

PsProcess::PsProcess(PsProcessOptions options)
    : options_(std::move(options)),
      apply_threads_(ApplyThreads(options_)),
      apply_pool_(apply_threads_ > 1 ? std::make_unique<ThreadPool>(apply_threads_ - 1) : nullptr),
      appliers_(std::min(4, apply_threads_)),
      shard_(apply_pool_.get(), Shard::kDefaultApplyRange, &appliers_, options_.trace),
      wakers_(std::max(2, UsableCores() / 4)),
      pushers_(std::max(4, UsableCores())),
      service_(&shard_, {.ps_index = options_.cluster.task_index,
                         .on_shutdown = [this] { stop_.Request(); },
                         .on_job = [this](bool ready) { readiness_.Set(ready); },
                         .metrics = &metrics_,
                         .limits = options_.limits,
                         .shared_memory = options_.shared_memory,
                         .trace = options_.trace,
                         .apply_in_place = options_.apply_in_place,
                         .spread_wakes = options_.parallel_pull_answers,
                         .channels = options_.same_host_channels,
                         .wakers = &wakers_,
                         .pushers = &pushers_}) {
  PSLOG(INFO) << "applying each step on " << apply_threads_ << " thread(s)";
  shard_.SetWireCopies(options_.wire_copies);
  service_.OnCheckpointTaken([this] { stop_.CheckpointTaken(); });
  AddShardMetrics(shard_, metrics_);
}

PsProcess::~PsProcess() = default;

int PsProcess::Run() {
  TerminationWatcher watcher([this](int sig) {
    if (!terminated_.HasBeenNotified()) terminated_.Notify();
    exit_code_ = ExitCodeForSignal(sig);
    if (!stop_.Signal(sig)) PSLOG(INFO) << "signal " << sig << ": exiting now";
  });
  absl::StatusOr<std::unique_ptr<RoleServers>> servers =
      ServeRole({.address = options_.cluster.self_address,
                 .services = {&service_},
                 .callers = PsCallers(options_.cluster.cluster.ChiefHostRole()),
                 .security = options_.security,
                 .metrics = &metrics_,
                 .readiness = &readiness_});
  if (!servers.ok()) {
    PSLOG(ERROR) << servers.status().message();
    return kExitPermanent;
  }
  PSLOG(INFO) << "listening on " << options_.cluster.self_address;
  stop_.Wait(options_.stop_grace, shard_, service_);
  readiness_.Set(false);  // the job is over (or the process stops): not ready
  shard_.Shutdown();      // wakes waiting pulls so the server can drain
  // With --exit_when_done=false the server stays up while idle, so that the
  // health service still shows the process alive.
  const int code = FinishOrIdle(exit_code_, terminated_);
  (*servers)->Stop(absl::Seconds(5));
  Shard::Stats stats = shard_.stats();
  PSLOG(INFO) << "exiting at version " << stats.version << " (stale pushes " << stats.stale
              << ", duplicates " << stats.duplicate << ", refused pushes " << stats.refused_pushes
              << ", streams refused over a bound " << service_.refused_streams() << ")";
  LogResourceUsage();
  return code;
}

}  // namespace psflow::ps
