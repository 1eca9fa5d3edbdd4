#include "role/process_setup.h"

#include <malloc.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "role/signals.h"

namespace psflow {
namespace {

// Takes two mutexes in one order, then in the other: a lock-order cycle,
// which Abseil's deadlock detection reports (and, in its default mode where
// it is built in, aborts on). Exits 0 when the process survives it.
[[noreturn]] void InvertLockOrder(bool skip_detection) {
  if (skip_detection) SkipMutexDeadlockDetection();
  absl::Mutex a, b;
  a.Lock();
  b.Lock();
  b.Unlock();
  a.Unlock();
  b.Lock();
  a.Lock();
  a.Unlock();
  b.Unlock();
  // _exit: a forked child must not flush the parent's buffered output again.
  _exit(0);
}

// A child that only inverts the lock order: whether this build of Abseil
// checks lock order by default (Debian's does: it is built without NDEBUG).
bool AbseilChecksLockOrder() {
  const pid_t pid = fork();
  if (pid == 0) {
    // Keeps the report of a cycle off the test's output.
    std::freopen("/dev/null", "w", stderr);
    InvertLockOrder(false);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(ProcessSetupDeathTest, RoleProcessesSkipTheLockOrderCheck) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(InvertLockOrder(true), testing::ExitedWithCode(0), "");
  if (!AbseilChecksLockOrder()) {
    GTEST_SKIP() << "this Abseil does not check lock order by default (built with NDEBUG)";
  }
  // Without the setup, the same inversion ends the process: the check the
  // setup turns off is really there.
  EXPECT_DEATH(InvertLockOrder(false), "deadlock");
}

// In a child (the policy cannot be taken back without privileges): a
// thread started before and one started after both run under SCHED_IDLE,
// and so does the calling thread. Exits 0 when all three do.
[[noreturn]] void IdleEveryThread() {
  absl::Notification go, checked;
  std::atomic<int> before{-1};
  std::thread early([&] {
    go.WaitForNotification();
    before = sched_getscheduler(0);
    checked.Notify();
  });
  const bool ok = RunOnlyOnIdleCores().ok();
  go.Notify();
  checked.WaitForNotification();
  int after = -1;
  std::thread late([&] { after = sched_getscheduler(0); });
  late.join();
  early.join();
  _exit(ok && sched_getscheduler(0) == SCHED_IDLE && before == SCHED_IDLE && after == SCHED_IDLE
            ? 0
            : 1);
}

TEST(ProcessSetupDeathTest, EveryThreadRunsOnlyOnIdleCores) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ASSERT_NE(sched_getscheduler(0), SCHED_IDLE) << "the test's own process is not idle";
  EXPECT_EXIT(IdleEveryThread(), testing::ExitedWithCode(0), "");
  EXPECT_NE(sched_getscheduler(0), SCHED_IDLE) << "only the child changed";
}

TEST(ProcessSetupTest, LargeFreedBlocksStayInTheHeap) {
  KeepLargeAllocationsInHeap();
  // A block of 16 MiB, under the raised threshold, comes from the heap
  // (brk), not from a mapping of its own: mallinfo2 counts mapped blocks.
  const size_t mapped_before = mallinfo2().hblkhd;
  void* block = std::malloc(16 << 20);
  ASSERT_NE(block, nullptr);
  EXPECT_EQ(mallinfo2().hblkhd, mapped_before);
  std::free(block);
}

// The process's only gRPC object, a channel, is made and destroyed: the
// library stays initialized, so that destructor did not shut gRPC down (which
// joins gRPC's threads, and can wait 10 s on one of them).
TEST(ProcessSetupTest, GrpcOutlivesTheLastChannel) {
  KeepGrpcUntilExit();
  KeepGrpcUntilExit();  // a second call changes nothing
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials());
  ASSERT_NE(channel, nullptr);
  channel.reset();
  EXPECT_NE(grpc_is_initialized(), 0);
}

// gRPC's threads started first (by KeepGrpcUntilExit, in the child that
// runs the statement), then the termination signals blocked and watched. A
// SIGTERM must reach the watcher, not end the process on a gRPC thread that
// takes it by default.
TEST(ProcessSetupDeathTest, GrpcThreadsLeaveTerminationSignalsToTheWatcher) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        KeepGrpcUntilExit();
        BlockTerminationSignals();
        TerminationWatcher watcher([](int sig) { _exit(sig == SIGTERM ? 7 : 8); });
        kill(getpid(), SIGTERM);
        absl::SleepFor(absl::Seconds(10));
        _exit(1);
      },
      testing::ExitedWithCode(7), "");
}

