// psflow-launch's engine: starts a whole cluster (chief, ps, workers, and
// evaluators if asked) as child
// processes of this one on free loopback ports, with a job token of their
// own, prefixes every output line with its process's name, forwards
// SIGINT/SIGTERM, and makes sure no child outlives it (children die with the
// launcher even if it is killed).
#ifndef PSFLOW_TOOLS_LAUNCH_LAUNCHER_H_
#define PSFLOW_TOOLS_LAUNCH_LAUNCHER_H_

#include <string>
#include <vector>

namespace psflow::launch {

struct LaunchOptions {
  int num_ps = 2;
  int num_workers = 2;
  // Evaluators (psflow-evaluator). Not training members: one that fails is
  // reported and neither stops the cluster nor decides the exit code.
  int num_evaluators = 0;
  std::string host = "127.0.0.1";
  std::string bin_dir;                  // where psflow-chief, -ps, -worker (-evaluator) are
  std::vector<std::string> chief_args;  // everything after "--"
  // false: a cluster without a chief task (the Helm shape); worker 0 runs
  // the chief's duties, takes chief_args, and its exit decides the result.
  bool with_chief = true;
  // --device of each worker (empty: the worker's default, cpu).
  std::vector<std::string> worker_devices;
  // More flags for every worker (psflow-worker's own, such as --ps_lanes).
  std::vector<std::string> worker_args;
  // More flags for every ps (psflow-ps's own, such as --apply_threads).
  std::vector<std::string> ps_args;
  // More flags for every ps and worker: the step trace's (--trace_dir,
  // --trace_steps).
  std::vector<std::string> trace_args;
  // --device of every evaluator (empty: its default, cpu).
  std::string evaluator_device;
  // A directory as scripts/make-certs.sh makes it (empty: plaintext): each
  // process gets its role's certificate and key, the CA, and the job token
  // where the directory has one.
  std::string tls_dir;
  // Every cluster runs with a job token (--auth_token_file for every
  // process): the one in tls_dir where there is one, else a fresh random one
  // written to this file (mode 0600, replaced if it exists, kept after the
  // run: for clients that call the cluster from outside) or, when this is
  // empty, to a private temporary directory removed at exit. Other users of
  // the machine reach loopback ports too; without the token they are refused.
  std::string token_file;
  // Seconds the other processes get to exit on their own after the chief
  // has exited, before they are terminated.
  int grace_seconds = 15;
  // Like a Kubernetes restartPolicy: OnFailure, start a process again (after
  // a second) when it exits non-zero, up to max_restarts times in all. A
  // process that cannot be started again counts as exited for good with its
  // last code.
  bool restart_on_failure = false;
  int max_restarts = 20;
  // With a port, each process serves /metrics (--metrics_port) on the ports
  // from it on: the chief on metrics_base_port, ps i on +1+i, worker i on
  // +1+num_ps+i, evaluator i on +1+num_ps+num_workers+i (without a chief,
  // the base port is unused). 0: none does.
  int metrics_base_port = 0;
};

// The workers' --device values from psflow-launch's --worker_devices:
// workers separated by ';', each a device list ("cuda:0,cuda:1;cuda:2,cuda:3",
// or cuda:all); without ';', one value for every worker, or a
// comma-separated list of one device per worker (cuda:0,cuda:1 for two
// workers), or, for a single worker, its device list. Sets *replicas to the
// devices each worker's list names (every list must name as many; 0 when a
// list is cuda:all, whose count only the worker's machine knows). Returns
// the error message, or "" when the flag is good.
std::string ParseWorkerDevices(const std::string& flag, int num_workers,
                               std::vector<std::string>* devices, int* replicas);

// A job token: 256 bits from OpenSSL's cryptographic generator, as 64 hex
// digits; "" if the generator fails.
std::string NewJobToken();

// Writes `token` and a newline to `path` as a file only its owner may read
// or write (0600), replacing (never following) what is there: written to a
// new file beside it, then renamed. Returns the error message, or "".
std::string WriteTokenFile(const std::string& path, const std::string& token);

// Runs the cluster; returns the chief's exit code (worker 0's without a
// chief), or the code of the first other process that failed while the
// chief was still running (after which the whole cluster is stopped) unless
// failed processes are restarted.
int RunCluster(const LaunchOptions& options);

}  // namespace psflow::launch

#endif  // PSFLOW_TOOLS_LAUNCH_LAUNCHER_H_
