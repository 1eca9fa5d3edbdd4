// CUDA backend on cuDNN (legacy API), cuBLAS and kernels/cuda/cuda_kernels.cu;
// see cuda_backend.h for the design and the contract.
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/shapes.h"

namespace psflow::kernels {
namespace cuda_internal {
namespace {

// ---------------------------------------------------------------- error checks

// The function name of a stringized call such as "cudaMalloc(&p, bytes)".
absl::string_view FunctionName(absl::string_view call) { return call.substr(0, call.find('(')); }

// A failed runtime call also records its error as the thread's "last error";
// clearing it keeps the cudaGetLastError() after the next kernel launch from
// reporting it a second time. (Sticky errors, which corrupt the context, stay
// and are reported by every later call.)
void ClearLastError() { static_cast<void>(cudaGetLastError()); }

absl::Status CheckCuda(cudaError_t err, absl::string_view call) {
  if (err == cudaSuccess) return absl::OkStatus();
  ClearLastError();
  return absl::InternalError(absl::StrCat(FunctionName(call), " failed: ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

absl::Status CheckCudnn(cudnnStatus_t status, absl::string_view call) {
  if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  ClearLastError();
  std::string message = absl::StrCat(FunctionName(call), " failed: ", cudnnGetErrorString(status));
  char detail[512] = "";
  cudnnGetLastErrorString(detail, sizeof detail);  // cuDNN 9's explanation, often empty
  if (detail[0] != '\0') absl::StrAppend(&message, " (", detail, ")");
  return absl::InternalError(message);
}

absl::Status CheckCublas(cublasStatus_t status, absl::string_view call) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  ClearLastError();
  return absl::InternalError(absl::StrCat(FunctionName(call),
                                          " failed: ", cublasGetStatusName(status), " (",
                                          cublasGetStatusString(status), ")"));
}

#define PSFLOW_CUDA_CHECK(expr) PSFLOW_RETURN_IF_ERROR(CheckCuda((expr), #expr))
#define PSFLOW_CUDNN_CHECK(expr) PSFLOW_RETURN_IF_ERROR(CheckCudnn((expr), #expr))
#define PSFLOW_CUBLAS_CHECK(expr) PSFLOW_RETURN_IF_ERROR(CheckCublas((expr), #expr))

// `what: message`, same code; OK stays OK.
absl::Status Annotate(absl::Status status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

absl::Status CheckNonNull(std::initializer_list<std::pair<absl::string_view, const void*>> args) {
  for (const auto& [name, ptr] : args) {
    if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------- context

// cuBLAS's own workspace (its default pool size on Hopper). Given explicitly,
// so that cuBLAS never allocates during graph capture.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

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

namespace {

// Opens every entry point: takes the context's lock and makes its device
// current on this thread; the destructor restores the previous device.
class Scope {
 public:
  explicit Scope(CudaContext& ctx) : lock_(ctx.mu) {
    int current = -1;
    status_ = CheckCuda(cudaGetDevice(&current), "cudaGetDevice");
    if (status_.ok() && current != ctx.device) {
      status_ = CheckCuda(cudaSetDevice(ctx.device), "cudaSetDevice");
      if (status_.ok()) restore_ = current;
    }
  }
  ~Scope() {
    if (restore_ >= 0) static_cast<void>(cudaSetDevice(restore_));
  }
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
absl::Status WithStep(const absl::Status& status, absl::string_view what, absl::string_view step) {
  return absl::Status(status.code(),
                      absl::StrCat(what, step.empty() ? "" : " ", step, ": ", status.message()));
}

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

// Makes one of the context's side streams (copies, uploads) at its first
// use. Call inside RunIn.
absl::Status EnsureStream(cudaStream_t* stream) {
  if (*stream == nullptr) {
    PSFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking));
  }
  return absl::OkStatus();
}

}  // namespace

CudaContext::~CudaContext() {
  // Nothing else refers to the context any more; errors can only be dropped.
  if (cudaSetDevice(device) != cudaSuccess) return;
  if (stream != nullptr) static_cast<void>(cudaStreamSynchronize(stream));
  if (copy_stream != nullptr) {
    static_cast<void>(cudaStreamSynchronize(copy_stream));
    static_cast<void>(cudaStreamDestroy(copy_stream));
  }
  if (upload_stream != nullptr) {
    static_cast<void>(cudaStreamSynchronize(upload_stream));
    static_cast<void>(cudaStreamDestroy(upload_stream));
  }
  if (uploads_joined != nullptr) static_cast<void>(cudaEventDestroy(uploads_joined));
  if (upload_buffer != nullptr) static_cast<void>(cudaFree(upload_buffer));
  if (cublas != nullptr) static_cast<void>(cublasDestroy(cublas));
  if (cudnn != nullptr) static_cast<void>(cudnnDestroy(cudnn));
  if (cublas_workspace != nullptr) static_cast<void>(cudaFree(cublas_workspace));
  if (stream != nullptr) static_cast<void>(cudaStreamDestroy(stream));
}

}  // namespace cuda_internal

namespace {

using cuda_internal::Annotate;
using cuda_internal::CheckCublas;
using cuda_internal::CheckCuda;
using cuda_internal::CheckCudnn;
using cuda_internal::CheckNonNull;
using cuda_internal::CudaContext;
using cuda_internal::RunIn;
using cuda_internal::Scope;

constexpr float kOne = 1.0f;
constexpr float kZero = 0.0f;

// ---------------------------------------------------------------- device memory

// Frees device memory of ctx's device once the work queued before has
// finished (ops may be destroyed while their kernels are still queued).
struct DeviceDeleter {
  std::shared_ptr<CudaContext> ctx;
  void operator()(void* p) const {
    if (p == nullptr) return;
    Scope scope(*ctx);
    if (!scope.status().ok()) return;
    static_cast<void>(cudaStreamSynchronize(ctx->stream));
    // An upload may still be writing it.
    if (ctx->upload_stream != nullptr) static_cast<void>(cudaStreamSynchronize(ctx->upload_stream));
    static_cast<void>(cudaFree(p));
  }
};
using DevicePtr = std::unique_ptr<void, DeviceDeleter>;

// cudaMalloc of `bytes` (at least 1) on ctx's device, zero-filled when
// `zero`. Runs inside a Scope of ctx. Out of memory is RESOURCE_EXHAUSTED.
absl::Status AllocateDevice(const std::shared_ptr<CudaContext>& ctx, size_t bytes, bool zero,
                            DevicePtr& out) {
  bytes = std::max<size_t>(bytes, 1);
  void* p = nullptr;
  if (const cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
    absl::Status status = CheckCuda(err, "cudaMalloc");
    if (err == cudaErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of GPU memory for ", bytes, " bytes: ", status.message()));
    }
    return status;
  }
  out = DevicePtr(p, DeviceDeleter{ctx});
  if (zero) {
    PSFLOW_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, ctx->stream));
    PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
  }
  return absl::OkStatus();
}

float* Floats(const DevicePtr& p) { return static_cast<float*>(p.get()); }

class CudaBuffer final : public Buffer {
 public:
  CudaBuffer(DevicePtr memory, size_t size) : memory_(std::move(memory)), size_(size) {}

  float* data() override { return Floats(memory_); }
  size_t size() const override { return size_; }

 private:
  DevicePtr memory_;
  size_t size_;
};

// ---------------------------------------------------------------- cuDNN descriptors

template <typename T, cudnnStatus_t (*Destroy)(T)>
struct CudnnDeleter {
  void operator()(T d) const { static_cast<void>(Destroy(d)); }
};
template <typename T, cudnnStatus_t (*Destroy)(T)>
using CudnnPtr = std::unique_ptr<std::remove_pointer_t<T>, CudnnDeleter<T, Destroy>>;

using TensorDesc = CudnnPtr<cudnnTensorDescriptor_t, cudnnDestroyTensorDescriptor>;
using FilterDesc = CudnnPtr<cudnnFilterDescriptor_t, cudnnDestroyFilterDescriptor>;
using ConvDesc = CudnnPtr<cudnnConvolutionDescriptor_t, cudnnDestroyConvolutionDescriptor>;
using PoolDesc = CudnnPtr<cudnnPoolingDescriptor_t, cudnnDestroyPoolingDescriptor>;
using ActivationDesc = CudnnPtr<cudnnActivationDescriptor_t, cudnnDestroyActivationDescriptor>;

// A packed fp32 NCHW tensor descriptor.
absl::Status MakeTensor(TensorDesc& out, int n, int c, int h, int w) {
  cudnnTensorDescriptor_t d = nullptr;
  PSFLOW_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
  out.reset(d);
  PSFLOW_CUDNN_CHECK(
      cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, w));
  return absl::OkStatus();
}

absl::Status MakeFilter(FilterDesc& out, int k, int c, int h, int w) {
  cudnnFilterDescriptor_t d = nullptr;
  PSFLOW_CUDNN_CHECK(cudnnCreateFilterDescriptor(&d));
  out.reset(d);
  PSFLOW_CUDNN_CHECK(
      cudnnSetFilter4dDescriptor(d, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, k, c, h, w));
  return absl::OkStatus();
}

// Cross-correlation (what deep-learning frameworks call convolution), fp32
// accumulation, dilation 1, CUDNN_DEFAULT_MATH (TF32 allowed).
absl::Status MakeConv(ConvDesc& out, int padding, int stride) {
  cudnnConvolutionDescriptor_t d = nullptr;
  PSFLOW_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d));
  out.reset(d);
  PSFLOW_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d, padding, padding, stride, stride, 1, 1,
                                                     CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  PSFLOW_CUDNN_CHECK(cudnnSetConvolutionMathType(d, CUDNN_DEFAULT_MATH));
  return absl::OkStatus();
}

// cuDNN's legacy descriptors (and our kernels' row indices) take int sizes.
bool FitsInt(int64_t n) { return n > 0 && n <= std::numeric_limits<int>::max(); }

// INVALID_ARGUMENT "<what>: <tensor> has <count> elements; ..." for the first
// tensor with too many (or no) elements.
absl::Status CheckElementCount(
    absl::string_view what, std::initializer_list<std::pair<absl::string_view, int64_t>> tensors) {
  for (const auto& [name, count] : tensors) {
    if (!FitsInt(count)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", name, " has ", count, " elements; the CUDA backend takes at most 2^31-1"));
    }
  }
  return absl::OkStatus();
}

// The first (fastest) result of a cudnnFind*Algorithm call that succeeded.
template <typename Perf>
const Perf* Fastest(const Perf* perf, int count) {
  for (int i = 0; i < count; ++i) {
    if (perf[i].status == CUDNN_STATUS_SUCCESS) return &perf[i];
  }
  return nullptr;
}

// ---------------------------------------------------------------- Conv2D

// PSFLOW_CUDA_VERBOSE=1 in the environment: each convolution prints the
// algorithms cuDNN's Find chose (a diagnostic for performance work).
bool Verbose() {
  static const bool verbose = [] {
    const char* v = std::getenv("PSFLOW_CUDA_VERBOSE");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return verbose;
}

template <typename Perf>
void LogChoice(const std::string& what, const char* direction, const Perf* perf, int count) {
  if (!Verbose()) return;
  std::string line = absl::StrCat(what, " ", direction, ":");
  for (int i = 0; i < count && i < 3; ++i) {
    if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
    absl::StrAppendFormat(&line, " algo %d%s %.3f ms %zu B;", static_cast<int>(perf[i].algo),
                          perf[i].mathType == CUDNN_TENSOR_OP_MATH ? " tensor-op" : "",
                          perf[i].time, perf[i].memory);
  }
  std::fprintf(stderr, "%s\n", line.c_str());
}

// One direction's cuDNN Find: runs find(kCount, &count, perf) (a
// cudnnFind*Algorithm call), takes the fastest algorithm that succeeded into
// `algo`, gives `conv` its math type, and raises `workspace` to what the
// algorithm needs (workspace_size(algo, &bytes), a cudnnGet*WorkspaceSize call,
// or the memory Find reported, whichever is larger). direction: "forward",
// "backward-data" or "backward-filter", for the error and LogChoice.
template <typename Perf, int kCount, typename Find, typename WorkspaceSize>
absl::Status FindConvAlgorithm(const std::string& what, const char* direction,
                               cudnnConvolutionDescriptor_t conv, Find&& find,
                               WorkspaceSize&& workspace_size, decltype(Perf::algo)& algo,
                               size_t& workspace) {
  Perf perf[kCount];
  int count = 0;
  PSFLOW_RETURN_IF_ERROR(find(kCount, &count, perf));
  const Perf* best = Fastest(perf, count);
  if (best == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN has no ", direction, " algorithm"));
  }
  LogChoice(what, direction, perf, count);
  algo = best->algo;
  PSFLOW_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, best->mathType));
  size_t bytes = 0;
  PSFLOW_RETURN_IF_ERROR(workspace_size(algo, &bytes));
  workspace = std::max({workspace, bytes, best->memory});
  return absl::OkStatus();
}

// After CheckShape (what: its description): cuDNN's int32 element counts.
absl::Status CheckCounts(const Conv2DShape& s, absl::string_view what) {
  const int64_t n = s.batch;
  return CheckElementCount(
      what, {{"x", n * s.in_channels * s.height * s.width},
             {"w", int64_t{s.out_channels} * s.in_channels * s.kernel_h * s.kernel_w},
             {"y", n * s.out_channels * s.out_height() * s.out_width()}});
}

class CudnnConv2D final : public Conv2D {
 public:
  CudnnConv2D(std::shared_ptr<CudaContext> ctx, absl::string_view what, const Conv2DShape& s)
      : ctx_(std::move(ctx)), shape_(s), what_(what) {}

