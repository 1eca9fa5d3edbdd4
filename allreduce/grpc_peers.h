// allreduce::Peers over gRPC: the AllReduce service of every other worker,
// at the workers' cluster addresses (one connection each, secured as the
// cluster is: transport/security.h).
#ifndef PSFLOW_ALLREDUCE_GRPC_PEERS_H_
#define PSFLOW_ALLREDUCE_GRPC_PEERS_H_

#include <memory>
#include <string>
#include <vector>

#include "allreduce/ring.h"
#include "proto/allreduce.grpc.pb.h"
#include "transport/grpc_util.h"
#include "transport/security.h"

namespace psflow::allreduce {

class GrpcPeers final : public Peers {
 public:
  // `addresses`: every worker's, by index (this one's is not called).
  GrpcPeers(const std::vector<std::string>& addresses, const SecurityOptions& security);
  absl::Status Send(int to, const RingPiece& piece, absl::Time deadline, bool forming) override;
  void Abort(int to, const RingAbort& abort, absl::Time deadline) override;
  void CancelAll() override { calls_.CancelAll(); }
  // The connection to `member` failed (TRANSIENT_FAILURE): nothing accepts
  // connections at its address. Asks the channel to connect if it is idle.
  bool Unreachable(int member) override;

 private:
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<AllReduce::Stub>> stubs_;
  ActiveCalls calls_;
};

}  // namespace psflow::allreduce

#endif  // PSFLOW_ALLREDUCE_GRPC_PEERS_H_
