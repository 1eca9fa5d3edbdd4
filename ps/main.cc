// psflow-ps: a parameter server. Holds variable slices for the job the chief
// loads onto it, applies the optimizer, and exits 0 when the chief says the
// job is done (or 143 on SIGTERM: holding a job, once the chief's stop
// checkpoint is done or --stop_grace passed; then after in-flight calls).
// The flags become a ps::PsProcessOptions; ps::PsProcess (ps/process.h) does
// the rest.
#include <memory>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "common/step_trace.h"
#include "ps/process.h"
#include "role/cluster_flags.h"
#include "role/process_setup.h"
#include "role/signals.h"

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

ABSL_FLAG(int, max_pending_streams, 0,
          "Most streams open at once of client connections that have not proven to be the job's "
          "(no push header or Init accepted on them yet: strangers, and workers before their "
          "first push); more are refused with RESOURCE_EXHAUSTED, so the rest of --max_streams "
          "stays for the workers at work. 0 = half of --max_streams.");
ABSL_FLAG(absl::Duration, stream_first_message_timeout, absl::Seconds(5),
          "End a Push stream (DEADLINE_EXCEEDED) or an Init stream (cancelled) that has not sent "
          "a valid header within this long of its start, so that silent streams cannot hold the "
          "stream budget; counted in psflow_ps_streams_timed_out_total. 0 = never.");

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
ABSL_FLAG(std::string, trace_dir, "", psflow::kTraceDirHelp);
ABSL_FLAG(std::string, trace_steps, "100:101", psflow::kTraceStepsHelp);

namespace {

constexpr char kUsage[] =
    "a parameter server of a psflow job.\n\n"
    "Configure the cluster with the flags below, or TF_CONFIG (Kubeflow), or CLUSTER_CONFIG and\n"
    "POD_NAME. Example:\n"
    "  psflow-ps --job_name=ps --task_id=0 --chief_hosts=h0:2222 --ps_hosts=h1:2222 \\\n"
    "            --worker_hosts=h2:2222\n"
    "The job itself (model, optimizer, placement) comes from the chief.";

// The flags into `options`, each checked; false once the one refused is
// logged. Runs --sched_idle at once, before the ps starts its threads (they
// inherit the policy).
bool OptionsFromFlags(psflow::ps::PsProcessOptions* options) {
  options->apply_threads = absl::GetFlag(FLAGS_apply_threads);
  if (options->apply_threads < 0) {
    PSLOG(ERROR) << "--apply_threads must be 0 (one share of the cores) or positive";
    return false;
  }
  options->stop_grace = absl::GetFlag(FLAGS_stop_grace);
  if (options->stop_grace < absl::ZeroDuration()) {
    PSLOG(ERROR) << "--stop_grace must be 0 (exit at once on a signal) or positive, not "
                 << absl::FormatDuration(options->stop_grace);
    return false;
  }
  if (absl::GetFlag(FLAGS_sched_idle)) {
    if (absl::Status s = psflow::RunOnlyOnIdleCores(); !s.ok()) {
      PSLOG(ERROR) << "--sched_idle: " << s.message();
      return false;
    }
    PSLOG(INFO) << "threads run under SCHED_IDLE (--sched_idle)";
  }
  options->limits.per_peer = absl::GetFlag(FLAGS_max_streams_per_peer);
  options->limits.total = absl::GetFlag(FLAGS_max_streams);
  if (options->limits.per_peer < 1 || options->limits.total < options->limits.per_peer) {
    PSLOG(ERROR) << "--max_streams_per_peer must be positive and at most --max_streams";
    return false;
  }
  const int pending = absl::GetFlag(FLAGS_max_pending_streams);
  options->limits.pending = pending == 0 ? options->limits.total / 2 : pending;
  if (pending < 0 || options->limits.pending > options->limits.total) {
    PSLOG(ERROR) << "--max_pending_streams must be 0 (half of --max_streams) or positive and at "
                    "most --max_streams, not "
                 << pending;
    return false;
  }
  options->limits.first_message_timeout = absl::GetFlag(FLAGS_stream_first_message_timeout);
  if (options->limits.first_message_timeout < absl::ZeroDuration()) {
    PSLOG(ERROR) << "--stream_first_message_timeout must be 0 (never) or positive, not "
                 << absl::FormatDuration(options->limits.first_message_timeout);
    return false;
  }
  options->shared_memory = absl::GetFlag(FLAGS_shared_memory);
  options->same_host_channels = absl::GetFlag(FLAGS_same_host_channels);
  options->apply_in_place = absl::GetFlag(FLAGS_apply_in_place);
  options->parallel_pull_answers = absl::GetFlag(FLAGS_parallel_pull_answers);
  options->wire_copies = absl::GetFlag(FLAGS_wire_copies);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::BlockTerminationSignals();
  psflow::ParseFlagsOrExit(argc, argv, kUsage);
  psflow::ps::PsProcessOptions options;
  options.cluster = psflow::ResolveClusterOrExit(psflow::Role::kPs);
  psflow::SetLogTag(absl::StrCat("ps", options.cluster.task_index));
  if (!OptionsFromFlags(&options)) return psflow::kExitPermanent;
  absl::StatusOr<std::unique_ptr<psflow::StepTrace>> trace =
      psflow::StepTrace::FromFlags(absl::GetFlag(FLAGS_trace_dir), absl::GetFlag(FLAGS_trace_steps),
                                   "ps", options.cluster.task_index);
  if (!trace.ok()) {
    PSLOG(ERROR) << "--trace_dir/--trace_steps: " << trace.status().message();
    return psflow::kExitPermanent;
  }
  options.trace = trace->get();
  options.security = psflow::LoadSecurityOrExit(options.cluster);
  psflow::ps::PsProcess process(std::move(options));
  return process.Run();
}
