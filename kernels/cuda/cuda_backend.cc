// CUDA backend on cuDNN (legacy API), cuBLAS and kernels/cuda/cuda_kernels.cu;
// see cuda_backend.h for the design and the contract. This file holds the
// backend itself (context, device memory, copies and uploads, events, graphs)
// and hands op creation to the ops' files (cuda_ops_internal.h).
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_ops_internal.h"

namespace psflow::kernels {
namespace cuda_internal {
namespace {

// The function name of a stringized call such as "cudaMalloc(&p, bytes)".
absl::string_view FunctionName(absl::string_view call) { return call.substr(0, call.find('(')); }

// cuDNN's legacy descriptors (and our kernels' row indices) take int sizes.
bool FitsInt(int64_t n) { return n > 0 && n <= std::numeric_limits<int>::max(); }

// cuBLAS's own workspace (its default pool size on Hopper). Given explicitly,
// so that cuBLAS never allocates during graph capture.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Makes one of the context's side streams (copies, uploads) at its first
// use. Call inside RunIn.
absl::Status EnsureStream(cudaStream_t* stream) {
  if (*stream == nullptr) {
    PSFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------- error checks

void ClearLastError() { static_cast<void>(cudaGetLastError()); }

absl::Status CheckCuda(cudaError_t err, absl::string_view call) {
  if (err == cudaSuccess) return absl::OkStatus();
  ClearLastError();
  return absl::InternalError(absl::StrCat(FunctionName(call), " failed: ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

absl::Status CheckCudnn(cudnnStatus_t status, absl::string_view call) {
  if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  ClearLastError();
  std::string message = absl::StrCat(FunctionName(call), " failed: ", cudnnGetErrorString(status));
  char detail[512] = "";
  cudnnGetLastErrorString(detail, sizeof detail);  // cuDNN 9's explanation, often empty
  if (detail[0] != '\0') absl::StrAppend(&message, " (", detail, ")");
  return absl::InternalError(message);
}

absl::Status CheckCublas(cublasStatus_t status, absl::string_view call) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  ClearLastError();
  return absl::InternalError(absl::StrCat(FunctionName(call),
                                          " failed: ", cublasGetStatusName(status), " (",
                                          cublasGetStatusString(status), ")"));
}

// `what: message`, same code; OK stays OK.
absl::Status Annotate(absl::Status status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

absl::Status CheckNonNull(std::initializer_list<std::pair<absl::string_view, const void*>> args) {
  for (const auto& [name, ptr] : args) {
    if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  }
  return absl::OkStatus();
}

absl::Status CheckCount(int64_t n, absl::string_view what) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative count ", n));
  return absl::OkStatus();
}

absl::Status CheckElementCount(
    absl::string_view what, std::initializer_list<std::pair<absl::string_view, int64_t>> tensors) {
  for (const auto& [name, count] : tensors) {
    if (!FitsInt(count)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", name, " has ", count, " elements; the CUDA backend takes at most 2^31-1"));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- context

Scope::Scope(CudaContext& ctx) : lock_(ctx.mu) {
  int current = -1;
  status_ = CheckCuda(cudaGetDevice(&current), "cudaGetDevice");
  if (status_.ok() && current != ctx.device) {
    status_ = CheckCuda(cudaSetDevice(ctx.device), "cudaSetDevice");
    if (status_.ok()) restore_ = current;
  }
}

Scope::~Scope() {
  if (restore_ >= 0) static_cast<void>(cudaSetDevice(restore_));
}

absl::Status WithStep(const absl::Status& status, absl::string_view what, absl::string_view step) {
  return absl::Status(status.code(),
                      absl::StrCat(what, step.empty() ? "" : " ", step, ": ", status.message()));
}

CudaContext::~CudaContext() {
  // Nothing else refers to the context any more; errors can only be dropped.
  if (cudaSetDevice(device) != cudaSuccess) return;
  if (stream != nullptr) static_cast<void>(cudaStreamSynchronize(stream));
  if (copy_stream != nullptr) {
    static_cast<void>(cudaStreamSynchronize(copy_stream));
    static_cast<void>(cudaStreamDestroy(copy_stream));
  }
  if (upload_stream != nullptr) {
    static_cast<void>(cudaStreamSynchronize(upload_stream));
    static_cast<void>(cudaStreamDestroy(upload_stream));
  }
  if (uploads_joined != nullptr) static_cast<void>(cudaEventDestroy(uploads_joined));
  if (upload_buffer != nullptr) static_cast<void>(cudaFree(upload_buffer));
  if (cublas != nullptr) static_cast<void>(cublasDestroy(cublas));
  if (cudnn != nullptr) static_cast<void>(cudnnDestroy(cudnn));
  if (cublas_workspace != nullptr) static_cast<void>(cudaFree(cublas_workspace));
  if (stream != nullptr) static_cast<void>(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------- device memory

void DeviceDeleter::operator()(void* p) const {
  if (p == nullptr) return;
  Scope scope(*ctx);
  if (!scope.status().ok()) return;
  static_cast<void>(cudaStreamSynchronize(ctx->stream));
  // An upload may still be writing it.
  if (ctx->upload_stream != nullptr) static_cast<void>(cudaStreamSynchronize(ctx->upload_stream));
  static_cast<void>(cudaFree(p));
}

absl::Status AllocateDevice(const std::shared_ptr<CudaContext>& ctx, size_t bytes, bool zero,
                            DevicePtr& out) {
  bytes = std::max<size_t>(bytes, 1);
  void* p = nullptr;
  if (const cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
    absl::Status status = CheckCuda(err, "cudaMalloc");
    if (err == cudaErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of GPU memory for ", bytes, " bytes: ", status.message()));
    }
    return status;
  }
  out = DevicePtr(p, DeviceDeleter{ctx});
  if (zero) {
    PSFLOW_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, ctx->stream));
    PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
  }
  return absl::OkStatus();
}

}  // namespace cuda_internal

namespace {

using cuda_internal::Annotate;
using cuda_internal::CheckCount;
using cuda_internal::CheckCublas;
using cuda_internal::CheckCuda;
using cuda_internal::CheckCudnn;
using cuda_internal::CheckNonNull;
using cuda_internal::CudaContext;
using cuda_internal::DevicePtr;
using cuda_internal::Floats;
using cuda_internal::RunIn;
using cuda_internal::Scope;

class CudaBuffer final : public Buffer {
 public:
  CudaBuffer(DevicePtr memory, size_t size) : memory_(std::move(memory)), size_(size) {}

  float* data() override { return Floats(memory_); }
  size_t size() const override { return size_; }

 private:
  DevicePtr memory_;
  size_t size_;
};

// ---------------------------------------------------------------- Graph

struct GraphDeleter {
  void operator()(cudaGraph_t g) const { static_cast<void>(cudaGraphDestroy(g)); }
};
using GraphPtr = std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, GraphDeleter>;

class CudaGraph final : public Graph {
 public:
  CudaGraph(std::shared_ptr<CudaContext> ctx, GraphPtr graph, cudaGraphExec_t exec)
      : ctx_(std::move(ctx)), graph_(std::move(graph)), exec_(exec) {}

  ~CudaGraph() override {
    // A replay still in flight finishes first (CUDA frees the executable
    // graph asynchronously).
    Scope scope(*ctx_);
    if (scope.status().ok()) static_cast<void>(cudaGraphExecDestroy(exec_));
    graph_.reset();
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  absl::Status Launch() override {
    return RunIn(*ctx_, "Graph", "launch", [&]() -> absl::Status {
      PSFLOW_CUDA_CHECK(cudaGraphLaunch(exec_, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  GraphPtr graph_;
  cudaGraphExec_t exec_;
};

}  // namespace

// ---------------------------------------------------------------- CudaBackend

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device_ordinal) {
  const std::string name = absl::StrCat("cuda:", device_ordinal);
  if (device_ordinal < 0) {
    return absl::InvalidArgumentError(name + ": the GPU index must not be negative");
  }
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cuda_internal::ClearLastError();
    return absl::UnavailableError(absl::StrCat(name, ": no usable CUDA device (",
                                               cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                                               ")"));
  }
  if (device_ordinal >= count) {
    return absl::UnavailableError(
        absl::StrCat(name, ": this machine has ", count, " CUDA device", count == 1 ? "" : "s"));
  }

  auto ctx = std::make_shared<CudaContext>(device_ordinal);
  absl::Status status = [&]() -> absl::Status {
    Scope scope(*ctx);
    PSFLOW_RETURN_IF_ERROR(scope.status());
    PSFLOW_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
    PSFLOW_CUDNN_CHECK(cudnnCreate(&ctx->cudnn));
    PSFLOW_CUDNN_CHECK(cudnnSetStream(ctx->cudnn, ctx->stream));
    PSFLOW_CUBLAS_CHECK(cublasCreate(&ctx->cublas));
    PSFLOW_CUBLAS_CHECK(cublasSetStream(ctx->cublas, ctx->stream));
    PSFLOW_CUDA_CHECK(cudaMalloc(&ctx->cublas_workspace, cuda_internal::kCublasWorkspaceBytes));
    PSFLOW_CUBLAS_CHECK(cublasSetWorkspace(ctx->cublas, ctx->cublas_workspace,
                                           cuda_internal::kCublasWorkspaceBytes));
    // CUBLAS_DEFAULT_MATH: fp32 GEMMs keep full fp32 precision (no TF32
    // tensor cores). alpha and beta are read from the host.
    PSFLOW_CUBLAS_CHECK(cublasSetMathMode(ctx->cublas, CUBLAS_DEFAULT_MATH));
    PSFLOW_CUBLAS_CHECK(cublasSetPointerMode(ctx->cublas, CUBLAS_POINTER_MODE_HOST));
    return absl::OkStatus();
  }();
  PSFLOW_RETURN_IF_ERROR(Annotate(status, name));
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(ctx)));
}

CudaBackend::CudaBackend(std::shared_ptr<CudaContext> ctx) : ctx_(std::move(ctx)) {}
CudaBackend::~CudaBackend() = default;

std::string CudaBackend::name() const { return absl::StrCat("cuda:", ctx_->device); }

absl::StatusOr<std::unique_ptr<Buffer>> CudaBackend::Allocate(size_t floats) {
  if (floats > std::numeric_limits<size_t>::max() / sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("Allocate: ", floats, " floats is too many"));
  }
  DevicePtr memory;
  PSFLOW_RETURN_IF_ERROR(RunIn(*ctx_, "Allocate", floats, "floats", [&] {
    return AllocateDevice(ctx_, floats * sizeof(float), true, memory);
  }));
  return std::make_unique<CudaBuffer>(std::move(memory), floats);
}

namespace {

// Page-locked host memory.
class PinnedBuffer final : public Buffer {
 public:
  PinnedBuffer(float* data, size_t size) : data_(data), size_(size) {}
  ~PinnedBuffer() override { static_cast<void>(cudaFreeHost(data_)); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  float* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  float* const data_;
  const size_t size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Buffer>> CudaBackend::AllocateHost(size_t floats) {
  if (floats > std::numeric_limits<size_t>::max() / sizeof(float)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllocateHost: ", floats, " floats is too many"));
  }
  void* memory = nullptr;
  const size_t bytes = std::max<size_t>(floats, 1) * sizeof(float);
  PSFLOW_RETURN_IF_ERROR(RunIn(*ctx_, "AllocateHost", floats, "floats", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaHostAlloc(&memory, bytes, cudaHostAllocPortable));
    return absl::OkStatus();
  }));
  std::memset(memory, 0, bytes);
  return std::make_unique<PinnedBuffer>(static_cast<float*>(memory), floats);
}

absl::Status CudaBackend::CopyToDevice(const float* host, size_t floats, float* device) {
  if (floats == 0) return absl::OkStatus();
  return RunIn(*ctx_, "CopyToDevice", floats, "floats", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"host", host}, {"device", device}}));
    // From pageable memory the driver stages the data before returning; from
    // page-locked memory the copy is queued like any other work.
    PSFLOW_CUDA_CHECK(cudaMemcpyAsync(device, host, floats * sizeof(float), cudaMemcpyHostToDevice,
                                      ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CopyToHost(const float* device, size_t floats, float* host) {
  if (floats == 0) return absl::OkStatus();
  return RunIn(*ctx_, "CopyToHost", floats, "floats", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"device", device}, {"host", host}}));
    PSFLOW_CUDA_CHECK(cudaMemcpyAsync(host, device, floats * sizeof(float), cudaMemcpyDeviceToHost,
                                      ctx_->stream));
    PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CopyToHostAfter(Event* ready, const std::vector<HostCopy>& copies) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(ready);
  if (cuda_event == nullptr) {
    return absl::InvalidArgumentError("CopyToHostAfter: not a CUDA event");
  }
  for (const HostCopy& c : copies) {
    if (c.floats > 0)
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"device", c.device}, {"host", c.host}}));
  }
  return RunIn(*ctx_, "CopyToHostAfter", "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(cuda_internal::EnsureStream(&ctx_->copy_stream));
    PSFLOW_CUDA_CHECK(
        cudaStreamWaitEvent(ctx_->copy_stream, static_cast<cudaEvent_t>(cuda_event->raw()), 0));
    for (const HostCopy& c : copies) {
      if (c.floats == 0) continue;
      PSFLOW_CUDA_CHECK(cudaMemcpyAsync(c.host, c.device, c.floats * sizeof(float),
                                        cudaMemcpyDeviceToHost, ctx_->copy_stream));
    }
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::WaitCopies() {
  return RunIn(*ctx_, "WaitCopies", "", [&]() -> absl::Status {
    if (ctx_->copy_stream != nullptr) PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->copy_stream));
    return absl::OkStatus();
  });
}

namespace {

// Records `done` on the side stream `*stream` of `ctx` (made at its first
// use): RecordCopiesDone, RecordUploadsDone.
absl::Status RecordOnSideStream(CudaContext& ctx, cudaStream_t* stream, Event* done,
                                absl::string_view what) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(done);
  if (cuda_event == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a CUDA event"));
  }
  return RunIn(ctx, what, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(cuda_internal::EnsureStream(stream));
    PSFLOW_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(cuda_event->raw()), *stream));
    return absl::OkStatus();
  });
}

}  // namespace

