// The gRPC face of a parameter server: ParameterServer::Service over a Shard.
// Turns streams of TensorChunks into checked slices and back; every problem
// with a request becomes an error status for that call only. The shard holds
// fp32 only: pulls are encoded here in the dtype the request names (the
// job's wire dtype when it names none) and pushes, which come in the job's
// wire dtype, decoded here; Init and Snapshot are fp32.
//
// Pull, Push and Snapshot use gRPC's callback API. In Pull and Snapshot,
// the calls that wait (for a version), a waiting call holds no thread, only
// a waiter on the shard that wakes it (on a small pool of this service's)
// when a slice is applied, and an alarm for its deadline. A push's messages
// are read on another pool of the service's. The streams a peer may have open
// at once (Init, Pull, Push, Snapshot; a peer is one client connection) and
// those of every peer together are bounded: a call over a bound fails at
// once with RESOURCE_EXHAUSTED and costs nothing else.
//
// Admission before resources (transport/stream_budget.h). A connection is a
// member once the ps accepted a push header or an Init on it; until then its
// streams are pending, and the pending streams of every connection together
// may hold only StreamLimits::pending of the budget: the rest is kept for
// members. So a crowd of strangers, or of callers that learnt the job id
// (GetState tells it to anyone) and hold waiting pulls, cannot take the
// streams that the workers at work need. A Push or Init stream that has
// shown no valid header (the right job id; this ps's index for an Init)
// within StreamLimits::first_message_timeout is ended (a push answered
// DEADLINE_EXCEEDED, an Init cancelled) and counted, whoever opened it; a
// timer per stream, no thread (the calls of a same-host channel are not
// timed: its thread waits only for its own worker). The limits: a
// worker's first pulls come before its first push, so a worker that
// (re)starts while strangers fill the pending part is refused until room
// frees (silent streams leave within the timeout; waiting pulls hold theirs
// as long as they wait). Without TLS anyone who knows the job id can forge
// a push header and so become a member; with TLS and the job token
// strangers never reach a handler.
#ifndef PSFLOW_PS_SERVICE_H_
#define PSFLOW_PS_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/thread_pool.h"
#include "proto/ps.grpc.pb.h"
#include "ps/callers.h"
#include "ps/shard.h"
#include "transport/channel_server.h"
#include "transport/security.h"
#include "transport/shared_region.h"
#include "transport/stream_budget.h"
#include "transport/waiting_writer.h"

