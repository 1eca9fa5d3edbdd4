// CreateBackend: maps a device name to the backends compiled into this build.
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kernels.h"

namespace psflow::kernels {
namespace {

struct Device {
  const char* name;
  absl::StatusOr<std::unique_ptr<Backend>> (*create)(int threads);
};

absl::StatusOr<std::unique_ptr<Backend>> CreateCpu(int threads) {
  auto backend = CpuBackend::Create(threads);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Backend>(std::move(*backend));
}

// One entry per backend in this build; a GPU backend adds its entry here
// (under its build option).
constexpr Device kDevices[] = {
    {"cpu", &CreateCpu},
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& device, int threads) {
  if (threads < 0) return absl::InvalidArgumentError("thread count must not be negative");
  std::vector<std::string> names;
  for (const Device& d : kDevices) {
    if (device == d.name) return d.create(threads);
    names.push_back(d.name);
  }
  return absl::InvalidArgumentError(absl::StrFormat("unknown device '%s' (this build supports: %s)",
                                                    device, absl::StrJoin(names, ", ")));
}

}  // namespace psflow::kernels