absl::Status CudaBackend::RecordCopiesDone(Event* done) {
  return RecordOnSideStream(*ctx_, &ctx_->copy_stream, done, "RecordCopiesDone");
}

absl::Status CudaBackend::WaitEvent(Event* event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(event);
  if (cuda_event == nullptr) return absl::InvalidArgumentError("WaitEvent: not a CUDA event");
  // Without the context's lock (another thread may hold it while it waits
  // for the stream): only this thread's current device is set, and then
  // restored.
  int current = -1;
  absl::Status status = [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaGetDevice(&current));
    if (current != ctx_->device) PSFLOW_CUDA_CHECK(cudaSetDevice(ctx_->device));
    PSFLOW_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(cuda_event->raw())));
    return absl::OkStatus();
  }();
  if (current >= 0 && current != ctx_->device) static_cast<void>(cudaSetDevice(current));
  return Annotate(status, "WaitEvent");
}

namespace {

// The CUDA event an upload waits for: null for none; INVALID_ARGUMENT
// (naming `what`) for an event of another backend.
absl::StatusOr<CudaEvent*> UploadEvent(Event* after, absl::string_view what) {
  if (after == nullptr) return nullptr;
  auto* cuda_event = dynamic_cast<CudaEvent*>(after);
  if (cuda_event == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a CUDA event"));
  }
  return cuda_event;
}

// Makes the context's stream of uploads wait for `after` (if any), making
// the stream at its first use. Call inside RunIn.
absl::Status UploadStreamWaitsFor(CudaContext& ctx, CudaEvent* after) {
  PSFLOW_RETURN_IF_ERROR(cuda_internal::EnsureStream(&ctx.upload_stream));
  if (after != nullptr) {
    PSFLOW_CUDA_CHECK(
        cudaStreamWaitEvent(ctx.upload_stream, static_cast<cudaEvent_t>(after->raw()), 0));
  }
  return absl::OkStatus();
}

// Makes the context's buffer of uploads hold at least `bytes` (once its
// stream is past every queued kernel that reads the old one). Call inside
// RunIn, with the stream of uploads made.
absl::Status GrowUploadBuffer(CudaContext& ctx, size_t bytes) {
  if (ctx.upload_buffer_bytes >= bytes) return absl::OkStatus();
  PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx.upload_stream));
  if (ctx.upload_buffer != nullptr) PSFLOW_CUDA_CHECK(cudaFree(ctx.upload_buffer));
  ctx.upload_buffer = nullptr;
  ctx.upload_buffer_bytes = 0;
  PSFLOW_CUDA_CHECK(cudaMalloc(&ctx.upload_buffer, bytes));
  ctx.upload_buffer_bytes = bytes;
  return absl::OkStatus();
}

