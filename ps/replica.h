// A worker's own replica of the weights in a job without ps
// (JobConfig.exchange ALL_REDUCE), as that worker's trainer sees it: a ps
// (ps 0) it reaches in-process, and, for a GPU worker that trains the
// replica on its device, the place it publishes the device's state to. An
// interface with no server in it, so that the worker library needs none of
// the ps's server types; ps::LocalReplica (ps/local_replica.h) is the
// replica that the worker process serves as a ps.
//
// Thread-safe: every call may run concurrently with the others.
#ifndef PSFLOW_PS_REPLICA_H_
#define PSFLOW_PS_REPLICA_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "ps/client.h"
#include "ps/slice_values.h"

namespace psflow::ps {

class Replica {
 public:
  virtual ~Replica() = default;

  // A client of the replica as ps 0, with no transport between them. The
  // replica must outlive it.
  virtual std::unique_ptr<Client> Connect() = 0;

  // The lowest version at or after `from` that a snapshot of the replica
  // still waits for (asked for and not yet taken), if any: the version a
  // replica kept elsewhere publishes next.
  virtual std::optional<int64_t> WantedSnapshot(int64_t from) const = 0;

  // Publishes a replica kept elsewhere (a GPU worker's device) as of
  // `version`: the values and slots of every slice of job `job_id` replace
  // the replica's, as if the steps between had been applied. Errors as
  // Shard::Mirror's: FAILED_PRECONDITION for another job, a version behind
  // the replica's or pushes pending; INVALID_ARGUMENT for values that do not
  // fit the slices.
  virtual absl::Status Mirror(uint64_t job_id, int64_t version,
                              std::vector<SliceValues> values) = 0;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_REPLICA_H_
