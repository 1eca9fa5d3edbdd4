// DeviceGroup on NCCL: one communicator per GPU of this process
// (ncclCommInitAll), every collective of a call in one NCCL group, queued on
// each replica's backend stream while every backend's lock is held (taken in
// replica order, so two groups never wait on each other).
#include "kernels/cuda/nccl_group.h"

#include <nccl.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"

namespace psflow::kernels {
namespace {

absl::Status CheckNccl(ncclResult_t r, absl::string_view call) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, ": ", ncclGetErrorString(r)));
}

class NcclGroup final : public DeviceGroup {
 public:
  NcclGroup(std::vector<CudaBackend*> backends, std::vector<ncclComm_t> comms)
      : backends_(std::move(backends)), comms_(std::move(comms)) {}
  ~NcclGroup() override {
    // No collective may still be queued on a communicator that goes.
    for (CudaBackend* b : backends_) static_cast<void>(b->Synchronize());
    for (ncclComm_t c : comms_) static_cast<void>(ncclCommDestroy(c));
  }

  absl::Status AllReduceMean(const std::vector<std::vector<float*>>& buffers,
                             const std::vector<int64_t>& sizes) override {
    return Collective("all-reduce", buffers, sizes, [&](size_t r, size_t i, cudaStream_t stream) {
      return ncclAllReduce(buffers[r][i], buffers[r][i], static_cast<size_t>(sizes[i]), ncclFloat,
                           ncclAvg, comms_[r], stream);
    });
  }

  absl::Status Broadcast(const std::vector<std::vector<float*>>& buffers,
                         const std::vector<int64_t>& sizes) override {
    return Collective("broadcast", buffers, sizes, [&](size_t r, size_t i, cudaStream_t stream) {
      return ncclBroadcast(buffers[r][i], buffers[r][i], static_cast<size_t>(sizes[i]), ncclFloat,
                           /*root=*/0, comms_[r], stream);
    });
  }

 private:
  // Queues op(r, i, stream) for every replica r and buffer i in one NCCL
  // group, with every backend's lock held and its stream at hand.
  template <typename Op>
  absl::Status Collective(absl::string_view what, const std::vector<std::vector<float*>>& buffers,
                          const std::vector<int64_t>& sizes, Op op) {
    if (buffers.size() != backends_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", buffers.size(), " replicas' buffers for a group of ", backends_.size()));
    }
    for (const std::vector<float*>& b : buffers) {
      if (b.size() != sizes.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": ", b.size(), " buffers for ", sizes.size(), " sizes"));
      }
    }
    std::vector<cudaStream_t> streams(backends_.size());
    std::function<absl::Status(size_t)> hold = [&](size_t r) -> absl::Status {
      if (r == backends_.size()) {
        PSFLOW_RETURN_IF_ERROR(CheckNccl(ncclGroupStart(), "ncclGroupStart"));
        absl::Status queued;
        for (size_t q = 0; q < backends_.size() && queued.ok(); ++q) {
          for (size_t i = 0; i < sizes.size() && queued.ok(); ++i) {
            if (sizes[i] > 0) queued = CheckNccl(op(q, i, streams[q]), what);
          }
        }
        // The group is closed whatever happened inside it.
        const absl::Status ended = CheckNccl(ncclGroupEnd(), "ncclGroupEnd");
        return queued.ok() ? ended : queued;
      }
      return backends_[r]->RunOnStream(
          absl::StrCat("cuda:", backends_[r]->device_ordinal(), " ", what),
          [&](void* stream) -> absl::Status {
            streams[r] = static_cast<cudaStream_t>(stream);
            return hold(r + 1);
          });
    };
    return hold(0);
  }

  std::vector<CudaBackend*> backends_;
  std::vector<ncclComm_t> comms_;
};

// Polls the communicator (and `done`, if given) until NCCL has nothing in
// progress and `done()` holds, a member failed, the deadline passed or
// `abandon()`: OK, UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED.
absl::Status Await(ncclComm_t comm, absl::Time deadline, const std::function<bool()>& abandon,
                   const std::function<bool()>& done, absl::string_view what) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(comm, &state);
    if (asked != ncclSuccess) state = asked;
    if (state != ncclSuccess && state != ncclInProgress) {
      return absl::UnavailableError(absl::StrCat(
          what, ": the workers' GPU group failed (a worker left?): ", ncclGetErrorString(state)));
    }
    if (state == ncclSuccess && (!done || done())) return absl::OkStatus();
    if (abandon && abandon()) return absl::CancelledError(absl::StrCat(what, ": abandoned"));
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": the workers' GPU group did not answer in time"));
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

