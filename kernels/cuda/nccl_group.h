// kernels::DeviceGroup over CUDA backends, on NCCL (CreateDeviceGroup in
// kernels/backend.cc hands CUDA backends here).
#ifndef PSFLOW_KERNELS_CUDA_NCCL_GROUP_H_
#define PSFLOW_KERNELS_CUDA_NCCL_GROUP_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/kernels.h"

namespace psflow::kernels {

// At least two backends of distinct GPUs, which must outlive the group.
absl::StatusOr<std::unique_ptr<DeviceGroup>> CreateNcclGroup(
    const std::vector<CudaBackend*>& backends);

// kernels::NewPeerGroupId and JoinPeerGroup on NCCL (ncclGetUniqueId,
// ncclCommInitRank).
absl::StatusOr<std::string> NewNcclPeerGroupId();
absl::StatusOr<std::unique_ptr<PeerGroup>> JoinNcclPeerGroup(CudaBackend* backend,
                                                             const std::string& id, int rank,
                                                             int size, WireDtype wire,
                                                             absl::Time deadline,
                                                             const std::function<bool()>& abandon);

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_CUDA_NCCL_GROUP_H_
