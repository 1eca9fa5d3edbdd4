#include "common/memory.h"

#include <malloc.h>

namespace psflow {

void KeepLargeAllocationsInHeap() {
  // 32 MiB is the largest mmap threshold glibc accepts on 64-bit systems.
  if (mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1) mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

}  // namespace psflow
