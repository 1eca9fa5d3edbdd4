// Tensors through shared memory between a worker and a ps of one host.
//
// The worker (the client) makes regions, anonymous memory files (memfd) of
// its own, and names one in a push or a pull (SharedRegionRef). The ps opens
// the worker's descriptor through /proc/<pid>/fd/<fd>, checks the random
// token at the region's start and maps it, once; later calls find it by its
// token. A push's chunks are then written into the region by the worker and
// read out of it by the ps, a pull's the other way round, and the call's
// messages carry only where each chunk lies (TensorChunk.shared_offset):
// no byte of a tensor crosses the kernel's TCP stack.
//
// Where the ps cannot open a region (it runs on another host, or in another
// container's process namespace, or with --shared_memory=false), it refuses
// the call with FAILED_PRECONDITION and a message that starts with
// kSharedMemoryRefused; the worker then sends over the network.
#ifndef PSFLOW_TRANSPORT_SHARED_REGION_H_
#define PSFLOW_TRANSPORT_SHARED_REGION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/tensor.pb.h"

namespace psflow {

// The start of the message of every refusal of a region.
inline constexpr char kSharedMemoryRefused[] = "shared memory";
// Bytes of a region before its data: the token, then zeros.
inline constexpr int64_t kRegionHeaderBytes = 4096;
inline constexpr int kRegionTokenBytes = 16;
// The largest region: a worker's pool holds at most this much in all.
inline constexpr int64_t kMaxRegionBytes = int64_t{8} << 30;
// Each chunk's data start at a multiple of this in a region.
inline constexpr int64_t kSharedAlign = 64;
// Chunks per message with a region: a call's tensors go in one message (a
// pull's slices in one message each).
inline constexpr size_t kSharedMessageBytes = size_t{1} << 40;

// Bytes of region that `count` tensors of `bytes` bytes in all may take.
inline int64_t SharedBytesFor(int64_t bytes, int64_t count) { return bytes + kSharedAlign * count; }

// `size` bytes of mapped shared memory at `data`.
struct SharedSpan {
  char* data = nullptr;
  int64_t size = 0;
};

// A status that refuses a region (FAILED_PRECONDITION, "shared memory: ...").
absl::Status SharedMemoryRefusal(const std::string& why);
bool IsSharedMemoryRefusal(const absl::Status& status);

// A client's region: `bytes` bytes of data after the header, mapped here
// until it is destroyed (its memory lives on while a ps still maps it). Its
// size is sealed (F_SEAL_SHRINK, F_SEAL_GROW): no process can shrink it under
// a mapping, which would make the mapping's readers fault.
class SharedRegion {
 public:
  // An error where this process cannot make one (no memfd_create, no memory).
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(int64_t bytes);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  SharedSpan data() const { return {base_ + kRegionHeaderBytes, bytes_}; }
  const SharedRegionRef& ref() const { return ref_; }
  // Registers its data with a device: `pin(data, bytes)` returns whether it
  // did, and then `unpin(data)` is called before the data are unmapped. At
  // most once, before the region is shared with other threads.
  bool Pin(const std::function<bool(void*, size_t)>& pin, std::function<void(void*)> unpin);
  // Whether its data are registered with a device (Pin, or
  // SharedRegionPool::SetPinning).
  bool pinned() const { return unpin_ != nullptr; }

 private:
  friend class SharedRegionPool;
  SharedRegion(int fd, char* base, int64_t bytes, SharedRegionRef ref)
      : fd_(fd), base_(base), bytes_(bytes), ref_(std::move(ref)) {}

  bool pin_tried_ = false;            // by the pool that leases it
  std::function<void(void*)> unpin_;  // called on the data before they are unmapped

  const int fd_;
  char* const base_;
  const int64_t bytes_;
  const SharedRegionRef ref_;
};

// A client's regions, reused from call to call: each call leases one at
// least as large as it needs and gives it back when it ends. Thread-safe.
class SharedRegionPool {
 public:
  // Regions are made in multiples of this.
  static constexpr int64_t kQuantum = 1 << 20;

  // After a region could not be made, none is tried for this long.
  static constexpr absl::Duration kRetryAfter = absl::Seconds(60);

  // At most `max_bytes` of regions (of data) at once, leased or not.
  explicit SharedRegionPool(int64_t max_bytes) : max_bytes_(max_bytes) {}
  SharedRegionPool(const SharedRegionPool&) = delete;
  SharedRegionPool& operator=(const SharedRegionPool&) = delete;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    ~Lease() { reset(); }
    explicit operator bool() const { return region_ != nullptr; }
    SharedRegion* get() const { return region_.get(); }
    // Gives the region back to the pool.
    void reset();
    // Drops the region instead: a call that did not end cleanly may still
    // have its ps reading or writing it.
    void Discard();

   private:
    friend class SharedRegionPool;
    SharedRegionPool* pool_ = nullptr;
    std::unique_ptr<SharedRegion> region_;
  };