  // Inside a Scope: descriptors, algorithms (cuDNN's Find runs each candidate
  // on the stream) and the workspace.
  absl::Status Init() {
    const Conv2DShape& s = shape_;
    PSFLOW_RETURN_IF_ERROR(MakeTensor(x_desc_, s.batch, s.in_channels, s.height, s.width));
    PSFLOW_RETURN_IF_ERROR(
        MakeTensor(y_desc_, s.batch, s.out_channels, s.out_height(), s.out_width()));
    PSFLOW_RETURN_IF_ERROR(MakeTensor(b_desc_, 1, s.out_channels, 1, 1));
    PSFLOW_RETURN_IF_ERROR(
        MakeFilter(w_desc_, s.out_channels, s.in_channels, s.kernel_h, s.kernel_w));
    // One convolution descriptor per direction: each takes the math type of
    // the algorithm found for it.
    PSFLOW_RETURN_IF_ERROR(MakeConv(fwd_conv_, s.padding, s.stride));
    PSFLOW_RETURN_IF_ERROR(MakeConv(data_conv_, s.padding, s.stride));
    PSFLOW_RETURN_IF_ERROR(MakeConv(filter_conv_, s.padding, s.stride));

    int n = 0, c = 0, h = 0, w = 0;
    PSFLOW_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(fwd_conv_.get(), x_desc_.get(),
                                                             w_desc_.get(), &n, &c, &h, &w));
    if (n != s.batch || c != s.out_channels || h != s.out_height() || w != s.out_width()) {
      return absl::InternalError(
          absl::StrFormat("cuDNN computes an output of %dx%dx%dx%d, not %dx%dx%dx%d", n, c, h, w,
                          s.batch, s.out_channels, s.out_height(), s.out_width()));
    }

