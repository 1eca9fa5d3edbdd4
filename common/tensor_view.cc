#include "common/tensor_view.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace psflow {

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape, int64_t limit) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 1 || n > limit / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " is empty or too large"));
    }
    n *= d;
  }
  return n;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

std::string TensorDisplayName(const std::string& name, const std::string& slot, int64_t row_begin) {
  std::string out = absl::StrCat("'", name, "'");
  if (row_begin != 0) absl::StrAppend(&out, " from row ", row_begin);
  if (!slot.empty()) absl::StrAppend(&out, " slot '", slot, "'");
  return out;
}

}  // namespace psflow
