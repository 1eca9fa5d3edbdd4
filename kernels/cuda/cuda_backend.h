// The CUDA backend: kernels.h implemented on cuDNN (legacy API), cuBLAS and a
// few kernels of psflow's own (kernels/cuda/cuda_kernels.h), over the memory
// of one GPU.
//
// Design:
// - One stream per backend (created non-blocking, so it never waits for the
//   legacy default stream). Every op and helper only queues its work on that
//   stream and returns; work runs in submission order. CopyToHost and
//   Synchronize wait for the stream; CopyToDevice does not (from pageable
//   memory the driver stages the data before it returns, so the caller may
//   reuse it; from AllocateHost's page-locked memory the copy is queued, and
//   the memory must stay unchanged until the stream has done it).
// - Two more streams, each made at its first use, for copies that must not
//   wait for everything queued before them: CopyToHostAfter's (gradients
//   leaving during the backward pass, each copy after its event) and
//   CopyToDeviceAfter's (weights arriving while a step still runs, each
//   after the event that says the step is done with them). The backend's
//   stream waits for the uploads only at JoinUploads; Synchronize and the
//   freeing of device memory wait for them too.
// - One cuDNN handle and one cuBLAS handle, both bound to the stream. cuBLAS
//   gets a fixed workspace of its own at creation, so it never allocates
//   while a graph is being captured. Dense keeps full fp32 GEMMs
//   (CUBLAS_DEFAULT_MATH: no TF32); convolutions use CUDNN_DEFAULT_MATH,
//   which lets cuDNN pick TF32 tensor-core algorithms (like PyTorch's
//   defaults for matmul and convolution).
// - Ops pick their algorithms (cuDNN's Find for convolutions) and allocate
//   every workspace and scratch buffer when they are created, never when they
//   run: an op's execution only queues kernels on the stream, which is what
//   makes Capture/Graph::Launch valid. A forward-only convolution finds and
//   sizes its forward algorithm alone (no backward workspace).
// - Capture records what the callback queues on the stream into a CUDA graph
//   (cudaStreamCaptureModeThreadLocal); Graph::Launch replays it on the same
//   stream with the same pointers. Inside the callback only ops and the
//   elementwise helpers may be called: Allocate, op creation, host copies,
//   Synchronize and the destruction of buffers or ops synchronize or
//   allocate, which a capture does not allow (the capture then fails, and
//   the stream stays usable).
// - Allocate waits for its zero fill. Freeing device memory (a buffer, an
//   op's workspace) first waits for the work queued before it, so memory is
//   never freed under a running kernel; a graph destroyed while a replay is
//   in flight is freed by CUDA when the replay ends.
// - MaxPool2D's Backward hands cuDNN the x and y of the latest Forward (cuDNN
//   finds each window's maximum again from them): those buffers must still
//   hold the forward's values when Backward is queued. BatchNorm keeps its
//   saved mean and inverse standard deviation in buffers of its own.
// - EmbeddingBag's SetPlan packs the plan's arrays into page-locked memory of
//   the op's and queues one copy of them; before it packs the next plan
//   there it waits (on the host) for that copy, which is why SetPlan has no
//   place inside Capture. Forward and Backward are one kernel each.
// - Every entry point (ops, helpers, buffers' and ops' destruction) makes the
//   backend's GPU current on the calling thread and restores the previous one
//   afterwards, so any thread may use the backend. Errors of CUDA, cuDNN and
//   cuBLAS become INTERNAL statuses naming the call and the library's message
//   (errors of queued work surface at the next call that waits for it).
//
// Thread-safety: the backend is thread-safe. Its calls, those of its ops and
// graphs, and the destruction of its buffers, ops and graphs are serialized
// by a recursive mutex of the backend (they only queue work, so the lock is
// held briefly); Capture holds it for the whole callback, so other threads
// wait instead of queueing into the graph being recorded. One op object still
// must not be executed from two threads at once (MaxPool2D and BatchNorm keep
// state of their latest Forward). Buffers, ops and graphs keep the stream and
// handles alive, so they may outlive the backend.
#ifndef PSFLOW_KERNELS_CUDA_CUDA_BACKEND_H_
#define PSFLOW_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/kernels.h"

