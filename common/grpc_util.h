// The one edge where gRPC status and absl::Status meet, plus the channel and
// server settings every psflow process uses.
#ifndef PSFLOW_COMMON_GRPC_UTIL_H_
#define PSFLOW_COMMON_GRPC_UTIL_H_

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cluster_config.h"
#include "common/security.h"

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
// (127.0.0.1:2222 stays on loopback), all interfaces (0.0.0.0:port)
// otherwise, as for a DNS name.
std::string ListenAddress(const std::string& self_address);

// Starts a server for `service` on ListenAddress(self_address) with psflow's
// limits, without SO_REUSEPORT (a port another process holds is an error,
// never shared), secured as `security` says: every call of every service
// passes a CallGate first (the token; with TLS, `callers`). UNAVAILABLE
// naming the port if it cannot listen there.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(const std::string& self_address,
                                                          grpc::Service* service,
                                                          const SecurityOptions& security,
                                                          const CallerRoles& callers = {});

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

#endif  // PSFLOW_COMMON_GRPC_UTIL_H_