TEST(KernelThreadWaitTest, FlagValues) {
  EXPECT_EQ(*ParseKernelThreadWait("auto"), KernelThreadWait::kAuto);
  EXPECT_EQ(*ParseKernelThreadWait("keep"), KernelThreadWait::kKeep);
  EXPECT_EQ(*ParseKernelThreadWait("passive"), KernelThreadWait::kPassive);
  const absl::StatusOr<KernelThreadWait> bad = ParseKernelThreadWait("active");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "'active' is not one of auto, keep, passive");
}

// auto: passive from kPassiveFromCores usable cores on where a ps shares
// the host, unless the environment says another policy; keep never changes
// it; passive always.
TEST(KernelThreadWaitTest, WhichPolicyEachChoiceWants) {
  const KernelThreadWait kAuto = KernelThreadWait::kAuto;
  EXPECT_EQ(WantedOmpWaitPolicy(kAuto, kPassiveFromCores, true, nullptr), "passive");
  EXPECT_EQ(WantedOmpWaitPolicy(kAuto, 64, true, nullptr), "passive");
  EXPECT_EQ(WantedOmpWaitPolicy(kAuto, 64, false, nullptr), "");
  EXPECT_EQ(WantedOmpWaitPolicy(kAuto, kPassiveFromCores - 1, true, nullptr), "");
  EXPECT_EQ(WantedOmpWaitPolicy(kAuto, 2, true, nullptr), "");
  EXPECT_EQ(WantedOmpWaitPolicy(kAuto, 64, true, "active"), "");
  EXPECT_EQ(WantedOmpWaitPolicy(kAuto, 64, true, "PASSIVE"), "passive");
  EXPECT_EQ(WantedOmpWaitPolicy(kAuto, 2, true, "passive"), "");
  EXPECT_EQ(WantedOmpWaitPolicy(KernelThreadWait::kKeep, 64, true, nullptr), "");
  EXPECT_EQ(WantedOmpWaitPolicy(KernelThreadWait::kPassive, 2, false, nullptr), "passive");
  EXPECT_EQ(WantedOmpWaitPolicy(KernelThreadWait::kPassive, 2, false, "active"), "passive");
}

// Asks for passive waits and executes a shell that writes what
// OMP_WAIT_POLICY held as it started, and its parent's process id, to `report`.
void RestartAShellWithPassiveWaits(const std::string& report) {
  unsetenv("OMP_WAIT_POLICY");
  const std::string script = "printf '%s %s' \"$OMP_WAIT_POLICY\" \"$PPID\" > '" + report + "'";
  const absl::Status s = RestartWithOmpWaitPolicy("passive", {"sh", "-c", script}, "/bin/sh");
  _exit(s.ok() ? 3 : 4);  // returned: not executed again
}

// A child process asks for passive waits: the program (here a shell, in
// the roles /proc/self/exe) runs in its place, the same process, with
// OMP_WAIT_POLICY=passive in the environment it starts with. Asked for what
// the environment holds already (in any case), nothing is executed again.
TEST(KernelThreadWaitDeathTest, RestartSetsThePolicyBeforeTheProgramLoads) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string report = ::testing::TempDir() + "/psflow_omp_report";
  std::remove(report.c_str());
  EXPECT_EXIT(RestartAShellWithPassiveWaits(report), testing::ExitedWithCode(0), "");
  std::ifstream in(report);
  std::string policy;
  pid_t parent = 0;
  in >> policy >> parent;
  EXPECT_EQ(policy, "passive");
  EXPECT_EQ(parent, getpid()) << "the shell is the child itself";

  // (A program that is not there: were it executed, the error says so.)
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  const std::vector<std::string> none = {"psflow"};
  EXPECT_TRUE(RestartWithOmpWaitPolicy("passive", none, "/nonexistent/psflow").ok());
  // An exec that fails leaves the environment as it was.
  setenv("OMP_WAIT_POLICY", "active", 1);
  const absl::Status failed = RestartWithOmpWaitPolicy("passive", none, "/nonexistent/psflow");
  EXPECT_FALSE(failed.ok());
  EXPECT_TRUE(absl::StrContains(failed.message(), "could not execute /nonexistent/psflow"))
      << failed;
  EXPECT_STREQ(std::getenv("OMP_WAIT_POLICY"), "active");
  unsetenv("OMP_WAIT_POLICY");
}

}  // namespace
}  // namespace psflow
