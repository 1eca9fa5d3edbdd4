// CudaBackend's elementwise, optimizer and conversion helpers (Add, Affine,
// Sgd, ApplyOptimizer, CountNonFinite, GlobalNorm, NarrowToHalves): argument checks, then
// one of psflow's own kernels (cuda_kernels.h) queued on the backend's
// stream. See cuda_backend.h for the contract.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/shapes.h"

namespace psflow::kernels {

using cuda_internal::CheckCount;
using cuda_internal::CheckCuda;
using cuda_internal::CheckNonNull;
using cuda_internal::RunIn;

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

absl::Status CudaBackend::ChannelAffine(const float* x, const float* scale, const float* shift,
                                        float* y, int64_t n, int64_t channels, int64_t plane) {
  PSFLOW_RETURN_IF_ERROR(CheckCount(n * channels * plane, "ChannelAffine"));
  if (n * channels * plane == 0) return absl::OkStatus();
  return RunIn(*ctx_, "ChannelAffine", n * channels * plane, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"y", y}, {"scale", scale}, {"shift", shift}}));
    PSFLOW_CUDA_CHECK(
        cuda_internal::LaunchChannelAffine(x, scale, shift, y, n, channels, plane, ctx_->stream));
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

namespace {

// The device pointers and lengths of the non-empty spans of `xs`, as the
// multi-span kernels (CountNonFinite, GlobalNorm) take them.
void NonEmptySpans(const std::vector<absl::Span<const float>>& xs, std::vector<const float*>* x,
                   std::vector<int64_t>* n) {
  for (absl::Span<const float> span : xs) {
    if (span.empty()) continue;
    x->push_back(span.data());
    n->push_back(static_cast<int64_t>(span.size()));
  }
}

}  // namespace

absl::Status CudaBackend::CountNonFinite(const std::vector<absl::Span<const float>>& xs,
                                         float* count) {
  PSFLOW_RETURN_IF_ERROR(CheckNonFiniteCount(xs, count));
  std::vector<const float*> x;
  std::vector<int64_t> n;
  NonEmptySpans(xs, &x, &n);
  if (x.empty()) return absl::OkStatus();
  return RunIn(*ctx_, "CountNonFinite", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cuda_internal::LaunchCountNonFinite(
        x.data(), n.data(), static_cast<int>(x.size()), count, ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::GlobalNorm(const std::vector<absl::Span<const float>>& xs, float* scratch,
                                     float* norm) {
  PSFLOW_RETURN_IF_ERROR(CheckGlobalNorm(xs, scratch, norm));
  std::vector<const float*> x;
  std::vector<int64_t> n;
  NonEmptySpans(xs, &x, &n);
  static_assert(cuda_internal::kGlobalNormBlocks * sizeof(double) <=
                    Backend::kGlobalNormScratch * sizeof(float),
                "GlobalNorm's scratch holds a double per block");
  return RunIn(*ctx_, "GlobalNorm", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(
        cuda_internal::LaunchGlobalNorm(x.data(), n.data(), static_cast<int>(x.size()),
                                        reinterpret_cast<double*>(scratch), norm, ctx_->stream));
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

}  // namespace psflow::kernels
