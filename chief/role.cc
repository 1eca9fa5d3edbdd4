#include "chief/role.h"

#include <algorithm>
#include <utility>

namespace psflow::chief {

std::unique_ptr<ChiefRole> ChiefRole::Create(ChiefOptions options, JobConfig job,
                                             const SecurityOptions& security,
                                             metrics::Registry* metrics) {
  options.coordinator.metrics = metrics;
  options.coordinator.identified_callers = security.tls();
  return std::unique_ptr<ChiefRole>(new ChiefRole(options, std::move(job), security, metrics));
}

ChiefRole::ChiefRole(const ChiefOptions& options, JobConfig job, const SecurityOptions& security,
                     metrics::Registry* metrics)
    : ps_(options.coordinator.ps_addresses,
          ps::GrpcClientOptions{
              .security = security,
              .metrics = metrics,
              .server_role = options.cluster.cluster.AllReduce() ? Role::kWorker : Role::kPs}),
      pool_(std::max(job.num_ps() - 1, 1)),
      summaries_(options.coordinator.model_dir),
      coordinator_(options.coordinator, std::move(job), &ps_, &pool_, &summaries_),
      service_(&coordinator_) {}

}  // namespace psflow::chief