    cudnnHandle_t handle = ctx_->cudnn;
    size_t workspace = 0;
    PSFLOW_RETURN_IF_ERROR(
        (FindConvAlgorithm<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
            what_, "forward", fwd_conv_.get(),
            [&](int requested, int* count, cudnnConvolutionFwdAlgoPerf_t* perf) -> absl::Status {
              PSFLOW_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithm(
                  handle, x_desc_.get(), w_desc_.get(), fwd_conv_.get(), y_desc_.get(), requested,
                  count, perf));
              return absl::OkStatus();
            },
            [&](cudnnConvolutionFwdAlgo_t algo, size_t* bytes) -> absl::Status {
              PSFLOW_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(
                  handle, x_desc_.get(), w_desc_.get(), fwd_conv_.get(), y_desc_.get(), algo,
                  bytes));
              return absl::OkStatus();
            },
            fwd_algo_, workspace)));
    // A forward-only op searches no backward algorithm: their workspaces,
    // often the largest, are never allocated.
    if (!s.forward_only) {
      PSFLOW_RETURN_IF_ERROR((FindConvAlgorithm<cudnnConvolutionBwdDataAlgoPerf_t,
                                                CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT>(
          what_, "backward-data", data_conv_.get(),
          [&](int requested, int* count, cudnnConvolutionBwdDataAlgoPerf_t* perf) -> absl::Status {
            PSFLOW_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithm(
                handle, w_desc_.get(), y_desc_.get(), data_conv_.get(), x_desc_.get(), requested,
                count, perf));
            return absl::OkStatus();
          },
          [&](cudnnConvolutionBwdDataAlgo_t algo, size_t* bytes) -> absl::Status {
            PSFLOW_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(
                handle, w_desc_.get(), y_desc_.get(), data_conv_.get(), x_desc_.get(), algo,
                bytes));
            return absl::OkStatus();
          },
          data_algo_, workspace)));
      PSFLOW_RETURN_IF_ERROR((FindConvAlgorithm<cudnnConvolutionBwdFilterAlgoPerf_t,
                                                CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
          what_, "backward-filter", filter_conv_.get(),
          [&](int requested, int* count,
              cudnnConvolutionBwdFilterAlgoPerf_t* perf) -> absl::Status {
            PSFLOW_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithm(
                handle, x_desc_.get(), y_desc_.get(), filter_conv_.get(), w_desc_.get(), requested,
                count, perf));
            return absl::OkStatus();
          },
          [&](cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) -> absl::Status {
            PSFLOW_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(
                handle, x_desc_.get(), y_desc_.get(), filter_conv_.get(), w_desc_.get(), algo,
                bytes));
            return absl::OkStatus();
          },
          filter_algo_, workspace)));
      PSFLOW_RETURN_IF_ERROR(AllocateDevice(
          ctx_, cuda_internal::ChannelPartialFloats(s.batch, s.out_channels) * sizeof(float), false,
          bias_partial_));
    }
    // One workspace for the three directions (the forward only, for a
    // forward-only op): they run one after another on the stream.
    workspace_bytes_ = workspace;
    if (workspace > 0) {
      PSFLOW_RETURN_IF_ERROR(AllocateDevice(ctx_, workspace, false, workspace_));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(const float* x, const float* w, const float* b, float* y) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"w", w}, {"y", y}}));
      PSFLOW_CUDNN_CHECK(cudnnConvolutionForward(
          ctx_->cudnn, &kOne, x_desc_.get(), x, w_desc_.get(), w, fwd_conv_.get(), fwd_algo_,
          workspace_.get(), workspace_bytes_, &kZero, y_desc_.get(), y));
      if (b != nullptr) {  // y += b, broadcast over N, H, W
        PSFLOW_CUDNN_CHECK(
            cudnnAddTensor(ctx_->cudnn, &kOne, b_desc_.get(), b, &kOne, y_desc_.get(), y));
      }
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                        float* db) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      if (shape_.forward_only) return absl::FailedPreconditionError("the op is forward-only");
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"w", w}, {"dy", dy}, {"dw", dw}}));
      if (db != nullptr) {  // own reduction: cuDNN's is slow for large N*H*W
        PSFLOW_CUDA_CHECK(cuda_internal::LaunchChannelSum(
            dy, db, Floats(bias_partial_), shape_.batch, shape_.out_channels,
            int64_t{shape_.out_height()} * shape_.out_width(), ctx_->stream));
      }
      PSFLOW_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
          ctx_->cudnn, &kOne, x_desc_.get(), x, y_desc_.get(), dy, filter_conv_.get(), filter_algo_,
          workspace_.get(), workspace_bytes_, &kZero, w_desc_.get(), dw));
      if (dx != nullptr) {  // null for a first layer: nothing consumes dx
        PSFLOW_CUDNN_CHECK(cudnnConvolutionBackwardData(
            ctx_->cudnn, &kOne, w_desc_.get(), w, y_desc_.get(), dy, data_conv_.get(), data_algo_,
            workspace_.get(), workspace_bytes_, &kZero, x_desc_.get(), dx));
      }
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const Conv2DShape shape_;
  const std::string what_;
  TensorDesc x_desc_, y_desc_, b_desc_;
  FilterDesc w_desc_;
  ConvDesc fwd_conv_, data_conv_, filter_conv_;
  cudnnConvolutionFwdAlgo_t fwd_algo_{};
  cudnnConvolutionBwdDataAlgo_t data_algo_{};
  cudnnConvolutionBwdFilterAlgo_t filter_algo_{};
  DevicePtr workspace_;
  size_t workspace_bytes_ = 0;
  DevicePtr bias_partial_;  // partial sums of the bias gradient
};

// ---------------------------------------------------------------- MaxPool2D

// After CheckShape (what: its description).
absl::Status CheckCounts(const Pool2DShape& s, absl::string_view what) {
  return CheckElementCount(what, {{"x", int64_t{s.batch} * s.channels * s.height * s.width}});
}

class CudnnMaxPool2D final : public MaxPool2D {
 public:
  CudnnMaxPool2D(std::shared_ptr<CudaContext> ctx, absl::string_view what, const Pool2DShape& s)
      : ctx_(std::move(ctx)), shape_(s), what_(what) {}

  absl::Status Init() {
    const Pool2DShape& s = shape_;
    PSFLOW_RETURN_IF_ERROR(MakeTensor(x_desc_, s.batch, s.channels, s.height, s.width));
    PSFLOW_RETURN_IF_ERROR(MakeTensor(y_desc_, s.batch, s.channels, s.out_height(), s.out_width()));
    cudnnPoolingDescriptor_t d = nullptr;
    PSFLOW_CUDNN_CHECK(cudnnCreatePoolingDescriptor(&d));
    pool_desc_.reset(d);
    // Deterministic max pooling (the gradient goes to one position per
    // window); no padding.
    PSFLOW_CUDNN_CHECK(cudnnSetPooling2dDescriptor(d, CUDNN_POOLING_MAX_DETERMINISTIC,
                                                   CUDNN_PROPAGATE_NAN, s.window, s.window, 0, 0,
                                                   s.stride, s.stride));
    int n = 0, c = 0, h = 0, w = 0;
    PSFLOW_CUDNN_CHECK(cudnnGetPooling2dForwardOutputDim(d, x_desc_.get(), &n, &c, &h, &w));
    if (n != s.batch || c != s.channels || h != s.out_height() || w != s.out_width()) {
      return absl::InternalError(
          absl::StrFormat("cuDNN computes an output of %dx%dx%dx%d", n, c, h, w));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(const float* x, float* y) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"y", y}}));
      last_x_ = last_y_ = nullptr;
      PSFLOW_CUDNN_CHECK(cudnnPoolingForward(ctx_->cudnn, pool_desc_.get(), &kOne, x_desc_.get(), x,
                                             &kZero, y_desc_.get(), y));
      last_x_ = x;
      last_y_ = y;
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* dy, float* dx) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      if (shape_.forward_only) return absl::FailedPreconditionError("the op is forward-only");
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"dy", dy}, {"dx", dx}}));
      if (last_x_ == nullptr) {
        return absl::FailedPreconditionError("no successful Forward before it");
      }
      // cuDNN finds each window's maximum again from the forward's x and y.
      PSFLOW_CUDNN_CHECK(cudnnPoolingBackward(ctx_->cudnn, pool_desc_.get(), &kOne, y_desc_.get(),
                                              last_y_, y_desc_.get(), dy, x_desc_.get(), last_x_,
                                              &kZero, x_desc_.get(), dx));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const Pool2DShape shape_;
  const std::string what_;
  TensorDesc x_desc_, y_desc_;
  PoolDesc pool_desc_;
  const float* last_x_ = nullptr;  // of the latest successful Forward
  const float* last_y_ = nullptr;
};

