#include "common/cpu_count.h"

#include <sched.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tests/common/scratch_dir.h"

namespace psflow {
namespace {

namespace fs = std::filesystem;

void Write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

TEST(CpuCountTest, ParsesCgroup2CpuMax) {
  EXPECT_EQ(ParseCpuMax("400000 100000\n"), 4.0);
  EXPECT_EQ(ParseCpuMax("150000 100000"), 1.5);
  EXPECT_EQ(ParseCpuMax("max 100000\n"), std::nullopt);
  EXPECT_EQ(ParseCpuMax(""), std::nullopt);
  EXPECT_EQ(ParseCpuMax("-1 100000"), std::nullopt);
  EXPECT_EQ(ParseCpuMax("100000 0"), std::nullopt);
  EXPECT_EQ(ParseCpuMax("100000"), std::nullopt);
  EXPECT_EQ(ParseCpuMax("a b"), std::nullopt);
}

// cgroup v2: the lowest quota of the process's cgroup and its ancestors.
TEST(CpuCountTest, Cgroup2TakesTheLowestQuotaUpToTheRoot) {
  ScratchDir dir("cpu_count");
  ASSERT_FALSE(dir.path().empty());
  const fs::path root = dir.path();
  Write(root / "cpu.max", "max 100000\n");
  Write(root / "kubepods" / "cpu.max", "300000 100000\n");
  Write(root / "kubepods" / "pod1" / "cpu.max", "max 100000\n");
  Write(root / "kubepods" / "pod1" / "c1" / "cpu.max", "800000 100000\n");
  EXPECT_EQ(CgroupCpuQuota("0::/kubepods/pod1/c1\n", root.string()), 3.0);
  Write(root / "kubepods" / "pod1" / "c1" / "cpu.max", "50000 100000\n");
  EXPECT_EQ(CgroupCpuQuota("0::/kubepods/pod1/c1\n", root.string()), 0.5);
  // No quota anywhere.
  Write(root / "kubepods" / "cpu.max", "max 100000\n");
  Write(root / "kubepods" / "pod1" / "c1" / "cpu.max", "max 100000\n");
  EXPECT_EQ(CgroupCpuQuota("0::/kubepods/pod1/c1\n", root.string()), std::nullopt);
  // In a cgroup namespace the mount's root is the process's own cgroup and
  // /proc/self/cgroup names "/" or a path this mount does not have.
  Write(root / "cpu.max", "200000 100000\n");
  EXPECT_EQ(CgroupCpuQuota("0::/\n", root.string()), 2.0);
  EXPECT_EQ(CgroupCpuQuota("0::/elsewhere/x\n", root.string()), 2.0);
  EXPECT_EQ(CgroupCpuQuota("0::/../x\n", root.string()), 2.0);
}

// cgroup v1: the cpu controller's hierarchy, mounted as cpu or cpu,cpuacct.
TEST(CpuCountTest, Cgroup1ReadsTheCfsQuotaOfTheCpuController) {
  ScratchDir dir("cpu_count");
  ASSERT_FALSE(dir.path().empty());
  const fs::path root = dir.path();
  const fs::path cpu = root / "cpu,cpuacct";
  Write(cpu / "cpu.cfs_quota_us", "-1\n");
  Write(cpu / "cpu.cfs_period_us", "100000\n");
  Write(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "150000\n");
  Write(cpu / "docker" / "abc" / "cpu.cfs_period_us", "100000\n");
  const std::string self = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n";
  EXPECT_EQ(CgroupCpuQuota(self, root.string()), 1.5);
  Write(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n");
  EXPECT_EQ(CgroupCpuQuota(self, root.string()), std::nullopt);
  // A hybrid host: an empty v2 hierarchy does not hide the v1 quota.
  Write(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "400000\n");
  EXPECT_EQ(CgroupCpuQuota("0::/\n" + self, root.string()), 4.0);
  // Nothing mounted, or nothing readable: no quota.
  EXPECT_EQ(CgroupCpuQuota(self, (root / "none").string()), std::nullopt);
  EXPECT_EQ(CgroupCpuQuota("garbage\n", root.string()), std::nullopt);
}

// On this machine: between 1 and the CPUs online, and no more than the CPUs
// this thread may run on (the launching shell's taskset, if any).
TEST(CpuCountTest, UsableCoresIsWithinTheAffinityMask) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_GE(UsableCores(), 1);
  EXPECT_LE(UsableCores(), CPU_COUNT(&set));
  EXPECT_LE(UsableCores(), static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace
}  // namespace psflow
