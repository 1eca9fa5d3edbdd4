#include "role/serve_role.h"

#include <chrono>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "common/cluster_config.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "role/cluster_flags.h"
#include "role/process_setup.h"

namespace psflow {

RoleServers::RoleServers(std::unique_ptr<grpc::Server> grpc, Readiness* readiness,
                         std::unique_ptr<metrics::MetricsServer> metrics)
    : grpc_(std::move(grpc)), readiness_(readiness), metrics_(std::move(metrics)) {}

RoleServers::~RoleServers() { Stop(absl::ZeroDuration()); }

void RoleServers::Stop(absl::Duration grace) {
  if (grpc_ == nullptr) return;
  grpc_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(grace));
  if (readiness_ != nullptr) readiness_->Detach();
  grpc_.reset();
}

absl::StatusOr<std::unique_ptr<RoleServers>> ServeRole(ServeOptions options) {
  std::string host;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
  if (ParseHostPort(options.address, &host, &port).ok() && port > 0) {
    absl::StatusOr<std::unique_ptr<grpc::Server>> started =
        StartServer(options.address, options.services, options.security, options.callers);
    if (!started.ok()) return started.status();
    server = *std::move(started);
    if (options.readiness != nullptr) options.readiness->Attach(server.get());
  }
  // Made first, so that an error below stops the gRPC server too.
  auto servers = std::make_unique<RoleServers>(std::move(server), options.readiness, nullptr);
  absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> metrics_server =
      ServeMetrics(options.metrics, options.readiness);
  if (!metrics_server.ok()) return metrics_server.status();
  servers->metrics_ = *std::move(metrics_server);
  return servers;
}

int ServeAndRunRole(ServeOptions serve, const RoleRun& role) {
  absl::StatusOr<std::unique_ptr<RoleServers>> servers = ServeRole(std::move(serve));
  if (!servers.ok()) {
    PSLOG(ERROR) << servers.status().message();
    return kExitPermanent;
  }
  const int code = RunRole(role.run, role.stop, role.grace, role.what);
  (*servers)->Stop(role.drain);
  LogResourceUsage();
  return code;
}

}  // namespace psflow
