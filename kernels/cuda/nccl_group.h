// kernels::DeviceGroup over CUDA backends, on NCCL (CreateDeviceGroup in
// kernels/backend.cc hands CUDA backends here).
#ifndef PSFLOW_KERNELS_CUDA_NCCL_GROUP_H_
#define PSFLOW_KERNELS_CUDA_NCCL_GROUP_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/kernels.h"

namespace psflow::kernels {

// At least two backends of distinct GPUs, which must outlive the group.
absl::StatusOr<std::unique_ptr<DeviceGroup>> CreateNcclGroup(
    const std::vector<CudaBackend*>& backends);

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_CUDA_NCCL_GROUP_H_