// The pointers of CopyToDeviceAfter's uploads checked, and the distinct
// events they wait for.
absl::StatusOr<std::vector<CudaEvent*>> UploadEvents(const std::vector<Backend::Upload>& uploads) {
  std::vector<CudaEvent*> events;
  for (const Backend::Upload& u : uploads) {
    PSFLOW_ASSIGN_OR_RETURN(CudaEvent* const e, UploadEvent(u.after, "CopyToDeviceAfter"));
    if (e != nullptr && std::find(events.begin(), events.end(), e) == events.end()) {
      events.push_back(e);
    }
    if (u.elements > 0) {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"host", u.host}, {"device", u.device}}));
    }
  }
  return events;
}

// One copy of CopyToDeviceAfter: [begin, end) of host memory, holding
// `uploads` uploads from upload `first` on; to byte `at` of the buffer, or
// (`direct`: one upload of floats) straight to its place.
struct UploadSpan {
  const char* begin;
  const char* end;
  size_t first;
  int uploads = 0;
  size_t at = 0;
  bool direct = false;
};

// How CopyToDeviceAfter moves its uploads: the copies, the copy of each
// non-empty upload, and the bytes of the buffer the copies fill.
struct UploadPlan {
  std::vector<UploadSpan> spans;
  std::vector<size_t> span_of;  // by non-empty upload
  size_t bytes = 0;
};

