#include "worker/model_replicas.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/exit_codes.h"
#include "common/placement.h"
#include "common/tensor_view.h"

namespace psflow::worker {

absl::StatusOr<std::unique_ptr<ModelReplicas>> ModelReplicas::Create(const std::string& device,
                                                                     const JobConfig& job) {
  std::unique_ptr<ModelReplicas> m(new ModelReplicas());
  absl::StatusOr<std::vector<std::string>> devices = kernels::ExpandDevices(device);
  if (!devices.ok()) return Permanent(devices.status());
  m->devices_ = *std::move(devices);
  const size_t count = m->devices_.size();
  const int replicas = ReplicasPerWorker(job);
  if (static_cast<int>(count) != replicas) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job runs ", replicas, replicas == 1 ? " replica" : " replicas",
        " of the model per worker (--replicas_per_worker on the chief), but this worker's "
        "--device=",
        device, " names ", count, count == 1 ? " device" : " devices",
        ": give every worker as many GPUs"));
  }
  std::vector<kernels::Backend*> all;
  for (size_t r = 0; r < count; ++r) {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
        kernels::CreateBackend(m->devices_[r], job.compute_threads());
    if (!backend.ok()) return Permanent(backend.status());
    absl::StatusOr<std::unique_ptr<model::Network>> net =
        model::Network::Create(job.model(), backend->get());
    if (!net.ok()) return Permanent(net.status());
    all.push_back(backend->get());
    if (r == 0) {
      m->backend_ = *std::move(backend);
      m->net_ = *std::move(net);
    } else {
      m->replica_backends_.push_back(*std::move(backend));
      m->replica_nets_.push_back(*std::move(net));
    }
  }
  for (const VariableShape& v : m->net_->variables()) {
    m->variable_floats_.push_back(NumElements(v.shape));
  }
  m->nets_ = {m->net_.get()};
  for (auto& n : m->replica_nets_) m->nets_.push_back(n.get());
  for (model::Network* n : m->nets_) {
    m->weights_.push_back(n->DeviceWeights());
    m->grads_.push_back(n->DeviceGradients());
  }
  if (all.size() > 1) {
    absl::StatusOr<std::unique_ptr<kernels::DeviceGroup>> group = kernels::CreateDeviceGroup(all);
    if (!group.ok()) return Permanent(group.status());
    m->group_ = *std::move(group);
  }
  return m;
}

std::string ModelReplicas::Description() const {
  if (devices_.size() > 1) {
    return absl::StrCat(devices_.size(), " replicas on ", absl::StrJoin(devices_, ", "));
  }
  return absl::StrCat("device ", backend_->Description());
}

absl::StatusOr<model::Network::Result> ModelReplicas::Step(const float* images, const uint64_t* ids,
                                                           const int32_t* labels, int batch,
                                                           int64_t example_floats,
                                                           int64_t example_ids) {
  // Names the GPU whose work failed: a lost GPU ends the worker with a
  // retryable exit code (INTERNAL), to be restarted.
  auto on = [&](size_t r, const absl::Status& s) {
    return absl::InternalError(absl::StrCat(devices_[r], ": ", s.message()));
  };
  // Replica 0 holds the pulled weights (queued on its stream): the others
  // take them from it, GPU to GPU.
  absl::Status s = group_->Broadcast(weights_, variable_floats_);
  if (!s.ok())
    return absl::InternalError(absl::StrCat("copying weights among the GPUs: ", s.message()));
  for (size_t r = 0; r < nets_.size(); ++r) {
    if (ids != nullptr) s = nets_[r]->SetIds(ids + r * batch * example_ids, batch);
    if (s.ok()) {
      s = nets_[r]->SetInputs(images + r * batch * example_floats, labels + r * batch, batch);
    }
    if (s.ok()) s = nets_[r]->StartTrainStep(batch);
    if (!s.ok()) return on(r, s);
  }
  s = group_->AllReduceMean(grads_, variable_floats_);
  if (!s.ok())
    return absl::InternalError(absl::StrCat("averaging gradients among the GPUs: ", s.message()));
  model::Network::Result total;
  for (size_t r = 0; r < nets_.size(); ++r) {
    absl::StatusOr<model::Network::Result> got = nets_[r]->FinishStep(batch);
    if (!got.ok()) return on(r, got.status());
    total.loss += got->loss / static_cast<double>(nets_.size());
    total.correct += got->correct;
  }
  return total;
}

}  // namespace psflow::worker
