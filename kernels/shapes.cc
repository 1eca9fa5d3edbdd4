#include "kernels/shapes.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_format.h"

namespace psflow::kernels {
namespace {

absl::Status Invalid(const std::string& what, const char* why) {
  return absl::InvalidArgumentError(what + ": " + why);
}

}  // namespace

std::string Describe(const Conv2DShape& s) {
  return absl::StrFormat("Conv2D(N=%d C=%d H=%d W=%d K=%d R=%d S=%d stride=%d padding=%d)", s.batch,
                         s.in_channels, s.height, s.width, s.out_channels, s.kernel_h, s.kernel_w,
                         s.stride, s.padding);
}

std::string Describe(const Pool2DShape& s) {
  return absl::StrFormat("MaxPool2D(N=%d C=%d H=%d W=%d window=%d stride=%d)", s.batch, s.channels,
                         s.height, s.width, s.window, s.stride);
}

std::string Describe(const BatchNormShape& s) {
  return absl::StrFormat("BatchNorm(N=%d C=%d H=%d W=%d epsilon=%g)", s.batch, s.channels, s.height,
                         s.width, s.epsilon);
}

std::string Describe(const DenseShape& s) {
  return absl::StrFormat("Dense(N=%d in=%d out=%d)", s.batch, s.in_features, s.out_features);
}

std::string Describe(const GlobalAvgPoolShape& s) {
  return absl::StrFormat("GlobalAvgPool(N=%d C=%d H=%d W=%d)", s.batch, s.channels, s.height,
                         s.width);
}

std::string DescribeRelu(int64_t size) { return absl::StrFormat("Relu(size=%d)", size); }

std::string DescribeSoftmaxCrossEntropy(int batch, int classes) {
  return absl::StrFormat("SoftmaxCrossEntropy(N=%d classes=%d)", batch, classes);
}

absl::Status ValidateShape(const Conv2DShape& s) {
  if (s.batch <= 0 || s.in_channels <= 0 || s.height <= 0 || s.width <= 0 || s.out_channels <= 0 ||
      s.kernel_h <= 0 || s.kernel_w <= 0) {
    return Invalid(Describe(s), "all dimensions must be positive");
  }
  if (s.stride <= 0) return Invalid(Describe(s), "stride must be positive");
  if (s.padding < 0) return Invalid(Describe(s), "padding is negative");
  // int64 so that a huge padding cannot overflow the check.
  if (s.kernel_h > int64_t{s.height} + 2 * int64_t{s.padding} ||
      s.kernel_w > int64_t{s.width} + 2 * int64_t{s.padding}) {
    return Invalid(Describe(s), "kernel is larger than the padded input");
  }
  return absl::OkStatus();
}

absl::Status ValidateShape(const Pool2DShape& s) {
  if (s.batch <= 0 || s.channels <= 0 || s.height <= 0 || s.width <= 0 || s.window <= 0 ||
      s.stride <= 0) {
    return Invalid(Describe(s), "all dimensions must be positive");
  }
  if (s.window > s.height || s.window > s.width) return Invalid(Describe(s), "window is larger than the input");
  return absl::OkStatus();
}

absl::Status ValidateShape(const BatchNormShape& s) {
  if (s.batch <= 0 || s.channels <= 0 || s.height <= 0 || s.width <= 0) {
    return Invalid(Describe(s), "all dimensions must be positive");
  }
  if (!(s.epsilon >= 0) || !std::isfinite(s.epsilon)) {  // NaN fails the first test
    return Invalid(Describe(s), "epsilon must be finite and not negative");
  }
  return absl::OkStatus();
}

absl::Status ValidateShape(const DenseShape& s) {
  if (s.batch <= 0 || s.in_features <= 0 || s.out_features <= 0) {
    return Invalid(Describe(s), "all dimensions must be positive");
  }
  return absl::OkStatus();
}

absl::Status ValidateShape(const GlobalAvgPoolShape& s) {
  if (s.batch <= 0 || s.channels <= 0 || s.height <= 0 || s.width <= 0) {
    return Invalid(Describe(s), "all dimensions must be positive");
  }
  return absl::OkStatus();
}

absl::Status ValidateRelu(int64_t size) {
  if (size <= 0) return Invalid(DescribeRelu(size), "size must be positive");
  return absl::OkStatus();
}

absl::Status ValidateSoftmaxCrossEntropy(int batch, int classes) {
  if (batch <= 0 || classes <= 0) {
    return Invalid(DescribeSoftmaxCrossEntropy(batch, classes), "all dimensions must be positive");
  }
  return absl::OkStatus();
}

}  // namespace psflow::kernels
