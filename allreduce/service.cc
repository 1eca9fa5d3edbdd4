#include "allreduce/service.h"

#include "transport/grpc_util.h"

namespace psflow::allreduce {

CallerRoles AllReduceCallers() {
  return {
      {MethodName(AllReduce::service_full_name(), "Send"), {Role::kWorker}},
      {MethodName(AllReduce::service_full_name(), "Abort"), {Role::kWorker}},
  };
}

// A per-task certificate sends pieces and aborts as its own rank only.
grpc::Status AllReduceService::Send(grpc::ServerContext* context, const RingPiece* request,
                                    RingPieceAck*) {
  if (absl::Status s = CheckCallerIndex(*context, Role::kWorker, request->from()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  return ToGrpcStatus(ring_->Deliver(*request));
}

grpc::Status AllReduceService::Abort(grpc::ServerContext* context, const RingAbort* request,
                                     RingAbortAck*) {
  if (absl::Status s = CheckCallerIndex(*context, Role::kWorker, request->from()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  return ToGrpcStatus(ring_->PeerAborted(*request));
}

}  // namespace psflow::allreduce
