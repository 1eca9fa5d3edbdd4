// psflow-ps: a parameter server. Holds variable slices for the job the chief
// loads onto it, applies the optimizer, and exits 0 when the chief says the
// job is done (or 143 on SIGTERM: holding a job, once the chief's stop
// checkpoint is done or --stop_grace passed; then after in-flight calls).
#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "role/cluster_flags.h"
#include "common/cpu_count.h"
#include "common/exit_codes.h"
#include "transport/grpc_util.h"
#include "common/log.h"
#include "common/metrics.h"
#include "role/process_setup.h"
#include "role/serve_role.h"
#include "role/signals.h"
#include "common/step_trace.h"
#include "common/thread_pool.h"
#include "ps/service.h"
#include "ps/shard.h"

ABSL_FLAG(
    int, apply_threads, 0,
    "Threads that average the pushes and run the optimizer of a step (1 = on the thread of "
    "the last push only; results are the same for any value). 0 = the cores this process may use "
    "(its CPU affinity, lowered to its cgroup's CPU quota) divided by the ps tasks of this "
    "ps's host, at least 1.");

ABSL_FLAG(
    bool, sched_idle, false,
    "Run every thread of this ps under Linux's SCHED_IDLE scheduling policy: they never "
    "preempt another process's threads and get a core while nothing else wants it. For ps "
    "that share their cores with busy CPU workers (a local cluster on a few cores), whose "
    "compute the ps's wake-ups then no longer interrupt. Nothing changes for a ps that has "
    "cores of its own; on a host that other processes keep busy, such a ps waits for them, "
    "and beside a GPU worker it slows the job (the worker's host threads delay its applies).");

ABSL_FLAG(int, max_streams_per_peer, 64,
          "Most Init, Pull, Push and Snapshot streams one client connection may have open at once "
          "(a worker's lane has one or two); more are refused with RESOURCE_EXHAUSTED. Also the "
          "most same-host channels (--same_host_channels) one worker process may have open.");
ABSL_FLAG(int, max_streams, 1024,
          "Most Init, Pull, Push and Snapshot streams open at once from every peer together; more "
          "are refused with RESOURCE_EXHAUSTED. Waiting pulls and snapshots hold no thread. Also "
          "the most same-host channels open at once (each holds a thread while it is open).");

ABSL_FLAG(bool, shared_memory, true,
          "Map the shared memory that workers on this host offer for their pushes and pulls "
          "(psflow-worker --shared_memory), so that their tensors do not cross the network. "
          "false: refuse it; those workers then send over the network.");

ABSL_FLAG(bool, same_host_channels, true,
          "With --shared_memory, let workers on this host open channels in shared memory "
          "(psflow-worker --same_host_channels) and serve their pushes and pulls there: each "
          "channel has a thread of its own here that sleeps on a futex until its worker rings, "
          "instead of gRPC's threads. false: refuse them; those workers use gRPC.");

ABSL_FLAG(bool, apply_in_place, true,
          "In a synchronous job, apply the gradients that workers on this host push through "
          "shared memory where they lie, without copying them out first (16-bit ones are widened "
          "to fp32 block by block as they are averaged); such a push is answered once its "
          "gradients are applied (the worker reuses that memory only then), and each block is "
          "checked for NaN and infinity again as it is averaged. false: copy (or widen) them out "
          "as they arrive and answer the push at once. Asynchronous jobs always copy.");

ABSL_FLAG(bool, parallel_pull_answers, true,
          "Answer the pulls that one apply wakes (every worker's pull of the slice it applied) on "
          "several threads at once: the applying thread answers one and the ps's waker threads "
          "the others. false: the applying thread answers them one after the other.");

ABSL_FLAG(bool, wire_copies, true,
          "In a job whose wire dtype (the chief's --wire_dtype) is bf16 or fp16: keep each "
          "slice's weights in that dtype too, written once a step by the apply as it writes "
          "the new weights, so that pulls send those bytes as they lie instead of encoding the "
          "weights for each worker that pulls them (memory: 2 more bytes a weight, twice over). "
          "false: each pull encodes the fp32 weights as it sends them.");

