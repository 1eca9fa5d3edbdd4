#include "kernels/shapes.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace psflow::kernels {
namespace {

// `what` when `why` is null, else INVALID_ARGUMENT "<what>: <why>".
absl::StatusOr<std::string> Checked(std::string what, const char* why) {
  if (why != nullptr) return absl::InvalidArgumentError(what + ": " + why);
  return what;
}

}  // namespace

absl::StatusOr<std::string> CheckShape(const Conv2DShape& s) {
  const char* why = nullptr;
  if (s.batch <= 0 || s.in_channels <= 0 || s.height <= 0 || s.width <= 0 || s.out_channels <= 0 ||
      s.kernel_h <= 0 || s.kernel_w <= 0) {
    why = "all dimensions must be positive";
  } else if (s.stride <= 0) {
    why = "stride must be positive";
  } else if (s.padding < 0) {
    why = "padding is negative";
  } else if (s.kernel_h > int64_t{s.height} + 2 * int64_t{s.padding} ||
             s.kernel_w > int64_t{s.width} + 2 * int64_t{s.padding}) {
    // int64 so that a huge padding cannot overflow the check.
    why = "kernel is larger than the padded input";
  }
  return Checked(absl::StrFormat("Conv2D(N=%d C=%d H=%d W=%d K=%d R=%d S=%d stride=%d padding=%d)",
                                 s.batch, s.in_channels, s.height, s.width, s.out_channels,
                                 s.kernel_h, s.kernel_w, s.stride, s.padding),
                 why);
}

absl::StatusOr<std::string> CheckShape(const Pool2DShape& s) {
  const char* why = nullptr;
  if (s.batch <= 0 || s.channels <= 0 || s.height <= 0 || s.width <= 0 || s.window <= 0 ||
      s.stride <= 0) {
    why = "all dimensions must be positive";
  } else if (s.window > s.height || s.window > s.width) {
    why = "window is larger than the input";
  }
  return Checked(absl::StrFormat("MaxPool2D(N=%d C=%d H=%d W=%d window=%d stride=%d)", s.batch,
                                 s.channels, s.height, s.width, s.window, s.stride),
                 why);
}

absl::StatusOr<std::string> CheckShape(const BatchNormShape& s) {
  const char* why = nullptr;
  if (s.batch <= 0 || s.channels <= 0 || s.height <= 0 || s.width <= 0) {
    why = "all dimensions must be positive";
  } else if (!(s.epsilon >= 0) || !std::isfinite(s.epsilon)) {  // NaN fails the first test
    why = "epsilon must be finite and not negative";
  }
  return Checked(absl::StrFormat("BatchNorm(N=%d C=%d H=%d W=%d epsilon=%g)", s.batch, s.channels,
                                 s.height, s.width, s.epsilon),
                 why);
}

absl::StatusOr<std::string> CheckShape(const DenseShape& s) {
  const bool bad = s.batch <= 0 || s.in_features <= 0 || s.out_features <= 0;
  return Checked(
      absl::StrFormat("Dense(N=%d in=%d out=%d)", s.batch, s.in_features, s.out_features),
      bad ? "all dimensions must be positive" : nullptr);
}

absl::StatusOr<std::string> CheckShape(const GlobalAvgPoolShape& s) {
  const bool bad = s.batch <= 0 || s.channels <= 0 || s.height <= 0 || s.width <= 0;
  return Checked(
      absl::StrFormat("GlobalAvgPool(N=%d C=%d H=%d W=%d)", s.batch, s.channels, s.height, s.width),
      bad ? "all dimensions must be positive" : nullptr);
}

absl::StatusOr<std::string> CheckShape(const ConcatShape& s) {
  const int n = static_cast<int>(s.widths.size());
  bool bad_width = false;
  for (int64_t w : s.widths) bad_width |= w <= 0;
  return Checked(absl::StrFormat("Concat(N=%d operands=%d width=%d)", s.batch, n, s.out_width()),
                 s.batch <= 0 || bad_width       ? "the batch and every width must be positive"
                 : n < 1 || n > kMaxJoinOperands ? "needs 1 to 64 operands"
                                                 : nullptr);
}

absl::StatusOr<std::string> CheckShape(const InteractionShape& s) {
  const int least = s.self ? 1 : 2;
  return Checked(absl::StrFormat("Interaction(N=%d features=%d dim=%d%s)", s.batch, s.features,
                                 s.dim, s.self ? " self" : ""),
                 s.batch <= 0 || s.dim <= 0 ? "the batch and dim must be positive"
                 : s.features < least || s.features > kMaxJoinOperands
                     ? "needs 2 to 64 features (1 with self)"
                     : nullptr);
}

absl::Status CheckJoinArgs(absl::string_view what, absl::Span<const float* const> xs,
                           absl::Span<float* const> dxs, absl::Span<const uint8_t> add, size_t n) {
  if (xs.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %d inputs given for %d operands", what, xs.size(), n));
  }
  for (const float* x : xs) {
    if (x == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": a null input"));
  }
  if (dxs.size() != n || add.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d gradients and %d flags given for %d operands", what, dxs.size(), add.size(), n));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckRelu(int64_t size) {
  return Checked(absl::StrFormat("Relu(size=%d)", size),
                 size <= 0 ? "size must be positive" : nullptr);
}

absl::StatusOr<std::string> CheckEmbeddingBag(int64_t dim) {
  return Checked(absl::StrFormat("EmbeddingBag(dim=%d)", dim),
                 dim <= 0 ? "dim must be positive" : nullptr);
}

absl::StatusOr<std::string> CheckSoftmaxCrossEntropy(int batch, int classes) {
  return Checked(absl::StrFormat("SoftmaxCrossEntropy(N=%d classes=%d)", batch, classes),
                 batch <= 0 || classes <= 0 ? "all dimensions must be positive" : nullptr);
}

absl::Status CheckOptimizerTensors(const OptimizerStep& step,
                                   const std::vector<OptimizerTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const OptimizerTensor& t = tensors[i];
    const char* why = nullptr;
    if (t.n < 0) {
      why = "a negative count";
    } else if (t.n > 0 && (t.w == nullptr || t.g == nullptr)) {
      why = "null weights or gradients";
    } else if (t.n > 0 &&
               ((step.slots() >= 1 && t.s0 == nullptr) || (step.slots() >= 2 && t.s1 == nullptr))) {
      why = "the rule needs its slot buffers";
    }
    if (why != nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("ApplyOptimizer: tensor %d: %s", i, why));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNonFiniteCount(const std::vector<absl::Span<const float>>& xs,
                                 const float* count) {
  if (count == nullptr) return absl::InvalidArgumentError("CountNonFinite: count is null");
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!xs[i].empty() && xs[i].data() == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("CountNonFinite: span %d is null", i));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckGlobalNorm(const std::vector<absl::Span<const float>>& xs, const float* scratch,
                             const float* norm) {
  if (norm == nullptr || scratch == nullptr) {
    return absl::InvalidArgumentError("GlobalNorm: norm or scratch is null");
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!xs[i].empty() && xs[i].data() == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("GlobalNorm: span %d is null", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace psflow::kernels
