// A GPU worker's replica in a job without ps (JobConfig.exchange
// ALL_REDUCE), kept on the device, and the exchange of such a worker
// (worker/exchange.h): the weights and the optimizer's slots live there,
// each step's gradients and loss are averaged among the workers' GPUs over
// NCCL (kernels::PeerGroup; a worker alone has none), their non-finite
// values counted there, and the optimizer applied there: no ps calls. The
// first Pull loads it from the replica this worker's ps service serves (the
// one the chief and the evaluator read), which gets the state back
// (ps::Replica::Mirror) when a snapshot asks for a step, every
// kReplicaPublishSteps steps on worker 0 (BeginStep), at a stop, as the
// group breaks (worker 0) and at the end (Finish).
//
// Thread-safety: as Exchange's (the training thread's), but for a publish,
// which runs on a thread of its own (one at a time). Ownership: the model,
// replica, client and ring are not owned and outlive the replica; it owns
// the GPU group.
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
#include "kernels/kernels.h"
#include "proto/chief.pb.h"
#include "proto/job.pb.h"
#include "ps/client.h"
#include "ps/optimizer.h"
#include "ps/replica.h"
#include "worker/exchange.h"
#include "worker/model_replicas.h"

namespace psflow::worker {

struct DeviceReplicaOptions {
  int worker_index = 0;
  absl::Duration transfer_timeout = absl::Seconds(120);
  ps::Replica* replica = nullptr;                 // the one this worker serves (not owned)
  ps::Client* client = nullptr;                   // reaches that replica (not owned)
  allreduce::Ring* ring = nullptr;                // the workers' ring (not owned)
  const std::atomic<uint64_t>* job_id = nullptr;  // the registration's (not owned)
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

class DeviceReplica final : public Exchange {
 public:
  // Allocates the optimizer's slots on the device of `model`'s replica 0;
  // `peers` (may be null: one worker) averages among the workers.
  static absl::StatusOr<std::unique_ptr<DeviceReplica>> Create(
      const JobConfig& job, DeviceReplicaOptions options, ExchangeHooks hooks, ModelReplicas* model,
      std::unique_ptr<kernels::PeerGroup> peers);
  ~DeviceReplica() override;

  // The first pull loads the device from the served replica (through
  // options.client), at its version; after that the device holds the
  // weights of the step it reached. `min_version` is not asked for.
  absl::Status Pull(int64_t min_version, ExchangeRound* out) override;
  // Publishes the step's replica (off the training thread) where a
  // snapshot waits for it, or on worker 0 at every kReplicaPublishSteps; a
  // failure ends the step at StepQueued.
  void BeginStep(const StepPush& push, ExchangeRound* out) override;
  // Queues the means of the step's gradients among the workers: for
  // single-GPU workers once the step's graph is queued, bucket by bucket
  // behind the backward pass; for workers of several GPUs once their GPUs
  // averaged theirs (the step ran). A failure ends the step.
  absl::Status StepQueued() override;
  void GradientsOnHost(const std::vector<int>& /*variables*/) override {}
  // The gradients stay on the device.
  bool NeedsHostGradients() const override { return false; }
  void EndCompute(const absl::StatusOr<double>& /*loss*/) override {}
  void Abandon() override {}
  // The mean loss among the workers, and whether any mean (loss or
  // gradient) is not finite: one verdict for the whole group.
  absl::Status Reduce(int64_t step, float* mean_loss) override;
  // Clips the mean gradients on the device (Backend::GlobalNorm, Affine),
  // after a finite Reduce.
  absl::Status ClipOnDevice(float bound, bool* clipped) override;
  // Applies the optimizer on the device (or skips the step, with
  // on_nonfinite SKIP_STEP; kNotFiniteMean with FAIL: nothing applied).
  absl::Status PushStep(const StepPush& push, StepVerdictKind* verdict,
                        ExchangeRound* out) override;
  // Publishes the replica it trained: the final one (waited for; a
  // failure is the training's), or at a stop the last whole one. A failure
  // of the replica's own that ended the training (a load, publish or apply
  // that failed, a stop or a broken group seen by its calls on the group,
  // which published what they could) is returned as it was, whatever the
  // trainer made of it.
  absl::Status Finish(const absl::Status& trained) override;

 private:
  DeviceReplica(const JobConfig& job, DeviceReplicaOptions options, ExchangeHooks hooks,
                ModelReplicas* model, std::unique_ptr<kernels::PeerGroup> peers);
  absl::Status Allocate();
  absl::Status MakeBuckets();
  float* slot(size_t variable, int k) {
    return k < slots_ ? slot_buffers_[variable * slots_ + k]->data() : nullptr;
  }
  // Loads the device replica with the served one's state (step_ its version).
  absl::Status Load(ps::Client* client);
  // Keeps `s` (not OK) as the status the training ends with (Finish).
  absl::Status Ended(const absl::Status& s);
  // Queues the means of the gradients among the workers (QueueAllReduceMeans).
  absl::Status QueueMeans();
  // The mean loss among the workers and whether any mean is not finite.
  absl::Status Verdict(float loss, bool* finite);
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
  const ExchangeHooks hooks_;
  bool loaded_ = false;  // by the first Pull
  int64_t step_ = 0;     // the step the device holds, whole, until its apply
  bool finite_ = false;  // the step's verdict (Reduce)
  // What ended the training (a failure of the replica's own), else OK.
  absl::Status ended_;
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
  // The mean loss, the count of non-finite values and the gradients' norm,
  // on the device (with Backend::GlobalNorm's scratch) and in page-locked
  // memory.
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
