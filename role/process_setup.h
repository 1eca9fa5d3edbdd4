// Process-wide settings of the role binaries (psflow-ps, psflow-worker,
// psflow-chief, psflow-evaluator), made once at the start of main.
#ifndef PSFLOW_ROLE_PROCESS_SETUP_H_
#define PSFLOW_ROLE_PROCESS_SETUP_H_

#include <cstdint>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace psflow {

// Makes two of the settings below: KeepLargeAllocationsInHeap and
// SkipMutexDeadlockDetection. Call once at the start of main, before any
// thread starts.
void SetUpRoleProcess();

// For tests that build gRPC servers in their process (PsServiceTest), not
// the roles. gRPC shuts its library down when the process's last gRPC object
// (a server, a channel) is destroyed, and that joins gRPC's executor threads. One of them may be in
// TCP's backup poller, which gRPC 1.51 starts when a socket's send buffer
// fills and which waits up to 10 s for events: a test that destroyed its
// server stalled 10 s at random (7 of 30 runs of one PsServiceTest under
// load). This holds one reference to the library until the process exits,
// so that no destructor shuts it down; exit ends its threads. The threads
// gRPC starts here block every signal, so that a termination signal never
// lands on one of them (where its default action would end the process) but
// on a thread of the process's own. Idempotent. Not for a process that
// forks without exec afterwards (a fast death test: its child deadlocked
// on exit), nor, for now, for the roles: a GPU worker of a job without ps,
// stopped by SIGTERM, hung at exit after its checkpoint with it (the cause
// is not known yet).
void KeepGrpcUntilExit();

// Every step moves megabytes of tensors through freshly allocated buffers
// (messages, gradients). By default glibc serves such blocks with mmap and
// returns them on free, so each step pays page faults on new memory. This
// keeps freed blocks of up to 32 MiB in the heap for reuse instead.
void KeepLargeAllocationsInHeap();

// Abseil built without NDEBUG (Debian's packages are) checks every
// absl::Mutex acquisition for lock-order cycles: each Lock takes one
// process-wide spin lock and updates a graph of the locks held, which gRPC's
// own locks (absl::Mutex underneath) pay too. This turns the check off. Unit
// tests, which do not call it, keep the check.
void SkipMutexDeadlockDetection();

// Puts every thread of this process under Linux's SCHED_IDLE policy, and so
// every thread it starts afterwards (they inherit the policy of the thread
// that starts them). Such threads never preempt other threads (of any other
// policy) and get a core while no other thread wants it. Errors name the
// thread whose policy could not be set. For a ps sharing cores with busy
// workers (psflow-ps --sched_idle).
absl::Status RunOnlyOnIdleCores();

// How a CPU worker's kernel threads (oneDNN's, on libgomp) wait between
// parallel regions. libgomp's own default spins a while, then sleeps: where
// the worker's threads fill the host's cores and the exchange (the lanes,
// the ps on the same host) needs cores between the passes, the spinning
// threads take them; sleeping at once (OMP_WAIT_POLICY=passive) costs a
// wake-up per region, which a host of few cores pays dearly
// (docs/performance.md, the eighteenth session).
enum class KernelThreadWait {
  kAuto,     // passive with at least kPassiveFromCores usable cores and a ps
             // on the same host, unless OMP_WAIT_POLICY says another policy;
             // else as the environment says
  kKeep,     // as the environment says (libgomp's default where unset)
  kPassive,  // OMP_WAIT_POLICY=passive
};
inline constexpr int kPassiveFromCores = 8;
// "auto", "keep" or "passive"; INVALID_ARGUMENT otherwise.
absl::StatusOr<KernelThreadWait> ParseKernelThreadWait(absl::string_view text);
// The OMP_WAIT_POLICY the process should run with, given the flag, its
// usable cores, whether a ps shares its host and the variable's value now
// (null: unset); empty: leave the environment as it is.
std::string WantedOmpWaitPolicy(KernelThreadWait wait, int usable_cores, bool ps_on_host,
                                const char* now);
// libgomp reads OMP_WAIT_POLICY once, as it loads, before main. So this
// sets it to `policy` and executes `program` (this one by default) with the
// arguments `args` (argv[0] first; a role passes CommandLineOfFlagsNow, in
// role/command_line.h, so that flags read from a pipe are not lost) in
// the same process, unless the variable already says `policy` (case
// aside), in which case it returns OK at once. Returns only then, or with
// the error of a failed exec (the environment is then as it was, and the
// process goes on as it is). Call before any thread starts.
absl::Status RestartWithOmpWaitPolicy(const std::string& policy,
                                      const std::vector<std::string>& args,
                                      const char* program = "/proc/self/exe");

// What the process used so far, all its threads together: CPU time (user
// and system) and context switches (voluntary: a thread blocked;
// involuntary: a thread was preempted). Zeros if the kernel does not say.
struct ResourceUsage {
  double user_s = 0;
  double system_s = 0;
  int64_t voluntary_switches = 0;
  int64_t involuntary_switches = 0;
  double cpu_s() const { return user_s + system_s; }
  int64_t switches() const { return voluntary_switches + involuntary_switches; }
};
ResourceUsage ProcessResourceUsage();

// Logs ProcessResourceUsage. The role binaries log it once their run is
// over; bench/throughput.sh adds up a job's CPU and context switches per step.
void LogResourceUsage();

}  // namespace psflow

#endif  // PSFLOW_ROLE_PROCESS_SETUP_H_