namespace psflow::kernels {

namespace cuda_internal {
struct CudaContext;  // device, streams, handles and their mutex (cuda_ops_internal.h)
}  // namespace cuda_internal

// A CUDA event of one backend (its device): `raw()` is the cudaEvent_t.
class CudaEvent final : public Event {
 public:
  explicit CudaEvent(void* event) : event_(event) {}
  ~CudaEvent() override;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  void* raw() const { return event_; }

 private:
  void* const event_;
};

class CudaBackend final : public Backend {
 public:
  // Creates the backend for GPU `device_ordinal`. UNAVAILABLE ("cuda:N: ...")
  // when the machine has no usable CUDA device of that index (no driver, no
  // GPU, ordinal out of range); INTERNAL when creating the stream or a library
  // handle fails.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device_ordinal);
  // The GPUs this process sees (cudaGetDeviceCount); UNAVAILABLE when there
  // are none or no driver.
  static absl::StatusOr<int> DeviceCount();
  ~CudaBackend() override;

  int device_ordinal() const;
  // Runs fn(stream) (the backend's cudaStream_t) inside the backend's lock,
  // with its GPU current: for work of other CUDA libraries (NCCL) queued in
  // order with the backend's own. Errors get the prefix "<what>: ".
  absl::Status RunOnStream(absl::string_view what, const std::function<absl::Status(void*)>& fn);

  std::string name() const override;

  // Zero-filled device memory (at least 256-byte aligned).
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t floats) override;
  // Page-locked (cudaHostAlloc, portable to every GPU of the process).
  absl::StatusOr<std::unique_ptr<Buffer>> AllocateHost(size_t floats) override;
  absl::Status CopyToDevice(const float* host, size_t floats, float* device) override;
  absl::Status CopyToHost(const float* device, size_t floats, float* host) override;
  // On a second stream of the context's, waiting for `ready` there.
  absl::Status CopyToHostAfter(Event* ready, const std::vector<HostCopy>& copies) override;
  absl::Status WaitCopies() override;
  absl::Status RecordCopiesDone(Event* done) override;
  absl::Status WaitEvent(Event* event) override;
  // On a third stream of the context's (made at the first call), waiting
  // there for the batch's events; JoinUploads makes the backend's stream
  // wait for an event recorded on it. A float upload that lies apart from
  // the others is copied straight to its place; the rest go through a
  // buffer of the context's (grown to the largest batch) and a kernel
  // places (and widens) them.
  using Backend::CopyToDeviceAfter;  // the one-upload form
  absl::Status CopyToDeviceAfter(const std::vector<Upload>& uploads, HostValues values) override;
  absl::Status JoinUploads() override;
  absl::Status RecordUploadsDone(Event* done) override;
  // cudaHostRegister (portable) and cudaHostUnregister, with this backend's
  // GPU current.
  HostPinning host_pinning() const override;
  // Waits for the backend's stream and for the uploads of CopyToDeviceAfter.
  absl::Status Synchronize() override;
  // The GPU's free memory (cudaMemGetInfo).
  absl::StatusOr<int64_t> AvailableMemory() override;

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
  // src and dst must be the same or not overlap.
  absl::Status Copy(const float* src, float* dst, int64_t n) override;
  absl::Status NarrowToHalves(const float* x, int64_t n, bool bf16, uint16_t* y) override;
  // Inside Capture, RecordEvent adds an external event node to the graph
  // (cudaEventRecordExternal), which each launch records.
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override;
  absl::Status RecordEvent(Event* event) override;

  absl::StatusOr<std::unique_ptr<Graph>> Capture(
      const std::function<absl::Status()>& work) override;

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
  explicit CudaBackend(std::shared_ptr<cuda_internal::CudaContext> ctx);

  std::shared_ptr<cuda_internal::CudaContext> ctx_;
};

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_CUDA_CUDA_BACKEND_H_