namespace psflow::ps {

// Bounds on the streams open at once (Init, Pull, Push, Snapshot).
using StreamLimits = ::psflow::StreamLimits;

// How a PsService serves; every field has its default.
struct PsServiceOptions {
  // This server's task index: an Init for another index is refused.
  int ps_index = 0;
  // Called for an accepted Shutdown; it must only signal (the caller stops
  // the server, letting this call finish, or keeps it up idle: from then on
  // GetState and SetLiveWorkers answer UNAVAILABLE, as a ps that is gone
  // would, and the shard refuses the rest). None: nothing is called.
  std::function<void()> on_shutdown;
  // Called with true after every accepted Init: the ps holds a job (is
  // ready). May be empty.
  std::function<void(bool)> on_job;
  // Gets the sizes and durations of pushes and pulls and the streams refused
  // over a bound. May be null; must outlive the service and not be rendered
  // once it is gone.
  metrics::Registry* metrics = nullptr;
  StreamLimits limits;
  // False: pushes and pulls that name a shared region
  // (transport/shared_region.h) are refused, so their workers send over the
  // network; true: the regions are mapped and used.
  bool shared_memory = true;
  // Gets the spans of push messages and answers and of the slices of pull
  // answers. May be null; must outlive the service.
  StepTrace* trace = nullptr;
  // A synchronous job's gradients pushed through a region are applied where
  // they lie (Shard::SliceGradient::borrowed; 16-bit ones widened as they
  // are read) instead of being copied out first, and such a push is answered
  // once the shard has let go of all of them: its worker reuses the region
  // only after the answer.
  bool apply_in_place = true;
  // The pulls that one apply wakes are answered on several threads at once
  // (the applying thread answers the first; the waker threads the others)
  // instead of one after the other on the applying thread. psflow-ps
  // --parallel_pull_answers turns it on; a worker's replica keeps it off.
  bool spread_wakes = false;
  // With `shared_memory`: workers of this host may open same-host channels
  // (OpenChannel) and push and pull through them.
  bool channels = false;
  // Where woken pulls encode their next slice, and where push messages are
  // decoded. Not owned; must outlive the service. Null: the service makes a
  // pool of its own (wakers: a quarter of the usable cores, at least 2;
  // pushers: the usable cores, at least 4).
  ThreadPool* wakers = nullptr;
  ThreadPool* pushers = nullptr;
};

class PsService final
    : public ParameterServer::WithRawCallbackMethod_Pull<
          ParameterServer::WithCallbackMethod_Snapshot<
              ParameterServer::WithRawCallbackMethod_Push<ParameterServer::Service>>>,
      private WaitingCallHost {
 public:
  // `shard` (not owned) outlives the service.
  PsService(Shard* shard, PsServiceOptions options);
  ~PsService() override;

  grpc::Status Init(grpc::ServerContext* context, grpc::ServerReader<InitRequest>* reader,
                    InitResponse* response) override;
  // Pull and Push send and read raw messages (transport/chunk_messages.h):
  // PullResponse and PushRequest in protobuf's encoding, whose chunks'
  // data go out of the shard's published values and into the gradients'
  // buffers without a copy through protobuf.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Pull(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* Push(grpc::CallbackServerContext* context,
                                                  grpc::ByteBuffer* response) override;
  grpc::Status Shutdown(grpc::ServerContext* context, const ShutdownRequest* request,
                        ShutdownResponse* response) override;
  // Checks the job id (FAILED_PRECONDITION for another) and calls the
  // function OnCheckpointTaken gave.
  grpc::Status CheckpointTaken(grpc::ServerContext* context, const CheckpointTakenRequest* request,
                               CheckpointTakenResponse* response) override;
  // What an accepted CheckpointTaken calls (it must only record it): psflow-ps
  // ends its wait for the chief's checkpoint. Set before the server starts;
  // none by default.
  void OnCheckpointTaken(std::function<void()> on_taken) {
    on_checkpoint_taken_ = std::move(on_taken);
  }
  grpc::Status GetState(grpc::ServerContext* context, const GetStateRequest* request,
                        PsState* response) override;
  grpc::Status SetLiveWorkers(grpc::ServerContext* context, const SetLiveWorkersRequest* request,
                              SetLiveWorkersResponse* response) override;
  grpc::ServerWriteReactor<SnapshotResponse>* Snapshot(grpc::CallbackServerContext* context,
                                                       const SnapshotRequest* request) override;
  // Maps the worker's channel region and serves its calls on a thread of
  // the channel's (transport/channel_server.h), through the same reactors as
  // Push and Pull. At most StreamLimits::per_peer channels per worker
  // process and `total` in all (RESOURCE_EXHAUSTED over them).
  grpc::Status OpenChannel(grpc::ServerContext* context, const OpenChannelRequest* request,
                           OpenChannelResponse* response) override;

  // Streams refused for a bound so far, and cancelled for sending no valid
  // header in time.
  int64_t refused_streams() const;
  int64_t timed_out_streams() const;
  // Push streams are numbered as they are admitted (from 1): the number of
  // the latest, and whether any up to `seq` is still open. A ps that is
  // stopping lets the pushes of the workers' steps in flight end before it
  // goes.
  int64_t pushes_admitted() const ABSL_LOCKS_EXCLUDED(pushes_mu_);
  bool pushes_open_up_to(int64_t seq) const ABSL_LOCKS_EXCLUDED(pushes_mu_);
  // From now on GetState says this ps is stopping (PsState.stopping): it
  // was told to stop and waits for the chief's checkpoint.
  void SetStopping() { stopping_ = true; }

