// What the chief and the workers call on the parameter servers, as an
// interface with no gRPC in it. ps::GrpcClient (ps/grpc_client.h) is its
// transport; tests give role logic an in-memory fake (tests/fakes/fake_ps.h).
//
// Every call names the ps by index and ends by `deadline`. Errors name the
// ps ("ps 1: ...") and keep the status code of the transport (UNAVAILABLE for
// a ps that is down or not up yet, so callers retry under common/fan_out.h).
// Thread-safe: calls to different ps (or the same) may run concurrently.
#ifndef PSFLOW_PS_CLIENT_H_
#define PSFLOW_PS_CLIENT_H_

#include <atomic>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/float16.h"
#include "proto/ps.pb.h"
#include "transport/shared_region.h"
#include "transport/tensor_chunks.h"

namespace psflow::ps {

// `s` with "ps <ps>: " before its message (OK stays OK): how every Client
// names the ps in its errors.
inline absl::Status WithPs(int ps, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("ps ", ps, ": ", s.message()));
}

// What a ps client that moves tensors through shared memory
// (transport/shared_region.h) with its ps lets its caller set: a GPU
// worker's pinned memory. Thread-safe.
class SharedMemoryClient {
 public:
  virtual ~SharedMemoryClient() = default;
  // Registers the memory pulls may leave values in (TensorSink::borrow)
  // with a device: `pin(data, bytes)` (true: pinned) before a pull first
  // uses it, `unpin(data)` before it goes. Sinks borrow only from pinned
  // memory.
  virtual void SetRegionPinning(std::function<bool(void*, size_t)> pin,
                                std::function<void(void*)> unpin) = 0;
  // Shared memory that the caller's gradients lie in (a GPU worker's copies
  // from the device land there): a push whose tensors all lie in it offers
  // it to the ps and names each tensor where it lies, with no copy (the
  // check of PushRuns reads the values there). The caller leaves those
  // tensors unchanged until the push is answered. Null: no such memory.
  // Returns whether pushes may send from it.
  virtual bool SetPushRegion(std::shared_ptr<const SharedRegion> region) = 0;
};

class Client {
 public:
  virtual ~Client() = default;
  virtual int num_ps() const = 0;

