// How many cores this process may use, for the default thread counts of the
// roles (kernel threads, a ps's appliers and decoders, the launcher's share
// per worker).
//
// A container on Kubernetes sees every core of its node, but its CPU limit
// becomes a CFS quota on its cgroup: a process that starts one busy thread
// per core of a 64-core node under a limit of 4 cores gets throttled most of
// every period, and OpenMP threads that spin while waiting for each other
// make that far worse. So the count is the CPUs of the process's affinity
// mask (taskset, cpuset, the kubelet's static CPU manager), lowered to its
// cgroup's CPU quota (cgroup v2 cpu.max, or v1 cpu.cfs_quota_us over
// cpu.cfs_period_us, the lowest along the path to the root), rounded up.
#ifndef PSFLOW_COMMON_CPU_COUNT_H_
#define PSFLOW_COMMON_CPU_COUNT_H_

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace psflow {

// The cores this process may use (at least 1); computed once.
int UsableCores();

// The pieces, for tests. The CPU quota in cores of a cgroup v2 cpu.max
// ("400000 100000" -> 4.0, "max 100000" -> none; malformed -> none).
std::optional<double> ParseCpuMax(absl::string_view text);

// The lowest CPU quota, in cores, of the cgroups named in `proc_self_cgroup`
// (the text of /proc/self/cgroup), with cgroupfs mounted at `root`
// (/sys/fs/cgroup): the v2 cgroup ("0::/path") and its ancestors, else the
// v1 cgroup of the cpu controller and its ancestors (under root/cpu or
// root/cpu,cpuacct). None when no quota is set or nothing can be read.
std::optional<double> CgroupCpuQuota(absl::string_view proc_self_cgroup, const std::string& root);

}  // namespace psflow

#endif  // PSFLOW_COMMON_CPU_COUNT_H_