  // Same-host channels open now (those whose thread ended are dropped as
  // the next one opens).
  int open_channels() const ABSL_LOCKS_EXCLUDED(channels_mu_);

  // Internals of the calls (service.cc). Push and Pull reactors are
  // templates over their base: gRPC's, or a channel's; Pull and Snapshot
  // wait as transport/waiting_writer.h says, this service their host.
  template <typename Base>
  class PullWriter;
  class SnapshotWriter;
  template <typename Base>
  class PushReader;

 private:
  // Counts a stream of `peer` in, or refuses it (RESOURCE_EXHAUSTED) over a
  // bound; every admitted stream is let out once. (Pulls and snapshots: they
  // vouch for no peer.)
  absl::Status Admit(const std::string& peer) override;
  void LetOut(const std::string& peer) override;
  // The status of a stream cancelled for showing no valid header in time.
  absl::Status SilentStream() const;
  // The shard's changes wake the waiting calls.
  int64_t AddWaiter(std::function<void(int slice)> wake) override {
    return shard_->AddWaiter(std::move(wake));
  }
  void RemoveWaiter(int64_t id) override { shard_->RemoveWaiter(id); }
  ThreadPool* wake_pool() override { return wakers_; }
  bool spread_wakes() const override { return spread_wakes_; }
  // The region a push or pull names, mapped; a refusal without shared memory.
  absl::StatusOr<std::shared_ptr<const SharedMapping>> AttachRegion(const SharedRegionRef& ref);
  void ForgetRegion(const SharedRegionRef& ref);
  // Logs a push refused for its contents (a non-finite gradient, a bad
  // size): the first ten, then every thousandth.
  void LogRefusedPush(const std::string& peer, const absl::Status& why);

  int ps_index_;
  Shard* shard_;
  std::function<void()> on_shutdown_;
  std::function<void(bool)> on_job_;
  std::function<void()> on_checkpoint_taken_;
  StreamBudget streams_;
  StepTrace* const trace_;  // may be null
  const bool apply_in_place_;
  const bool spread_wakes_;
  std::atomic<bool> finished_{false};  // an accepted Shutdown came
  mutable absl::Mutex pushes_mu_;
  int64_t pushes_admitted_ ABSL_GUARDED_BY(pushes_mu_) = 0;
  std::set<int64_t> open_pushes_ ABSL_GUARDED_BY(pushes_mu_);
  std::atomic<bool> stopping_{false};
  std::unique_ptr<metrics::Registry> own_metrics_;  // when none is given
  metrics::Histogram* push_bytes_;
  metrics::Histogram* push_seconds_;
  metrics::Histogram* pull_bytes_;
  metrics::Histogram* pull_seconds_;
  metrics::Counter* refused_regions_;
  // Runs what a shard's waiter wakes (never under the shard's lock); its
  // threads may record into the metrics, so it goes first.
  ThreadPool* wakers_;
  std::unique_ptr<ThreadPool> own_wakers_;  // when the options gave none
  // Reads the pushes' messages (decodes their chunks, hands complete slices
  // to the shard) off gRPC's threads: one message of a push at a time.
  ThreadPool* pushers_;
  std::unique_ptr<ThreadPool> own_pushers_;  // when the options gave none
  // Workers' shared regions; null when this ps takes none.
  std::unique_ptr<SharedRegionMap> regions_;
  const bool channels_;
  // Stopped (their calls cancelled and done) before anything above goes.
  mutable absl::Mutex channels_mu_;
  std::vector<std::unique_ptr<ChannelServer>> channel_servers_ ABSL_GUARDED_BY(channels_mu_);

  std::atomic<int64_t> refused_pushes_{0};
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_SERVICE_H_