UploadPlan PlanUploads(const std::vector<Backend::Upload>& uploads, Backend::HostValues values) {
  // Host ranges of one block at most this far apart (in ascending order, as
  // a pull lays its slices out in a region) cross in one copy, the gap with
  // them. (Never two blocks: the bytes between may not be mapped, and one
  // copy from two page-locked allocations is refused.)
  constexpr size_t kGapBytes = 4096;
  constexpr size_t kAlign = 256;
  const size_t value_bytes =
      values == Backend::HostValues::kFloat ? sizeof(float) : sizeof(uint16_t);
  UploadPlan plan;
  std::vector<UploadSpan>& spans = plan.spans;
  plan.span_of.assign(uploads.size(), 0);
  for (size_t i = 0; i < uploads.size(); ++i) {
    const Backend::Upload& u = uploads[i];
    if (u.elements == 0) continue;
    const char* const begin = static_cast<const char*>(u.host);
    const char* const end = begin + u.elements * value_bytes;
    if (spans.empty() || u.block == nullptr || u.block != uploads[spans.back().first].block ||
        begin < spans.back().end || static_cast<size_t>(begin - spans.back().end) > kGapBytes) {
      spans.push_back({begin, end, i});
    } else {
      spans.back().end = end;
    }
    ++spans.back().uploads;
    plan.span_of[i] = spans.size() - 1;
  }
  for (UploadSpan& s : spans) {
    s.direct = values == Backend::HostValues::kFloat && s.uploads == 1;
    if (s.direct) continue;
    s.at = (plan.bytes + kAlign - 1) / kAlign * kAlign;
    plan.bytes = s.at + static_cast<size_t>(s.end - s.begin);
  }
  return plan;
}