// ---------------------------------------------------------------- Relu

class CudnnRelu final : public Relu {
 public:
  CudnnRelu(std::shared_ptr<CudaContext> ctx, absl::string_view what, int64_t size)
      : ctx_(std::move(ctx)), size_(size), what_(what) {}

  absl::Status Init() {
    // Elementwise, so any packed shape of `size` elements will do.
    PSFLOW_RETURN_IF_ERROR(MakeTensor(desc_, static_cast<int>(size_), 1, 1, 1));
    cudnnActivationDescriptor_t d = nullptr;
    PSFLOW_CUDNN_CHECK(cudnnCreateActivationDescriptor(&d));
    act_desc_.reset(d);
    PSFLOW_CUDNN_CHECK(
        cudnnSetActivationDescriptor(d, CUDNN_ACTIVATION_RELU, CUDNN_PROPAGATE_NAN, 0.0));
    return absl::OkStatus();
  }

  absl::Status Forward(const float* x, float* y) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"y", y}}));
      PSFLOW_CUDNN_CHECK(cudnnActivationForward(ctx_->cudnn, act_desc_.get(), &kOne, desc_.get(), x,
                                                &kZero, desc_.get(), y));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* x, const float* dy, float* dx) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"dy", dy}, {"dx", dx}}));
      // cuDNN wants the forward output y; relu(x) > 0 exactly where x > 0,
      // so x serves as y.
      PSFLOW_CUDNN_CHECK(cudnnActivationBackward(ctx_->cudnn, act_desc_.get(), &kOne, desc_.get(),
                                                 x, desc_.get(), dy, desc_.get(), x, &kZero,
                                                 desc_.get(), dx));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const int64_t size_;
  const std::string what_;
  TensorDesc desc_;
  ActivationDesc act_desc_;
};

// ---------------------------------------------------------------- Dense

// cuBLAS is column-major; a row-major [R,C] matrix is the same memory as a
// column-major [C,R] one (its transpose) with leading dimension C. So, with
// x: [N,in], w: [out,in], y, dy: [N,out] row-major:
//   y[N,out]  = x·wᵀ   <=> yᵀ[out,N] = (wᵀ)ᵀ·xᵀ  : gemm(T, N, m=out, n=N, k=in,
//                                                    A=w (lda=in), B=x (ldb=in), C=y (ldc=out))
//   dw[out,in] = dyᵀ·x  <=> dwᵀ[in,out] = xᵀ·dy   : gemm(N, T, m=in, n=out, k=N,
//                                                    A=x (lda=in), B=dy (ldb=out), C=dw (ldc=in))
//   dx[N,in]  = dy·w    <=> dxᵀ[in,N] = wᵀ·dyᵀ   : gemm(N, N, m=in, n=N, k=out,
//                                                    A=w (lda=in), B=dy (ldb=out), C=dx (ldc=in))
//   db[out]   = Σ_n dy[n,:] = dyᵀ[out,N]·1[N]    : gemv(N, m=out, n=N, A=dy (lda=out), x=ones)
// The bias is added to y by a kernel after the GEMM.
class CublasDense final : public Dense {
 public:
  CublasDense(std::shared_ptr<CudaContext> ctx, absl::string_view what, const DenseShape& s)
      : ctx_(std::move(ctx)), shape_(s), what_(what) {}

  absl::Status Init() {
    PSFLOW_RETURN_IF_ERROR(
        AllocateDevice(ctx_, static_cast<size_t>(shape_.batch) * sizeof(float), false, ones_));
    const std::vector<float> ones(shape_.batch, 1.0f);
    PSFLOW_CUDA_CHECK(cudaMemcpyAsync(ones_.get(), ones.data(), ones.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, ctx_->stream));
    PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));  // before `ones` goes away
    return absl::OkStatus();
  }

  absl::Status Forward(const float* x, const float* w, const float* b, float* y) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"w", w}, {"b", b}, {"y", y}}));
      const int n = shape_.batch, in = shape_.in_features, out = shape_.out_features;
      PSFLOW_CUBLAS_CHECK(cublasSgemm(ctx_->cublas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &kOne, w,
                                      in, x, in, &kZero, y, out));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchAddRowBias(y, b, n, out, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                        float* db) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      if (shape_.forward_only) return absl::FailedPreconditionError("the op is forward-only");
      PSFLOW_RETURN_IF_ERROR(
          CheckNonNull({{"x", x}, {"w", w}, {"dy", dy}, {"dw", dw}, {"db", db}}));
      const int n = shape_.batch, in = shape_.in_features, out = shape_.out_features;
      PSFLOW_CUBLAS_CHECK(cublasSgemm(ctx_->cublas, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, &kOne, x,
                                      in, dy, out, &kZero, dw, in));
      PSFLOW_CUBLAS_CHECK(cublasSgemv(ctx_->cublas, CUBLAS_OP_N, out, n, &kOne, dy, out,
                                      Floats(ones_), 1, &kZero, db, 1));
      if (dx != nullptr) {
        PSFLOW_CUBLAS_CHECK(cublasSgemm(ctx_->cublas, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, &kOne,
                                        w, in, dy, out, &kZero, dx, in));
      }
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const DenseShape shape_;
  const std::string what_;
  DevicePtr ones_;  // [N] of 1.0f, for db
};

// ---------------------------------------------------------------- BatchNorm

// Own kernels (cuda_kernels.h): per-channel partial sums over slices of the
// batch, then one elementwise pass. cuDNN's legacy NCHW batch norm took
// several times longer on the H100 for the large activations of a resnet.
// Inference (given statistics) is the same elementwise pass after one small
// kernel for the per-channel scale and shift: no reduction at all.
class CudaBatchNorm final : public BatchNorm {
 public:
  CudaBatchNorm(std::shared_ptr<CudaContext> ctx, absl::string_view what, const BatchNormShape& s)
      : ctx_(std::move(ctx)), shape_(s), what_(what) {}

  absl::Status Init() {
    const int64_t c = shape_.channels;
    partial_floats_ = cuda_internal::ChannelPartialFloats(shape_.batch, c);
    // saved: [mean | inv_std]; scratch: partial sums, then 3 floats of
    // coefficients per channel.
    PSFLOW_RETURN_IF_ERROR(AllocateDevice(ctx_, 2 * c * sizeof(float), true, saved_));
    return AllocateDevice(ctx_, (partial_floats_ + 3 * c) * sizeof(float), false, scratch_);
  }

