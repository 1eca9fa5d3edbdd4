#include "ps/limits.h"

#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/placement.h"
#include "common/tensor_chunks.h"

namespace psflow::ps {

absl::Status CheckInitHeader(const InitHeader& header, size_t num_slots) {
  if (WireDtypeOf(header.job()) == DT_INVALID) {
    return absl::InvalidArgumentError(
        absl::StrCat("init names unknown wire dtype ", header.job().wire_dtype()));
  }
  absl::flat_hash_set<std::string> names;
  int64_t total_floats = 0;
  for (const SliceSpec& s : header.slice()) {
    absl::StatusOr<int64_t> n = CheckedNumElements(s.shape(), kMaxInitFloats);
    if (!n.ok() || !names.insert(s.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("slice '", s.name(), "' ", n.ok() ? "appears twice" : n.status().message()));
    }
    total_floats += *n * static_cast<int64_t>(1 + num_slots);
    if (total_floats > kMaxInitFloats) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "init asks for more than ", kMaxInitFloats * 4 >> 30, " GiB of slices and slots"));
    }
  }
  return absl::OkStatus();
}

}  // namespace psflow::ps
