// Sizes in bytes as people write and read them: parsed from flags
// ("512MiB"), printed in messages ("44.7 MiB"). Thread-safe (pure
// functions).
#ifndef PSFLOW_COMMON_BYTE_SIZE_H_
#define PSFLOW_COMMON_BYTE_SIZE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace psflow {

// A number of bytes, a decimal fraction allowed, with an optional unit:
// B, KiB, MiB, GiB, TiB (powers of 1024; K, M, G, T and KB, MB, GB, TB mean
// the same), case-insensitive, a space before it allowed: "1048576",
// "512MiB", "1.5 GiB", "2g". Rounded down to whole bytes.
// INVALID_ARGUMENT, quoting the text, for anything else, a negative size or
// one of 2^63 bytes or more.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);

// `bytes` in the largest unit that leaves at least 1 of it, with one
// decimal: "512 B", "1.5 KiB", "44.7 MiB", "2.0 GiB".
std::string FormatByteSize(int64_t bytes);

}  // namespace psflow

#endif  // PSFLOW_COMMON_BYTE_SIZE_H_
