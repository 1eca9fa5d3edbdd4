#include "chief/service.h"

#include "transport/grpc_util.h"

namespace psflow::chief {
namespace {

// Copies a result into the response, or converts its error.
template <typename Response>
grpc::Status Answer(absl::StatusOr<Response> result, Response* response) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

}  // namespace

CallerRoles ChiefCallers() {
  auto method = [](absl::string_view name) {
    return MethodName(ChiefService::service_full_name(), name);
  };
  return {
      {method("RegisterWorker"), {Role::kWorker}},
      {method("Report"), {Role::kWorker}},
      {method("RegisterEvaluator"), {Role::kEvaluator}},
      {method("ReportEval"), {Role::kEvaluator}},
  };
}

grpc::Status GrpcChiefService::RegisterWorker(grpc::ServerContext* context,
                                              const RegisterWorkerRequest* request,
                                              RegisterWorkerResponse* response) {
  // A per-task certificate registers (or rejoins) its own task only.
  if (absl::Status s = CheckCallerIndex(*context, Role::kWorker, request->worker()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  return Answer(
      coordinator_->RegisterWorker(request->worker(), absl::FromChrono(context->deadline())),
      response);
}

grpc::Status GrpcChiefService::Report(grpc::ServerContext* context, const ReportRequest* request,
                                      ReportResponse* response) {
  if (absl::Status s = CheckCallerIndex(*context, Role::kWorker, request->worker()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  return Answer(coordinator_->Report(*request, absl::FromChrono(context->deadline())), response);
}

grpc::Status GrpcChiefService::RegisterEvaluator(grpc::ServerContext* context,
                                                 const RegisterEvaluatorRequest* request,
                                                 RegisterEvaluatorResponse* response) {
  if (absl::Status s = CheckCallerIndex(*context, Role::kEvaluator, request->evaluator());
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  return Answer(coordinator_->RegisterEvaluator(request->evaluator(), request->lease()), response);
}

grpc::Status GrpcChiefService::ReportEval(grpc::ServerContext* context,
                                          const ReportEvalRequest* request,
                                          ReportEvalResponse* response) {
  if (absl::Status s = CheckCallerIndex(*context, Role::kEvaluator, request->evaluator());
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  return Answer(coordinator_->ReportEval(*request), response);
}

}  // namespace psflow::chief