  absl::Status Forward(const float* x, const float* gamma, const float* beta, float* y,
                       float* batch_mean, float* batch_var) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      if (shape_.forward_only) return absl::FailedPreconditionError("the op is forward-only");
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"gamma", gamma}, {"beta", beta}, {"y", y}}));
      has_forward_ = false;
      float* scratch = Floats(scratch_);
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchBatchNormForward(
          x, gamma, beta, y, Floats(saved_), scratch + partial_floats_, scratch, batch_mean,
          batch_var, shape_.batch, shape_.channels, int64_t{shape_.height} * shape_.width,
          shape_.epsilon, ctx_->stream));
      has_forward_ = true;
      return absl::OkStatus();
    });
  }

  absl::Status Infer(const float* x, const float* gamma, const float* beta, const float* mean,
                     const float* var, float* y) override {
    return RunIn(*ctx_, what_, "inference", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull(
          {{"x", x}, {"gamma", gamma}, {"beta", beta}, {"mean", mean}, {"var", var}, {"y", y}}));
      // The coefficients go where Backward computes its own: saved_ stays
      // the latest Forward's.
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchBatchNormInference(
          x, gamma, beta, mean, var, y, Floats(scratch_) + partial_floats_, shape_.batch,
          shape_.channels, int64_t{shape_.height} * shape_.width, shape_.epsilon, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* x, const float* gamma, const float* dy, float* dx,
                        float* dgamma, float* dbeta) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      if (shape_.forward_only) return absl::FailedPreconditionError("the op is forward-only");
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x},
                                           {"gamma", gamma},
                                           {"dy", dy},
                                           {"dx", dx},
                                           {"dgamma", dgamma},
                                           {"dbeta", dbeta}}));
      if (!has_forward_) return absl::FailedPreconditionError("no successful Forward before it");
      float* scratch = Floats(scratch_);
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchBatchNormBackward(
          x, gamma, dy, dx, dgamma, dbeta, Floats(saved_), scratch + partial_floats_, scratch,
          shape_.batch, shape_.channels, int64_t{shape_.height} * shape_.width, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const BatchNormShape shape_;
  const std::string what_;
  int64_t partial_floats_ = 0;
  DevicePtr saved_, scratch_;
  bool has_forward_ = false;
};

// ---------------------------------------------------------------- GlobalAvgPool

class CudaGlobalAvgPool final : public GlobalAvgPool {
 public:
  CudaGlobalAvgPool(std::shared_ptr<CudaContext> ctx, absl::string_view what,
                    const GlobalAvgPoolShape& s)
      : ctx_(std::move(ctx)),
        rows_(int64_t{s.batch} * s.channels),
        hw_(int64_t{s.height} * s.width),
        what_(what) {}

  absl::Status Init() { return absl::OkStatus(); }  // nothing to prepare

  absl::Status Forward(const float* x, float* y) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"y", y}}));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchGlobalAvgPoolForward(x, y, rows_, hw_, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* dy, float* dx) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"dy", dy}, {"dx", dx}}));
      PSFLOW_CUDA_CHECK(
          cuda_internal::LaunchGlobalAvgPoolBackward(dy, dx, rows_, hw_, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const int64_t rows_, hw_;
  const std::string what_;
};

// ---------------------------------------------------------------- SoftmaxCrossEntropy

class CudaSoftmaxCrossEntropy final : public SoftmaxCrossEntropy {
 public:
  CudaSoftmaxCrossEntropy(std::shared_ptr<CudaContext> ctx, absl::string_view what, int batch,
                          int classes)
      : ctx_(std::move(ctx)), batch_(batch), classes_(classes), what_(what) {}

  absl::Status Init() {
    // Per-example loss and correct flag, reduced by a second kernel.
    return AllocateDevice(ctx_, 2 * static_cast<size_t>(batch_) * sizeof(float), false, scratch_);
  }

  absl::Status Forward(const float* logits, const int32_t* labels, float* probs,
                       float* stats) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull(
          {{"logits", logits}, {"labels", labels}, {"probs", probs}, {"stats", stats}}));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchSoftmaxCrossEntropyForward(
          logits, labels, probs, Floats(scratch_), stats, batch_, classes_, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* probs, const int32_t* labels, float* dlogits) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(
          CheckNonNull({{"probs", probs}, {"labels", labels}, {"dlogits", dlogits}}));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchSoftmaxCrossEntropyBackward(
          probs, labels, dlogits, batch_, classes_, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const int batch_, classes_;
  const std::string what_;
  DevicePtr scratch_;
};

// ---------------------------------------------------------------- Graph

struct GraphDeleter {
  void operator()(cudaGraph_t g) const { static_cast<void>(cudaGraphDestroy(g)); }
};
using GraphPtr = std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, GraphDeleter>;

class CudaGraph final : public Graph {
 public:
  CudaGraph(std::shared_ptr<CudaContext> ctx, GraphPtr graph, cudaGraphExec_t exec)
      : ctx_(std::move(ctx)), graph_(std::move(graph)), exec_(exec) {}

  ~CudaGraph() override {
    // A replay still in flight finishes first (CUDA frees the executable
    // graph asynchronously).
    Scope scope(*ctx_);
    if (scope.status().ok()) static_cast<void>(cudaGraphExecDestroy(exec_));
    graph_.reset();
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  absl::Status Launch() override {
    return RunIn(*ctx_, "Graph", "launch", [&]() -> absl::Status {
      PSFLOW_CUDA_CHECK(cudaGraphLaunch(exec_, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  GraphPtr graph_;
  cudaGraphExec_t exec_;
};

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

absl::Status CheckCount(int64_t n, absl::string_view what) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative count ", n));
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------- CudaBackend

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device_ordinal) {
  const std::string name = absl::StrCat("cuda:", device_ordinal);
  if (device_ordinal < 0) {
    return absl::InvalidArgumentError(name + ": the GPU index must not be negative");
  }
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cuda_internal::ClearLastError();
    return absl::UnavailableError(absl::StrCat(name, ": no usable CUDA device (",
                                               cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                                               ")"));
  }
  if (device_ordinal >= count) {
    return absl::UnavailableError(
        absl::StrCat(name, ": this machine has ", count, " CUDA device", count == 1 ? "" : "s"));
  }

  auto ctx = std::make_shared<CudaContext>(device_ordinal);
  absl::Status status = [&]() -> absl::Status {
    Scope scope(*ctx);
    PSFLOW_RETURN_IF_ERROR(scope.status());
    PSFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
    PSFLOW_CUDNN_CHECK(cudnnCreate(&ctx->cudnn));
    PSFLOW_CUDNN_CHECK(cudnnSetStream(ctx->cudnn, ctx->stream));
    PSFLOW_CUBLAS_CHECK(cublasCreate(&ctx->cublas));
    PSFLOW_CUBLAS_CHECK(cublasSetStream(ctx->cublas, ctx->stream));
    PSFLOW_CUDA_CHECK(cudaMalloc(&ctx->cublas_workspace, cuda_internal::kCublasWorkspaceBytes));
    PSFLOW_CUBLAS_CHECK(cublasSetWorkspace(ctx->cublas, ctx->cublas_workspace,
                                           cuda_internal::kCublasWorkspaceBytes));
    // CUBLAS_DEFAULT_MATH: fp32 GEMMs keep full fp32 precision (no TF32
    // tensor cores). alpha and beta are read from the host.
    PSFLOW_CUBLAS_CHECK(cublasSetMathMode(ctx->cublas, CUBLAS_DEFAULT_MATH));
    PSFLOW_CUBLAS_CHECK(cublasSetPointerMode(ctx->cublas, CUBLAS_POINTER_MODE_HOST));
    return absl::OkStatus();
  }();
  PSFLOW_RETURN_IF_ERROR(Annotate(status, name));
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(ctx)));
}

CudaBackend::CudaBackend(std::shared_ptr<CudaContext> ctx) : ctx_(std::move(ctx)) {}
CudaBackend::~CudaBackend() = default;

std::string CudaBackend::name() const { return absl::StrCat("cuda:", ctx_->device); }

absl::StatusOr<std::unique_ptr<Buffer>> CudaBackend::Allocate(size_t floats) {
  if (floats > std::numeric_limits<size_t>::max() / sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("Allocate: ", floats, " floats is too many"));
  }
  DevicePtr memory;
  PSFLOW_RETURN_IF_ERROR(RunIn(*ctx_, "Allocate", floats, "floats", [&] {
    return AllocateDevice(ctx_, floats * sizeof(float), true, memory);
  }));
  return std::make_unique<CudaBuffer>(std::move(memory), floats);
}

namespace {

// Page-locked host memory.
class PinnedBuffer final : public Buffer {
 public:
  PinnedBuffer(float* data, size_t size) : data_(data), size_(size) {}
  ~PinnedBuffer() override { static_cast<void>(cudaFreeHost(data_)); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  float* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  float* const data_;
  const size_t size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Buffer>> CudaBackend::AllocateHost(size_t floats) {
  if (floats > std::numeric_limits<size_t>::max() / sizeof(float)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllocateHost: ", floats, " floats is too many"));
  }
  void* memory = nullptr;
  const size_t bytes = std::max<size_t>(floats, 1) * sizeof(float);
  PSFLOW_RETURN_IF_ERROR(RunIn(*ctx_, "AllocateHost", floats, "floats", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaHostAlloc(&memory, bytes, cudaHostAllocPortable));
    return absl::OkStatus();
  }));
  std::memset(memory, 0, bytes);
  return std::make_unique<PinnedBuffer>(static_cast<float*>(memory), floats);
}

absl::Status CudaBackend::CopyToDevice(const float* host, size_t floats, float* device) {
  if (floats == 0) return absl::OkStatus();
  return RunIn(*ctx_, "CopyToDevice", floats, "floats", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"host", host}, {"device", device}}));
    // From pageable memory the driver stages the data before returning; from
    // page-locked memory the copy is queued like any other work.
    PSFLOW_CUDA_CHECK(cudaMemcpyAsync(device, host, floats * sizeof(float), cudaMemcpyHostToDevice,
                                      ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CopyToHost(const float* device, size_t floats, float* host) {
  if (floats == 0) return absl::OkStatus();
  return RunIn(*ctx_, "CopyToHost", floats, "floats", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"device", device}, {"host", host}}));
    PSFLOW_CUDA_CHECK(cudaMemcpyAsync(host, device, floats * sizeof(float), cudaMemcpyDeviceToHost,
                                      ctx_->stream));
    PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CopyToHostAfter(Event* ready, const std::vector<HostCopy>& copies) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(ready);
  if (cuda_event == nullptr) {
    return absl::InvalidArgumentError("CopyToHostAfter: not a CUDA event");
  }
  for (const HostCopy& c : copies) {
    if (c.floats > 0)
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"device", c.device}, {"host", c.host}}));
  }
  return RunIn(*ctx_, "CopyToHostAfter", "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(cuda_internal::EnsureStream(&ctx_->copy_stream));
    PSFLOW_CUDA_CHECK(
        cudaStreamWaitEvent(ctx_->copy_stream, static_cast<cudaEvent_t>(cuda_event->raw()), 0));
    for (const HostCopy& c : copies) {
      if (c.floats == 0) continue;
      PSFLOW_CUDA_CHECK(cudaMemcpyAsync(c.host, c.device, c.floats * sizeof(float),
                                        cudaMemcpyDeviceToHost, ctx_->copy_stream));
    }
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::WaitCopies() {
  return RunIn(*ctx_, "WaitCopies", "", [&]() -> absl::Status {
    if (ctx_->copy_stream != nullptr) PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->copy_stream));
    return absl::OkStatus();
  });
}

