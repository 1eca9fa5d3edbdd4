// The CPU backend: kernels.h implemented on oneDNN (2.x API) over host memory.
//
// Each op builds its oneDNN primitives once, for its fixed shape and the plain
// layouts of kernels.h (nchw, oihw, nc, oi, x), and on every call only
// re-points its dnnl::memory handles at the caller's pointers (Conv2D builds
// both its with-bias and its bias-less primitives at creation). Forward-only
// ops build their forward primitives alone; max pooling's is then oneDNN's
// inference primitive, which needs no arg-max workspace. Work that
// oneDNN has no primitive for (global average pooling, the elementwise
// helpers, the loss, embedding bags) is plain loops, OpenMP-parallel where the size pays for
// it. Buffers are 64-byte aligned, zero-filled host memory; Copy* is memcpy
// and all work has finished when an op returns, so Synchronize has nothing to
// wait for. There are no graphs: Capture is UNIMPLEMENTED.
//
// Thread-safety: the backend is thread-safe. Its ops share one engine and one
// stream; execution on that stream, and the OpenMP loops, are serialized by a
// mutex, so different ops may be called from different threads (one op object
// still must not be executed concurrently: it keeps per-call state such as the
// pooling workspace or the batch-norm statistics). Ops keep the engine alive,
// so they may outlive the backend.
#ifndef PSFLOW_KERNELS_CPU_CPU_BACKEND_H_
#define PSFLOW_KERNELS_CPU_CPU_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kernels.h"

namespace psflow::kernels {

namespace cpu_internal {
struct DnnlContext;  // engine + stream + its mutex; defined in cpu_internal.h
}  // namespace cpu_internal

class CpuBackend final : public Backend {
 public:
  // Fails (INTERNAL) only if oneDNN cannot create a CPU engine. Sets the
  // OpenMP team size of the calling thread, which runs the ops, to `threads`,
  // or with 0 to the cores this process may use (common/cpu_count.h).
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(int threads = 0);
  ~CpuBackend() override;

  std::string name() const override { return "cpu"; }
  // "cpu (N kernel threads)".
  std::string Description() const override;
  bool host_memory() const override { return true; }

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t floats) override;
  absl::Status CopyToDevice(const float* host, size_t floats, float* device) override;
  absl::Status CopyToHost(const float* device, size_t floats, float* host) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }
  // AvailableHostMemory() (kernels/host_memory.h).
  absl::StatusOr<int64_t> AvailableMemory() override;

  // Elementwise helpers; n < 0 or a null pointer (for n > 0) is INVALID_ARGUMENT.
  absl::Status Add(const float* a, const float* b, float* y, int64_t n) override;
  absl::Status Affine(const float* x, float scale, float shift, float* y, int64_t n) override;
  absl::Status ChannelAffine(const float* x, const float* scale, const float* shift, float* y,
                             int64_t n, int64_t channels, int64_t plane) override;
  absl::Status Sgd(float* w, const float* g, float learning_rate, int64_t n) override;
  absl::Status ApplyOptimizer(const OptimizerStep& step,
                              const std::vector<OptimizerTensor>& tensors) override;
  absl::Status CountNonFinite(const std::vector<absl::Span<const float>>& xs,
                              float* count) override;
  absl::Status GlobalNorm(const std::vector<absl::Span<const float>>& xs, float* scratch,
                          float* norm) override;
  absl::Status Copy(const float* src, float* dst, int64_t n) override;

  absl::StatusOr<std::unique_ptr<Conv2D>> CreateConv2D(const Conv2DShape& shape) override;
  absl::StatusOr<std::unique_ptr<MaxPool2D>> CreateMaxPool2D(const Pool2DShape& shape) override;
  absl::StatusOr<std::unique_ptr<Relu>> CreateRelu(int64_t size) override;
  absl::StatusOr<std::unique_ptr<Dense>> CreateDense(const DenseShape& shape) override;
  absl::StatusOr<std::unique_ptr<SoftmaxCrossEntropy>> CreateSoftmaxCrossEntropy(
      int batch, int classes) override;
  absl::StatusOr<std::unique_ptr<BatchNorm>> CreateBatchNorm(const BatchNormShape& shape) override;
  absl::StatusOr<std::unique_ptr<GlobalAvgPool>> CreateGlobalAvgPool(
      const GlobalAvgPoolShape& shape) override;
  absl::StatusOr<std::unique_ptr<Concat>> CreateConcat(const ConcatShape& shape) override;
  absl::StatusOr<std::unique_ptr<Interaction>> CreateInteraction(
      const InteractionShape& shape) override;
  absl::StatusOr<std::unique_ptr<EmbeddingBag>> CreateEmbeddingBag(int64_t dim) override;

 private:
  CpuBackend(std::shared_ptr<cpu_internal::DnnlContext> ctx, int threads);

  std::shared_ptr<cpu_internal::DnnlContext> ctx_;
  int threads_;  // the OpenMP team size Create set
};

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_CPU_CPU_BACKEND_H_
