// Where a worker's pulls land and its pushes come from, by variable: the
// network's own buffers when they are host memory (a CPU's), else buffers on
// the host, page-locked where the device can, copied to and from the device.
// A GPU worker of a job with ps (one replica) copies each bucket of
// gradients out as soon as the backward pass has written it
// (StepCopyingGradients), rounded to a 16-bit wire dtype on the device where
// asked (narrowing), into a shared region registered with the GPU that its
// pushes offer the ps (the push region).
//
// Thread-safety: none; the training thread's (the exchange's lanes read the
// buffers between steps). Ownership: the network, backend and client are
// not owned and outlive the staging. Errors: Permanent where the device
// cannot give the buffers or events.
#ifndef PSFLOW_WORKER_STAGING_H_
#define PSFLOW_WORKER_STAGING_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/step_trace.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "proto/job.pb.h"
#include "ps/client.h"
#include "transport/shared_region.h"
#include "worker/exchange.h"

namespace psflow::worker {

// A bucket of gradients, in the order the backward pass completes them,
// with an event the network records (Network::SetGradientEvents) after the
// layer that completes it: work on another stream can take the bucket while
// the rest of the backward pass runs.
struct GradientBucket {
  std::unique_ptr<kernels::Event> ready;
  std::vector<int> variables;
  // Host buckets of a worker that pushes during the backward pass: recorded
  // after the bucket's copies to the host.
  std::unique_ptr<kernels::Event> copied;
};

// The gradients of `net` in buckets of about kGpuBucketBytes (the last ones
// smaller), their events set on the network. UNIMPLEMENTED for backends
// without events.
absl::StatusOr<std::vector<GradientBucket>> GradientBuckets(model::Network* net,
                                                            kernels::Backend* backend);

struct HostStagingOptions {
  DataType wire = DT_FLOAT;  // of pushes and pulls
  // Copy each bucket of gradients out as the backward pass writes it (a GPU
  // worker of a job with ps, one replica).
  bool copy_buckets = false;
  // As TrainerOptions'.
  bool narrow_on_device = true;
  bool gradients_to_shared_memory = true;
};

class HostStaging {
 public:
  // Stages `net`'s weights and gradients; `client` (may be null) gets the
  // push region where one is made.
  static absl::StatusOr<std::unique_ptr<HostStaging>> Create(HostStagingOptions options,
                                                             model::Network* net,
                                                             kernels::Backend* backend,
                                                             ps::Client* client);

  bool in_place() const { return in_place_; }
  const std::vector<float*>& weights() const { return weights_; }
  // No grads where the step rounds them on the device (narrowed then).
  const std::vector<float*>& grads() const { return grads_; }
  std::vector<const uint16_t*> narrowed() const;
  // With copied buckets: by variable, the event its pulled weights wait for
  // on their way to the device (its bucket's `ready`: the running step's
  // backward pass is done with the weight), so that they overlap the rest
  // of the pass (Network::SetWeightAfter). Empty: uploads queue behind the
  // step.
  const std::vector<kernels::Event*>& upload_after() const { return upload_after_; }
  bool copies_buckets() const { return !buckets_.empty(); }
  std::vector<std::vector<int>> bucket_variables() const;
  // Pushing during the backward pass: each bucket's copies record an event,
  // which the step waits for before it tells the exchange of the bucket.
  absl::Status RecordCopies();

  // The step's graph, and each bucket of gradients copied to the host as
  // soon as the backward pass has written it; `exchange` hears when the
  // step is queued and (RecordCopies) of each bucket on the host.
  absl::StatusOr<model::Network::Result> StepCopyingGradients(const float* images,
                                                              const int32_t* labels, int batch,
                                                              Exchange* exchange, StepTrace* trace,
                                                              int64_t trace_step);
  // After a step that did not copy its gradients out (and is not in place):
  // copies them to the host.
  absl::Status FetchGradients();

 private:
  // With options_.narrow_on_device and a 16-bit wire dtype, by variable:
  // its gradient rounded by the step on the device
  // (Network::SetGradientHalves), and where StepCopyingGradients copies it
  // (page-locked; the lanes' refs point there: TensorRef::encoded). Each
  // buffer is in whole floats that hold the 16-bit values.
  struct NarrowedGradient {
    std::unique_ptr<kernels::Buffer> device, host;
    uint16_t* host_values() const { return reinterpret_cast<uint16_t*>(host->data()); }
  };

  HostStaging(HostStagingOptions options, model::Network* net, kernels::Backend* backend);
  absl::Status Stage(ps::Client* client);
  // Host buffers of `floats` floats: a gradient's from the push region
  // while it has room (MakePushRegion sized it for them), else page-locked
  // memory of the backend's.
  absl::StatusOr<std::unique_ptr<kernels::Buffer>> HostBuffer(int64_t floats, bool gradient);
  absl::Status StageAll(std::vector<float*>* into, bool gradients);
  absl::Status CopyBuckets();
  absl::Status Narrow();
  // Makes push_region_ for every variable's gradient host buffer (16-bit
  // ones with `narrow`), and gives it to `client`; leaves it null, saying
  // why, where no region can be made or registered.
  void MakePushRegion(ps::Client* client, bool narrow);

  const HostStagingOptions options_;
  model::Network* const net_;
  kernels::Backend* const backend_;
  std::vector<int64_t> variable_floats_;
  std::vector<float*> weights_, grads_;
  bool in_place_ = false;
  // The region that the gradients' host buffers lie in (with
  // gradients_to_shared_memory where it applies), registered with the GPU
  // and given to the ps client (SetPushRegion); null otherwise. Declared
  // before the buffers in it: it outlives them.
  std::shared_ptr<const SharedRegion> push_region_;
  int64_t region_used_ = 0;
  std::vector<std::unique_ptr<kernels::Buffer>> staging_;
  std::vector<GradientBucket> buckets_;
  std::vector<NarrowedGradient> narrowed_;
  std::vector<kernels::Event*> upload_after_;
  bool copy_events_ = false;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_STAGING_H_
