// A kernels backend for tests that hands every call to another backend,
// counting the floats of the buffers it allocates (what a network really
// takes) and answering AvailableMemory as the test says. Not thread-safe.
#ifndef PSFLOW_TESTS_KERNELS_WRAPPED_BACKEND_H_
#define PSFLOW_TESTS_KERNELS_WRAPPED_BACKEND_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kernels.h"

namespace psflow::kernels {

class WrappedBackend final : public Backend {
 public:
  explicit WrappedBackend(Backend* inner) : inner_(inner) {}
  // Floats of the buffers Allocate gave out so far (AllocateHost aside).
  int64_t floats() const { return floats_; }
  // What AvailableMemory answers from now on, instead of the inner backend.
  void SetAvailableMemory(absl::StatusOr<int64_t> available) { available_ = std::move(available); }

  std::string name() const override { return inner_->name(); }
  bool host_memory() const override { return inner_->host_memory(); }
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t floats) override {
    floats_ += static_cast<int64_t>(floats);
    return inner_->Allocate(floats);
  }
  absl::StatusOr<std::unique_ptr<Buffer>> AllocateHost(size_t floats) override {
    return inner_->AllocateHost(floats);
  }
  absl::Status CopyToDevice(const float* host, size_t floats, float* device) override {
    return inner_->CopyToDevice(host, floats, device);
  }
  absl::Status CopyToHost(const float* device, size_t floats, float* host) override {
    return inner_->CopyToHost(device, floats, host);
  }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  absl::StatusOr<int64_t> AvailableMemory() override {
    return available_.has_value() ? *available_ : inner_->AvailableMemory();
  }
  absl::Status Add(const float* a, const float* b, float* y, int64_t n) override {
    return inner_->Add(a, b, y, n);
  }
  absl::Status Affine(const float* x, float scale, float shift, float* y, int64_t n) override {
    return inner_->Affine(x, scale, shift, y, n);
  }
  absl::Status ChannelAffine(const float* x, const float* scale, const float* shift, float* y,
                             int64_t n, int64_t channels, int64_t plane) override {
    return inner_->ChannelAffine(x, scale, shift, y, n, channels, plane);
  }
  absl::Status Sgd(float* w, const float* g, float learning_rate, int64_t n) override {
    return inner_->Sgd(w, g, learning_rate, n);
  }
  absl::Status ApplyOptimizer(const OptimizerStep& step,
                              const std::vector<OptimizerTensor>& tensors) override {
    return inner_->ApplyOptimizer(step, tensors);
  }
  absl::Status CountNonFinite(const std::vector<absl::Span<const float>>& xs,
                              float* count) override {
    return inner_->CountNonFinite(xs, count);
  }
  absl::Status Copy(const float* src, float* dst, int64_t n) override {
    return inner_->Copy(src, dst, n);
  }
  absl::StatusOr<std::unique_ptr<Graph>> Capture(
      const std::function<absl::Status()>& work) override {
    return inner_->Capture(work);
  }
  absl::StatusOr<std::unique_ptr<Conv2D>> CreateConv2D(const Conv2DShape& shape) override {
    return inner_->CreateConv2D(shape);
  }
  absl::StatusOr<std::unique_ptr<MaxPool2D>> CreateMaxPool2D(const Pool2DShape& shape) override {
    return inner_->CreateMaxPool2D(shape);
  }
  absl::StatusOr<std::unique_ptr<Relu>> CreateRelu(int64_t size) override {
    return inner_->CreateRelu(size);
  }
  absl::StatusOr<std::unique_ptr<Dense>> CreateDense(const DenseShape& shape) override {
    return inner_->CreateDense(shape);
  }
  absl::StatusOr<std::unique_ptr<SoftmaxCrossEntropy>> CreateSoftmaxCrossEntropy(
      int batch, int classes) override {
    return inner_->CreateSoftmaxCrossEntropy(batch, classes);
  }
  absl::StatusOr<std::unique_ptr<BatchNorm>> CreateBatchNorm(const BatchNormShape& shape) override {
    return inner_->CreateBatchNorm(shape);
  }
  absl::StatusOr<std::unique_ptr<GlobalAvgPool>> CreateGlobalAvgPool(
      const GlobalAvgPoolShape& shape) override {
    return inner_->CreateGlobalAvgPool(shape);
  }
  absl::StatusOr<std::unique_ptr<Concat>> CreateConcat(const ConcatShape& shape) override {
    return inner_->CreateConcat(shape);
  }
  absl::StatusOr<std::unique_ptr<Interaction>> CreateInteraction(
      const InteractionShape& shape) override {
    return inner_->CreateInteraction(shape);
  }
  absl::StatusOr<std::unique_ptr<EmbeddingBag>> CreateEmbeddingBag(int64_t dim) override {
    return inner_->CreateEmbeddingBag(dim);
  }

 private:
  Backend* const inner_;
  int64_t floats_ = 0;
  std::optional<absl::StatusOr<int64_t>> available_;
};

}  // namespace psflow::kernels

#endif  // PSFLOW_TESTS_KERNELS_WRAPPED_BACKEND_H_
