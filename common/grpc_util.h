// The one edge where gRPC status and absl::Status meet, plus the channel and
// server settings every psflow process uses.
#ifndef PSFLOW_COMMON_GRPC_UTIL_H_
#define PSFLOW_COMMON_GRPC_UTIL_H_

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

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

// A channel to `address` ("host:port") with psflow's message limits and
// keepalive settings.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);

// Starts a server for `service` on 0.0.0.0:port (all interfaces) with
// psflow's limits, without SO_REUSEPORT (a port another process holds is an
// error, never shared); UNAVAILABLE naming the port if it cannot listen there.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(int port, grpc::Service* service);

}  // namespace psflow

#endif  // PSFLOW_COMMON_GRPC_UTIL_H_
