// CreateBackend: maps a device name to the backends compiled into this build;
// ExpandDevices and CreateDeviceGroup for several GPUs in one process.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kernels.h"
#if PSFLOW_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/nccl_group.h"
#endif

namespace psflow::kernels {
namespace {

struct Device {
  const char* name;
  absl::StatusOr<std::unique_ptr<Backend>> (*create)(int threads);
};

absl::StatusOr<std::unique_ptr<Backend>> CreateCpu(int threads) {
  auto backend = CpuBackend::Create(threads);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Backend>(std::move(*backend));
}

// One entry per backend in this build that has a fixed name; GPUs ("cuda:N")
// are matched in CreateBackend.
constexpr Device kDevices[] = {
    {"cpu", &CreateCpu},
};

#if PSFLOW_HAVE_CUDA
// "cuda" (GPU 0) or "cuda:N", N a non-negative decimal integer.
absl::StatusOr<std::unique_ptr<Backend>> CreateCuda(absl::string_view device) {
  int ordinal = 0;
  if (device != "cuda") {
    const absl::string_view index = device.substr(device.find(':') + 1);
    // SimpleAtoi alone would take signs and surrounding spaces.
    const bool digits = !index.empty() && index.find_first_not_of("0123456789") == index.npos;
    if (!digits || !absl::SimpleAtoi(index, &ordinal)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "invalid device '%s': the GPU index must be a non-negative integer (cuda:0, cuda:1, ...)",
          device));
    }
  }
  auto backend = CudaBackend::Create(ordinal);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Backend>(std::move(*backend));
}
#endif

// Host memory from the heap.
class HeapBuffer final : public Buffer {
 public:
  explicit HeapBuffer(size_t floats) : data_(floats, 0.0f) {}
  float* data() override { return data_.data(); }
  size_t size() const override { return data_.size(); }

 private:
  std::vector<float> data_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Buffer>> Backend::AllocateHost(size_t floats) {
  return std::make_unique<HeapBuffer>(floats);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& device, int threads) {
  if (threads < 0) return absl::InvalidArgumentError("thread count must not be negative");
  std::vector<std::string> names;
  for (const Device& d : kDevices) {
    if (device == d.name) return d.create(threads);
    names.push_back(d.name);
  }
#if PSFLOW_HAVE_CUDA
  if (device == "cuda" || absl::StartsWith(device, "cuda:")) return CreateCuda(device);
  names.push_back("cuda:N");
#endif
  return absl::InvalidArgumentError(absl::StrFormat("unknown device '%s' (this build supports: %s)",
                                                    device, absl::StrJoin(names, ", ")));
}

absl::StatusOr<std::vector<std::string>> ExpandDevices(const std::string& list) {
  std::vector<std::string> devices;
  if (list == "cuda:all") {
#if PSFLOW_HAVE_CUDA
    absl::StatusOr<int> count = CudaBackend::DeviceCount();
    if (!count.ok()) return count.status();
    for (int i = 0; i < *count; ++i) devices.push_back(absl::StrCat("cuda:", i));
    return devices;
#else
    return absl::UnavailableError("cuda:all: this build has no CUDA backend");
#endif
  }
  for (absl::string_view d : absl::StrSplit(list, ',')) {
    if (d.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("device list '%s' has an empty entry", list));
    }
    // "cuda" is cuda:0.
    const std::string name = d == "cuda" ? "cuda:0" : std::string(d);
    if (std::find(devices.begin(), devices.end(), name) != devices.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("device list '%s' names %s twice", list, name));
    }
    devices.push_back(name);
  }
  return devices;
}

absl::StatusOr<std::unique_ptr<DeviceGroup>> CreateDeviceGroup(
    const std::vector<Backend*>& backends) {
#if PSFLOW_HAVE_CUDA
  std::vector<CudaBackend*> gpus;
  for (Backend* b : backends) {
    auto* gpu = dynamic_cast<CudaBackend*>(b);
    if (gpu == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("device %s cannot join a group of GPUs", b->name()));
    }
    gpus.push_back(gpu);
  }
  return CreateNcclGroup(gpus);
#else
  return absl::UnimplementedError("several devices per process need the CUDA backend (NCCL)");
#endif
}

absl::StatusOr<std::string> NewPeerGroupId() {
#if PSFLOW_HAVE_CUDA
  return NewNcclPeerGroupId();
#else
  return absl::UnimplementedError("GPU peer groups need the CUDA backend (NCCL)");
#endif
}

absl::StatusOr<std::unique_ptr<PeerGroup>> JoinPeerGroup(Backend* backend, const std::string& id,
                                                         int rank, int size, WireDtype wire,
                                                         absl::Time deadline,
                                                         const std::function<bool()>& abandon) {
#if PSFLOW_HAVE_CUDA
  auto* gpu = dynamic_cast<CudaBackend*>(backend);
  if (gpu == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device %s cannot join a group of GPUs", backend->name()));
  }
  return JoinNcclPeerGroup(gpu, id, rank, size, wire, deadline, abandon);
#else
  return absl::UnimplementedError("GPU peer groups need the CUDA backend (NCCL)");
#endif
}

}  // namespace psflow::kernels
