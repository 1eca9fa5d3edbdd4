#include "common/cpu_count.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace psflow {
namespace {

namespace fs = std::filesystem;

std::optional<std::string> ReadSmallFile(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text;
}

// The quotas read by `quota_of` in the cgroup at `cgroup_path` under `root`
// and in each of its ancestors up to `root` (a cgroup cannot use more than
// its parent): the lowest.
template <typename QuotaOf>
std::optional<double> LowestUpTo(const fs::path& root, absl::string_view cgroup_path,
                                 const QuotaOf& quota_of) {
  std::vector<fs::path> dirs = {root};
  for (absl::string_view part : absl::StrSplit(cgroup_path, '/', absl::SkipEmpty())) {
    if (part == "." || part == "..") {  // outside this mount's view: its root alone
      dirs.resize(1);
      break;
    }
    dirs.push_back(dirs.back() / std::string(part));
  }
  // Under a cgroup namespace the path may not exist in this mount, whose
  // root is then the process's own cgroup.
  std::error_code ec;
  if (!fs::is_directory(dirs.back(), ec)) dirs.resize(1);
  std::optional<double> lowest;
  for (const fs::path& dir : dirs) {
    if (std::optional<double> q = quota_of(dir); q && (!lowest || *q < *lowest)) lowest = q;
  }
  return lowest;
}

std::optional<double> V1Quota(const fs::path& dir) {
  const std::optional<std::string> quota = ReadSmallFile(dir / "cpu.cfs_quota_us");
  const std::optional<std::string> period = ReadSmallFile(dir / "cpu.cfs_period_us");
  int64_t q = 0, p = 0;
  if (!quota || !period || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*quota), &q) ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(*period), &p) || q <= 0 || p <= 0) {
    return std::nullopt;  // -1: no quota
  }
  return static_cast<double>(q) / static_cast<double>(p);
}

int AffinityCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

std::optional<double> ParseCpuMax(absl::string_view text) {
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::StripAsciiWhitespace(text), ' ', absl::SkipEmpty());
  int64_t quota = 0, period = 0;
  if (fields.size() != 2 || !absl::SimpleAtoi(fields[0], &quota) ||
      !absl::SimpleAtoi(fields[1], &period) || quota <= 0 || period <= 0) {
    return std::nullopt;  // "max ...": no quota
  }
  return static_cast<double>(quota) / static_cast<double>(period);
}

std::optional<double> CgroupCpuQuota(absl::string_view proc_self_cgroup, const std::string& root) {
  // Lines of "hierarchy-ID:controller-list:cgroup-path".
  std::optional<std::string> v2_path, v1_path;
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) v2_path = std::string(f[2]);
    for (absl::string_view controller : absl::StrSplit(f[1], ',')) {
      if (controller == "cpu") v1_path = std::string(f[2]);
    }
  }
  if (v2_path) {
    std::optional<double> q = LowestUpTo(root, *v2_path, [](const fs::path& dir) {
      const std::optional<std::string> text = ReadSmallFile(dir / "cpu.max");
      return text ? ParseCpuMax(*text) : std::nullopt;
    });
    if (q) return q;
  }
  if (v1_path) {
    for (const char* mount : {"cpu", "cpu,cpuacct", "cpuacct,cpu"}) {
      const fs::path at = fs::path(root) / mount;
      std::error_code ec;
      if (fs::is_directory(at, ec)) return LowestUpTo(at, *v1_path, V1Quota);
    }
  }
  return std::nullopt;
}

int UsableCores() {
  static const int cores = [] {
    int n = AffinityCores();
    const std::optional<std::string> cgroup = ReadSmallFile("/proc/self/cgroup");
    if (cgroup) {
      if (std::optional<double> quota = CgroupCpuQuota(*cgroup, "/sys/fs/cgroup")) {
        n = std::min(n, static_cast<int>(std::ceil(*quota - 1e-9)));
      }
    }
    return std::max(1, n);
  }();
  return cores;
}

}  // namespace psflow
