#include "common/crc32c.h"

#include <array>

namespace psflow {
namespace {

// kTable[b]: the CRC register after shifting byte b through it.
constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int bit = 0; bit < 8; ++bit) r = (r & 1) ? (r >> 1) ^ 0x82F63B78u : r >> 1;
    table[b] = r;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = MakeTable();

}  // namespace

uint32_t ExtendCrc32c(uint32_t crc, absl::string_view bytes) {
  uint32_t r = ~crc;
  for (unsigned char c : bytes) r = kTable[(r ^ c) & 0xFF] ^ (r >> 8);
  return ~r;
}

uint32_t Crc32c(absl::string_view bytes) { return ExtendCrc32c(0, bytes); }

}  // namespace psflow