  // The smallest free region of at least `bytes`, or a new one (dropping
  // free regions too small for it where the bound needs their room); an
  // empty lease when even that leaves no room, or when no region can be
  // made (the call then goes over the network).
  Lease Acquire(int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of all regions, leased or not.
  int64_t total_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

  // Registers each region with a device as it is first leased, so that the
  // device copies from and to it at full speed (a GPU worker uploads pulled
  // weights straight from a pull's region): `pin(data, bytes)` returns
  // whether it did (SharedRegion::pinned), and `unpin(data)` is called on a
  // pinned region's data before it is unmapped. Both must stay callable
  // until the pool and every lease are gone; call before leasing.
  void SetPinning(std::function<bool(void*, size_t)> pin, std::function<void(void*)> unpin)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Lease Take(int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void Return(std::unique_ptr<SharedRegion> region) ABSL_LOCKS_EXCLUDED(mu_);
  void Drop(std::unique_ptr<SharedRegion> region) ABSL_LOCKS_EXCLUDED(mu_);

  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<SharedRegion>> free_ ABSL_GUARDED_BY(mu_);
  int64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time retry_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // after a failed Create
  std::function<bool(void*, size_t)> pin_ ABSL_GUARDED_BY(mu_);
  std::function<void(void*)> unpin_ ABSL_GUARDED_BY(mu_);
};

// A region mapped by a ps: unmapped when the last holder lets it go.
struct SharedMapping {
  SharedMapping(char* base, size_t length)
      : base(base),
        length(length),
        data{base + kRegionHeaderBytes, static_cast<int64_t>(length) - kRegionHeaderBytes} {}
  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  char* const base;
  const size_t length;
  const SharedSpan data;
};

// The regions a ps has mapped, by token. A region once mapped is found by
// its token alone (the token is the secret; the pid and descriptor only say
// where to open it the first time). Thread-safe.
class SharedRegionMap {
 public:
  struct Limits {
    // A region no call is using is unmapped once it has been idle this
    // long, or soon after its process is gone.
    absl::Duration idle = absl::Seconds(60);
    // Most regions and bytes mapped at once: to map another, the least
    // recently used regions no call is using are unmapped; if that does
    // not make room, the region is refused.
    int max_regions = 1024;
    int64_t max_bytes = int64_t{64} << 30;
    // How often a thread of the map unmaps idle regions and those of
    // exited processes; InfiniteDuration: only when Sweep is called.
    absl::Duration sweep_every = absl::Seconds(1);
  };

  SharedRegionMap() : SharedRegionMap(Limits()) {}
  explicit SharedRegionMap(const Limits& limits);
  ~SharedRegionMap();
  SharedRegionMap(const SharedRegionMap&) = delete;
  SharedRegionMap& operator=(const SharedRegionMap&) = delete;

  // The region `ref` names, mapped (at once when its token is known here),
  // kept mapped at least while the returned pointer lives. A refusal
  // (SharedMemoryRefusal) when `ref` is malformed or larger than
  // kMaxRegionBytes, its descriptor cannot be opened or is not a sealed
  // psflow region of that size holding that token, or the bounds leave no
  // room. The descriptor is first opened with O_PATH (which opens nothing)
  // and checked there: an unlinked regular file of memfd's file system
  // (tmpfs, so no huge pages that a worker could punch holes in), named as
  // a psflow region, of the right size. Only then is it opened again
  // through this process's own descriptor, so a process that swaps its
  // descriptor cannot make the ps open another file. Room is made (idle
  // regions unmapped) only for a region that passed every check.
  absl::StatusOr<std::shared_ptr<const SharedMapping>> Attach(const SharedRegionRef& ref)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the region of `token` (a call through it failed, so its worker
  // drops it too); calls using it keep their mapping until they end.
  void Forget(const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);
  // Unmaps the regions no call has used for `limits.idle` at `now`, and
  // those no call is using whose process has exited. A region in use counts
  // as used at `now`.
  void Sweep(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  int size() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t mapped_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::shared_ptr<const SharedMapping> mapping;
    int64_t bytes = 0;
    int32_t pid = 0;
    absl::Time used;  // the last attach, or the last sweep that saw it in use
  };
  using Unmapped = std::vector<std::shared_ptr<const SharedMapping>>;
  // Moves the regions to unmap into `unmapped`, so that they are unmapped
  // after the lock is let go.
  void SweepLocked(absl::Time now, Unmapped* unmapped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unmaps least recently used regions no call is using until one more of
  // `bytes` fits the bounds; false if it cannot.
  bool MakeRoomLocked(int64_t bytes, Unmapped* unmapped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepEvery(absl::Duration period) ABSL_LOCKS_EXCLUDED(mu_);

  const Limits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);  // by token
  int64_t mapped_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_SHARED_REGION_H_