  // Loads a job onto ps `ps`: the header, then `tensors` (values, and slots
  // named by TensorRef::slot), DT_FLOAT whatever the job's wire dtype.
  virtual absl::Status Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                            absl::Time deadline) = 0;

  struct PullResult {
    int64_t version = 0;  // below min_version: max_wait passed first, sinks untouched
    int64_t wait_us = 0;  // time the ps waited for min_version
    // Where sinks borrowed (TensorSink::borrow: fp32 values left where the
    // transport put them, in a shared region): keeps that memory for the
    // caller until it drops this. Null when no sink borrowed.
    std::shared_ptr<const void> hold;
  };
  // Pulls the slices `slices` of ps `ps` (indices into its slices, in the
  // order to send them; empty: all) into `sinks` (one per slice pulled),
  // each slice as soon as it reaches min_version, waiting at most `max_wait`
  // for the first (zero: until the deadline). The ps sends the values in the
  // sinks' dtype (one for all: INVALID_ARGUMENT otherwise), converted from
  // its fp32 masters. The result's version is the lowest of the slices'
  // (they may be one apart). An answer that leaves a sink incomplete is
  // DATA_LOSS.
  virtual absl::StatusOr<PullResult> Pull(int ps, uint64_t job_id, int64_t min_version,
                                          std::vector<int> slices, std::vector<TensorSink> sinks,
                                          absl::Time deadline, absl::Duration max_wait) = 0;
  // As Pull, but given up (CANCELLED, soon, even while the ps waits for a
  // later slice) once `give_up` holds. This default does not look at it.
  virtual absl::StatusOr<PullResult> PullUnlessGivenUp(int ps, uint64_t job_id, int64_t min_version,
                                                       std::vector<int> slices,
                                                       std::vector<TensorSink> sinks,
                                                       absl::Time deadline, absl::Duration max_wait,
                                                       const std::atomic<bool>& give_up) {
    return Pull(ps, job_id, min_version, std::move(slices), std::move(sinks), deadline, max_wait);
  }

  // An asynchronous job's pull (PullRequest.by_clock): waits, at most
  // `max_wait` (zero: until the deadline), until `worker` has had `clock`
  // gradients applied on ps `ps` (and, in SSP, the slowest live worker is
  // close enough), then pulls as Pull does at the version the ps had then.
  // `ready` is false when max_wait passed first (sinks untouched).
  struct ClockedPull {
    bool ready = false;
    int64_t version = 0;  // the lowest of the slices'
    int64_t wait_us = 0;
    int64_t clock = 0;                 // the worker's gradients applied on this ps
    int64_t lag = 0;                   // the staleness of the latest of them
    std::shared_ptr<const void> hold;  // as PullResult's
  };
  virtual absl::StatusOr<ClockedPull> PullByClock(int ps, uint64_t job_id, int worker,
                                                  int64_t clock, std::vector<int> slices,
                                                  std::vector<TensorSink> sinks,
                                                  absl::Time deadline, absl::Duration max_wait) {
    return absl::UnimplementedError("this ps client has no pull by clock");
  }

  // Pushes one worker's gradients of the slices header.slices() names (all
  // when empty); `grads` must be in the job's wire dtype
  // (JobConfig.wire_dtype; the ps refuses another with INVALID_ARGUMENT).
  virtual absl::StatusOr<PushResponse> Push(int ps, const PushHeader& header,
                                            std::vector<TensorRef> grads, absl::Time deadline) = 0;

  // Gradients that become final while their push runs (a worker pushing
  // during its backward pass), in runs: run g is grads[starts[g]] up to the
  // next run's start. `wait(g)` returns once run g's memory is final (OK),
  // or with the error that ends the push. If `checked` is set, the client
  // checks each run after its wait, before any of it leaves: whether every
  // value is below `below` in magnitude (finite, and within the wire
  // dtype's range: common/float16.h's AllBelow), and passes the answer to
  // checked(g, ok), whose error ends the push as a wait's does. (A client
  // that copies the values, into shared memory, checks them as it copies,
  // while they are in the cache.)
  struct PushRuns {
    std::vector<size_t> starts;  // ascending, from 0
    std::function<absl::Status(int run)> wait;
    std::function<absl::Status(int run, bool ok)> checked;
    float below = std::numeric_limits<float>::infinity();
  };
  // Where run g of `count` tensors in runs from `starts` ends (one past its
  // last tensor): the next run's start, or `count` for the last run.
  static size_t RunEnd(const std::vector<size_t>& starts, size_t count, size_t g) {
    return g + 1 < starts.size() ? starts[g + 1] : count;
  }
  // Whether run g of `grads` is below `runs.below` throughout (a separate
  // pass over it).
  static bool RunBelow(const std::vector<TensorRef>& grads, const PushRuns& runs, int g) {
    const size_t end = RunEnd(runs.starts, grads.size(), static_cast<size_t>(g));
    for (size_t i = runs.starts[g]; i < end; ++i) {
      if (!WireValuesBelow(grads[i], 0, NumElements(grads[i].shape), runs.below)) return false;
    }
    return true;
  }
  // As Push, but reads each run only after its wait returned (and checked
  // it), and sends what it has read before waiting for the next. What the ps
  // received complete before a failing wait stays received there (as with
  // any push that fails half-way). This default waits for (and checks)
  // every run, then pushes.
  virtual absl::StatusOr<PushResponse> PushInRuns(int ps, const PushHeader& header,
                                                  std::vector<TensorRef> grads,
                                                  const PushRuns& runs, absl::Time deadline) {
    for (int g = 0; g < static_cast<int>(runs.starts.size()); ++g) {
      absl::Status s = runs.wait(g);
      if (s.ok() && runs.checked) s = runs.checked(g, RunBelow(grads, runs, g));
      if (!s.ok()) return s;
    }
    return Push(ps, header, std::move(grads), deadline);
  }

  virtual absl::Status Shutdown(int ps, uint64_t job_id, absl::Time deadline) = 0;
  // Tells ps `ps` that the chief stops and leaves the job running, its
  // stop checkpoint written or given up: a ps that was told to stop too,
  // and waits for that checkpoint, exits now (ParameterServer.CheckpointTaken).
  virtual absl::Status CheckpointTaken(int ps, uint64_t job_id, absl::Time deadline) = 0;

  virtual absl::StatusOr<PsState> GetState(int ps, absl::Time deadline) = 0;
  virtual absl::Status SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live,
                                      int64_t from_version, absl::Time deadline) = 0;
  // Values and slots of ps `ps` as of exactly `version`, into `sinks` (one
  // per slice and slot: value sinks have slot ""; DT_FLOAT whatever the
  // job's wire dtype). DATA_LOSS if incomplete. Sinks of values alone (every
  // slot "") ask the ps for no slots.
  virtual absl::Status Snapshot(int ps, uint64_t job_id, int64_t version,
                                std::vector<TensorSink> sinks, absl::Time deadline) = 0;

  // The settings of a client that moves tensors through shared memory with
  // its ps (SharedMemoryClient, below); null for one that does not, whose
  // pushes copy and whose pulls' sinks never borrow (this default).
  virtual SharedMemoryClient* shared_memory() { return nullptr; }

  // Whether the connection to ps `ps` is up (or idle), not failing.
  virtual bool Reachable(int ps) const = 0;

  // Cancels every call in flight and makes later calls fail with CANCELLED
  // at once (for a process that is stopping).
  virtual void CancelAll() = 0;
};

// Makes the client of the ps at `addresses` (by ps index): how a worker or an
// evaluator gets its ps client once the chief has named the ps.
using ClientFactory =
    std::function<std::unique_ptr<Client>(const std::vector<std::string>& addresses)>;

}  // namespace psflow::ps

#endif  // PSFLOW_PS_CLIENT_H_
