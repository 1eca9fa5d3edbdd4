#include "common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define PSFLOW_CRC32C_X86 1
#endif

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

#ifdef PSFLOW_CRC32C_X86
// SSE4.2's crc32 instruction computes CRC-32C (the Castagnoli polynomial,
// reflected, without the initial and final xor), 8 bytes per instruction.
// Compiled for SSE4.2 whatever the build's -march; called only after the
// run-time check.
__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const char* p, size_t n) {
  uint64_t r = static_cast<uint32_t>(~crc);
  // Byte steps up to an 8-byte boundary, so the wide loads are aligned.
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    r = _mm_crc32_u8(static_cast<uint32_t>(r), static_cast<uint8_t>(*p++));
    --n;
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    r = _mm_crc32_u64(r, word);
  }
  for (; n > 0; --n) r = _mm_crc32_u8(static_cast<uint32_t>(r), static_cast<uint8_t>(*p++));
  return ~static_cast<uint32_t>(r);
}
#endif

}  // namespace

namespace crc32c_internal {

uint32_t ExtendPortable(uint32_t crc, absl::string_view bytes) {
  uint32_t r = ~crc;
  for (unsigned char c : bytes) r = kTable[(r ^ c) & 0xFF] ^ (r >> 8);
  return ~r;
}

bool HardwareAvailable() {
#ifdef PSFLOW_CRC32C_X86
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

uint32_t ExtendHardware(uint32_t crc, absl::string_view bytes) {
#ifdef PSFLOW_CRC32C_X86
  return ExtendSse42(crc, bytes.data(), bytes.size());
#else
  return ExtendPortable(crc, bytes);
#endif
}

}  // namespace crc32c_internal

uint32_t ExtendCrc32c(uint32_t crc, absl::string_view bytes) {
  return crc32c_internal::HardwareAvailable() ? crc32c_internal::ExtendHardware(crc, bytes)
                                              : crc32c_internal::ExtendPortable(crc, bytes);
}

uint32_t Crc32c(absl::string_view bytes) { return ExtendCrc32c(0, bytes); }

}  // namespace psflow
