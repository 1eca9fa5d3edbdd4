#include "role/flag_checks.h"

#include <cstdio>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "common/exit_codes.h"

namespace psflow {

int FlagError(Role role, absl::string_view message) {
  std::fprintf(stderr, "psflow-%s: %.*s\n", RoleName(role).c_str(),
               static_cast<int>(message.size()), message.data());
  return kExitPermanent;
}

absl::StatusOr<int64_t> MemoryLimitFlag(absl::string_view flag, const std::string& value) {
  if (value == "auto") return 0;
  absl::StatusOr<int64_t> bytes = ParseByteSize(value);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", bytes.status().message()));
  }
  if (*bytes <= 0)
    return absl::InvalidArgumentError(absl::StrCat(flag, ": must be positive, or auto"));
  return *bytes;
}

}  // namespace psflow