ABSL_FLAG(absl::Duration, stop_grace, absl::Seconds(10),
          "How long at most a ps that holds a job and is told to stop (SIGTERM, SIGINT) goes on "
          "serving while it waits for a checkpoint of the chief's. It says it is stopping (in "
          "GetState), and the chief checkpoints at once; a chief that is stopping too takes its "
          "stop checkpoint. Once the chief says the checkpoint is written (or given up), or at "
          "once if it said so within this long before the signal (psflow-launch signals the "
          "chief first), the ps lets the pushes in progress end and exits; it also exits when "
          "the job is over. So neither a ps evicted alone nor a whole cluster told to stop at "
          "once (Kubernetes deleting or draining it) loses the steps since the last periodic "
          "checkpoint. Keep it below the pod's termination grace period (30 s by default); 0 = "
          "exit at once. A second signal ends the wait.");

namespace {

// Why and when the ps stops: the job is over (the chief's Shutdown), or a
// signal came; when the chief last said a checkpoint was taken
// (CheckpointTaken).
class StopState {
 public:
  // The job is over, or a second signal: stop now.
  void Request() {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  // A signal: the first is noted, a second stops now. Returns whether it
  // was the first.
  bool Signal(int sig) {
    absl::MutexLock lock(&mu_);
    if (signal_ != 0) {
      stop_ = true;
      return false;
    }
    signal_ = sig;
    signalled_at_ = absl::Now();
    return true;
  }
  void CheckpointTaken() {
    absl::MutexLock lock(&mu_);
    taken_at_ = absl::Now();
  }
  // Blocks until the ps should stop: at once when the job is over or on a
  // second signal. After the first signal, if `shard` holds a job (and
  // `grace` is not zero): once the chief said its checkpoint was taken
  // (since `grace` before the signal; `service` says meanwhile that the ps
  // is stopping) and the pushes in progress then have ended (the workers'
  // steps in flight), or `grace` after the signal; otherwise at once. Logs
  // what it waits for and why the wait ended.
  void Wait(absl::Duration grace, const psflow::ps::Shard& shard, psflow::ps::PsService& service) {
    absl::MutexLock lock(&mu_);
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || signal_ != 0; };
    mu_.Await(absl::Condition(&stopping));
    if (stop_) return;
    auto taken = [this, grace]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return taken_at_ >= signalled_at_ - grace;
    };
    if (grace <= absl::ZeroDuration() || !shard.state().has_job) {
      PSLOG(INFO) << "signal " << signal_ << ": finishing in-flight calls and exiting";
      return;
    }
    const absl::Time until = signalled_at_ + grace;
    if (taken()) {
      PSLOG(INFO) << "signal " << signal_ << ": the chief took its checkpoint "
                  << absl::FormatDuration(
                         absl::Trunc(signalled_at_ - taken_at_, absl::Milliseconds(1)))
                  << " before it; exiting once the pushes in progress end";
    } else {
      service.SetStopping();
      PSLOG(INFO) << "signal " << signal_ << ": serving on until the chief has taken a "
                  << "checkpoint, for at most " << absl::FormatDuration(grace)
                  << " (a second signal: exit now)";
      auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || taken(); };
      mu_.AwaitWithDeadline(absl::Condition(&done), until);
      if (!taken()) {
        if (!stop_) {
          PSLOG(WARNING) << "no word from the chief within " << absl::FormatDuration(grace)
                         << ": finishing in-flight calls and exiting";
        }
        return;
      }
      PSLOG(INFO) << "the chief has taken its checkpoint: exiting once the pushes in progress "
                     "end";
    }
    // Workers that are stopping too stop once their step's pushes are
    // answered: let those end, rather than fail them (each would wait for
    // this ps to come back). Pushes that start later are not waited for
    // (workers that go on training).
    const int64_t in_progress = service.pushes_admitted();
    while (!stop_ && service.pushes_open_up_to(in_progress) && absl::Now() < until) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(5));
    }
    if (!stop_ && service.pushes_open_up_to(in_progress)) {
      PSLOG(WARNING) << "pushes still in progress after " << absl::FormatDuration(grace)
                     << ": exiting";
    }
  }

 private:
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int signal_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time signalled_at_ ABSL_GUARDED_BY(mu_);
  absl::Time taken_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// --apply_threads=0: the cores shared evenly by the ps of this host (in a
