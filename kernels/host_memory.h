// How much host memory this process may still take, as Linux tells it: the
// one place that reads /proc/meminfo and the memory cgroup's limit (the CPU
// backend's Backend::AvailableMemory). Thread-safe: it only reads files.
#ifndef PSFLOW_KERNELS_HOST_MEMORY_H_
#define PSFLOW_KERNELS_HOST_MEMORY_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace psflow::kernels {

// Bytes of host memory this process may still allocate: MemAvailable of
// /proc/meminfo, or less where a memory cgroup's limit leaves less above that
// cgroup's usage. Cgroups looked at: this process's own (from
// /proc/self/cgroup) and the one at the mount point, in v2
// (/sys/fs/cgroup[/path]/memory.max and memory.current) and v1
// (/sys/fs/cgroup/memory[/path]/memory.limit_in_bytes and
// memory.usage_in_bytes); "max", or a limit no smaller than MemTotal, is no
// limit, and cgroup files that are missing or unreadable are no limit either.
// UNAVAILABLE, naming the file, when /proc/meminfo cannot be read or lacks
// MemAvailable. `root` is put before every path: "" on a real system, a
// directory with a fake proc/ and sys/ in tests.
absl::StatusOr<int64_t> AvailableHostMemory(const std::string& root = "");

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_HOST_MEMORY_H_
