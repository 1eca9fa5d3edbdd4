// psflow-launch: runs a whole psflow cluster on this machine.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cpu_count.h"
#include "common/step_trace.h"
#include "role/command_line.h"
#include "tools/launch/launcher.h"

ABSL_FLAG(int, ps, 2,
          "Number of parameter servers. 0: none; the workers average their gradients among "
          "themselves (all-reduce), each keeping a replica of the weights, and worker 0 runs the "
          "chief's duties unless --chief stays true.");
ABSL_FLAG(bool, chief, true,
          "false: no chief process (a cluster of ps and workers only, as a Helm-rendered "
          "CLUSTER_CONFIG has it): worker 0 runs the chief's duties and gets the arguments after "
          "--; its exit is the launcher's.");
ABSL_FLAG(int, workers, 2, "Number of workers.");
ABSL_FLAG(int, evaluators, 0,
          "Number of evaluators (psflow-evaluator: they evaluate the weights on the test split as "
          "the job trains, and the final model; see the chief's --eval_every_secs). One that "
          "fails does not stop the cluster.");
ABSL_FLAG(std::string, host, "127.0.0.1",
          "Host in the cluster addresses handed to the processes, on free ports picked here. Each "
          "listens on that address where it is an IP address of this machine, else on all "
          "interfaces.");
ABSL_FLAG(
    std::string, bin_dir, "",
    "Directory holding psflow-chief, psflow-ps, psflow-worker and psflow-evaluator (default: this "
    "binary's own).");
ABSL_FLAG(int, grace_seconds, 15,
          "Seconds the ps and workers get to exit by themselves after the chief exits with 0 (a "
          "chief that fails stops them at once).");
ABSL_FLAG(
    std::string, restart, "never",
    "never, or on-failure: start a process again (after a second) when it exits non-zero, as a "
    "Kubernetes restart policy would; the job then ends when the chief exits 0.");
ABSL_FLAG(
    std::string, worker_devices, "",
    "The workers' --device: one value for every worker (cuda:0, or cuda:all), a comma-separated "
    "list with one per worker (cuda:0,cuda:1), or device lists separated by ';' for workers "
    "with several GPUs each (cuda:0,cuda:1;cuda:2,cuda:3; a single worker may take "
    "cuda:0,cuda:1). Several GPUs per worker set the chief's --replicas_per_worker unless it "
    "is given after --; with cuda:all give it yourself. Default: cpu.");
ABSL_FLAG(std::string, worker_args, "",
          "More flags for every worker, separated by spaces (psflow-worker's own, e.g. "
          "\"--ps_lanes=4 --push_during_backward=false\"); each must start with --.");
ABSL_FLAG(std::string, ps_args, "",
          "More flags for every ps, separated by spaces (psflow-ps's own, e.g. "
          "\"--apply_threads=4\"); each must start with --.");
ABSL_FLAG(std::string, trace_dir, "",
          "Give every ps and worker --trace_dir=DIR (and --trace_steps): each writes a timeline "
          "of those steps to DIR/<role><index>.json; scripts/trace-summary.py DIR lists one step "
          "of the whole job. Empty: no trace.");
ABSL_FLAG(std::string, trace_steps, "100:101",
          "With --trace_dir: the steps to trace, FIRST:LAST (both included) or one step.");
ABSL_FLAG(std::string, evaluator_device, "",
          "The evaluators' --device (cuda:0, say). Default: cpu.");
ABSL_FLAG(int, max_restarts, 20, "With --restart=on-failure: restarts allowed in all.");
ABSL_FLAG(std::string, tls_dir, "",
          "Run the cluster with mutual TLS and the job token from a directory made by "
          "scripts/make-certs.sh DIR: each process gets --tls_cert/--tls_key of its own task "
          "where DIR holds them (DIR/<role>-<index>.crt, .key: it may then act only as itself), "
          "else of its role (DIR/<role>.crt, .key), --tls_ca=DIR/ca.crt and "
          "--auth_token_file=DIR/token (when "
          "there is one). Default: plaintext, with a job token generated for the cluster.");
