// The chief's gRPC service: checks nothing and decides nothing, it converts
// workers' and evaluators' calls (with their deadlines) into Coordinator calls and the
// answers back. Thread-safe as the coordinator is.
#ifndef PSFLOW_CHIEF_SERVICE_H_
#define PSFLOW_CHIEF_SERVICE_H_

#include "chief/coordinator.h"
#include "proto/chief.grpc.pb.h"
#include "transport/security.h"

namespace psflow::chief {

// Who may call what on the chief when members have certificates (mutual
// TLS): RegisterWorker and Report only a worker, RegisterEvaluator and
// ReportEval only an evaluator.
CallerRoles ChiefCallers();

class GrpcChiefService final : public ChiefService::Service {
 public:
  // `coordinator` (not owned) must outlive the service.
  explicit GrpcChiefService(Coordinator* coordinator) : coordinator_(coordinator) {}

  grpc::Status RegisterWorker(grpc::ServerContext* context, const RegisterWorkerRequest* request,
                              RegisterWorkerResponse* response) override;
  grpc::Status Report(grpc::ServerContext* context, const ReportRequest* request,
                      ReportResponse* response) override;
  grpc::Status RegisterEvaluator(grpc::ServerContext* context,
                                 const RegisterEvaluatorRequest* request,
                                 RegisterEvaluatorResponse* response) override;
  grpc::Status ReportEval(grpc::ServerContext* context, const ReportEvalRequest* request,
                          ReportEvalResponse* response) override;

 private:
  Coordinator* const coordinator_;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_SERVICE_H_
