// The command-line flags every role binary shares (--job_name, --task_id,
// --task_index, --chief_hosts, --ps_hosts, --worker_hosts, --evaluator_hosts,
// --exit_when_done, --metrics_port, and the security flags --tls_cert,
// --tls_key, --tls_ca, --auth_token_file, --insecure),
// and the start-up every main.cc runs: parse flags with --help covering the
// shared flags, then resolve the cluster configuration or exit 1 with one line.
#ifndef PSFLOW_ROLE_CLUSTER_FLAGS_H_
#define PSFLOW_ROLE_CLUSTER_FLAGS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/cluster_config.h"
#include "common/metrics.h"
#include "role/metrics_server.h"
#include "transport/grpc_util.h"
#include "transport/security.h"

namespace psflow {

// Parses argv with absl flags; `usage` is the first paragraph of --help.
// Unknown flags and stray positional arguments exit 1 with one line.
void ParseFlagsOrExit(int argc, char** argv, const std::string& usage);

// The cluster flags as given (unset ones are nullopt).
ClusterFlags GetClusterFlags();

// A role's main returns FinishOrIdle(code, terminated): `code`, except that
// after success with --exit_when_done=false it first waits until
// `terminated` (notified by the termination-signal handler) and returns 0.
int FinishOrIdle(int code, absl::Notification& terminated);

// The rest of a role's main, once its parts are built: runs `run` on this
// thread while SIGTERM/SIGINT make `stop(signal)` run (after logging
// "signal N: <what>"); if `run` has not returned `grace` after a signal the
// process exits 128+signal at once. Returns the exit code of run's status
// (ExitCodeFor), through FinishOrIdle. Needs BlockTerminationSignals() first.
int RunRole(const std::function<absl::Status()>& run, const std::function<void(int)>& stop,
            absl::Duration grace, const std::string& what);

// --metrics_port: with a port, serves `registry` at
// http://0.0.0.0:<port>/metrics, /healthz, and /readyz from `readiness` (may
// be null: no /readyz); with 0 (the default), null. UNAVAILABLE if it cannot
// listen there, INVALID_ARGUMENT for a port out of range. Start it once
// everything the registry reads exists, and destroy it before that goes (and
// before `readiness`).
absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> ServeMetrics(
    const metrics::Registry* registry, const Readiness* readiness = nullptr);

// Resolves this process's cluster configuration for `role` from the flags and
// the environment; on error prints "<binary>: <problem>" and exits 1.
ClusterConfig ResolveClusterOrExit(Role role);

// Reads the files of the security flags and checks this process's
// certificate for its role and task (config.role, config.task_index: a
// per-task certificate must be this task's); where it listens
// (config.self_port > 0), checks that it may listen there as secured
// (CheckListenSecurity: beyond loopback only with TLS, a token or
// --insecure). On error prints "<binary>: <problem>" and exits 1. Logs one
// line saying what protects this process (a warning when nothing does). Call
// after SetLogTag.
SecurityOptions LoadSecurityOrExit(const ClusterConfig& config);

}  // namespace psflow

#endif  // PSFLOW_ROLE_CLUSTER_FLAGS_H_
