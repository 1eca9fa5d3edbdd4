// A worker's batches: the examples of its step k, from its shard of the
// epoch that step falls in (data::ShardSampler; the shard's order is drawn
// once per epoch), gathered into buffers of its own.
//
// Thread-safety: none (the training thread's). `data` is not owned and
// outlives the batches. Errors: Gather's, from data::GatherBatch.
#ifndef PSFLOW_WORKER_BATCHES_H_
#define PSFLOW_WORKER_BATCHES_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/placement.h"
#include "data/mnist.h"
#include "data/source.h"
#include "proto/job.pb.h"

namespace psflow::worker {

class WorkerBatches {
 public:
  WorkerBatches(const data::Dataset& data, const JobConfig& job, int worker)
      : data_(data),
        sampler_(data.count, job.num_workers(), worker, job.seed()),
        batch_(WorkerBatch(job)),
        images_(static_cast<size_t>(batch_) * data.example_floats()),
        labels_(batch_) {}

  // Gathers the batch of `step` (of `steps_per_epoch` in an epoch).
  absl::Status Gather(int64_t step, int64_t steps_per_epoch) {
    const int64_t epoch = step / steps_per_epoch, position = step % steps_per_epoch;
    if (epoch != epoch_) {
      order_ = sampler_.EpochIndices(epoch);
      epoch_ = epoch;
    }
    return data::GatherBatch(data_, absl::MakeConstSpan(order_).subspan(position * batch_, batch_),
                             images_.data(), labels_.data());
  }
  const float* images() const { return images_.data(); }
  const int32_t* labels() const { return labels_.data(); }
  int64_t size() const { return batch_; }

 private:
  const data::Dataset& data_;
  data::ShardSampler sampler_;
  const int64_t batch_;
  std::vector<float> images_;
  std::vector<int32_t> labels_;
  std::vector<int64_t> order_;
  int64_t epoch_ = -1;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_BATCHES_H_
