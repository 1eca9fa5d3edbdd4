// The one edge where gRPC status and absl::Status meet, plus the channel and
// server settings every psflow process uses.
#ifndef PSFLOW_TRANSPORT_GRPC_UTIL_H_
#define PSFLOW_TRANSPORT_GRPC_UTIL_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cluster_config.h"
#include "common/metrics.h"
#include "transport/security.h"

namespace psflow {

// Converts, keeping code and message (gRPC reports a lost connection as
// UNAVAILABLE, which callers treat as worth a retry).
absl::Status FromGrpcStatus(const grpc::Status& status);
grpc::Status ToGrpcStatus(const absl::Status& status);

// The largest message any psflow peer accepts. Tensors are chunked well below
// this; the limit only guards against garbage.
inline constexpr int kMaxMessageBytes = 64 << 20;
// Target payload of one streamed message of tensor chunks.
inline constexpr size_t kChunkBytes = 1 << 20;

// A channel to `address` ("host:port") of a member of role `peer`, with
// psflow's message limits and keepalive settings, secured as `security` says
// (with TLS the server's certificate must be valid for the name of `peer`,
// whatever host the address names; with a token every call carries it).
// Channels with `own_connection` set never share their TCP connection with
// another channel (one HTTP/2 connection carries its streams on one thread
// of each side: several of them move more bytes).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, Role peer,
                                           const SecurityOptions& security,
                                           bool own_connection = false);

// Where a member whose cluster address is `self_address` listens: that
// address itself where its host is an IP address of this machine
// (127.0.0.1:2222 stays on loopback), 127.0.0.1 for the name "localhost"
// (which names nothing beyond this machine), all interfaces (0.0.0.0:port)
// otherwise, as for any other DNS name.
std::string ListenAddress(const std::string& self_address);

// Whether `listen_address` (as ListenAddress returns it) is on loopback only:
// 127.0.0.0/8 or ::1 (also written ::ffff:127.x.x.x). 0.0.0.0, any other
// address, and anything that does not parse are not.
bool IsLoopbackListenAddress(const std::string& listen_address);

// Secure by default: a member that would listen beyond loopback (by
// ListenAddress(self_address)) needs TLS or a job token, or
// `security.insecure`, the operator's word that anyone who reaches the port
// may act as a member. FAILED_PRECONDITION with one line naming the address
// and the flags that fix it; OK otherwise. Reads no socket: it runs before
// anything listens.
absl::Status CheckListenSecurity(const std::string& self_address, const SecurityOptions& security);

// `n` distinct TCP ports that were free on `host` (an IPv4 address) a moment
// ago, bound all at once while picking; fewer if no more could be bound.
std::vector<int> FreePorts(const std::string& host, int n);

// Starts a server for `service` on ListenAddress(self_address) with psflow's
// limits, without SO_REUSEPORT (a port another process holds is an error,
// never shared), secured as `security` says: every call of every service
// passes a CallGate first (the token; with TLS, `callers`). UNAVAILABLE
// naming the port if it cannot listen there; CheckListenSecurity's
// FAILED_PRECONDITION, before anything is bound, where it may not. The server also answers the
// standard gRPC health service (grpc.health.v1.Health; through the gate like
// every service): the server as a whole (service "") starts NOT_SERVING, for
// its role to declare ready (Readiness below), and service kLivenessService
// is SERVING for as long as the server runs.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(const std::string& self_address,
                                                          grpc::Service* service,
                                                          const SecurityOptions& security,
                                                          const CallerRoles& callers = {});
// The same for several services on one port (a worker that also runs the
// chief's duties); `callers` holds the rules of all of them.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    const std::string& self_address, const std::vector<grpc::Service*>& services,
    const SecurityOptions& security, const CallerRoles& callers = {});

// The health service name that answers SERVING while the process serves at
// all, whether or not its role is ready: for liveness probes, which must not
// fail (and restart the process) while a role waits for its peers.
inline constexpr char kLivenessService[] = "liveness";

// A role's readiness, shown as the serving status of service "" of the
// standard gRPC health service. Logic that knows no gRPC reports through
// Set; the server, which starts after that logic is built, is attached once
// it runs and takes the latest state. Thread-safe.
class Readiness {
 public:
  // NOT_SERVING until Set(true).
  void Set(bool ready);
  bool ready() const;
  // Shows the current state on `server` (started by StartServer) from now
  // on. Detach before the server is destroyed.
  void Attach(grpc::Server* server);
  void Detach();

 private:
  mutable absl::Mutex mu_;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  grpc::HealthCheckServiceInterface* health_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// Counts the failed calls of one client as
// psflow_rpc_errors_total{service, method, code} (code as gRPC names it:
// UNAVAILABLE, DEADLINE_EXCEEDED, ...). Thread-safe.
class RpcErrors {
 public:
  // `registry` (may be null: nothing is counted) must outlive this;
  // `service` is the full name of the service called ("psflow.ChiefService").
  RpcErrors(metrics::Registry* registry, std::string service)
      : registry_(registry), service_(std::move(service)) {}
  // Counts `status` against `method` if it is an error, and returns it.
  absl::Status Count(absl::string_view method, absl::Status status) const;

 private:
  metrics::Registry* const registry_;
  const std::string service_;
};

// The calls in flight of one client, so that CancelAll can end them: each
// call runs inside a Scope, whose context is cancelled at once if CancelAll
// came first. Thread-safe.
class ActiveCalls {
 public:
  class Scope {
   public:
    // A context with `deadline` (and wait-for-ready when asked) for one call.
    Scope(ActiveCalls* calls, absl::Time deadline, bool wait_for_ready);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    grpc::ClientContext* context() { return &context_; }

   private:
    ActiveCalls* const calls_;
    grpc::ClientContext context_;
  };

  // Cancels every call in flight; later calls are cancelled as they start.
  void CancelAll();

 private:
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<grpc::ClientContext*> active_ ABSL_GUARDED_BY(mu_);
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_GRPC_UTIL_H_
