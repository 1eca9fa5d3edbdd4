// What every backend checks of an op's shape before creating it, and how
// errors name the op: INVALID_ARGUMENT "<Describe(shape)>: <why>". Backends
// add checks of their own (a GPU library's index range, say) after these.
#ifndef PSFLOW_KERNELS_SHAPES_H_
#define PSFLOW_KERNELS_SHAPES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/kernels.h"

namespace psflow::kernels {

// "Conv2D(N=.. C=.. H=.. W=.. K=.. R=.. S=.. stride=.. padding=..)" and the like.
std::string Describe(const Conv2DShape& s);
std::string Describe(const Pool2DShape& s);
std::string Describe(const BatchNormShape& s);
std::string Describe(const DenseShape& s);
std::string Describe(const GlobalAvgPoolShape& s);
// "Relu(size=..)" and "SoftmaxCrossEntropy(N=.. classes=..)": these ops take
// plain sizes rather than a shape struct.
std::string DescribeRelu(int64_t size);
std::string DescribeSoftmaxCrossEntropy(int batch, int classes);

// Positive sizes; a non-negative padding; a kernel or window that fits its
// (padded) input; a finite, non-negative batch-norm epsilon.
absl::Status ValidateShape(const Conv2DShape& s);
absl::Status ValidateShape(const Pool2DShape& s);
absl::Status ValidateShape(const BatchNormShape& s);
absl::Status ValidateShape(const DenseShape& s);
absl::Status ValidateShape(const GlobalAvgPoolShape& s);
absl::Status ValidateRelu(int64_t size);
absl::Status ValidateSoftmaxCrossEntropy(int batch, int classes);

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_SHAPES_H_