// synchronous job the workers wait while the ps apply, so the cores are free).
int ApplyThreads(const psflow::ClusterConfig& config) {
  const int flag = absl::GetFlag(FLAGS_apply_threads);
  if (flag > 0) return flag;
  std::string self_host, host;
  int port = 0;
  int ps_here = 0;
  if (psflow::ParseHostPort(config.self_address, &self_host, &port).ok()) {
    for (const std::string& address : config.cluster.ps) {
      if (psflow::ParseHostPort(address, &host, &port).ok() && host == self_host) ++ps_here;
    }
  }
  return std::max(1, psflow::UsableCores() / std::max(1, ps_here));
}

// The shard's own counts (since its last Init, so a reload starts them again
// at 0: a counter reset to Prometheus) and version, read at each scrape.
void AddShardMetrics(const psflow::ps::Shard& shard, psflow::metrics::Registry& metrics) {
  using Stats = psflow::ps::Shard::Stats;
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
      "Pushes refused for a non-finite gradient since this ps last took a job.",
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

ABSL_FLAG(std::string, trace_dir, "", psflow::kTraceDirHelp);
ABSL_FLAG(std::string, trace_steps, "100:101", psflow::kTraceStepsHelp);

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::BlockTerminationSignals();
  psflow::ParseFlagsOrExit(
      argc, argv,
      "a parameter server of a psflow job.\n\n"
      "Configure the cluster with the flags below, or TF_CONFIG (Kubeflow), or CLUSTER_CONFIG and\n"
      "POD_NAME. Example:\n"
      "  psflow-ps --job_name=ps --task_id=0 --chief_hosts=h0:2222 --ps_hosts=h1:2222 \\\n"
      "            --worker_hosts=h2:2222\n"
      "The job itself (model, optimizer, placement) comes from the chief.");
  psflow::ClusterConfig config = psflow::ResolveClusterOrExit(psflow::Role::kPs);
  psflow::SetLogTag(absl::StrCat("ps", config.task_index));

  if (absl::GetFlag(FLAGS_apply_threads) < 0) {
    PSLOG(ERROR) << "--apply_threads must be 0 (one share of the cores) or positive";
    return psflow::kExitPermanent;
  }
  if (absl::GetFlag(FLAGS_stop_grace) < absl::ZeroDuration()) {
    PSLOG(ERROR) << "--stop_grace must be 0 (exit at once on a signal) or positive, not "
                 << absl::FormatDuration(absl::GetFlag(FLAGS_stop_grace));
    return psflow::kExitPermanent;
  }
  // Before the ps starts its threads (they inherit the policy).
  if (absl::GetFlag(FLAGS_sched_idle)) {
    if (absl::Status s = psflow::RunOnlyOnIdleCores(); !s.ok()) {
      PSLOG(ERROR) << "--sched_idle: " << s.message();
      return psflow::kExitPermanent;
    }
    PSLOG(INFO) << "threads run under SCHED_IDLE (--sched_idle)";
  }
  psflow::ps::StreamLimits limits;
  limits.per_peer = absl::GetFlag(FLAGS_max_streams_per_peer);
  limits.total = absl::GetFlag(FLAGS_max_streams);
  if (limits.per_peer < 1 || limits.total < limits.per_peer) {
    PSLOG(ERROR) << "--max_streams_per_peer must be positive and at most --max_streams";
    return psflow::kExitPermanent;
  }
  absl::StatusOr<std::unique_ptr<psflow::StepTrace>> trace = psflow::StepTrace::FromFlags(
      absl::GetFlag(FLAGS_trace_dir), absl::GetFlag(FLAGS_trace_steps), "ps", config.task_index);
  if (!trace.ok()) {
    PSLOG(ERROR) << "--trace_dir/--trace_steps: " << trace.status().message();
    return psflow::kExitPermanent;
  }
  const psflow::SecurityOptions security = psflow::LoadSecurityOrExit(psflow::Role::kPs);
  const int apply_threads = ApplyThreads(config);
  // The thread of the push that completes a step applies too: the pool adds the others.
  std::unique_ptr<psflow::ThreadPool> apply_pool;
  if (apply_threads > 1) apply_pool = std::make_unique<psflow::ThreadPool>(apply_threads - 1);
  // Slices are applied off the threads that read the pushes, so that a push
  // stream goes on while its slices are applied; a few at once.
  psflow::ThreadPool appliers(std::min(4, apply_threads));
  PSLOG(INFO) << "applying each step on " << apply_threads << " thread(s)";
  // Before the shard and the service, which record into it; its function
  // series read the shard until the metrics server stops (below).
  psflow::metrics::Registry metrics;
  psflow::Readiness readiness;  // ready once the ps holds a job
  psflow::ps::Shard shard(apply_pool.get(), psflow::ps::Shard::kDefaultApplyRange, &appliers,
                          trace->get());
  shard.SetWireCopies(absl::GetFlag(FLAGS_wire_copies));
  StopState stop;
  std::atomic<int> exit_code{0};
  auto request_stop = [&] { stop.Request(); };
  // A woken pull encodes its next slice on the wakers (a few threads: pulls
  // beside pushes wait for most slices); push messages are decoded on the
  // pushers (CPU work: about as many threads as cores).
  psflow::ThreadPool wakers(std::max(2, psflow::UsableCores() / 4));
  psflow::ThreadPool pushers(std::max(4, psflow::UsableCores()));
  psflow::ps::PsService service(
      &shard, {.ps_index = config.task_index,
               .on_shutdown = request_stop,
               .on_job = [&readiness](bool ready) { readiness.Set(ready); },
               .metrics = &metrics,
               .limits = limits,
               .shared_memory = absl::GetFlag(FLAGS_shared_memory),
               .trace = trace->get(),
               .apply_in_place = absl::GetFlag(FLAGS_apply_in_place),
               .spread_wakes = absl::GetFlag(FLAGS_parallel_pull_answers),
               .channels = absl::GetFlag(FLAGS_same_host_channels),
               .wakers = &wakers,
               .pushers = &pushers});
  service.OnCheckpointTaken([&stop] { stop.CheckpointTaken(); });
  AddShardMetrics(shard, metrics);
  absl::Notification terminated;
  psflow::TerminationWatcher watcher([&](int sig) {
    if (!terminated.HasBeenNotified()) terminated.Notify();
    exit_code = psflow::ExitCodeForSignal(sig);
    if (!stop.Signal(sig)) PSLOG(INFO) << "signal " << sig << ": exiting now";
  });

  absl::StatusOr<std::unique_ptr<psflow::RoleServers>> servers =
      psflow::ServeRole({.address = config.self_address,
                         .services = {&service},
                         .callers = psflow::ps::PsCallers(config.cluster.ChiefHostRole()),
                         .security = security,
                         .metrics = &metrics,
                         .readiness = &readiness});
  if (!servers.ok()) {
    PSLOG(ERROR) << servers.status().message();
    return psflow::kExitPermanent;
  }
  PSLOG(INFO) << "listening on " << config.self_address;
  stop.Wait(absl::GetFlag(FLAGS_stop_grace), shard, service);
  readiness.Set(false);  // the job is over (or the process stops): not ready
  shard.Shutdown();      // wakes waiting pulls so the server can drain
  // With --exit_when_done=false the server stays up while idle, so that the
  // health service still shows the process alive.
  const int code = psflow::FinishOrIdle(exit_code, terminated);
  (*servers)->Stop(absl::Seconds(5));
  psflow::ps::Shard::Stats stats = shard.stats();
  PSLOG(INFO) << "exiting at version " << stats.version << " (stale pushes " << stats.stale
              << ", duplicates " << stats.duplicate << ", refused for non-finite gradients "
              << stats.refused_pushes << ", streams refused over a bound "
              << service.refused_streams() << ")";
  psflow::LogResourceUsage();
  return code;
}
