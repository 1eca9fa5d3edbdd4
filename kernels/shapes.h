// What every backend checks of an op's shape before creating it, and how
// errors name the op: INVALID_ARGUMENT "<description>: <why>". Backends
// add checks of their own (a GPU library's index range, say) after these.
#ifndef PSFLOW_KERNELS_SHAPES_H_
#define PSFLOW_KERNELS_SHAPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/kernels.h"

namespace psflow::kernels {

// Each returns the op's description, "Conv2D(N=.. C=.. H=.. W=.. K=.. R=..
// S=.. stride=.. padding=..)" and the like, for naming the op in later errors;
// or INVALID_ARGUMENT "<description>: <why>" unless the sizes are positive,
// the padding is not negative, the kernel or window fits its (padded) input
// and a batch-norm epsilon is finite and not negative. Relu and
// SoftmaxCrossEntropy take plain sizes rather than a shape struct, EmbeddingBag
// its row size.
absl::StatusOr<std::string> CheckShape(const Conv2DShape& s);
absl::StatusOr<std::string> CheckShape(const Pool2DShape& s);
absl::StatusOr<std::string> CheckShape(const BatchNormShape& s);
absl::StatusOr<std::string> CheckShape(const DenseShape& s);
absl::StatusOr<std::string> CheckShape(const GlobalAvgPoolShape& s);
// Concat and Interaction also need 1 to kMaxJoinOperands operands (2 or more
// for Interaction without self).
absl::StatusOr<std::string> CheckShape(const ConcatShape& s);
absl::StatusOr<std::string> CheckShape(const InteractionShape& s);
// The arguments of their calls: `n` operands (as created), no null input,
// and `add` one flag per operand.
absl::Status CheckJoinArgs(absl::string_view what, absl::Span<const float* const> xs,
                           absl::Span<float* const> dxs, absl::Span<const uint8_t> add, size_t n);
absl::StatusOr<std::string> CheckRelu(int64_t size);
absl::StatusOr<std::string> CheckEmbeddingBag(int64_t dim);
absl::StatusOr<std::string> CheckSoftmaxCrossEntropy(int batch, int classes);

// Backend::ApplyOptimizer's tensors: INVALID_ARGUMENT "ApplyOptimizer:
// tensor <i>: <why>" for a negative count, or (count > 0) a null weight or
// gradient or a slot the rule needs.
absl::Status CheckOptimizerTensors(const OptimizerStep& step,
                                   const std::vector<OptimizerTensor>& tensors);
// Backend::CountNonFinite's arguments: a null count, or a null span of
// floats.
absl::Status CheckNonFiniteCount(const std::vector<absl::Span<const float>>& xs,
                                 const float* count);
// Backend::GlobalNorm's arguments: a null norm or scratch, or a null span
// of floats.
absl::Status CheckGlobalNorm(const std::vector<absl::Span<const float>>& xs, const float* scratch,
                             const float* norm);

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_SHAPES_H_