// Queues the kernels that place (and widen) the uploads that crossed
// through the buffer at `buffer`, kMaxUploadPieces a launch. Call inside
// RunIn.
absl::Status PlaceUploads(CudaContext& ctx, const std::vector<Backend::Upload>& uploads,
                          const UploadPlan& plan, const char* buffer, Backend::HostValues values) {
  const cuda_internal::PieceValues piece_values =
      values == Backend::HostValues::kFloat      ? cuda_internal::PieceValues::kFloat
      : values == Backend::HostValues::kBfloat16 ? cuda_internal::PieceValues::kBfloat16
                                                 : cuda_internal::PieceValues::kHalf;
  cuda_internal::UploadPieces pieces;
  int num = 0;
  int64_t max_count = 0;
  auto launch = [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(
        cuda_internal::LaunchUploadPieces(pieces, num, max_count, piece_values, ctx.upload_stream));
    num = 0;
    max_count = 0;
    return absl::OkStatus();
  };
  for (size_t i = 0; i < uploads.size(); ++i) {
    if (uploads[i].elements == 0) continue;
    const UploadSpan& s = plan.spans[plan.span_of[i]];
    if (s.direct) continue;
    pieces.src[num] = buffer + s.at + (static_cast<const char*>(uploads[i].host) - s.begin);
    pieces.dst[num] = uploads[i].device;
    pieces.count[num] = static_cast<int64_t>(uploads[i].elements);
    max_count = std::max(max_count, pieces.count[num]);
    if (++num == cuda_internal::kMaxUploadPieces) PSFLOW_RETURN_IF_ERROR(launch());
  }
  if (num > 0) PSFLOW_RETURN_IF_ERROR(launch());
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaBackend::JoinUploads() {
  return RunIn(*ctx_, "JoinUploads", "", [&]() -> absl::Status {
    if (!ctx_->uploads_pending) return absl::OkStatus();
    if (ctx_->uploads_joined == nullptr) {
      PSFLOW_CUDA_CHECK(cudaEventCreateWithFlags(&ctx_->uploads_joined, cudaEventDisableTiming));
    }
    PSFLOW_CUDA_CHECK(cudaEventRecord(ctx_->uploads_joined, ctx_->upload_stream));
    PSFLOW_CUDA_CHECK(cudaStreamWaitEvent(ctx_->stream, ctx_->uploads_joined, 0));
    ctx_->uploads_pending = false;
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CopyToDeviceAfter(const std::vector<Upload>& uploads, HostValues values) {
  PSFLOW_ASSIGN_OR_RETURN(const std::vector<CudaEvent*> events, UploadEvents(uploads));
  const UploadPlan plan = PlanUploads(uploads, values);
  if (plan.spans.empty()) return absl::OkStatus();
  return RunIn(*ctx_, "CopyToDeviceAfter", uploads.size(), "copies", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(cuda_internal::EnsureStream(&ctx_->upload_stream));
    PSFLOW_RETURN_IF_ERROR(GrowUploadBuffer(*ctx_, plan.bytes));
    char* const buffer = static_cast<char*>(ctx_->upload_buffer);
    // The copies into the buffer need no wait (they write no weight); the
    // direct copies and the placing do.
    for (const UploadSpan& s : plan.spans) {
      if (s.direct) continue;
      PSFLOW_CUDA_CHECK(cudaMemcpyAsync(buffer + s.at, s.begin,
                                        static_cast<size_t>(s.end - s.begin),
                                        cudaMemcpyHostToDevice, ctx_->upload_stream));
    }
    for (CudaEvent* e : events) PSFLOW_RETURN_IF_ERROR(UploadStreamWaitsFor(*ctx_, e));
    for (const UploadSpan& s : plan.spans) {
      if (!s.direct) continue;
      PSFLOW_CUDA_CHECK(cudaMemcpyAsync(uploads[s.first].device, s.begin,
                                        static_cast<size_t>(s.end - s.begin),
                                        cudaMemcpyHostToDevice, ctx_->upload_stream));
    }
    PSFLOW_RETURN_IF_ERROR(PlaceUploads(*ctx_, uploads, plan, buffer, values));
    ctx_->uploads_pending = true;
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::RecordUploadsDone(Event* done) {
  return RecordOnSideStream(*ctx_, &ctx_->upload_stream, done, "RecordUploadsDone");
}

namespace {

// Runs `f` with `device` current on this thread (the device it had before
// is current again after).
template <typename F>
auto OnDevice(int device, F f) {
  int current = -1;
  const bool switched = cudaGetDevice(&current) == cudaSuccess && current != device &&
                        cudaSetDevice(device) == cudaSuccess;
  auto result = f();
  if (switched) static_cast<void>(cudaSetDevice(current));
  return result;
}

}  // namespace

Backend::HostPinning CudaBackend::host_pinning() const {
  const int device = ctx_->device;
  HostPinning pinning;
  pinning.pin = [device](void* data, size_t bytes) {
    return OnDevice(device, [&] {
      const bool ok = cudaHostRegister(data, bytes, cudaHostRegisterPortable) == cudaSuccess;
      if (!ok) cuda_internal::ClearLastError();
      return ok;
    });
  };
  pinning.unpin = [device](void* data) {
    OnDevice(device, [&] {
      if (cudaHostUnregister(data) != cudaSuccess) cuda_internal::ClearLastError();
      return 0;
    });
  };
  return pinning;
}

absl::StatusOr<int> CudaBackend::DeviceCount() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cuda:all: this process sees no GPU (",
        e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none", ")"));
  }
  return count;
}

int CudaBackend::device_ordinal() const { return ctx_->device; }

absl::Status CudaBackend::RunOnStream(absl::string_view what,
                                      const std::function<absl::Status(void*)>& fn) {
  return RunIn(*ctx_, what, "", [&]() -> absl::Status { return fn(ctx_->stream); });
}

absl::Status CudaBackend::Synchronize() {
  return RunIn(*ctx_, "Synchronize", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    if (ctx_->upload_stream != nullptr)
      PSFLOW_CUDA_CHECK(cudaStreamSynchronize(ctx_->upload_stream));
    return absl::OkStatus();
  });
}

absl::StatusOr<int64_t> CudaBackend::AvailableMemory() {
  size_t free_bytes = 0, total_bytes = 0;
  PSFLOW_RETURN_IF_ERROR(RunIn(*ctx_, "AvailableMemory", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return absl::OkStatus();
  }));
  return static_cast<int64_t>(free_bytes);
}

CudaEvent::~CudaEvent() { static_cast<void>(cudaEventDestroy(static_cast<cudaEvent_t>(event_))); }

absl::StatusOr<std::unique_ptr<Event>> CudaBackend::CreateEvent() {
  cudaEvent_t event = nullptr;
  PSFLOW_RETURN_IF_ERROR(RunIn(*ctx_, "CreateEvent", "", [&]() -> absl::Status {
    PSFLOW_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return absl::OkStatus();
  }));
  return std::unique_ptr<Event>(new CudaEvent(event));
}

absl::Status CudaBackend::RecordEvent(Event* event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(event);
  if (cuda_event == nullptr) return absl::InvalidArgumentError("RecordEvent: not a CUDA event");
  const cudaEvent_t e = static_cast<cudaEvent_t>(cuda_event->raw());
  return RunIn(*ctx_, "RecordEvent", "", [&]() -> absl::Status {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    PSFLOW_CUDA_CHECK(cudaStreamIsCapturing(ctx_->stream, &capturing));
    if (capturing == cudaStreamCaptureStatusActive) {
      PSFLOW_CUDA_CHECK(cudaEventRecordWithFlags(e, ctx_->stream, cudaEventRecordExternal));
    } else {
      PSFLOW_CUDA_CHECK(cudaEventRecord(e, ctx_->stream));
    }
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::Copy(const float* src, float* dst, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckCount(n, "Copy"));
  if (n == 0 || src == dst) return absl::OkStatus();
  return RunIn(*ctx_, "Copy", n, "", [&]() -> absl::Status {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"src", src}, {"dst", dst}}));
    PSFLOW_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, ctx_->stream));
    return absl::OkStatus();
  });
}