namespace {

// Records `done` on the side stream `*stream` of `ctx` (made at its first
// use): RecordCopiesDone, RecordUploadsDone.
absl::Status RecordOnSideStream(CudaContext& ctx, cudaStream_t* stream, Event* done,
                                absl::string_view what) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(done);
  if (cuda_event == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a CUDA event"));
  }
  return RunIn(ctx, what, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(cuda_internal::EnsureStream(stream));
    PSFLOW_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(cuda_event->raw()), *stream));
    return absl::OkStatus();
  });
}

}  // namespace

absl::Status CudaBackend::RecordCopiesDone(Event* done) {
  return RecordOnSideStream(*ctx_, &ctx_->copy_stream, done, "RecordCopiesDone");
}

absl::Status CudaBackend::WaitEvent(Event* event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(event);
  if (cuda_event == nullptr) return absl::InvalidArgumentError("WaitEvent: not a CUDA event");
  // Without the context's lock (another thread may hold it while it waits
  // for the stream): only this thread's current device is set, and then
  // restored.
  int current = -1;
  absl::Status status = [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaGetDevice(&current));
    if (current != ctx_->device) PSFLOW_CUDA_CHECK(cudaSetDevice(ctx_->device));
    PSFLOW_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(cuda_event->raw())));
    return absl::OkStatus();
  }();
  if (current >= 0 && current != ctx_->device) static_cast<void>(cudaSetDevice(current));
  return Annotate(status, "WaitEvent");
}

