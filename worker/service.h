// The worker's own gRPC service: answers GetStatus from the trainer's
// status, and nothing else (the trainer knows no gRPC). Thread-safe.
#ifndef PSFLOW_WORKER_SERVICE_H_
#define PSFLOW_WORKER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "proto/worker.grpc.pb.h"
#include "worker/trainer.h"

namespace psflow::worker {

class StatusService final : public WorkerService::Service {
 public:
  // `trainer` is not owned and must outlive the service's server.
  explicit StatusService(const Trainer* trainer) : trainer_(trainer) {}

  grpc::Status GetStatus(grpc::ServerContext* context, const WorkerStatusRequest* request,
                         WorkerStatus* status) override;

 private:
  const Trainer* const trainer_;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_SERVICE_H_
