#include "common/crc32c.h"

#include <cstdint>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace psflow {
namespace {

std::string Bytes(int n, int first, int stride) {
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>(first + stride * i));
  return s;
}

// The check value of the CRC catalogue and the test vectors of RFC 3720
// (iSCSI), appendix B.4.
TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(Bytes(32, 0, 1)), 0x46DD794Eu);    // 0x00, 0x01, ..., 0x1F
  EXPECT_EQ(Crc32c(Bytes(32, 31, -1)), 0x113FDB5Cu);  // 0x1F, 0x1E, ..., 0x00
}

TEST(Crc32cTest, ExtendEqualsWhole) {
  const std::string text = "The quick brown fox jumps over the lazy dog";
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    EXPECT_EQ(ExtendCrc32c(Crc32c(text.substr(0, cut)), text.substr(cut)), Crc32c(text)) << cut;
  }
  EXPECT_EQ(Crc32c(text), 0x22620404u);
}

TEST(Crc32cTest, MaskRoundTripsAndChangesTheValue) {
  for (uint32_t crc : {0u, 1u, 0xE3069283u, 0xFFFFFFFFu, 0x80000000u}) {
    EXPECT_EQ(UnmaskCrc32c(MaskCrc32c(crc)), crc);
    EXPECT_NE(MaskCrc32c(crc), crc);
  }
  // ((crc >> 15) | (crc << 17)) + 0xa282ead8, by hand.
  EXPECT_EQ(MaskCrc32c(0), 0xa282ead8u);
  EXPECT_EQ(MaskCrc32c(0x00008000u), 0xa282ead9u);
  EXPECT_EQ(MaskCrc32c(1), 0xa282ead8u + 0x20000u);
}

// The crc32 instruction and the table give the same CRC for every length
// around the 8-byte steps, at every alignment of the start, from any initial
// CRC. Where the CPU lacks the instruction only the table runs, which the
// tests above check.
TEST(Crc32cTest, HardwareAndTableAgree) {
  if (!crc32c_internal::HardwareAvailable()) {
    GTEST_SKIP() << "this CPU has no crc32 instruction";
  }
  std::mt19937 rng(17);
  std::string buffer(4096 + 64, '\0');
  for (char& c : buffer) c = static_cast<char>(rng());
  for (size_t start = 0; start < 16; ++start) {
    for (size_t length = 0; length < 300; ++length) {
      const absl::string_view bytes(buffer.data() + start, length);
      const uint32_t initial = static_cast<uint32_t>(rng());
      ASSERT_EQ(crc32c_internal::ExtendHardware(initial, bytes),
                crc32c_internal::ExtendPortable(initial, bytes))
          << "start " << start << ", length " << length;
    }
  }
  for (size_t length : {1000, 4095, 4096, 4097}) {
    const absl::string_view bytes(buffer.data() + 3, length);
    EXPECT_EQ(crc32c_internal::ExtendHardware(0, bytes), crc32c_internal::ExtendPortable(0, bytes));
  }
  EXPECT_EQ(crc32c_internal::ExtendHardware(0, "123456789"), 0xE3069283u);
}

// The known vectors again through the table alone, whichever path Crc32c takes.
TEST(Crc32cTest, TableGivesKnownVectors) {
  EXPECT_EQ(crc32c_internal::ExtendPortable(0, "123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c_internal::ExtendPortable(0, std::string(32, '\xFF')), 0x62A8AB43u);
  EXPECT_EQ(crc32c_internal::ExtendPortable(0, Bytes(32, 0, 1)), 0x46DD794Eu);
}

}  // namespace
}  // namespace psflow
