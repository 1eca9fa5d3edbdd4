// What the CUDA backend (cuda_backend.cc) shares with the files of its ops
// (cuda_cudnn_ops.cc, cuda_cublas_dense.cc, cuda_kernel_layers.cc,
// cuda_elementwise.cc): the context (device, streams, handles, lock), the
// Scope/RunIn entry-point wrappers, error checks, device memory and the op
// factories. Not part of the backend's interface; the non-template functions
// are defined in cuda_backend.cc.
//
// Thread-safety: as cuda_backend.h says; everything that touches the context
// runs inside a Scope (RunIn or Build open one).
#ifndef PSFLOW_KERNELS_CUDA_CUDA_OPS_INTERNAL_H_
#define PSFLOW_KERNELS_CUDA_CUDA_OPS_INTERNAL_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "kernels/kernels.h"

namespace psflow::kernels::cuda_internal {

// ---------------------------------------------------------------- error checks

// A failed runtime call also records its error as the thread's "last error";
// clearing it keeps the cudaGetLastError() after the next kernel launch from
// reporting it a second time. (Sticky errors, which corrupt the context, stay
// and are reported by every later call.)
void ClearLastError();

// INTERNAL "<function> failed: <library's message>" for a failed call
// (`call`: the stringized call); OK on success.
absl::Status CheckCuda(cudaError_t err, absl::string_view call);
absl::Status CheckCudnn(cudnnStatus_t status, absl::string_view call);
absl::Status CheckCublas(cublasStatus_t status, absl::string_view call);

#define PSFLOW_CUDA_CHECK(expr) PSFLOW_RETURN_IF_ERROR(CheckCuda((expr), #expr))
#define PSFLOW_CUDNN_CHECK(expr) PSFLOW_RETURN_IF_ERROR(CheckCudnn((expr), #expr))
#define PSFLOW_CUBLAS_CHECK(expr) PSFLOW_RETURN_IF_ERROR(CheckCublas((expr), #expr))

// `what: message`, same code; OK stays OK.
absl::Status Annotate(absl::Status status, absl::string_view what);

// INVALID_ARGUMENT "<name> is null" for the first null pointer.
absl::Status CheckNonNull(std::initializer_list<std::pair<absl::string_view, const void*>> args);

// INVALID_ARGUMENT "<what>: negative count <n>".
absl::Status CheckCount(int64_t n, absl::string_view what);

// INVALID_ARGUMENT "<what>: <tensor> has <count> elements; ..." for the first
// tensor with too many (or no) elements: cuDNN's legacy descriptors (and our
// kernels' row indices) take int sizes.
absl::Status CheckElementCount(
    absl::string_view what, std::initializer_list<std::pair<absl::string_view, int64_t>> tensors);

// ---------------------------------------------------------------- context

// Shared by a backend and everything it creates.
struct CudaContext {
  explicit CudaContext(int device) : device(device) {}
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  const int device;
  // Serializes the use of the stream and the handles (cuDNN and cuBLAS
  // handles must not be used by two threads at once). Recursive, because
  // Capture holds it while the ops it records take it again, and because
  // freeing memory takes it inside calls that hold it already.
  std::recursive_mutex mu;
  cudaStream_t stream = nullptr;
  // CopyToHostAfter's stream, made at its first call.
  cudaStream_t copy_stream = nullptr;
  // CopyToDeviceAfter's stream, made at its first call; `uploads_joined`
  // marks the point JoinUploads makes `stream` wait for, and
  // `uploads_pending` says whether an upload was queued since the last join.
  cudaStream_t upload_stream = nullptr;
  cudaEvent_t uploads_joined = nullptr;
  bool uploads_pending = false;
  // CopyToDeviceAfter's uploads on the device, before a kernel places (and
  // widens) them (used in order on upload_stream).
  void* upload_buffer = nullptr;
  size_t upload_buffer_bytes = 0;
  cudnnHandle_t cudnn = nullptr;
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;
};

// Opens every entry point: takes the context's lock and makes its device
// current on this thread; the destructor restores the previous device.
class Scope {
 public:
  explicit Scope(CudaContext& ctx);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  std::lock_guard<std::recursive_mutex> lock_;
  absl::Status status_;
  int restore_ = -1;
};

// `status` (not OK) with the prefix "<what> <step>: " (or "<what>: " without
// a step).
absl::Status WithStep(const absl::Status& status, absl::string_view what, absl::string_view step);

// Runs fn() (returning absl::Status) inside a Scope; errors get the prefix
// "<what> <step>: " (or "<what>: " without a step).
template <typename Fn>
absl::Status RunIn(CudaContext& ctx, absl::string_view what, absl::string_view step, Fn&& fn) {
  Scope scope(ctx);
  absl::Status status = scope.status();
  if (status.ok()) status = fn();
  if (status.ok()) return status;
  return WithStep(status, what, step);
}

// The same with the step "<count>" or "<count> <unit>", formatted only on
// error (the helpers and copies run often). Count: any integer type, printed
// as it is.
template <typename Count, typename Fn>
absl::Status RunIn(CudaContext& ctx, absl::string_view what, Count count, absl::string_view unit,
                   Fn&& fn) {
  static_assert(std::is_integral_v<Count>, "RunIn: the count must be an integer");
  Scope scope(ctx);
  absl::Status status = scope.status();
  if (status.ok()) status = fn();
  if (status.ok()) return status;
  return WithStep(status, what,
                  unit.empty() ? absl::StrCat(count) : absl::StrCat(count, " ", unit));
}

// ---------------------------------------------------------------- device memory

// Frees device memory of ctx's device once the work queued before has
// finished (ops may be destroyed while their kernels are still queued).
struct DeviceDeleter {
  std::shared_ptr<CudaContext> ctx;
  void operator()(void* p) const;
};
using DevicePtr = std::unique_ptr<void, DeviceDeleter>;

// cudaMalloc of `bytes` (at least 1) on ctx's device, zero-filled when
// `zero`. Runs inside a Scope of ctx. Out of memory is RESOURCE_EXHAUSTED.
absl::Status AllocateDevice(const std::shared_ptr<CudaContext>& ctx, size_t bytes, bool zero,
                            DevicePtr& out);

inline float* Floats(const DevicePtr& p) { return static_cast<float*>(p.get()); }

// ---------------------------------------------------------------- ops

// alpha and beta of cuDNN and cuBLAS calls (read from the host).
inline constexpr float kOne = 1.0f;
inline constexpr float kZero = 0.0f;

// Creates an op whose constructor takes (ctx, what, args...) and whose Init()
// runs inside a Scope; errors are prefixed with the op's description `what`.
template <typename Interface, typename Op, typename... Args>
absl::StatusOr<std::unique_ptr<Interface>> Build(const std::shared_ptr<CudaContext>& ctx,
                                                 absl::string_view what, Args&&... args) {
  Scope scope(*ctx);
  PSFLOW_RETURN_IF_ERROR(Annotate(scope.status(), what));
  auto op = std::make_unique<Op>(ctx, what, std::forward<Args>(args)...);
  PSFLOW_RETURN_IF_ERROR(Annotate(op->Init(), what));
  return std::unique_ptr<Interface>(std::move(op));
}

// The ops' factories, behind CudaBackend's Create*: each checks the shape
// (kernels/shapes.h, then CheckElementCount) and builds the op on ctx.
// cuDNN (cuda_cudnn_ops.cc):
absl::StatusOr<std::unique_ptr<Conv2D>> CreateConv2D(const std::shared_ptr<CudaContext>& ctx,
                                                     const Conv2DShape& shape);
absl::StatusOr<std::unique_ptr<MaxPool2D>> CreateMaxPool2D(const std::shared_ptr<CudaContext>& ctx,
                                                           const Pool2DShape& shape);
absl::StatusOr<std::unique_ptr<Relu>> CreateRelu(const std::shared_ptr<CudaContext>& ctx,
                                                 int64_t size);
// cuBLAS (cuda_cublas_dense.cc):
absl::StatusOr<std::unique_ptr<Dense>> CreateDense(const std::shared_ptr<CudaContext>& ctx,
                                                   const DenseShape& shape);
// psflow's own kernels (cuda_kernel_layers.cc):
absl::StatusOr<std::unique_ptr<BatchNorm>> CreateBatchNorm(const std::shared_ptr<CudaContext>& ctx,
                                                           const BatchNormShape& shape);
absl::StatusOr<std::unique_ptr<GlobalAvgPool>> CreateGlobalAvgPool(
    const std::shared_ptr<CudaContext>& ctx, const GlobalAvgPoolShape& shape);
absl::StatusOr<std::unique_ptr<SoftmaxCrossEntropy>> CreateSoftmaxCrossEntropy(
    const std::shared_ptr<CudaContext>& ctx, int batch, int classes);
absl::StatusOr<std::unique_ptr<Concat>> CreateConcat(const std::shared_ptr<CudaContext>& ctx,
                                                     const ConcatShape& shape);
absl::StatusOr<std::unique_ptr<Interaction>> CreateInteraction(
    const std::shared_ptr<CudaContext>& ctx, const InteractionShape& shape);
absl::StatusOr<std::unique_ptr<EmbeddingBag>> CreateEmbeddingBag(
    const std::shared_ptr<CudaContext>& ctx, int64_t dim);

}  // namespace psflow::kernels::cuda_internal

#endif  // PSFLOW_KERNELS_CUDA_CUDA_OPS_INTERNAL_H_