// One non-blocking communicator of a group across processes; collectives
// queued under the backend's lock (AllReduceMean's on the backend's stream,
// QueueAllReduceMeans' on the group's own), then waited for by polling the
// communicator and an event, so that a member that is gone ends the wait
// (the communicator is then aborted). With a 16-bit wire dtype each bucket
// is packed into one device buffer of that dtype, averaged there and
// unpacked, all on the group's stream.
class NcclPeerGroup final : public PeerGroup {
 public:
  NcclPeerGroup(CudaBackend* backend, ncclComm_t comm, cudaEvent_t done, WireDtype wire)
      : backend_(backend), comm_(comm), done_(done), wire_dtype_(wire) {}
  ~NcclPeerGroup() override {
    if (comm_ != nullptr) {
      static_cast<void>(backend_->Synchronize());
      if (comm_stream_ != nullptr) static_cast<void>(cudaStreamSynchronize(comm_stream_));
      static_cast<void>(ncclCommDestroy(comm_));
    } else if (comm_stream_ != nullptr) {
      // Aborted: NCCL has ended its kernels; what else is queued (a pack or
      // unpack of the wire buffers freed below) ends now.
      static_cast<void>(cudaStreamSynchronize(comm_stream_));
    }
    if (comm_stream_ != nullptr) static_cast<void>(cudaStreamDestroy(comm_stream_));
    if (comm_done_ != nullptr) static_cast<void>(cudaEventDestroy(comm_done_));
    static_cast<void>(cudaEventDestroy(done_));
  }

