// Whole-file I/O, and the checksum of stored tensors. WriteFileAtomically
// makes a file appear complete or not at all: it writes a temporary name in
// the same directory, fsyncs it, renames it over the target and fsyncs the
// directory. Errors name the path.
#ifndef PSFLOW_COMMON_FILE_UTIL_H_
#define PSFLOW_COMMON_FILE_UTIL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace psflow {

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents);
absl::StatusOr<std::string> ReadFile(const std::string& path);
// Creates the directory and its parents; an existing directory is fine.
absl::Status MakeDirectories(const std::string& path);
// zlib's CRC-32 of `bytes`, the checksum of checkpoint and saved-model tensors.
uint32_t Crc32(absl::string_view bytes);

}  // namespace psflow

#endif  // PSFLOW_COMMON_FILE_UTIL_H_
