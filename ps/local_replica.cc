#include "ps/local_replica.h"

#include <utility>

#include "ps/local_client.h"

namespace psflow::ps {

std::unique_ptr<Client> LocalReplica::Connect() { return std::make_unique<LocalClient>(shard_); }

std::optional<int64_t> LocalReplica::WantedSnapshot(int64_t from) const {
  return shard_->WantedSnapshot(from);
}

absl::Status LocalReplica::Mirror(uint64_t job_id, int64_t version,
                                  std::vector<SliceValues> values) {
  return shard_->Mirror(job_id, version, std::move(values));
}

}  // namespace psflow::ps