  absl::Status QueueAllReduceMeans(const std::vector<Bucket>& buckets, absl::Time deadline,
                                   const std::function<bool()>& abandon) override {
    for (const Bucket& b : buckets) {
      if (b.buffers.size() != b.sizes.size() || dynamic_cast<CudaEvent*>(b.ready) == nullptr) {
        return absl::InvalidArgumentError("all-reduce: a bucket without its CUDA event or sizes");
      }
      for (int64_t n : b.sizes) {
        if (n < 0) return absl::InvalidArgumentError("all-reduce: a negative size");
      }
    }
    if (comm_ == nullptr) return absl::UnavailableError("the workers' GPU group was aborted");
    const std::string what =
        absl::StrCat("cuda:", backend_->device_ordinal(), " all-reduce among the workers");
    absl::Status s =
        wire_dtype_ != WireDtype::kFloat32 ? PrepareWire(buckets, what) : absl::OkStatus();
    if (s.ok())
      s = backend_->RunOnStream(what, [&](void* stream) -> absl::Status {
        if (comm_stream_ == nullptr) {
          if (cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking) != cudaSuccess ||
              cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming) != cudaSuccess) {
            return absl::InternalError(absl::StrCat(what, ": cannot make its stream"));
          }
        }
        for (size_t k = 0; k < buckets.size(); ++k) {
          const Bucket& b = buckets[k];
          const auto ready = static_cast<cudaEvent_t>(static_cast<CudaEvent*>(b.ready)->raw());
          if (cudaStreamWaitEvent(comm_stream_, ready, 0) != cudaSuccess) {
            return absl::InternalError(absl::StrCat(what, ": cudaStreamWaitEvent failed"));
          }
          if (wire_dtype_ != WireDtype::kFloat32) {
            PSFLOW_RETURN_IF_ERROR(QueueWireMean(&tables_[k], deadline, abandon, what));
            continue;
          }
          PSFLOW_RETURN_IF_ERROR(QueueMeans(b.buffers, b.sizes, comm_stream_));
          PSFLOW_RETURN_IF_ERROR(Await(comm_, deadline, abandon, nullptr, what));
        }
        // The next AllReduceMean orders the backend's stream after the means
        // (not now: the step's own work must not wait for its peers, or a dead
        // one would leave this worker blocked on its GPU instead of polling).
        if (cudaEventRecord(comm_done_, comm_stream_) != cudaSuccess) {
          return absl::InternalError(absl::StrCat(what, ": cudaEventRecord failed"));
        }
        means_pending_ = true;
        return absl::OkStatus();
      });
    if (!s.ok() && !absl::IsInvalidArgument(s)) {
      static_cast<void>(ncclCommAbort(comm_));
      comm_ = nullptr;
    }
    return s;
  }

  absl::Status AllReduceMean(const std::vector<float*>& buffers, const std::vector<int64_t>& sizes,
                             absl::Time deadline, const std::function<bool()>& abandon) override {
    if (buffers.size() != sizes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("all-reduce: ", buffers.size(), " buffers for ", sizes.size(), " sizes"));
    }
    for (int64_t n : sizes) {
      if (n < 0) return absl::InvalidArgumentError("all-reduce: a negative size");
    }
    if (comm_ == nullptr) return absl::UnavailableError("the workers' GPU group was aborted");
    const std::string what =
        absl::StrCat("cuda:", backend_->device_ordinal(), " all-reduce among the workers");
    absl::Status s = backend_->RunOnStream(what, [&](void* stream) -> absl::Status {
      // After the means QueueAllReduceMeans queued: this call's wait is theirs.
      if (means_pending_) {
        if (cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), comm_done_, 0) != cudaSuccess) {
          return absl::InternalError(absl::StrCat(what, ": cudaStreamWaitEvent failed"));
        }
        means_pending_ = false;
      }
      PSFLOW_RETURN_IF_ERROR(QueueMeans(buffers, sizes, static_cast<cudaStream_t>(stream)));
      // Non-blocking: the collectives are on the stream once NCCL says so.
      PSFLOW_RETURN_IF_ERROR(Await(comm_, deadline, abandon, nullptr, what));
      if (cudaEventRecord(done_, static_cast<cudaStream_t>(stream)) != cudaSuccess) {
        return absl::InternalError(absl::StrCat(what, ": cudaEventRecord failed"));
      }
      return absl::OkStatus();
    });
    if (s.ok()) {
      s = Await(
          comm_, deadline, abandon, [&] { return cudaEventQuery(done_) != cudaErrorNotReady; },
          what);
    }
    if (!s.ok() && !absl::IsInvalidArgument(s)) {
      // Whatever is left of the collectives ends with the communicator.
      static_cast<void>(ncclCommAbort(comm_));
      comm_ = nullptr;
    }
    return s;
  }

 private:
  // Queues the fp32 mean of each non-empty buffer on `stream`, in one NCCL
  // group (non-blocking: on the stream once Await says so).
  absl::Status QueueMeans(const std::vector<float*>& buffers, const std::vector<int64_t>& sizes,
                          cudaStream_t stream) {
    PSFLOW_RETURN_IF_ERROR(CheckNccl(ncclGroupStart(), "ncclGroupStart"));
    absl::Status queued;
    for (size_t i = 0; i < sizes.size() && queued.ok(); ++i) {
      if (sizes[i] == 0) continue;
      const ncclResult_t r = ncclAllReduce(buffers[i], buffers[i], static_cast<size_t>(sizes[i]),
                                           ncclFloat, ncclAvg, comm_, stream);
      if (r != ncclInProgress) queued = CheckNccl(r, "ncclAllReduce");
    }
    // The group is closed whatever happened inside it.
    const ncclResult_t ended = ncclGroupEnd();
    if (ended != ncclInProgress) PSFLOW_RETURN_IF_ERROR(CheckNccl(ended, "ncclGroupEnd"));
    return queued;
  }

  // A bucket's pieces in the wire buffer, in device memory once uploaded.
  struct WireTable {
    std::vector<float*> buffers;
    std::vector<int64_t> sizes;
    std::vector<cuda_internal::WirePiece> pieces;  // the non-empty buffers
    std::unique_ptr<Buffer> device;                // `pieces`, on the GPU
    int64_t floats = 0, max_count = 0;
  };

  // Makes the tables of `buckets` (kept while the buckets stay the same,
  // as they do from step to step) and a wire buffer that holds the largest.
  // What it replaces may still be in use on the group's stream: waited for
  // first (it only happens at the first call, or when the buckets change).
  absl::Status PrepareWire(const std::vector<Bucket>& buckets, absl::string_view what) {
    bool waited = false;
    auto wait_for_the_stream = [&]() -> absl::Status {
      if (waited || comm_stream_ == nullptr) return absl::OkStatus();
      waited = true;
      if (cudaStreamSynchronize(comm_stream_) != cudaSuccess) {
        return absl::InternalError(absl::StrCat(what, ": cudaStreamSynchronize failed"));
      }
      return absl::OkStatus();
    };
    if (tables_.size() != buckets.size()) {
      PSFLOW_RETURN_IF_ERROR(wait_for_the_stream());
      tables_.resize(buckets.size());
    }
    int64_t largest = 0;
    for (size_t k = 0; k < buckets.size(); ++k) {
      WireTable& t = tables_[k];
      const Bucket& b = buckets[k];
      if (t.device != nullptr && t.buffers == b.buffers && t.sizes == b.sizes) {
        largest = std::max(largest, t.floats);
        continue;
      }
      PSFLOW_RETURN_IF_ERROR(wait_for_the_stream());
      t = WireTable();
      t.buffers = b.buffers;
      t.sizes = b.sizes;
      for (size_t i = 0; i < b.sizes.size(); ++i) {
        if (b.sizes[i] == 0) continue;  // (negative ones were refused)
        t.pieces.push_back({b.buffers[i], t.floats, b.sizes[i]});
        t.floats += b.sizes[i];
        t.max_count = std::max(t.max_count, b.sizes[i]);
      }
      if (t.pieces.size() > 65535) {
        return absl::InvalidArgumentError("all-reduce: a bucket of more than 65535 buffers");
      }
      // WirePiece is 3 x 8 bytes: whole floats.
      constexpr size_t kFloatsPerPiece = sizeof(cuda_internal::WirePiece) / sizeof(float);
      static_assert(sizeof(cuda_internal::WirePiece) % sizeof(float) == 0);
      const size_t table_floats = t.pieces.size() * kFloatsPerPiece;
      absl::StatusOr<std::unique_ptr<Buffer>> device =
          backend_->Allocate(std::max<size_t>(1, table_floats));
      if (!device.ok()) return device.status();
      t.device = *std::move(device);
      // On the backend's stream, done before any pack reads it (the host
      // memory is pageable: a synchronous upload, once).
      PSFLOW_RETURN_IF_ERROR(backend_->CopyToDevice(reinterpret_cast<const float*>(t.pieces.data()),
                                                    table_floats, t.device->data()));
      PSFLOW_RETURN_IF_ERROR(backend_->Synchronize());
      largest = std::max(largest, t.floats);
    }
    // Two bytes an element: half as many floats.
    const int64_t wire_floats = (largest + 1) / 2;
    if (wire_ == nullptr || static_cast<int64_t>(wire_->size()) < wire_floats) {
      PSFLOW_RETURN_IF_ERROR(wait_for_the_stream());
      wire_.reset();
      absl::StatusOr<std::unique_ptr<Buffer>> wire =
          backend_->Allocate(static_cast<size_t>(std::max<int64_t>(1, wire_floats)));
      if (!wire.ok()) return wire.status();
      wire_ = *std::move(wire);
    }
    return absl::OkStatus();
  }

  // On the group's stream: packs `t`'s floats into the wire buffer, averages
  // them there and unpacks the means.
  absl::Status QueueWireMean(WireTable* t, absl::Time deadline,
                             const std::function<bool()>& abandon, absl::string_view what) {
    if (t->floats == 0) return absl::OkStatus();
    auto* pieces = reinterpret_cast<cuda_internal::WirePiece*>(t->device->data());
    const bool bf16 = wire_dtype_ == WireDtype::kBfloat16;
    const int n = static_cast<int>(t->pieces.size());
    if (cuda_internal::LaunchPackToWire(pieces, n, t->max_count, bf16, wire_->data(),
                                        comm_stream_) != cudaSuccess) {
      return absl::InternalError(absl::StrCat(what, ": packing the bucket failed"));
    }
    const ncclResult_t r =
        ncclAllReduce(wire_->data(), wire_->data(), static_cast<size_t>(t->floats),
                      bf16 ? ncclBfloat16 : ncclFloat16, ncclAvg, comm_, comm_stream_);
    if (r != ncclInProgress) PSFLOW_RETURN_IF_ERROR(CheckNccl(r, "ncclAllReduce"));
    // Non-blocking: the all-reduce is on the stream only once NCCL says so,
    // and the unpack must come after it.
    PSFLOW_RETURN_IF_ERROR(Await(comm_, deadline, abandon, nullptr, what));
    if (cuda_internal::LaunchUnpackFromWire(pieces, n, t->max_count, bf16, wire_->data(),
                                            comm_stream_) != cudaSuccess) {
      return absl::InternalError(absl::StrCat(what, ": unpacking the bucket failed"));
    }
    return absl::OkStatus();
  }

  CudaBackend* const backend_;
  ncclComm_t comm_;  // null once aborted
  cudaEvent_t done_;
  const WireDtype wire_dtype_;
  // 16-bit wire dtypes: each bucket's table (by position) and the one wire
  // buffer they take turns in (in order, on the group's stream).
  std::vector<WireTable> tables_;
  std::unique_ptr<Buffer> wire_;
  // QueueAllReduceMeans' stream, and the event the backend's stream waits
  // for; made at its first call.
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t comm_done_ = nullptr;
  bool means_pending_ = false;  // queued means the backend's stream has not waited for yet
};

}  // namespace

