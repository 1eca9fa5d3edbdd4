// The Dense op on cuBLAS (full fp32 GEMMs), owning its vector of ones for the
// bias gradient. See cuda_backend.h for the contract.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/shapes.h"

namespace psflow::kernels::cuda_internal {
namespace {

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

}  // namespace

absl::StatusOr<std::unique_ptr<Dense>> CreateDense(const std::shared_ptr<CudaContext>& ctx,
                                                   const DenseShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(
      CheckElementCount(what, {{"x", int64_t{shape.batch} * shape.in_features},
                               {"w", int64_t{shape.out_features} * shape.in_features},
                               {"y", int64_t{shape.batch} * shape.out_features}}));
  return Build<Dense, CublasDense>(ctx, what, shape);
}

}  // namespace psflow::kernels::cuda_internal