absl::StatusOr<std::unique_ptr<Graph>> CudaBackend::Capture(
    const std::function<absl::Status()>& work) {
  // The scope (and so the backend's lock) is held while `work` runs: other
  // threads wait rather than queue into the graph; this thread's ops take the
  // recursive lock again.
  Scope scope(*ctx_);
  PSFLOW_RETURN_IF_ERROR(Annotate(scope.status(), "Capture"));
  PSFLOW_RETURN_IF_ERROR(
      Annotate(CheckCuda(cudaStreamBeginCapture(ctx_->stream, cudaStreamCaptureModeThreadLocal),
                         "cudaStreamBeginCapture"),
               "Capture"));
  const absl::Status work_status = work();
  // Always end the capture, or the stream stays unusable.
  cudaGraph_t raw_graph = nullptr;
  const absl::Status end_status =
      CheckCuda(cudaStreamEndCapture(ctx_->stream, &raw_graph), "cudaStreamEndCapture");
  GraphPtr graph(raw_graph);
  if (!work_status.ok()) return work_status;
  PSFLOW_RETURN_IF_ERROR(Annotate(end_status, "Capture"));
  cudaGraphExec_t exec = nullptr;
  PSFLOW_RETURN_IF_ERROR(Annotate(
      CheckCuda(cudaGraphInstantiate(&exec, graph.get(), 0), "cudaGraphInstantiate"), "Capture"));
  return std::unique_ptr<Graph>(new CudaGraph(ctx_, std::move(graph), exec));
}

