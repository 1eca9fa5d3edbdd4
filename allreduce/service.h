// The AllReduce gRPC service: hands pieces and aborts to the worker's ring.
#ifndef PSFLOW_ALLREDUCE_SERVICE_H_
#define PSFLOW_ALLREDUCE_SERVICE_H_

#include "allreduce/ring.h"
#include "proto/allreduce.grpc.pb.h"
#include "transport/security.h"

namespace psflow::allreduce {

// Who may call the service: workers.
CallerRoles AllReduceCallers();

class AllReduceService final : public AllReduce::Service {
 public:
  explicit AllReduceService(Ring* ring) : ring_(ring) {}
  grpc::Status Send(grpc::ServerContext* context, const RingPiece* request,
                    RingPieceAck* response) override;
  grpc::Status Abort(grpc::ServerContext* context, const RingAbort* request,
                     RingAbortAck* response) override;

 private:
  Ring* const ring_;
};

}  // namespace psflow::allreduce

#endif  // PSFLOW_ALLREDUCE_SERVICE_H_
