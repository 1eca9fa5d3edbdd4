// Checks of flag values that several executables repeat, each with the one
// line it prints. No flags are defined here: tools link it without the
// role binaries' flags (role/cluster_flags.h). Thread-safe (no state).
#ifndef PSFLOW_ROLE_FLAG_CHECKS_H_
#define PSFLOW_ROLE_FLAG_CHECKS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cluster_config.h"

namespace psflow {

// For a role's main that refuses its command line: writes
// "psflow-<role>: <message>" as one line on stderr and returns
// kExitPermanent (1), the code to exit with.
int FlagError(Role role, absl::string_view message);

// A memory budget flag (--eval_memory_limit): "auto" is 0 (resolved later,
// on the device); otherwise a positive size as ParseByteSize reads it.
// INVALID_ARGUMENT "<flag>: <why>" for anything else.
absl::StatusOr<int64_t> MemoryLimitFlag(absl::string_view flag, const std::string& value);

}  // namespace psflow

#endif  // PSFLOW_ROLE_FLAG_CHECKS_H_
