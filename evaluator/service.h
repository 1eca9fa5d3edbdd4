// The evaluator's own gRPC service: answers GetStatus from the evaluator's
// status, and nothing else (the evaluator knows no gRPC). Thread-safe.
#ifndef PSFLOW_EVALUATOR_SERVICE_H_
#define PSFLOW_EVALUATOR_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "evaluator/evaluator.h"
#include "proto/evaluator.grpc.pb.h"

namespace psflow::evaluator {

class StatusService final : public EvaluatorService::Service {
 public:
  // `evaluator` is not owned and must outlive the service's server.
  explicit StatusService(const Evaluator* evaluator) : evaluator_(evaluator) {}

  grpc::Status GetStatus(grpc::ServerContext* context, const EvaluatorStatusRequest* request,
                         EvaluatorStatus* status) override;

 private:
  const Evaluator* const evaluator_;
};

}  // namespace psflow::evaluator

#endif  // PSFLOW_EVALUATOR_SERVICE_H_
