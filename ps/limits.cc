#include "ps/limits.h"

#include <string>
#include <utility>

#include <google/protobuf/util/message_differencer.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/placement.h"
#include "common/tensor_view.h"

namespace psflow::ps {

absl::Status CheckInitHeader(const InitHeader& header, size_t num_slots) {
  if (WireDtypeOf(header.job()) == DT_INVALID) {
    return absl::InvalidArgumentError(
        absl::StrCat("init names unknown wire dtype ", header.job().wire_dtype()));
  }
  absl::flat_hash_set<std::pair<std::string, int64_t>> names;  // name, first row
  int64_t total_floats = 0;
  for (const SliceSpec& s : header.slice()) {
    absl::StatusOr<int64_t> n = CheckedNumElements(s.shape(), kMaxInitFloats);
    if (!n.ok() || !names.insert({s.name(), s.row_begin()}).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("slice '", s.name(), "' ", n.ok() ? "appears twice" : n.status().message()));
    }
    total_floats += *n * static_cast<int64_t>(1 + num_slots);
    if (total_floats > kMaxInitFloats) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "init asks for more than ", kMaxInitFloats * 4 >> 30, " GiB of slices and slots"));
    }
  }
  if (header.job_id() == 0) return absl::InvalidArgumentError("init names no job id");
  // The slices are exactly what the job's own placement gives this ps: a
  // header cannot declare more than the job holds.
  const Placement& placement = header.job().placement();
  if (header.ps_index() < 0 || header.ps_index() >= placement.num_ps()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init for ps ", header.ps_index(), " of a job placed on ", placement.num_ps(), " ps"));
  }
  const std::vector<SliceSpec> placed = SliceSpecs(placement, header.ps_index());
  if (static_cast<int>(placed.size()) != header.slice_size()) {
    return absl::InvalidArgumentError(absl::StrCat("init declares ", header.slice_size(),
                                                   " slices; the job's placement gives ps ",
                                                   header.ps_index(), " ", placed.size()));
  }
  for (size_t i = 0; i < placed.size(); ++i) {
    if (!google::protobuf::util::MessageDifferencer::Equals(placed[i], header.slice(i))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "init slice ", i, " ('", header.slice(i).name(), "') is not the job's placement of it"));
    }
  }
  return absl::OkStatus();
}

}  // namespace psflow::ps