namespace {

// The CUDA event an upload waits for: null for none; INVALID_ARGUMENT
// (naming `what`) for an event of another backend.
absl::StatusOr<CudaEvent*> UploadEvent(Event* after, absl::string_view what) {
  if (after == nullptr) return nullptr;
  auto* cuda_event = dynamic_cast<CudaEvent*>(after);
  if (cuda_event == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a CUDA event"));
  }
  return cuda_event;
}

// Makes the context's stream of uploads wait for `after` (if any), making
// the stream at its first use. Call inside RunIn.
absl::Status UploadStreamWaitsFor(CudaContext& ctx, CudaEvent* after) {
  PSFLOW_RETURN_IF_ERROR(cuda_internal::EnsureStream(&ctx.upload_stream));
  if (after != nullptr) {
    PSFLOW_CUDA_CHECK(
        cudaStreamWaitEvent(ctx.upload_stream, static_cast<cudaEvent_t>(after->raw()), 0));
  }
  return absl::OkStatus();
}

// Makes the context's buffer of uploads hold at least `bytes` (once its
// stream is past every queued kernel that reads the old one). Call inside
// RunIn, with the stream of uploads made.
absl::Status GrowUploadBuffer(CudaContext& ctx, size_t bytes) {
  if (ctx.upload_buffer_bytes >= bytes) return absl::OkStatus();
  PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx.upload_stream));
  if (ctx.upload_buffer != nullptr) PSFLOW_CUDA_CHECK(cudaFree(ctx.upload_buffer));
  ctx.upload_buffer = nullptr;
  ctx.upload_buffer_bytes = 0;
  PSFLOW_CUDA_CHECK(cudaMalloc(&ctx.upload_buffer, bytes));
  ctx.upload_buffer_bytes = bytes;
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaBackend::JoinUploads() {
  return RunIn(*ctx_, "JoinUploads", "", [&]() -> absl::Status {
    if (!ctx_->uploads_pending) return absl::OkStatus();
    if (ctx_->uploads_joined == nullptr) {
      PSFLOW_CUDA_CHECK(cudaEventCreateWithFlags(&ctx_->uploads_joined, cudaEventDisableTiming));
    }
    PSFLOW_CUDA_CHECK(cudaEventRecord(ctx_->uploads_joined, ctx_->upload_stream));
    PSFLOW_CUDA_CHECK(cudaStreamWaitEvent(ctx_->stream, ctx_->uploads_joined, 0));
    ctx_->uploads_pending = false;
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CopyToDeviceAfter(const std::vector<Upload>& uploads, HostValues values) {
  // Host ranges of one block at most this far apart (in ascending order, as
  // a pull lays its slices out in a region) cross in one copy, the gap with
  // them. (Never two blocks: the bytes between may not be mapped, and one
  // copy from two page-locked allocations is refused.)
  constexpr size_t kGapBytes = 4096;
  constexpr size_t kAlign = 256;
  const size_t value_bytes = values == HostValues::kFloat ? sizeof(float) : sizeof(uint16_t);
  std::vector<CudaEvent*> events;
  for (const Upload& u : uploads) {
    PSFLOW_ASSIGN_OR_RETURN(CudaEvent* const e, UploadEvent(u.after, "CopyToDeviceAfter"));
    if (e != nullptr && std::find(events.begin(), events.end(), e) == events.end()) {
      events.push_back(e);
    }
    if (u.elements > 0) {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"host", u.host}, {"device", u.device}}));
    }
  }
  // The copies: [begin, end) of host memory, holding `uploads` uploads
  // from upload `first` on; to byte `at` of the buffer, or (`direct`: one
  // upload of floats) straight to its place.
  struct Span {
    const char* begin;
    const char* end;
    size_t first;
    int uploads = 0;
    size_t at = 0;
    bool direct = false;
  };
  std::vector<Span> spans;
  std::vector<size_t> span_of(uploads.size(), 0);  // by non-empty upload
  for (size_t i = 0; i < uploads.size(); ++i) {
    const Upload& u = uploads[i];
    if (u.elements == 0) continue;
    const char* const begin = static_cast<const char*>(u.host);
    const char* const end = begin + u.elements * value_bytes;
    if (spans.empty() || u.block == nullptr || u.block != uploads[spans.back().first].block ||
        begin < spans.back().end || static_cast<size_t>(begin - spans.back().end) > kGapBytes) {
      spans.push_back({begin, end, i});
    } else {
      spans.back().end = end;
    }
    ++spans.back().uploads;
    span_of[i] = spans.size() - 1;
  }
  if (spans.empty()) return absl::OkStatus();
  size_t bytes = 0;
  for (Span& s : spans) {
    s.direct = values == HostValues::kFloat && s.uploads == 1;
    if (s.direct) continue;
    s.at = (bytes + kAlign - 1) / kAlign * kAlign;
    bytes = s.at + static_cast<size_t>(s.end - s.begin);
  }
  const cuda_internal::PieceValues piece_values =
      values == HostValues::kFloat      ? cuda_internal::PieceValues::kFloat
      : values == HostValues::kBfloat16 ? cuda_internal::PieceValues::kBfloat16
                                        : cuda_internal::PieceValues::kHalf;
  return RunIn(*ctx_, "CopyToDeviceAfter", uploads.size(), "copies", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(cuda_internal::EnsureStream(&ctx_->upload_stream));
    PSFLOW_RETURN_IF_ERROR(GrowUploadBuffer(*ctx_, bytes));
    char* const buffer = static_cast<char*>(ctx_->upload_buffer);
    // The copies into the buffer need no wait (they write no weight); the
    // direct copies and the placing do.
    for (const Span& s : spans) {
      if (s.direct) continue;
      PSFLOW_CUDA_CHECK(cudaMemcpyAsync(buffer + s.at, s.begin,
                                        static_cast<size_t>(s.end - s.begin),
                                        cudaMemcpyHostToDevice, ctx_->upload_stream));
    }
    for (CudaEvent* e : events) PSFLOW_RETURN_IF_ERROR(UploadStreamWaitsFor(*ctx_, e));
    for (const Span& s : spans) {
      if (!s.direct) continue;
      PSFLOW_CUDA_CHECK(cudaMemcpyAsync(uploads[s.first].device, s.begin,
                                        static_cast<size_t>(s.end - s.begin),
                                        cudaMemcpyHostToDevice, ctx_->upload_stream));
    }
    cuda_internal::UploadPieces pieces;
    int num = 0;
    int64_t max_count = 0;
    auto launch = [&]() -> absl::Status {
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchUploadPieces(pieces, num, max_count, piece_values,
                                                          ctx_->upload_stream));
      num = 0;
      max_count = 0;
      return absl::OkStatus();
    };
    for (size_t i = 0; i < uploads.size(); ++i) {
      if (uploads[i].elements == 0) continue;
      const Span& s = spans[span_of[i]];
      if (s.direct) continue;
      pieces.src[num] = buffer + s.at + (static_cast<const char*>(uploads[i].host) - s.begin);
      pieces.dst[num] = uploads[i].device;
      pieces.count[num] = static_cast<int64_t>(uploads[i].elements);
      max_count = std::max(max_count, pieces.count[num]);
      if (++num == cuda_internal::kMaxUploadPieces) PSFLOW_RETURN_IF_ERROR(launch());
    }
    if (num > 0) PSFLOW_RETURN_IF_ERROR(launch());
    ctx_->uploads_pending = true;
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::RecordUploadsDone(Event* done) {
  return RecordOnSideStream(*ctx_, &ctx_->upload_stream, done, "RecordUploadsDone");
}

namespace {

// Runs `f` with `device` current on this thread (the device it had before
// is current again after).
template <typename F>
auto OnDevice(int device, F f) {
  int current = -1;
  const bool switched = cudaGetDevice(&current) == cudaSuccess && current != device &&
                        cudaSetDevice(device) == cudaSuccess;
  auto result = f();
  if (switched) static_cast<void>(cudaSetDevice(current));
  return result;
}

}  // namespace

Backend::HostPinning CudaBackend::host_pinning() const {
  const int device = ctx_->device;
  HostPinning pinning;
  pinning.pin = [device](void* data, size_t bytes) {
    return OnDevice(device, [&] {
      const bool ok = cudaHostRegister(data, bytes, cudaHostRegisterPortable) == cudaSuccess;
      if (!ok) cuda_internal::ClearLastError();
      return ok;
    });
  };
  pinning.unpin = [device](void* data) {
    OnDevice(device, [&] {
      if (cudaHostUnregister(data) != cudaSuccess) cuda_internal::ClearLastError();
      return 0;
    });
  };
  return pinning;
}

absl::StatusOr<int> CudaBackend::DeviceCount() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cuda:all: this process sees no GPU (",
        e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none", ")"));
  }
  return count;
}

int CudaBackend::device_ordinal() const { return ctx_->device; }

absl::Status CudaBackend::RunOnStream(absl::string_view what,
                                      const std::function<absl::Status(void*)>& fn) {
  return RunIn(*ctx_, what, "", [&]() -> absl::Status { return fn(ctx_->stream); });
}

absl::Status CudaBackend::Synchronize() {
  return RunIn(*ctx_, "Synchronize", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    if (ctx_->upload_stream != nullptr)
      PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->upload_stream));
    return absl::OkStatus();
  });
}

absl::StatusOr<int64_t> CudaBackend::AvailableMemory() {
  size_t free_bytes = 0, total_bytes = 0;
  PSFLOW_RETURN_IF_ERROR(RunIn(*ctx_, "AvailableMemory", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return absl::OkStatus();
  }));
  return static_cast<int64_t>(free_bytes);
}

