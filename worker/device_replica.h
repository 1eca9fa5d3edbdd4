// A GPU worker's replica in a job without ps (JobConfig.exchange
// ALL_REDUCE), kept on the device: the weights and the optimizer's slots
// live there, each step's gradients and loss are averaged among the
// workers' GPUs over NCCL (kernels::PeerGroup; a worker alone has none),
// their non-finite values counted there, and the optimizer applied there:
// no ps calls. The replica this worker's ps service serves (the one the
// chief and the evaluator read) gets the state (ps::Replica::Mirror) when a
// snapshot asks for a step, every kReplicaPublishSteps steps on worker 0,
// at a stop, as the group breaks (worker 0) and at the end.
//
// Thread-safety: the training thread's, but for a publish, which runs on a
// thread of its own (one at a time). Ownership: the model, replica and ring
// are not owned and outlive the replica; it owns the GPU group.
#ifndef PSFLOW_WORKER_DEVICE_REPLICA_H_
#define PSFLOW_WORKER_DEVICE_REPLICA_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "allreduce/ring.h"
#include "data/mnist.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "proto/chief.pb.h"
#include "proto/job.pb.h"
#include "ps/client.h"
#include "ps/optimizer.h"
#include "ps/replica.h"
#include "worker/batches.h"
#include "worker/model_replicas.h"

namespace psflow::worker {

struct DeviceReplicaOptions {
  int worker_index = 0;
  absl::Duration transfer_timeout = absl::Seconds(120);
  ps::Replica* replica = nullptr;                 // the one this worker serves (not owned)
  allreduce::Ring* ring = nullptr;                // the workers' ring (not owned)
  const std::atomic<uint64_t>* job_id = nullptr;  // the registration's (not owned)
};

// What the replica's training asks of the worker. Every function is set.
struct DeviceReplicaHooks {
  // The chief failed the job or asks for a registration: the status that
  // ends the training (else OK). A stop is stop_signal's.
  std::function<absl::Status()> interrupted;
  std::function<int()> stop_signal;
  std::function<bool()> stopping;  // Stop, or the chief's FAIL
  // After a step that was not finite: the status to end with.
  std::function<absl::Status(int64_t step)> non_finite;
  // A step's metrics, and the step reached.
  std::function<void(StepMetrics metrics, int64_t next_step)> step_done;
};

// When every worker computes on GPUs (`on_gpu` for this one), joins them in
// one NCCL group, which then averages the gradients on the devices instead
// of the ring on the host (null: the host ring it is, or one worker). The
// workers agree through the ring (steps -2 and -1, before any training
// step), and wait at most `timeout` for the others to join. `abandoned`:
// stop waiting (a stop, or a member failed).
absl::StatusOr<std::unique_ptr<kernels::PeerGroup>> FormGpuGroup(
    allreduce::Ring* ring, kernels::Backend* backend, bool on_gpu, int worker_index, DataType wire,
    absl::Duration timeout, const std::function<int()>& stop_signal,
    const std::function<bool()>& abandoned);

class DeviceReplica {
 public:
  // Allocates the optimizer's slots on the device of `model`'s replica 0;
  // `peers` (may be null: one worker) averages among the workers.
  static absl::StatusOr<std::unique_ptr<DeviceReplica>> Create(
      const JobConfig& job, DeviceReplicaOptions options, ModelReplicas* model,
      std::unique_ptr<kernels::PeerGroup> peers);
  ~DeviceReplica();

  // Loads the replica from the one this worker serves (options.replica)
  // through `client` and trains it to the last step (OK), publishing it
  // there at the end.
  absl::Status Train(ps::Client* client, const data::Dataset& data,
                     const DeviceReplicaHooks& hooks);

 private:
  DeviceReplica(const JobConfig& job, DeviceReplicaOptions options, ModelReplicas* model,
                std::unique_ptr<kernels::PeerGroup> peers);
  absl::Status Allocate();
  absl::Status MakeBuckets();
  float* slot(size_t variable, int k) {
    return k < slots_ ? slot_buffers_[variable * slots_ + k]->data() : nullptr;
  }
  // Loads the device replica with the served one's state (step_ its version).
  absl::Status Load(ps::Client* client);
  // The step's compute, with the NCCL means of its gradients queued; a
  // status that ends the training (a stop, the group gone), else OK with
  // the step's outcome in *result.
  absl::Status Compute(WorkerBatches& batches, absl::StatusOr<model::Network::Result>* result);
  // Queues the means of the gradients among the workers (QueueAllReduceMeans).
  absl::Status QueueMeans();
  // The mean loss among the workers and whether any mean is not finite.
  absl::Status Verdict(double loss, bool* finite);
  absl::Status Apply(int64_t step);
  // Copies the replica (weights and slots) to page-locked memory and
  // publishes it into the served replica as of `version`: on a thread of
  // its own, or before returning with `wait`. The next waits for the one
  // before.
  absl::Status Publish(int64_t version, bool wait);
  // Publishes the replica of step_ (logged on failure): a stop keeps what
  // was trained.
  void PublishLast(const char* why);
  absl::Status Stopped(int signal);
  // The group is gone (a member failed): every worker restarts.
  absl::Status GroupFailed(const absl::Status& s);
  // After a call on the group: a stop or its failure, else OK.
  absl::Status AfterGroupCall(const absl::Status& s);
  bool Abandoned() const;

  const JobConfig job_;
  const DeviceReplicaOptions options_;
  ModelReplicas* const model_;
  kernels::Backend* const backend_;
  // Every worker's replica 0, in one group (null: one worker). Declared
  // first: it goes last, after the buffers it queues on.
  const std::unique_ptr<kernels::PeerGroup> peers_;
  DeviceReplicaHooks hooks_;    // Train's
  int64_t step_ = 0;            // the step the device holds, whole, until its apply
  int64_t example_floats_ = 0;  // of an image
  std::unique_ptr<ps::Optimizer> optimizer_;
  float bn_momentum_ = ps::kDefaultBnMomentum;
  int slots_ = 0;  // per variable
  // The variables the optimizer trains, and those that follow a moving
  // average (batch norm's running statistics): each a batch of one launch
  // or a few.
  std::vector<kernels::OptimizerTensor> trained_, averaged_;
  // The slots on the device, [variable * slots + k], and their host copies
  // for publishing, [variable * (1 + slots) + k] (k = 0 the value).
  std::vector<std::unique_ptr<kernels::Buffer>> slot_buffers_, staging_;
  // The mean loss and the count of non-finite values, on the device and in
  // page-locked memory.
  std::unique_ptr<kernels::Buffer> flags_, host_flags_;
  // The gradients and the loss: each step counts their non-finite values.
  std::vector<absl::Span<const float>> counted_;
  // The gradients' means among the workers, in buckets: for single-GPU
  // workers about kGpuBucketBytes each, in the order the backward pass
  // completes them, averaged as the step runs; for workers of several GPUs
  // one bucket, once their GPUs have averaged theirs. Their events.
  std::vector<kernels::PeerGroup::Bucket> buckets_;
  std::vector<std::unique_ptr<kernels::Event>> events_;
  // The publish in flight (or done), its outcome and the version it holds.
  std::thread publisher_;
  absl::Status published_;
  int64_t published_version_ = -1;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_DEVICE_REPLICA_H_
