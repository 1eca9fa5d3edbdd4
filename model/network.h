// A model spec made runnable on a kernels backend: the worker trains with it,
// psflow-eval and the evaluator run it forward. Ops and activation buffers
// are created once per batch size and reused. Weights and gradients are
// exchanged through host memory, in ModelVariables(spec) order.
//
// Not thread-safe: one Network per thread.
#ifndef PSFLOW_MODEL_NETWORK_H_
#define PSFLOW_MODEL_NETWORK_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kernels.h"
#include "model/spec.h"
#include "proto/model.pb.h"

namespace psflow::model {

class Network {
 public:
  // `spec` must be valid; `backend` must outlive the network.
  static absl::StatusOr<std::unique_ptr<Network>> Create(const ModelSpec& spec,
                                                         kernels::Backend* backend);
  ~Network();

  const ModelSpec& spec() const { return spec_; }
  const std::vector<VariableShape>& variables() const { return variables_; }
  int64_t input_floats() const;  // per example

  // When the backend computes in host memory: the network's own weight and
  // gradient buffers, one per variable, to fill and read in place instead of
  // SetWeights and GetGradients. Empty for other backends.
  std::vector<float*> HostWeights();
  std::vector<float*> HostGradients();

  // Copies weights in from host memory, one pointer per variable.
  absl::Status SetWeights(const std::vector<const float*>& host);

  struct Result {
    double loss = 0;      // mean over the batch
    int64_t correct = 0;  // arg-max equals the label
  };
  // Forward and backward over one batch (host memory: images [batch, C, H, W]
  // in [0, 1], standardized here as the spec's input says; labels [batch]); the gradients of the mean loss stay in the network until
  // GetGradients.
  absl::StatusOr<Result> TrainStep(const float* images, const int32_t* labels, int batch);
  // Copies the latest gradients out to host memory, one pointer per variable.
  absl::Status GetGradients(const std::vector<float*>& host);
  // Forward only.
  absl::StatusOr<Result> Evaluate(const float* images, const int32_t* labels, int batch);

 private:
  struct Layer;
  struct BatchState;
  Network(ModelSpec spec, kernels::Backend* backend);
  absl::StatusOr<BatchState*> StateFor(int batch);
  absl::StatusOr<Result> Forward(BatchState* state, const float* images, const int32_t* labels);

  ModelSpec spec_;
  kernels::Backend* backend_;
  std::vector<VariableShape> variables_;
  std::vector<Layer> layers_;
  std::vector<std::unique_ptr<kernels::Buffer>> weights_;
  std::vector<std::unique_ptr<kernels::Buffer>> grads_;
  std::map<int, std::unique_ptr<BatchState>> states_;  // by batch size
};

}  // namespace psflow::model

#endif  // PSFLOW_MODEL_NETWORK_H_
