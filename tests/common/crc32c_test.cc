#include "common/crc32c.h"

#include <cstdint>
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

}  // namespace
}  // namespace psflow
