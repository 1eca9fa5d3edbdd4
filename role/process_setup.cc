#include "role/process_setup.h"

#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <grpc/grpc.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"

namespace psflow {

void SetUpRoleProcess() {
  KeepLargeAllocationsInHeap();
  SkipMutexDeadlockDetection();
}

void KeepGrpcUntilExit() {
  // grpc_init counts references: this one is never given back.
  static const bool initialized = [] {
    // grpc_init starts gRPC's threads, which inherit this thread's mask.
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    grpc_init();
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
    return true;
  }();
  static_cast<void>(initialized);
}

void KeepLargeAllocationsInHeap() {
  // 32 MiB is the largest mmap threshold glibc accepts on 64-bit systems.
  if (mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1) mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

void SkipMutexDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

absl::Status RunOnlyOnIdleCores() {
  sched_param param{};
  param.sched_priority = 0;  // the only one SCHED_IDLE takes
  // This thread first, so that a thread started meanwhile inherits it.
  if (sched_setscheduler(0, SCHED_IDLE, &param) != 0) {
    return absl::InternalError(absl::StrCat("SCHED_IDLE: ", std::strerror(errno)));
  }
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task", error)) {
    pid_t tid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &tid)) continue;
    // A thread that ended since the listing (ESRCH) needs nothing.
    if (sched_setscheduler(tid, SCHED_IDLE, &param) != 0 && errno != ESRCH) {
      return absl::InternalError(
          absl::StrCat("SCHED_IDLE for thread ", tid, ": ", std::strerror(errno)));
    }
  }
  if (error) {
    return absl::InternalError(absl::StrCat("listing /proc/self/task: ", error.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<KernelThreadWait> ParseKernelThreadWait(absl::string_view text) {
  if (text == "auto") return KernelThreadWait::kAuto;
  if (text == "keep") return KernelThreadWait::kKeep;
  if (text == "passive") return KernelThreadWait::kPassive;
  return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not one of auto, keep, passive"));
}

std::string WantedOmpWaitPolicy(KernelThreadWait wait, int usable_cores, bool ps_on_host,
                                const char* now) {
  switch (wait) {
    case KernelThreadWait::kKeep:
      return "";
    case KernelThreadWait::kPassive:
      return "passive";
    case KernelThreadWait::kAuto:
      // (After its restart a worker finds its own choice in the environment.)
      if (now != nullptr && !absl::EqualsIgnoreCase(now, "passive")) return "";
      return usable_cores >= kPassiveFromCores && ps_on_host ? "passive" : "";
  }
  return "";
}

absl::Status RestartWithOmpWaitPolicy(const std::string& policy,
                                      const std::vector<std::string>& args, const char* program) {
  const char* value = std::getenv("OMP_WAIT_POLICY");
  if (value != nullptr && absl::EqualsIgnoreCase(value, policy)) return absl::OkStatus();
  const std::optional<std::string> now =
      value != nullptr ? std::optional<std::string>(value) : std::nullopt;
  if (setenv("OMP_WAIT_POLICY", policy.c_str(), /*overwrite=*/1) != 0) {
    return absl::InternalError(absl::StrCat("setenv OMP_WAIT_POLICY: ", std::strerror(errno)));
  }
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execv(program, argv.data());
  const int error = errno;
  // Gone on: its libgomp keeps what it read at load.
  if (now.has_value()) {
    setenv("OMP_WAIT_POLICY", now->c_str(), 1);
  } else {
    unsetenv("OMP_WAIT_POLICY");
  }
  return absl::InternalError(
      absl::StrCat("could not execute ", program, " again: ", std::strerror(error)));
}

ResourceUsage ProcessResourceUsage() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return {};
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  ResourceUsage u;
  u.user_s = seconds(usage.ru_utime);
  u.system_s = seconds(usage.ru_stime);
  u.voluntary_switches = usage.ru_nvcsw;
  u.involuntary_switches = usage.ru_nivcsw;
  return u;
}

void LogResourceUsage() {
  const ResourceUsage u = ProcessResourceUsage();
  PSLOG(INFO) << absl::StrFormat(
      "used %.2f s of CPU (user %.2f, system %.2f); context switches: %d voluntary, %d involuntary",
      u.cpu_s(), u.user_s, u.system_s, u.voluntary_switches, u.involuntary_switches);
}

}  // namespace psflow
