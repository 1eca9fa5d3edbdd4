#include "allreduce/service.h"

#include "transport/grpc_util.h"

namespace psflow::allreduce {

CallerRoles AllReduceCallers() {
  return {
      {MethodName(AllReduce::service_full_name(), "Send"), {Role::kWorker}},
      {MethodName(AllReduce::service_full_name(), "Abort"), {Role::kWorker}},
  };
}

grpc::Status AllReduceService::Send(grpc::ServerContext*, const RingPiece* request, RingPieceAck*) {
  return ToGrpcStatus(ring_->Deliver(*request));
}

grpc::Status AllReduceService::Abort(grpc::ServerContext*, const RingAbort* request,
                                     RingAbortAck*) {
  return ToGrpcStatus(ring_->PeerAborted(*request));
}

}  // namespace psflow::allreduce
