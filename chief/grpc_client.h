// The gRPC transport of chief::Client and chief::EvaluatorClient. Registration waits for a chief
// that is not up yet (wait-for-ready) until its deadline. Thread-safe.
#ifndef PSFLOW_CHIEF_GRPC_CLIENT_H_
#define PSFLOW_CHIEF_GRPC_CLIENT_H_

#include <memory>
#include <string>

#include "chief/client.h"
#include "common/grpc_util.h"
#include "proto/chief.grpc.pb.h"

namespace psflow::chief {

class GrpcClient final : public Client, public EvaluatorClient {
 public:
  // Secured as `security` says (MakeChannel).
  GrpcClient(const std::string& address, const SecurityOptions& security);
  absl::StatusOr<RegisterWorkerResponse> RegisterWorker(int worker, absl::Time deadline) override;
  absl::StatusOr<ReportResponse> Report(const ReportRequest& request, absl::Time deadline) override;
  absl::StatusOr<RegisterEvaluatorResponse> RegisterEvaluator(int evaluator,
                                                              absl::Time deadline) override;
  absl::StatusOr<ReportEvalResponse> ReportEval(const ReportEvalRequest& request,
                                                absl::Time deadline) override;
  void CancelAll() override { calls_.CancelAll(); }

 private:
  std::unique_ptr<ChiefService::Stub> stub_;
  ActiveCalls calls_;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_GRPC_CLIENT_H_