absl::Status CudaBackend::Add(const float* a, const float* b, float* y, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckCount(n, "Add"));
  if (n == 0) return absl::OkStatus();
  return RunIn(*ctx_, "Add", n, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"a", a}, {"b", b}, {"y", y}}));
    PSFLOW_CUDA_CHECK(cuda_internal::LaunchAdd(a, b, y, n, ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::Affine(const float* x, float scale, float shift, float* y, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckCount(n, "Affine"));
  if (n == 0) return absl::OkStatus();
  return RunIn(*ctx_, "Affine", n, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"y", y}}));
    PSFLOW_CUDA_CHECK(cuda_internal::LaunchAffine(x, scale, shift, y, n, ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::Sgd(float* w, const float* g, float learning_rate, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckCount(n, "Sgd"));
  if (n == 0) return absl::OkStatus();
  return RunIn(*ctx_, "Sgd", n, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"w", w}, {"g", g}}));
    PSFLOW_CUDA_CHECK(cuda_internal::LaunchSgd(w, g, learning_rate, n, ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::ApplyOptimizer(const OptimizerStep& step,
                                         const std::vector<OptimizerTensor>& tensors) {
  PSFLOW_RETURN_IF_ERROR(CheckOptimizerTensors(step, tensors));
  std::vector<cuda_internal::OptimizerArgs> args;
  args.reserve(tensors.size());
  for (const OptimizerTensor& t : tensors) {
    if (t.n == 0) continue;
    args.push_back(
        {t.w, t.g, step.slots() >= 1 ? t.s0 : nullptr, step.slots() >= 2 ? t.s1 : nullptr, t.n});
  }
  if (args.empty()) return absl::OkStatus();
  return RunIn(*ctx_, "ApplyOptimizer", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cuda_internal::LaunchApplyOptimizer(
        step, args.data(), static_cast<int>(args.size()), ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CountNonFinite(const std::vector<absl::Span<const float>>& xs,
                                         float* count) {
  PSFLOW_RETURN_IF_ERROR(CheckNonFiniteCount(xs, count));
  std::vector<const float*> x;
  std::vector<int64_t> n;
  for (absl::Span<const float> span : xs) {
    if (span.empty()) continue;
    x.push_back(span.data());
    n.push_back(static_cast<int64_t>(span.size()));
  }
  if (x.empty()) return absl::OkStatus();
  return RunIn(*ctx_, "CountNonFinite", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cuda_internal::LaunchCountNonFinite(
        x.data(), n.data(), static_cast<int>(x.size()), count, ctx_->stream));
    return absl::OkStatus();
  });
}

CudaEvent::~CudaEvent() { static_cast<void>(cudaEventDestroy(static_cast<cudaEvent_t>(event_))); }

absl::StatusOr<std::unique_ptr<Event>> CudaBackend::CreateEvent() {
  cudaEvent_t event = nullptr;
  PSFLOW_RETURN_IF_ERROR(RunIn(*ctx_, "CreateEvent", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return absl::OkStatus();
  }));
  return std::unique_ptr<Event>(new CudaEvent(event));
}

absl::Status CudaBackend::RecordEvent(Event* event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(event);
  if (cuda_event == nullptr) return absl::InvalidArgumentError("RecordEvent: not a CUDA event");
  const cudaEvent_t e = static_cast<cudaEvent_t>(cuda_event->raw());
  return RunIn(*ctx_, "RecordEvent", "", [&]() -> absl::Status {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    PSFLOW_CUDA_CHECK(cudaStreamIsCapturing(ctx_->stream, &capturing));
    if (capturing == cudaStreamCaptureStatusActive) {
      PSFLOW_CUDA_CHECK(cudaEventRecordWithFlags(e, ctx_->stream, cudaEventRecordExternal));
    } else {
      PSFLOW_CUDA_CHECK(cudaEventRecord(e, ctx_->stream));
    }
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::Copy(const float* src, float* dst, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckCount(n, "Copy"));
  if (n == 0 || src == dst) return absl::OkStatus();
  return RunIn(*ctx_, "Copy", n, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"src", src}, {"dst", dst}}));
    PSFLOW_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::NarrowToHalves(const float* x, int64_t n, bool bf16, uint16_t* y) {
  PSFLOW_RETURN_IF_ERROR(CheckCount(n, "NarrowToHalves"));
  if (n == 0) return absl::OkStatus();
  return RunIn(*ctx_, "NarrowToHalves", n, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"y", y}}));
    PSFLOW_CUDA_CHECK(cuda_internal::LaunchNarrowFromFloat(x, bf16, y, n, ctx_->stream));
    return absl::OkStatus();
  });
}

absl::StatusOr<std::unique_ptr<Graph>> CudaBackend::Capture(
    const std::function<absl::Status()>& work) {
  // The scope (and so the backend's lock) is held while `work` runs: other
  // threads wait rather than queue into the graph; this thread's ops take the
  // recursive lock again.
  Scope scope(*ctx_);
  PSFLOW_RETURN_IF_ERROR(Annotate(scope.status(), "Capture"));
  PSFLOW_RETURN_IF_ERROR(
      Annotate(CheckCuda(cudaStreamBeginCapture(ctx_->stream, cudaStreamCaptureModeThreadLocal),
                         "cudaStreamBeginCapture"),
               "Capture"));
  const absl::Status work_status = work();
  // Always end the capture, or the stream stays unusable.
  cudaGraph_t raw_graph = nullptr;
  const absl::Status end_status =
      CheckCuda(cudaStreamEndCapture(ctx_->stream, &raw_graph), "cudaStreamEndCapture");
  GraphPtr graph(raw_graph);
  if (!work_status.ok()) return work_status;
  PSFLOW_RETURN_IF_ERROR(Annotate(end_status, "Capture"));
  cudaGraphExec_t exec = nullptr;
  PSFLOW_RETURN_IF_ERROR(Annotate(
      CheckCuda(cudaGraphInstantiate(&exec, graph.get(), 0), "cudaGraphInstantiate"), "Capture"));
  return std::unique_ptr<Graph>(new CudaGraph(ctx_, std::move(graph), exec));
}

absl::StatusOr<std::unique_ptr<Conv2D>> CudaBackend::CreateConv2D(const Conv2DShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(CheckCounts(shape, what));
  return Build<Conv2D, CudnnConv2D>(ctx_, what, shape);
}

absl::StatusOr<std::unique_ptr<MaxPool2D>> CudaBackend::CreateMaxPool2D(const Pool2DShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(CheckCounts(shape, what));
  return Build<MaxPool2D, CudnnMaxPool2D>(ctx_, what, shape);
}

absl::StatusOr<std::unique_ptr<Relu>> CudaBackend::CreateRelu(int64_t size) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckRelu(size));
  PSFLOW_RETURN_IF_ERROR(CheckElementCount(what, {{"x", size}}));
  return Build<Relu, CudnnRelu>(ctx_, what, size);
}

absl::StatusOr<std::unique_ptr<Dense>> CudaBackend::CreateDense(const DenseShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(
      CheckElementCount(what, {{"x", int64_t{shape.batch} * shape.in_features},
                               {"w", int64_t{shape.out_features} * shape.in_features},
                               {"y", int64_t{shape.batch} * shape.out_features}}));
  return Build<Dense, CublasDense>(ctx_, what, shape);
}

absl::StatusOr<std::unique_ptr<SoftmaxCrossEntropy>> CudaBackend::CreateSoftmaxCrossEntropy(
    int batch, int classes) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckSoftmaxCrossEntropy(batch, classes));
  PSFLOW_RETURN_IF_ERROR(CheckElementCount(what, {{"logits", int64_t{batch} * classes}}));
  return Build<SoftmaxCrossEntropy, CudaSoftmaxCrossEntropy>(ctx_, what, batch, classes);
}

absl::StatusOr<std::unique_ptr<BatchNorm>> CudaBackend::CreateBatchNorm(
    const BatchNormShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(CheckElementCount(
      what, {{"x", int64_t{shape.batch} * shape.channels * shape.height * shape.width}}));
  return Build<BatchNorm, CudaBatchNorm>(ctx_, what, shape);
}

absl::StatusOr<std::unique_ptr<GlobalAvgPool>> CudaBackend::CreateGlobalAvgPool(
    const GlobalAvgPoolShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(CheckElementCount(
      what, {{"x", int64_t{shape.batch} * shape.channels * shape.height * shape.width}}));
  return Build<GlobalAvgPool, CudaGlobalAvgPool>(ctx_, what, shape);
}

}  // namespace psflow::kernels