static_assert(kPeerGroupIdBytes == NCCL_UNIQUE_ID_BYTES, "a group id is an ncclUniqueId");

absl::StatusOr<std::string> NewNcclPeerGroupId() {
  ncclUniqueId id;
  PSFLOW_RETURN_IF_ERROR(CheckNccl(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<PeerGroup>> JoinNcclPeerGroup(CudaBackend* backend,
                                                             const std::string& id, int rank,
                                                             int size, WireDtype wire,
                                                             absl::Time deadline,
                                                             const std::function<bool()>& abandon) {
  ncclUniqueId unique;
  if (id.size() != sizeof(unique.internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a GPU group id of ", id.size(), " bytes, not ", sizeof(unique.internal)));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("member ", rank, " of ", size));
  }
  std::copy(id.begin(), id.end(), unique.internal);
  ncclComm_t comm = nullptr;
  cudaEvent_t done = nullptr;
  const std::string what =
      absl::StrCat("cuda:", backend->device_ordinal(), " joining the workers' GPU group");
  // On the backend's device (the communicator binds to the current one);
  // non-blocking, so that a member that never comes does not hang this one.
  absl::Status s = backend->RunOnStream(what, [&](void*) -> absl::Status {
    if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) {
      return absl::InternalError("cudaEventCreate failed");
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, unique, rank, &config);
    if (r != ncclInProgress) return CheckNccl(r, "ncclCommInitRankConfig");
    return absl::OkStatus();
  });
  if (s.ok()) s = Await(comm, deadline, abandon, nullptr, what);
  if (!s.ok()) {
    if (comm != nullptr) static_cast<void>(ncclCommAbort(comm));
    if (done != nullptr) static_cast<void>(cudaEventDestroy(done));
    return s;
  }
  return std::unique_ptr<PeerGroup>(new NcclPeerGroup(backend, comm, done, wire));
}

absl::StatusOr<std::unique_ptr<DeviceGroup>> CreateNcclGroup(
    const std::vector<CudaBackend*>& backends) {
  if (backends.size() < 2) {
    return absl::InvalidArgumentError("a device group needs at least two GPUs");
  }
  std::vector<int> devices;
  for (CudaBackend* b : backends) {
    for (int d : devices) {
      if (d == b->device_ordinal()) {
        return absl::InvalidArgumentError(absl::StrCat("cuda:", d, " named twice"));
      }
    }
    devices.push_back(b->device_ordinal());
  }
  std::vector<ncclComm_t> comms(backends.size(), nullptr);
  PSFLOW_RETURN_IF_ERROR(
      CheckNccl(ncclCommInitAll(comms.data(), static_cast<int>(comms.size()), devices.data()),
                "ncclCommInitAll"));
  return std::unique_ptr<DeviceGroup>(new NcclGroup(backends, std::move(comms)));
}

}  // namespace psflow::kernels
