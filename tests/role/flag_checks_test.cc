// The checks several mains share: the one-line refusal and --eval_memory_limit.
#include "role/flag_checks.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::StartsWith;

TEST(FlagErrorTest, OneLineNamingTheBinaryAndExitCodeOne) {
  ::testing::internal::CaptureStderr();
  const int code = FlagError(Role::kWorker, "--ps_lanes must be in [0, 64], not 65");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "psflow-worker: --ps_lanes must be in [0, 64], not 65\n");
  EXPECT_EQ(code, 1);
}

TEST(MemoryLimitFlagTest, AutoIsZeroAndSizesAreBytes) {
  EXPECT_EQ(MemoryLimitFlag("--eval_memory_limit", "auto").value(), 0);
  EXPECT_EQ(MemoryLimitFlag("--eval_memory_limit", "512MiB").value(), int64_t{512} << 20);
  EXPECT_EQ(MemoryLimitFlag("--eval_memory_limit", "1073741824").value(), int64_t{1} << 30);
}

TEST(MemoryLimitFlagTest, ZeroAndNoSizeAreRefusedNamingTheFlag) {
  absl::StatusOr<int64_t> zero = MemoryLimitFlag("--eval_memory_limit", "0");
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(zero.status().message()), "--eval_memory_limit: must be positive, or auto");
  absl::StatusOr<int64_t> word = MemoryLimitFlag("--eval_memory_limit", "abc");
  ASSERT_FALSE(word.ok());
  EXPECT_THAT(std::string(word.status().message()),
              StartsWith("--eval_memory_limit: 'abc' is not a size in bytes"));
}

}  // namespace
}  // namespace psflow