ABSL_FLAG(std::string, token_file, "",
          "Write the job token generated for this cluster to this file (mode 0600, replaced if "
          "it exists) and keep it after the run, for clients that call the cluster from outside "
          "(they send it as \"authorization: Bearer <token>\"). Every cluster gets a fresh "
          "random token (256 bits) and every process --auth_token_file, so that other users of "
          "this machine cannot call it; by default the file lives in a private temporary "
          "directory, removed at exit. Not with a --tls_dir that holds a token (that one is "
          "used).");
ABSL_FLAG(int, metrics_base_port, 0,
          "Serve each process's Prometheus metrics from this port on: --metrics_port of the chief "
          "is this port, of ps i this + 1 + i, of worker i this + 1 + --ps + i, of evaluator i "
          "this + 1 + --ps + --workers + i. 0: no metrics.");

namespace {

using psflow::launch::LaunchOptions;

// Each of the checks below says what is wrong on stderr and returns false.

// The files --tls_dir must hold for the processes this cluster has.
bool CheckTlsDir(const LaunchOptions& o) {
  std::vector<std::string> needed = {"ca.crt", "worker.crt", "worker.key"};
  if (o.num_ps > 0) needed.insert(needed.end(), {"ps.crt", "ps.key"});
  if (o.with_chief) needed.insert(needed.end(), {"chief.crt", "chief.key"});
  if (o.num_evaluators > 0) needed.insert(needed.end(), {"evaluator.crt", "evaluator.key"});
  for (const std::string& file : needed) {
    if (!std::filesystem::exists(o.tls_dir + "/" + file)) {
      std::fprintf(stderr,
                   "psflow-launch: --tls_dir: no %s in %s (make the set with "
                   "scripts/make-certs.sh %s)\n",
                   file.c_str(), o.tls_dir.c_str(), o.tls_dir.c_str());
      return false;
    }
  }
  return true;
}

// The cluster's shape, restarts, TLS and metrics ports.
bool ClusterFromFlags(LaunchOptions* o) {
  o->num_ps = absl::GetFlag(FLAGS_ps);
  o->num_workers = absl::GetFlag(FLAGS_workers);
  o->with_chief = absl::GetFlag(FLAGS_chief);
  if (!o->with_chief && o->num_workers < 1) {
    std::fprintf(stderr, "psflow-launch: --chief=false needs a worker to run the chief's duties\n");
    return false;
  }
  o->num_evaluators = absl::GetFlag(FLAGS_evaluators);
  o->host = absl::GetFlag(FLAGS_host);
  o->grace_seconds = absl::GetFlag(FLAGS_grace_seconds);
  const std::string restart = absl::GetFlag(FLAGS_restart);
  if (restart != "never" && restart != "on-failure") {
    std::fprintf(stderr, "psflow-launch: --restart must be never or on-failure, not '%s'\n",
                 restart.c_str());
    return false;
  }
  o->restart_on_failure = restart == "on-failure";
  o->max_restarts = absl::GetFlag(FLAGS_max_restarts);
  o->metrics_base_port = absl::GetFlag(FLAGS_metrics_base_port);
  if (o->num_ps < 0 || o->num_workers < 1 || o->num_evaluators < 0) {
    std::fprintf(stderr,
                 "psflow-launch: --workers must be at least 1, --ps and --evaluators not "
                 "negative\n");
    return false;
  }
  o->tls_dir = absl::GetFlag(FLAGS_tls_dir);
  if (!o->tls_dir.empty() && !CheckTlsDir(*o)) return false;
  o->token_file = absl::GetFlag(FLAGS_token_file);
  if (!o->token_file.empty() && !o->tls_dir.empty() &&
      std::filesystem::exists(o->tls_dir + "/token")) {
    std::fprintf(stderr,
                 "psflow-launch: --token_file: the cluster uses the token in %s/token "
                 "(--tls_dir); give one or the other\n",
                 o->tls_dir.c_str());
    return false;
  }
  if (o->metrics_base_port < 0 ||
      o->metrics_base_port + o->num_ps + o->num_workers + o->num_evaluators > 65535) {
    std::fprintf(stderr,
                 "psflow-launch: --metrics_base_port must be 0 or leave a port for every process "
                 "below 65536\n");
    return false;
  }
  return true;
}

// --worker_args and --ps_args: flags separated by spaces, each "--...".
bool SplitFlags(const char* name, const std::string& text, std::vector<std::string>* out) {
  for (absl::string_view arg : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!absl::StartsWith(arg, "--")) {
      std::fprintf(stderr, "psflow-launch: --%s: '%s' is not a flag (--name=value)\n", name,
                   std::string(arg).c_str());
      return false;
    }
    out->emplace_back(arg);
  }
  return true;
}

