#include "common/process_setup.h"

#include <malloc.h>

#include "absl/synchronization/mutex.h"

namespace psflow {

void SetUpRoleProcess() {
  KeepLargeAllocationsInHeap();
  SkipMutexDeadlockDetection();
}

void KeepLargeAllocationsInHeap() {
  // 32 MiB is the largest mmap threshold glibc accepts on 64-bit systems.
  if (mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1) mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

void SkipMutexDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

}  // namespace psflow