absl::StatusOr<std::unique_ptr<Conv2D>> CudaBackend::CreateConv2D(const Conv2DShape& shape) {
  return cuda_internal::CreateConv2D(ctx_, shape);
}

absl::StatusOr<std::unique_ptr<MaxPool2D>> CudaBackend::CreateMaxPool2D(const Pool2DShape& shape) {
  return cuda_internal::CreateMaxPool2D(ctx_, shape);
}

absl::StatusOr<std::unique_ptr<Relu>> CudaBackend::CreateRelu(int64_t size) {
  return cuda_internal::CreateRelu(ctx_, size);
}

absl::StatusOr<std::unique_ptr<Dense>> CudaBackend::CreateDense(const DenseShape& shape) {
  return cuda_internal::CreateDense(ctx_, shape);
}

absl::StatusOr<std::unique_ptr<SoftmaxCrossEntropy>> CudaBackend::CreateSoftmaxCrossEntropy(
    int batch, int classes) {
  return cuda_internal::CreateSoftmaxCrossEntropy(ctx_, batch, classes);
}

absl::StatusOr<std::unique_ptr<BatchNorm>> CudaBackend::CreateBatchNorm(
    const BatchNormShape& shape) {
  return cuda_internal::CreateBatchNorm(ctx_, shape);
}

absl::StatusOr<std::unique_ptr<GlobalAvgPool>> CudaBackend::CreateGlobalAvgPool(
    const GlobalAvgPoolShape& shape) {
  return cuda_internal::CreateGlobalAvgPool(ctx_, shape);
}

absl::StatusOr<std::unique_ptr<Concat>> CudaBackend::CreateConcat(const ConcatShape& shape) {
  return cuda_internal::CreateConcat(ctx_, shape);
}

absl::StatusOr<std::unique_ptr<Interaction>> CudaBackend::CreateInteraction(
    const InteractionShape& shape) {
  return cuda_internal::CreateInteraction(ctx_, shape);
}

absl::StatusOr<std::unique_ptr<EmbeddingBag>> CudaBackend::CreateEmbeddingBag(int64_t dim) {
  return cuda_internal::CreateEmbeddingBag(ctx_, dim);
}

}  // namespace psflow::kernels
