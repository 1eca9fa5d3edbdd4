// What a worker and an evaluator call on the chief, as interfaces with no
// gRPC in them.
// chief::GrpcClient (chief/grpc_client.h) is its transport; tests give the
// trainer a fake (tests/fakes/fake_chief.h). Errors keep the
// transport's status code (UNAVAILABLE while the chief is down or not up
// yet). Thread-safe.
#ifndef PSFLOW_CHIEF_CLIENT_H_
#define PSFLOW_CHIEF_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/chief.pb.h"

namespace psflow::chief {

class Client {
 public:
  virtual ~Client() = default;
  // Registers worker `worker`; the chief answers once every ps holds the
  // job. Waits for a chief that is not up yet until `deadline`.
  virtual absl::StatusOr<RegisterWorkerResponse> RegisterWorker(int worker,
                                                                absl::Time deadline) = 0;
  // Step metrics and heartbeat; the answer says go on, exit, register again
  // or fail.
  virtual absl::StatusOr<ReportResponse> Report(const ReportRequest& request,
                                                absl::Time deadline) = 0;
  // Cancels every call in flight and makes later calls fail with CANCELLED
  // at once (for a worker that is stopping).
  virtual void CancelAll() = 0;
};

// What an evaluator calls on the chief; chief::GrpcClient is its transport
// too. The same error conventions as Client. Thread-safe.
class EvaluatorClient {
 public:
  virtual ~EvaluatorClient() = default;
  // Registers evaluator `request.evaluator()` (renewing `request.lease()`):
  // the job, the ps, when to evaluate and the lease its reports carry. Waits
  // for a chief that is not up yet until `deadline`.
  virtual absl::StatusOr<RegisterEvaluatorResponse> RegisterEvaluator(
      const RegisterEvaluatorRequest& request, absl::Time deadline) = 0;
  // A heartbeat, with a result when it has one; the answer says go on, exit,
  // register again or fail.
  virtual absl::StatusOr<ReportEvalResponse> ReportEval(const ReportEvalRequest& request,
                                                        absl::Time deadline) = 0;
  // As Client::CancelAll.
  virtual void CancelAll() = 0;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_CLIENT_H_
