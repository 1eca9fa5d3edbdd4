// Process exit codes of the role binaries, chosen for the Kubeflow training
// operator's ExitCode restart policy: 1-127 are permanent failures (no
// restart), 128 and above are retried.
#ifndef PSFLOW_COMMON_EXIT_CODES_H_
#define PSFLOW_COMMON_EXIT_CODES_H_

namespace psflow {

inline constexpr int kExitDone = 0;
inline constexpr int kExitPermanent = 1;      // bad configuration or input: do not retry
inline constexpr int kExitUnreachable = 138;  // a peer unreachable within --startup_timeout
inline constexpr int kExitRetryable = 140;    // another failure worth a retry
// After signal n a process exits 128 + n (143 for SIGTERM).
inline constexpr int ExitCodeForSignal(int signal) { return 128 + signal; }

}  // namespace psflow

#endif  // PSFLOW_COMMON_EXIT_CODES_H_
