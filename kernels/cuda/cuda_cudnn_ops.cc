// The ops on cuDNN (legacy API): Conv2D (algorithms from cuDNN's Find),
// MaxPool2D and Relu, each owning its descriptors and workspace. See
// cuda_backend.h for the contract.
#include <cudnn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/shapes.h"

namespace psflow::kernels::cuda_internal {
namespace {

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
    PSFLOW_RETURN_IF_ERROR(MakeDescriptors());
    size_t workspace = 0;
    PSFLOW_RETURN_IF_ERROR(FindForward(workspace));
    // A forward-only op searches no backward algorithm: their workspaces,
    // often the largest, are never allocated.
    if (!s.forward_only) {
      PSFLOW_RETURN_IF_ERROR(FindBackwardData(workspace));
      PSFLOW_RETURN_IF_ERROR(FindBackwardFilter(workspace));
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
  // Inside Init: the tensor, filter and convolution descriptors, and the
  // check that cuDNN computes the op's output shape.
  absl::Status MakeDescriptors() {
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
    return absl::OkStatus();
  }

  // Inside Init: cuDNN's Find for one direction (FindConvAlgorithm), raising
  // `workspace` to what its algorithm needs.
  absl::Status FindForward(size_t& workspace) {
    cudnnHandle_t handle = ctx_->cudnn;
    return FindConvAlgorithm<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
        what_, "forward", fwd_conv_.get(),
        [&](int requested, int* count, cudnnConvolutionFwdAlgoPerf_t* perf) -> absl::Status {
          PSFLOW_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithm(
              handle, x_desc_.get(), w_desc_.get(), fwd_conv_.get(), y_desc_.get(), requested,
              count, perf));
          return absl::OkStatus();
        },
        [&](cudnnConvolutionFwdAlgo_t algo, size_t* bytes) -> absl::Status {
          PSFLOW_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(
              handle, x_desc_.get(), w_desc_.get(), fwd_conv_.get(), y_desc_.get(), algo, bytes));
          return absl::OkStatus();
        },
        fwd_algo_, workspace);
  }

  absl::Status FindBackwardData(size_t& workspace) {
    cudnnHandle_t handle = ctx_->cudnn;
    return FindConvAlgorithm<cudnnConvolutionBwdDataAlgoPerf_t,
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
              handle, w_desc_.get(), y_desc_.get(), data_conv_.get(), x_desc_.get(), algo, bytes));
          return absl::OkStatus();
        },
        data_algo_, workspace);
  }

  absl::Status FindBackwardFilter(size_t& workspace) {
    cudnnHandle_t handle = ctx_->cudnn;
    return FindConvAlgorithm<cudnnConvolutionBwdFilterAlgoPerf_t,
                             CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
        what_, "backward-filter", filter_conv_.get(),
        [&](int requested, int* count, cudnnConvolutionBwdFilterAlgoPerf_t* perf) -> absl::Status {
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
        filter_algo_, workspace);
  }

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

}  // namespace
absl::StatusOr<std::unique_ptr<Conv2D>> CreateConv2D(const std::shared_ptr<CudaContext>& ctx,
                                                     const Conv2DShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(CheckCounts(shape, what));
  return Build<Conv2D, CudnnConv2D>(ctx, what, shape);
}

absl::StatusOr<std::unique_ptr<MaxPool2D>> CreateMaxPool2D(const std::shared_ptr<CudaContext>& ctx,
                                                           const Pool2DShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(CheckCounts(shape, what));
  return Build<MaxPool2D, CudnnMaxPool2D>(ctx, what, shape);
}

absl::StatusOr<std::unique_ptr<Relu>> CreateRelu(const std::shared_ptr<CudaContext>& ctx,
                                                 int64_t size) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckRelu(size));
  PSFLOW_RETURN_IF_ERROR(CheckElementCount(what, {{"x", size}}));
  return Build<Relu, CudnnRelu>(ctx, what, size);
}

}  // namespace psflow::kernels::cuda_internal
