// What a ps accepts of a peer's Init before it allocates anything: the one
// check shared by the gRPC service and the in-memory fake of tests.
#ifndef PSFLOW_PS_LIMITS_H_
#define PSFLOW_PS_LIMITS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "proto/ps.pb.h"

namespace psflow::ps {

// The most one ps holds for a job (values and optimizer slots): 16 GiB.
inline constexpr int64_t kMaxInitFloats = int64_t{4} << 30;

// OK when the job's wire dtype is one psflow knows, every slice of `header` has a shape of
// dimensions >= 1, no name repeats, the slices with `num_slots` optimizer slots each add up to
// at most kMaxInitFloats, the header names a job id, and its slices are exactly those the job's
// placement gives this ps; INVALID_ARGUMENT (bad shape, repeated name, no job id, slices not
// the placement's) or RESOURCE_EXHAUSTED (too large) naming the first fault otherwise.
absl::Status CheckInitHeader(const InitHeader& header, size_t num_slots);

}  // namespace psflow::ps

#endif  // PSFLOW_PS_LIMITS_H_
