// A worker's replicas of the model: a backend and a network on each device
// of its --device (JobConfig.replicas_per_worker of them). Replica 0 is the
// one that pulls and pushes; with several GPUs the others take its weights
// and their gradients are averaged into its own, GPU to GPU
// (kernels::DeviceGroup), each step.
//
// Thread-safety: none; the training thread's. Errors: Permanent where a
// device or model cannot be created, FAILED_PRECONDITION where the worker has
// not as many devices as the job's replicas, INTERNAL from a step (naming
// the GPU that failed).
#ifndef PSFLOW_WORKER_MODEL_REPLICAS_H_
#define PSFLOW_WORKER_MODEL_REPLICAS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "proto/job.pb.h"

namespace psflow::worker {

class ModelReplicas {
 public:
  // The backends and networks of every device of `device` (a --device).
  static absl::StatusOr<std::unique_ptr<ModelReplicas>> Create(const std::string& device,
                                                               const JobConfig& job);

  kernels::Backend* backend() const { return backend_.get(); }  // replica 0's
  model::Network* net() const { return net_.get(); }            // replica 0
  // Several replicas, averaged among their GPUs each step (Step).
  bool several() const { return group_ != nullptr; }
  // Each variable's floats, and by replica its buffers on the device.
  const std::vector<int64_t>& variable_floats() const { return variable_floats_; }
  const std::vector<std::vector<float*>>& weights() const { return weights_; }
  const std::vector<std::vector<float*>>& grads() const { return grads_; }
  // For the log: the devices, or replica 0's backend.
  std::string Description() const;

  // One step of every replica, each on `batch` examples of images/labels in
  // turn (replica r on the r-th batch, `example_floats` floats an image, and
  // `example_ids` ids from `ids` for the embedding layers; ids null where
  // the model reads none), then their gradients averaged among the GPUs
  // into replica 0's; the loss is the mean over the replicas. Several
  // replicas only.
  absl::StatusOr<model::Network::Result> Step(const float* images, const uint64_t* ids,
                                              const int32_t* labels, int batch,
                                              int64_t example_floats, int64_t example_ids);

 private:
  ModelReplicas() = default;

  std::vector<std::string> devices_;
  // Replica 0, and replicas 1.. each on its own GPU; the group that
  // averages their gradients and copies replica 0's weights to the others.
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<model::Network> net_;
  std::vector<std::unique_ptr<kernels::Backend>> replica_backends_;
  std::vector<std::unique_ptr<model::Network>> replica_nets_;
  std::unique_ptr<kernels::DeviceGroup> group_;
  // Every replica's network, in replica order, and its buffers on the GPU.
  std::vector<model::Network*> nets_;
  std::vector<std::vector<float*>> weights_, grads_;
  std::vector<int64_t> variable_floats_;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_MODEL_REPLICAS_H_
