#include "evaluator/service.h"

namespace psflow::evaluator {

grpc::Status StatusService::GetStatus(grpc::ServerContext*, const EvaluatorStatusRequest*,
                                      EvaluatorStatus* status) {
  *status = evaluator_->Status();
  return grpc::Status::OK;
}

}  // namespace psflow::evaluator
