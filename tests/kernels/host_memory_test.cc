// Tests of AvailableHostMemory on fake /proc and /sys trees: MemAvailable
// alone, cgroup v1 and v2 limits (at the mount point and at this process's
// own path), limits that are no limits, and unreadable files.
#include "kernels/host_memory.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::kernels {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;

class HostMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = ::testing::TempDir() + "/host_memory_test_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(root_);
    // 8 GiB in the machine, 3000 MiB available.
    Write("proc/meminfo",
          "MemTotal:        8388608 kB\nMemFree:         1000000 kB\n"
          "MemAvailable:    3072000 kB\nBuffers:           1000 kB\n");
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  void Write(const std::string& path, const std::string& text) {
    const std::filesystem::path p = std::filesystem::path(root_) / path;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }

  std::string root_;
};

TEST_F(HostMemoryTest, MemAvailableWithoutCgroups) {
  absl::StatusOr<int64_t> bytes = AvailableHostMemory(root_);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, 3000 * kMiB);
}

TEST_F(HostMemoryTest, CgroupV2LimitLeavesLess) {
  Write("sys/fs/cgroup/memory.max", "2147483648\n");      // 2 GiB
  Write("sys/fs/cgroup/memory.current", "1610612736\n");  // 1.5 GiB used
  EXPECT_EQ(AvailableHostMemory(root_).value(), 512 * kMiB);
  // More headroom than MemAvailable: MemAvailable.
  Write("sys/fs/cgroup/memory.current", "0\n");
  EXPECT_EQ(AvailableHostMemory(root_).value(), 2048 * kMiB);
  Write("sys/fs/cgroup/memory.max", "1073741824\n");
  Write("sys/fs/cgroup/memory.current", "0\n");
  EXPECT_EQ(AvailableHostMemory(root_).value(), 1024 * kMiB);
  // Usage above the limit leaves nothing.
  Write("sys/fs/cgroup/memory.current", "2147483648\n");
  EXPECT_EQ(AvailableHostMemory(root_).value(), 0);
}

TEST_F(HostMemoryTest, CgroupV1LimitAtThisProcesssOwnPath) {
  Write("proc/self/cgroup", "9:name=systemd:/\n4:memory:/pod/abc\n0::/\n");
  Write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");  // none
  Write("sys/fs/cgroup/memory/memory.usage_in_bytes", "1000\n");
  Write("sys/fs/cgroup/memory/pod/abc/memory.limit_in_bytes", "1073741824\n");
  Write("sys/fs/cgroup/memory/pod/abc/memory.usage_in_bytes", "268435456\n");
  EXPECT_EQ(AvailableHostMemory(root_).value(), 768 * kMiB);
}

TEST_F(HostMemoryTest, CgroupV2AtThisProcesssOwnPath) {
  Write("proc/self/cgroup", "0::/job/eval\n");
  Write("sys/fs/cgroup/job/eval/memory.max", "536870912\n");
  Write("sys/fs/cgroup/job/eval/memory.current", "0\n");
  EXPECT_EQ(AvailableHostMemory(root_).value(), 512 * kMiB);
}

TEST_F(HostMemoryTest, LimitsThatAreNoLimits) {
  Write("sys/fs/cgroup/memory.max", "max\n");
  Write("sys/fs/cgroup/memory.current", "100\n");
  // At or above MemTotal (cgroup v1's "unlimited" is near 2^63).
  Write("sys/fs/cgroup/memory/memory.limit_in_bytes", "8589934592\n");
  Write("sys/fs/cgroup/memory/memory.usage_in_bytes", "8000000000\n");
  EXPECT_EQ(AvailableHostMemory(root_).value(), 3000 * kMiB);
  // A limit without a readable usage is skipped.
  Write("sys/fs/cgroup/memory.max", "1048576\n");
  std::filesystem::remove(std::filesystem::path(root_) / "sys/fs/cgroup/memory.current");
  EXPECT_EQ(AvailableHostMemory(root_).value(), 3000 * kMiB);
}

TEST_F(HostMemoryTest, NoMeminfoIsUnavailable) {
  Write("proc/meminfo", "MemTotal: 100 kB\n");
  absl::StatusOr<int64_t> bytes = AvailableHostMemory(root_);
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(bytes.status().message()), HasSubstr("MemAvailable"));
  std::filesystem::remove(std::filesystem::path(root_) / "proc/meminfo");
  bytes = AvailableHostMemory(root_);
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(bytes.status().message()), HasSubstr("proc/meminfo"));
}

// This machine's answer: positive, and no more than its MemAvailable.
TEST(HostMemoryRealTest, ThisMachine) {
  absl::StatusOr<int64_t> bytes = AvailableHostMemory();
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_GT(*bytes, 0);
}

}  // namespace
}  // namespace psflow::kernels
