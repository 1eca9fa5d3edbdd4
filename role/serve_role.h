// The servers every role process starts once its parts are built: its gRPC
// services on its own address, with its readiness shown by the standard
// health service, and /metrics (--metrics_port) over HTTP. ServeRole starts
// both or neither; RoleServers stops them in the order their users need.
// Not thread-safe: made, stopped and destroyed on the thread of main.
#ifndef PSFLOW_ROLE_SERVE_ROLE_H_
#define PSFLOW_ROLE_SERVE_ROLE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "role/metrics_server.h"
#include "transport/grpc_util.h"
#include "transport/security.h"

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace psflow {

struct ServeOptions {
  // host:port to listen on (on every interface); with port 0 (an evaluator
  // left out of the cluster) there is no gRPC server, only /metrics.
  std::string address;
  std::vector<grpc::Service*> services;  // not owned; outlive the servers
  CallerRoles callers;                   // which roles may call each method
  SecurityOptions security;
  // Not owned; both outlive the RoleServers. `readiness` may be null.
  const metrics::Registry* metrics = nullptr;
  Readiness* readiness = nullptr;
};

class RoleServers {
 public:
  RoleServers(std::unique_ptr<grpc::Server> grpc, Readiness* readiness,
              std::unique_ptr<metrics::MetricsServer> metrics);
  ~RoleServers();  // Stop(0) if not stopped yet
  RoleServers(const RoleServers&) = delete;
  RoleServers& operator=(const RoleServers&) = delete;

  // Shuts the gRPC server down, cancelling the calls still in flight after
  // `grace`, and detaches the readiness from it. /metrics serves until the
  // destructor. Idempotent.
  void Stop(absl::Duration grace);

 private:
  friend absl::StatusOr<std::unique_ptr<RoleServers>> ServeRole(ServeOptions options);
  std::unique_ptr<grpc::Server> grpc_;
  Readiness* const readiness_;
  std::unique_ptr<metrics::MetricsServer> metrics_;
};

// Starts the gRPC server (unless the address has no port) and the metrics
// server; on an error (a port taken, a bad --metrics_port) stops what it
// started and returns it, for the role to log and exit 1.
absl::StatusOr<std::unique_ptr<RoleServers>> ServeRole(ServeOptions options);

// A role's run once its servers are up: RunRole's arguments (role/cluster_flags.h)
// and how long the servers then get for the calls in flight.
struct RoleRun {
  std::function<absl::Status()> run;
  std::function<void(int)> stop;
  absl::Duration grace;  // after a signal, before the process exits anyway
  std::string what;      // logged at a signal: "signal N: <what>"
  absl::Duration drain;  // RoleServers::Stop's grace
};

// The rest of a role's run (chief, evaluator, worker): ServeRole(serve),
// RunRole with `role`, the servers stopped, the resource usage logged. The
// exit code; kExitPermanent, with the error logged, when the servers cannot
// start.
int ServeAndRunRole(ServeOptions serve, const RoleRun& role);

}  // namespace psflow

#endif  // PSFLOW_ROLE_SERVE_ROLE_H_
