// A replica's whole state as plain buffers on the host: each variable's
// values ("") and optimizer slots, for reading a shard's replica
// (ps::Client::Snapshot into Sinks) and loading one (Init from Refs) in a
// job without ps. Thread-safety: none. Owns its buffers.
#ifndef PSFLOW_WORKER_REPLICA_TENSORS_H_
#define PSFLOW_WORKER_REPLICA_TENSORS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/placement.h"
#include "common/tensor_view.h"
#include "proto/job.pb.h"
#include "ps/optimizer.h"

namespace psflow::worker {

struct ReplicaTensors {
  std::vector<std::string> slots;
  std::vector<std::vector<std::vector<float>>> buffers;  // [slot][variable]
  std::vector<std::vector<float*>> pointers;             // the same, as pointers

  explicit ReplicaTensors(const JobConfig& job) {
    slots = {""};
    for (const std::string& s : ps::Optimizer::SlotNames(job.optimizer().kind()))
      slots.push_back(s);
    buffers.resize(slots.size());
    pointers.resize(slots.size());
    for (size_t k = 0; k < slots.size(); ++k) {
      for (const VariablePlacement& v : job.placement().variable()) {
        int64_t n = 1;
        for (int64_t d : v.shape()) n *= d;
        buffers[k].emplace_back(static_cast<size_t>(n), 0.0f);
      }
      for (std::vector<float>& b : buffers[k]) pointers[k].push_back(b.data());
    }
  }
  std::vector<TensorSink> Sinks(const Placement& placement) {
    return StateSinks(placement, 0, pointers, slots);
  }
  std::vector<TensorRef> Refs(const Placement& placement) const {
    std::vector<std::vector<const float*>> values(pointers.size());
    for (size_t k = 0; k < pointers.size(); ++k)
      values[k].assign(pointers[k].begin(), pointers[k].end());
    return StateRefs(placement, 0, values, slots);
  }
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_REPLICA_TENSORS_H_
