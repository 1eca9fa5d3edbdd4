#include "common/memory.h"

#include <malloc.h>

namespace psflow {

void KeepLargeAllocationsInHeap() {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

}  // namespace psflow
