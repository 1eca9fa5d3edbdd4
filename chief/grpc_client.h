// The gRPC transport of chief::Client and chief::EvaluatorClient. Registration waits for a chief
// that is not up yet (wait-for-ready) until its deadline. Failed calls are counted in `metrics`
// (psflow_rpc_errors_total; may be null, else must outlive the client). Thread-safe.
#ifndef PSFLOW_CHIEF_GRPC_CLIENT_H_
#define PSFLOW_CHIEF_GRPC_CLIENT_H_

#include <memory>
#include <string>

#include "chief/client.h"
#include "common/metrics.h"
#include "proto/chief.grpc.pb.h"
#include "transport/grpc_util.h"

namespace psflow::chief {

class GrpcClient final : public Client, public EvaluatorClient {
 public:
  // Secured as `security` says (MakeChannel); `server_role` is the role whose
  // certificate the chief's address presents (ClusterSpec::ChiefHostRole).
  GrpcClient(const std::string& address, const SecurityOptions& security,
             metrics::Registry* metrics = nullptr, Role server_role = Role::kChief);
  absl::StatusOr<RegisterWorkerResponse> RegisterWorker(int worker, absl::Time deadline) override;
  absl::StatusOr<ReportResponse> Report(const ReportRequest& request, absl::Time deadline) override;
  absl::StatusOr<RegisterEvaluatorResponse> RegisterEvaluator(
      const RegisterEvaluatorRequest& request, absl::Time deadline) override;
  absl::StatusOr<ReportEvalResponse> ReportEval(const ReportEvalRequest& request,
                                                absl::Time deadline) override;
  void CancelAll() override { calls_.CancelAll(); }

 private:
  std::unique_ptr<ChiefService::Stub> stub_;
  ActiveCalls calls_;
  RpcErrors errors_;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_GRPC_CLIENT_H_
