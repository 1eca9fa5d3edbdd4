#include "chief/grpc_client.h"

#include <grpcpp/grpcpp.h>

#include "transport/grpc_util.h"

namespace psflow::chief {

GrpcClient::GrpcClient(const std::string& address, const SecurityOptions& security,
                       metrics::Registry* metrics, Role server_role)
    : stub_(ChiefService::NewStub(MakeChannel(address, server_role, security))),
      errors_(metrics, "psflow.ChiefService") {}

absl::StatusOr<RegisterWorkerResponse> GrpcClient::RegisterWorker(int worker, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  RegisterWorkerRequest request;
  request.set_worker(worker);
  RegisterWorkerResponse response;
  absl::Status s = errors_.Count(
      "RegisterWorker", FromGrpcStatus(stub_->RegisterWorker(call.context(), request, &response)));
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<ReportResponse> GrpcClient::Report(const ReportRequest& request,
                                                  absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/false);
  ReportResponse response;
  absl::Status s =
      errors_.Count("Report", FromGrpcStatus(stub_->Report(call.context(), request, &response)));
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<RegisterEvaluatorResponse> GrpcClient::RegisterEvaluator(
    const RegisterEvaluatorRequest& request, absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/true);
  RegisterEvaluatorResponse response;
  absl::Status s =
      errors_.Count("RegisterEvaluator",
                    FromGrpcStatus(stub_->RegisterEvaluator(call.context(), request, &response)));
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<ReportEvalResponse> GrpcClient::ReportEval(const ReportEvalRequest& request,
                                                          absl::Time deadline) {
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/false);
  ReportEvalResponse response;
  absl::Status s = errors_.Count(
      "ReportEval", FromGrpcStatus(stub_->ReportEval(call.context(), request, &response)));
  if (!s.ok()) return s;
  return response;
}

}  // namespace psflow::chief
