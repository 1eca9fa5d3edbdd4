// Process exit codes of the role binaries, chosen for the Kubeflow training
// operator's ExitCode restart policy: 1-127 are permanent failures (no
// restart), 128 and above are retried. Role logic returns absl::Status; each
// executable's main turns the final status into its exit code with
// ExitCodeFor, in one place.
#ifndef PSFLOW_COMMON_EXIT_CODES_H_
#define PSFLOW_COMMON_EXIT_CODES_H_

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace psflow {

inline constexpr int kExitDone = 0;
inline constexpr int kExitPermanent = 1;      // bad configuration or input: do not retry
inline constexpr int kExitUnreachable = 138;  // a peer unreachable within --startup_timeout
inline constexpr int kExitRetryable = 140;    // another failure worth a retry
// After signal n a process exits 128 + n (143 for SIGTERM).
inline constexpr int ExitCodeForSignal(int signal) { return 128 + signal; }

// The status of a role stopped by signal `signal` (CANCELLED, carrying it).
absl::Status StoppedBySignal(int signal);
// The signal a StoppedBySignal status carries, if any.
std::optional<int> SignalOf(const absl::Status& status);

// The exit code for a role's final status:
//   OK                                        -> 0
//   StoppedBySignal(n)                        -> 128 + n
//   INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, OUT_OF_RANGE,
//   ALREADY_EXISTS, PERMISSION_DENIED, UNAUTHENTICATED, UNIMPLEMENTED
//                                             -> 1   (the same input fails again)
//   UNAVAILABLE, DEADLINE_EXCEEDED            -> 138 (a peer stayed unreachable)
//   anything else                             -> 140 (worth a retry)
int ExitCodeFor(const absl::Status& status);

// Whether a call that failed with `status` may succeed if tried again: the
// peer is not up yet, or the connection broke (UNAVAILABLE), or the call ran
// out of time (DEADLINE_EXCEEDED). The one retry rule of every role.
bool IsRetryable(const absl::Status& status);

// A failure that happens again with the same input, whatever the code of
// `status`: INVALID_ARGUMENT stays, anything else becomes FAILED_PRECONDITION
// (exit code 1); `context` goes before the message.
absl::Status Permanent(const absl::Status& status, absl::string_view context = "");

// What a role's loop returns to itself to say "register with the chief
// again" (the job was reloaded, this process was dropped from it): ABORTED,
// told apart by a payload. Never a role's final status.
absl::Status RegisterAgain(absl::string_view why);
bool IsRegisterAgain(const absl::Status& status);

}  // namespace psflow

#endif  // PSFLOW_COMMON_EXIT_CODES_H_
