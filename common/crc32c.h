// CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial value and
// final xor 0xFFFFFFFF), the checksum of TFRecord framing (common/event_file.h,
// data/tfrecord/record_file.h). On x86-64 CPUs with SSE4.2 (checked at run
// time) it uses the crc32 instruction, 8 bytes at a time: TFRecord data sets
// checksum every byte they read. Elsewhere a table, one byte at a time.
// Thread-safe.
#ifndef PSFLOW_COMMON_CRC32C_H_
#define PSFLOW_COMMON_CRC32C_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace psflow {

// The CRC-32C of `bytes` ("123456789" gives 0xE3069283).
uint32_t Crc32c(absl::string_view bytes);
// The CRC-32C of A + `bytes`, given `crc` = Crc32c(A) (Crc32c(B) is
// ExtendCrc32c(0, B)).
uint32_t ExtendCrc32c(uint32_t crc, absl::string_view bytes);

// TFRecord stores CRCs rotated and offset ("masked"), so that the CRC of data
// that holds CRCs does not degenerate.
inline uint32_t MaskCrc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }
inline uint32_t UnmaskCrc32c(uint32_t masked) {
  const uint32_t rot = masked - 0xa282ead8u;
  return (rot >> 17) | (rot << 15);
}

// The two implementations behind ExtendCrc32c, exposed so that tests can
// check they agree.
namespace crc32c_internal {
uint32_t ExtendPortable(uint32_t crc, absl::string_view bytes);  // the table
// Whether this CPU has the crc32 instruction (x86-64 with SSE4.2).
bool HardwareAvailable();
// The crc32 instruction where the build targets x86-64, else the table. Call
// it only when HardwareAvailable().
uint32_t ExtendHardware(uint32_t crc, absl::string_view bytes);
}  // namespace crc32c_internal

}  // namespace psflow

#endif  // PSFLOW_COMMON_CRC32C_H_
