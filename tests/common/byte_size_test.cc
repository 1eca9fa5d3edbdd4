#include "common/byte_size.h"

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

TEST(ByteSizeTest, ParsesNumbersAndBinaryUnits) {
  EXPECT_EQ(ParseByteSize("1048576").value(), 1048576);
  EXPECT_EQ(ParseByteSize("0").value(), 0);
  EXPECT_EQ(ParseByteSize("17B").value(), 17);
  EXPECT_EQ(ParseByteSize("512KiB").value(), 512 * 1024);
  EXPECT_EQ(ParseByteSize("64MiB").value(), 64 << 20);
  EXPECT_EQ(ParseByteSize("2GiB").value(), int64_t{2} << 30);
  EXPECT_EQ(ParseByteSize("1TiB").value(), int64_t{1} << 40);
  EXPECT_EQ(ParseByteSize("1.5 GiB").value(), int64_t{3} << 29);
  EXPECT_EQ(ParseByteSize(" 2g ").value(), int64_t{2} << 30);
  EXPECT_EQ(ParseByteSize("3M").value(), 3 << 20);
  EXPECT_EQ(ParseByteSize("3mb").value(), 3 << 20);
  EXPECT_EQ(ParseByteSize("3MIB").value(), 3 << 20);
  EXPECT_EQ(ParseByteSize("0.5k").value(), 512);
  EXPECT_EQ(ParseByteSize("1.7").value(), 1);  // whole bytes, rounded down
}

TEST(ByteSizeTest, RefusesWhatIsNoSize) {
  for (const char* text : {"", "GiB", "-1", "-1GiB", "1.2.3", "12 apples", "1PiB", "1ib",
                           "9223372036854775808", "8EiB", "10000000TiB"}) {
    absl::StatusOr<int64_t> r = ParseByteSize(text);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << "'" << text << "'";
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(std::string("'") + text + "'"));
  }
}

TEST(ByteSizeTest, Formats) {
  EXPECT_EQ(FormatByteSize(0), "0 B");
  EXPECT_EQ(FormatByteSize(1023), "1023 B");
  EXPECT_EQ(FormatByteSize(1536), "1.5 KiB");
  EXPECT_EQ(FormatByteSize(int64_t{44} << 20), "44.0 MiB");
  EXPECT_EQ(FormatByteSize(int64_t{3} << 29), "1.5 GiB");
  EXPECT_EQ(FormatByteSize(int64_t{5} << 40), "5.0 TiB");
  EXPECT_EQ(FormatByteSize(int64_t{5} << 50), "5120.0 TiB");
}

}  // namespace
}  // namespace psflow
