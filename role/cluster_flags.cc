#include "role/cluster_flags.h"

#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "role/command_line.h"
#include "role/flag_checks.h"
#include "role/signals.h"
#include "transport/security.h"

ABSL_FLAG(std::string, job_name, "",
          "This process's role: chief (or master), ps, worker or evaluator. Overrides TF_CONFIG "
          "and POD_NAME.");
ABSL_FLAG(int, task_id, -1, "This process's index among the tasks of its role (0-based).");
ABSL_FLAG(int, task_index, -1, "Alias of --task_id.");
ABSL_FLAG(
    std::string, chief_hosts, "",
    "Comma-separated host:port of the chief (exactly one). Overrides the environment's list.");
ABSL_FLAG(std::string, ps_hosts, "",
          "Comma-separated host:port of every parameter server, in task order.");
ABSL_FLAG(std::string, worker_hosts, "",
          "Comma-separated host:port of every worker, in task order.");
ABSL_FLAG(std::string, evaluator_hosts, "",
          "Comma-separated host:port of evaluators (listed only; not training members).");
ABSL_FLAG(bool, exit_when_done, true,
          "When the job is over, exit 0. false: stay up idle until SIGTERM, then exit 0 (for "
          "controllers that restart containers even after success, such as StatefulSets).");

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate of this process, signed by --tls_ca: its CN is this process's role "
          "(chief, ps, worker or evaluator), or its task (worker-1, ps-0, evaluator-0: a "
          "certificate of that task only, which may then act only as itself), and it is valid "
          "for the DNS name of the role (subjectAltName DNS:<role>; scripts/make-certs.sh makes "
          "both kinds). With --tls_key and --tls_ca: mutual TLS on every connection. Default: "
          "plaintext, listening on loopback only (see --insecure).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM certificate of the CA that signs every member's certificate. Servers accept only "
          "clients with a certificate it signed; clients accept only servers with one it signed "
          "that is valid for the role they call, whatever host name the address has. Only the "
          "chief may call the ps's Init, SetLiveWorkers and Shutdown, only the chief or an "
          "evaluator its Snapshot; other callers get PERMISSION_DENIED (docs/deploy.md lists "
          "every rule).");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the job token (one line; surrounding whitespace is ignored). Every call "
          "carries it and every server refuses calls without it, or with another, as "
          "UNAUTHENTICATED (counted and logged). With or without TLS; without TLS it travels in "
          "plaintext. Default: no token.");
ABSL_FLAG(bool, insecure, false,
          "Allow listening beyond loopback (any address but 127.0.0.0/8 and ::1; a DNS name "
          "other than localhost means every interface) in plaintext without a job token. "
          "Without it a process that would do so exits 1 at once: anyone who reaches such a port "
          "could act as a member (push gradients, stop the job). Give --tls_cert/--tls_key/"
          "--tls_ca or --auth_token_file instead where you can. Loopback needs neither; the "
          "--metrics_port server (read-only HTTP) is not affected.");
ABSL_FLAG(int, metrics_port, 0,
          "Serve Prometheus metrics (text format 0.0.4) over HTTP at "
          "http://0.0.0.0:<port>/metrics. 0: no metrics server (a local cluster runs many "
          "processes on one machine; psflow-launch --metrics_base_port numbers them).");

namespace psflow {
namespace {

std::optional<std::string> NonEmpty(const std::string& s) {
  if (s.empty()) return std::nullopt;
  return s;
}

std::optional<int> NonNegative(int v) {
  if (v < 0) return std::nullopt;
  return v;
}

// --exit_when_done: whether a role exits once the job is over.
bool ExitWhenDone() { return absl::GetFlag(FLAGS_exit_when_done); }

}  // namespace

void ParseFlagsOrExit(int argc, char** argv, const std::string& usage) {
  std::vector<char*> rest = ParseCommandLine(
      argc, argv, usage, {"main.cc", "cluster_flags.cc", "chief/flags.cc", "data/flags.cc"});
  if (rest.size() > 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s' (flags are written --name=value)\n", argv[0],
                 rest[1]);
    std::exit(1);
  }
}

