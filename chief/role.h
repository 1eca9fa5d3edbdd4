// The chief's duties as one object: the coordinator with its ps client,
// thread pool, TensorBoard summaries and gRPC service. psflow-chief serves
// it alone; psflow-worker's task 0 serves it beside its own service in a
// cluster without a chief (ClusterSpec::ChiefInWorker0).
#ifndef PSFLOW_CHIEF_ROLE_H_
#define PSFLOW_CHIEF_ROLE_H_

#include <memory>

#include "chief/coordinator.h"
#include "chief/service.h"
#include "chief/summaries.h"
#include "common/metrics.h"
#include "common/thread_pool.h"
#include "ps/grpc_client.h"
#include "transport/security.h"

namespace psflow::chief {

class ChiefRole {
 public:
  // Everything the coordinator of `job` (BuildJobConfig of `options`)
  // needs. The coordinator's metrics go to `metrics` (not owned, outliving
  // the role).
  static std::unique_ptr<ChiefRole> Create(ChiefOptions options, JobConfig job,
                                           const SecurityOptions& security,
                                           metrics::Registry* metrics);

  // The chief's RPCs, to serve with ChiefCallers().
  grpc::Service* service() { return &service_; }
  Coordinator& coordinator() { return coordinator_; }
  // Runs the job to its end (Coordinator::Run).
  absl::Status Run() { return coordinator_.Run(); }
  // Checkpoints and ends Run with StoppedBySignal(signal). Thread-safe.
  void Stop(int signal) { coordinator_.Stop(signal); }

 private:
  ChiefRole(const ChiefOptions& options, JobConfig job, const SecurityOptions& security,
            metrics::Registry* metrics);

  ps::GrpcClient ps_;
  ThreadPool pool_;
  Summaries summaries_;  // TensorBoard curves under <model_dir>/train (and eval)
  Coordinator coordinator_;
  GrpcChiefService service_;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_ROLE_H_