// What each process is given: devices, the flags for workers and ps, the
// trace's, and the chief's (`rest`: the command line after --, rest[0] the
// program).
bool ProcessArgsFromFlags(const std::vector<char*>& rest, LaunchOptions* o) {
  o->bin_dir = absl::GetFlag(FLAGS_bin_dir);
  o->evaluator_device = absl::GetFlag(FLAGS_evaluator_device);
  int replicas = 1;
  const std::string bad = psflow::launch::ParseWorkerDevices(
      absl::GetFlag(FLAGS_worker_devices), o->num_workers, &o->worker_devices, &replicas);
  if (!bad.empty()) {
    std::fprintf(stderr, "psflow-launch: %s\n", bad.c_str());
    return false;
  }
  if (!SplitFlags("worker_args", absl::GetFlag(FLAGS_worker_args), &o->worker_args) ||
      !SplitFlags("ps_args", absl::GetFlag(FLAGS_ps_args), &o->ps_args)) {
    return false;
  }
  if (const std::string dir = absl::GetFlag(FLAGS_trace_dir); !dir.empty()) {
    int64_t first = 0, last = 0;
    const std::string steps = absl::GetFlag(FLAGS_trace_steps);
    if (absl::Status s = psflow::StepTrace::ParseSteps(steps, &first, &last); !s.ok()) {
      std::fprintf(stderr, "psflow-launch: --trace_steps: %s\n", std::string(s.message()).c_str());
      return false;
    }
    o->trace_args = {"--trace_dir=" + dir, "--trace_steps=" + steps};
  }
  if (o->bin_dir.empty())
    o->bin_dir = std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
  bool threads_given = false, replicas_given = false;
  for (size_t i = 1; i < rest.size(); ++i) {
    o->chief_args.push_back(rest[i]);
    threads_given |= absl::StartsWith(rest[i], "--compute_threads");
    replicas_given |= absl::StartsWith(rest[i], "--replicas_per_worker");
  }
  // Workers with several GPUs each: the job's replicas per worker follow.
  if (replicas > 1 && !replicas_given) {
    o->chief_args.push_back(absl::StrCat("--replicas_per_worker=", replicas));
  }
  if (!threads_given) {
    const int cores = psflow::UsableCores();
    o->chief_args.push_back(
        absl::StrCat("--compute_threads=", std::max(1, cores / o->num_workers)));
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> rest = psflow::ParseCommandLine(
      argc, argv,
      "runs a psflow cluster (1 chief, --ps parameter servers, --workers workers,\n"
      "--evaluators evaluators) on this machine. Everything after -- goes to the chief, e.g.\n"
      "  psflow-launch --ps=2 --workers=2 -- --model=cnn --epochs=5 --optimizer=adam \\\n"
      "                --learning_rate=0.001 --model_dir=/tmp/run\n"
      "Each output line is prefixed with its process ([chief], [ps0], [worker1]).\n"
      "Ctrl-C and SIGTERM are forwarded: to the chief first (worker 0 with --chief=false),\n"
      "which checkpoints, then, once it has exited or 10 s later, to the rest; a second one\n"
      "goes to all at once. A ps or worker that fails (without --restart=on-failure) stops the\n"
      "cluster the same way, the chief first. No process outlives the launcher. Unless the\n"
      "chief's arguments set --compute_threads, each worker gets cores / workers threads.\n"
      "Exits with the chief's code, or with the code of a ps or worker that failed first.\n"
      "With --chief=false there is no chief: worker 0 runs its duties and takes the arguments\n"
      "after --. Every cluster runs with a job token of its own (see --token_file).");
  LaunchOptions o;
  if (!ClusterFromFlags(&o) || !ProcessArgsFromFlags(rest, &o)) return 1;
  return psflow::launch::RunCluster(o);
}
