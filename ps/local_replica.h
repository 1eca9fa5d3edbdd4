// ps::Replica over a shard in this process: the replica a worker of a job
// without ps serves as ps 0 (its PsService in front of the same shard),
// reached by the worker's trainer through ps::LocalClient, with no gRPC.
//
// Thread-safe, as the shard is. Ownership: the shard is not owned and must
// outlive the replica and every client it hands out.
#ifndef PSFLOW_PS_LOCAL_REPLICA_H_
#define PSFLOW_PS_LOCAL_REPLICA_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "ps/client.h"
#include "ps/replica.h"
#include "ps/shard.h"
#include "ps/slice_values.h"

namespace psflow::ps {

class LocalReplica final : public Replica {
 public:
  explicit LocalReplica(Shard* shard) : shard_(shard) {}

  std::unique_ptr<Client> Connect() override;
  std::optional<int64_t> WantedSnapshot(int64_t from) const override;
  absl::Status Mirror(uint64_t job_id, int64_t version, std::vector<SliceValues> values) override;

 private:
  Shard* const shard_;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_LOCAL_REPLICA_H_