ClusterFlags GetClusterFlags() {
  ClusterFlags f;
  f.job_name = NonEmpty(absl::GetFlag(FLAGS_job_name));
  f.task_id = NonNegative(absl::GetFlag(FLAGS_task_id));
  f.task_index = NonNegative(absl::GetFlag(FLAGS_task_index));
  f.chief_hosts = NonEmpty(absl::GetFlag(FLAGS_chief_hosts));
  f.ps_hosts = NonEmpty(absl::GetFlag(FLAGS_ps_hosts));
  f.worker_hosts = NonEmpty(absl::GetFlag(FLAGS_worker_hosts));
  f.evaluator_hosts = NonEmpty(absl::GetFlag(FLAGS_evaluator_hosts));
  return f;
}

int FinishOrIdle(int code, absl::Notification& terminated) {
  if (code != 0 || ExitWhenDone()) return code;
  PSLOG(INFO) << "the job is over; idling until terminated (--exit_when_done=false)";
  terminated.WaitForNotification();
  return 0;
}

int RunRole(const std::function<absl::Status()>& run, const std::function<void(int)>& stop,
            absl::Duration grace, const std::string& what) {
  absl::Notification terminated;
  absl::Notification returned;
  TerminationWatcher watcher([&](int sig) {
    if (!terminated.HasBeenNotified()) terminated.Notify();
    PSLOG(INFO) << "signal " << sig << ": " << what;
    stop(sig);
    if (!returned.WaitForNotificationWithTimeout(grace)) std::_Exit(ExitCodeForSignal(sig));
  });
  const absl::Status status = run();
  returned.Notify();
  const int code = ExitCodeFor(status);
  if (!status.ok() && !SignalOf(status).has_value()) {
    PSLOG(ERROR) << "exiting with code " << code << ": " << status.message() << " ("
                 << absl::StatusCodeToString(status.code()) << ")";
  }
  return FinishOrIdle(code, terminated);
}

SecurityOptions LoadSecurityOrExit(const ClusterConfig& config) {
  const Role role = config.role;
  SecurityFiles files;
  files.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  files.tls_key = absl::GetFlag(FLAGS_tls_key);
  files.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  files.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  absl::StatusOr<SecurityOptions> security = LoadSecurityOptions(files);
  absl::Status s =
      security.ok() ? CheckOwnCertificate(*security, role, config.task_index) : security.status();
  if (!s.ok()) std::exit(FlagError(role, s.message()));
  security->insecure = absl::GetFlag(FLAGS_insecure);
  // Before anything is built or bound: StartServer checks again, too late
  // for a clear exit before a ps or worker has loaded its data.
  if (config.self_port > 0) {
    s = CheckListenSecurity(config.self_address, *security);
    if (!s.ok()) std::exit(FlagError(role, s.message()));
  }
  if (security->tls() || !security->token.empty()) {
    PSLOG(INFO) << DescribeSecurity(*security, role);
  } else {
    PSLOG(WARNING) << DescribeSecurity(*security, role);
  }
  return *std::move(security);
}

absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> ServeMetrics(
    const metrics::Registry* registry, const Readiness* readiness) {
  const int port = absl::GetFlag(FLAGS_metrics_port);
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_port must be in [0, 65535], not ", port));
  }
  if (port == 0) return nullptr;
  absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> server = metrics::MetricsServer::Start(
      port, registry,
      readiness == nullptr ? std::function<bool()>() : [readiness] { return readiness->ready(); });
  if (server.ok()) {
    PSLOG(INFO) << "serving metrics on http://0.0.0.0:" << port << "/metrics"
                << (readiness != nullptr ? " (probes: /healthz, /readyz)" : " (probes: /healthz)");
  }
  return server;
}

ClusterConfig ResolveClusterOrExit(Role role) {
  absl::StatusOr<ClusterConfig> config =
      ResolveClusterConfig(GetClusterFlags(), ConfigEnv::FromProcess(), role);
  if (!config.ok()) std::exit(FlagError(role, config.status().message()));
  return *std::move(config);
}

}  // namespace psflow
