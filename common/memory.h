// Process-wide allocator settings for the role binaries.
#ifndef PSFLOW_COMMON_MEMORY_H_
#define PSFLOW_COMMON_MEMORY_H_

namespace psflow {

// Every step moves megabytes of tensors through freshly allocated buffers
// (messages, gradients). By default glibc serves such blocks with mmap and
// returns them on free, so each step pays page faults on new memory. This
// keeps freed blocks of up to 32 MiB in the heap for reuse instead. Call once
// at the start of main.
void KeepLargeAllocationsInHeap();

}  // namespace psflow

#endif  // PSFLOW_COMMON_MEMORY_H_
