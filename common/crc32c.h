// CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial value and
// final xor 0xFFFFFFFF), the checksum of TFRecord framing (common/event_file.h).
// Table-driven, one byte at a time: event files are small. Thread-safe.
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

}  // namespace psflow

#endif  // PSFLOW_COMMON_CRC32C_H_
