// The gRPC transport of ps::Client: tensors streamed as chunks in both
// directions, over one or more connections per ps. Pushes and pulls, the
// calls of every step, send and read their messages as raw byte buffers
// (transport/chunk_messages.h): gradients leave from the caller's memory and
// pulled weights are decoded straight into the sinks. Thread-safe.
#ifndef PSFLOW_PS_GRPC_CLIENT_H_
#define PSFLOW_PS_GRPC_CLIENT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>

#include "common/metrics.h"
#include "common/step_trace.h"
#include "proto/ps.grpc.pb.h"
#include "ps/client.h"
#include "transport/call_channel.h"
#include "transport/channel_pool.h"
#include "transport/grpc_util.h"
#include "transport/region_offers.h"
#include "transport/shared_region.h"

namespace psflow::ps {

// The gRPC transport. Calls wait for a ps that is not up yet (gRPC
// wait-for-ready) until their deadline. With `connections_per_ps` > 1,
// pulls and pushes to one ps take its connections in turn (so that
// concurrent ones spread over them); other calls use the first. Channels are
// secured as `security` says (MakeChannel). `metrics` (may be null; must
// outlive the client) gets the bytes and durations of pushes and pulls and
// the failed calls by code.
//
// With `shared_memory`, pushes and pulls offer each ps a shared region
// (transport/shared_region.h) for their tensors, leased from a pool of at most
// kMaxRegionBytes. A ps that refuses one (it is on another host, or in
// another process namespace) gets that call again over the network, and so
// do its calls of the next GrpcClientOptions::retry_shared_after; after that one call at a time
// offers it a region again, until one is taken. A region whose call failed
// otherwise is dropped rather than reused: its ps may still be reading it.
// `metrics` also counts the calls whose tensors went through shared memory.
// How a GrpcClient reaches its ps; every field has its default.
struct GrpcClientOptions {
  SecurityOptions security;
  // Connections to each ps; pulls and pushes take them in turn.
  int connections_per_ps = 1;
  // May be null; must outlive the client.
  metrics::Registry* metrics = nullptr;
  // The role whose certificate the addresses present (a ps, or a worker
  // serving its replica in a job without ps).
  Role server_role = Role::kPs;
  // Offer each ps a shared region for the tensors of pushes and pulls.
  bool shared_memory = false;
  // With shared memory, pushes and pulls through a region go through a
  // same-host channel to their ps (transport/call_channel.h) where it opens
  // one: the same messages, without gRPC's threads on either side. At most
  // GrpcClient::kMaxChannelsPerPs per ps (one per call in flight; a call
  // that finds none free goes through gRPC). A ps that refuses to open one
  // is asked again after `retry_shared_after`.
  bool channels = false;
  // How long a ps that refused a region (or a channel) gets none.
  absl::Duration retry_shared_after = absl::Seconds(60);
  // Records spans of the pushes' and pulls' calls (null: none; it must
  // outlive the client): each push run's copy into the region and its
  // write, the wait for a push's answer, each pull message's reading and the
  // end of a pull's stream.
  StepTrace* trace = nullptr;
};

class GrpcClient final : public Client, public SharedMemoryClient {
 public:
  static constexpr int kMaxChannelsPerPs = 16;

  GrpcClient(const std::vector<std::string>& addresses, GrpcClientOptions options = {});
  int num_ps() const override { return static_cast<int>(links_.size()); }

  absl::Status Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                    absl::Time deadline) override;
  absl::StatusOr<PullResult> Pull(int ps, uint64_t job_id, int64_t min_version,
                                  std::vector<int> slices, std::vector<TensorSink> sinks,
                                  absl::Time deadline, absl::Duration max_wait) override;
  absl::StatusOr<PullResult> PullUnlessGivenUp(int ps, uint64_t job_id, int64_t min_version,
                                               std::vector<int> slices,
                                               std::vector<TensorSink> sinks, absl::Time deadline,
                                               absl::Duration max_wait,
                                               const std::atomic<bool>& give_up) override;
  absl::StatusOr<ClockedPull> PullByClock(int ps, uint64_t job_id, int worker, int64_t clock,
                                          std::vector<int> slices, std::vector<TensorSink> sinks,
                                          absl::Time deadline, absl::Duration max_wait) override;
  absl::StatusOr<PushResponse> Push(int ps, const PushHeader& header, std::vector<TensorRef> grads,
                                    absl::Time deadline) override;
  // One call: the header at once, then each run's chunks as its wait
  // returns (through shared memory, one message per run).
  absl::StatusOr<PushResponse> PushInRuns(int ps, const PushHeader& header,
                                          std::vector<TensorRef> grads, const PushRuns& runs,
                                          absl::Time deadline) override;
  absl::Status Shutdown(int ps, uint64_t job_id, absl::Time deadline) override;
  absl::Status CheckpointTaken(int ps, uint64_t job_id, absl::Time deadline) override;
  void SetRegionPinning(std::function<bool(void*, size_t)> pin,
                        std::function<void(void*)> unpin) override;
  bool SetPushRegion(std::shared_ptr<const SharedRegion> region) override
      ABSL_LOCKS_EXCLUDED(push_region_mu_);
  // This client where it was made with shared memory, else null.
  SharedMemoryClient* shared_memory() override { return regions_ != nullptr ? this : nullptr; }
  absl::StatusOr<PsState> GetState(int ps, absl::Time deadline) override;
  absl::Status SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live,
                              int64_t from_version, absl::Time deadline) override;
  absl::Status Snapshot(int ps, uint64_t job_id, int64_t version, std::vector<TensorSink> sinks,
                        absl::Time deadline) override;
  bool Reachable(int ps) const override;
  void CancelAll() override;

 private:
  // One pull: `request` (its dtype set from the sinks') answered into
  // `sinks`; the first message of the answer, or an error. `ready` tells an
  // answer that carries data from a "not yet" one. Through a shared region
  // where the ps takes one.
  // Pull and PullUnlessGivenUp (`give_up` may be null).
  absl::StatusOr<PullResult> PullVersion(int ps, uint64_t job_id, int64_t min_version,
                                         std::vector<int> slices, std::vector<TensorSink> sinks,
                                         absl::Time deadline, absl::Duration max_wait,
                                         const std::atomic<bool>* give_up);
  // Given up (CANCELLED, not counted as a failed call) once `give_up`
  // holds, where it is not null.
  // Sets *hold where sinks borrowed from the call's region.
  absl::StatusOr<PullResponse> RunPull(int ps, PullRequest request, std::vector<TensorSink> sinks,
                                       absl::Time deadline,
                                       const std::function<bool(const PullResponse&)>& ready,
                                       std::shared_ptr<const void>* hold,
                                       const std::atomic<bool>* give_up = nullptr);
  // One pull or push call, through `region` (its tensors there) or, when
  // it is null, over the network. A pull's sinks borrow only from a pinned
  // region; *borrowed counts those that did.
  absl::StatusOr<PullResponse> PullCall(int ps, PullRequest request, std::vector<TensorSink> sinks,
                                        absl::Time deadline,
                                        const std::function<bool(const PullResponse&)>& ready,
                                        SharedRegion* region, int64_t* bytes, int* borrowed,
                                        const std::atomic<bool>* give_up);
  // A push, in `runs` where not null: through a region where the ps takes
  // one, else over the network.
  absl::StatusOr<PushResponse> RunPush(int ps, const PushHeader& header,
                                       std::vector<TensorRef> grads, const PushRuns* runs,
                                       absl::Time deadline);
  // `*waited`: a run's wait ended the call (its error is returned). With
  // `in_place`, the tensors lie in `region` already (the push region) and
  // are named there, not copied.
  absl::StatusOr<PushResponse> PushCall(int ps, PushHeader header, std::vector<TensorRef> grads,
                                        const PushRuns* runs, absl::Time deadline,
                                        const SharedRegion* region, bool in_place, bool* waited);
  // PushCall's parts: the runs' messages (each run waited for and checked
  // first), one run's, one message's encoding into the region, the answer.
  struct PushWrite;
  absl::Status WritePushRuns(PushWrite& w, const std::vector<TensorRef>& grads);
  absl::Status WritePushRun(PushWrite& w, int run, std::vector<TensorRef> part);
  absl::StatusOr<grpc::ByteBuffer> EncodeInRegion(PushWrite& w, int run,
                                                  const std::vector<ChunkPiece>& pieces);
  absl::Status AwaitPushAnswer(PushWrite& w, bool on_channel, PushResponse* response, bool* clean);
  // Whether a call to `ps` may offer it a region now (RegionOffers::Offer).
  bool OfferRegion(int ps, bool* probe);
  // A region for a call that moves `bytes` bytes in `count` tensors to or
  // from `ps`; empty where it goes over the network. `*probe` as above.
  SharedRegionPool::Lease RegionFor(int ps, int64_t bytes, int64_t count, bool* probe);
  // After a call through a region (RegionOffers::Answered, counted): true
  // when the ps refused shared memory and the call must go again over the
  // network.
  bool RefusedRegion(int ps, const absl::Status& status, SharedRegionPool::Lease* lease,
                     bool probe);
  // A channel to `ps` for a call through a region, where channels are used
  // and one may be had (ChannelPool::Take); null otherwise.
  std::unique_ptr<ChannelPool::Channel> TakeChannel(int ps);
  // Asks a ps (through its stub) to open a channel in `region`: its pid.
  absl::StatusOr<int32_t> OpenChannel(ParameterServer::Stub* stub, const SharedRegionRef& region);
  // The call: on `channel` where it is not null, else over gRPC.
  std::unique_ptr<MessageCall> OpenCall(int ps, ChannelMethod method, const char* grpc_method,
                                        grpc::ClientContext* context, absl::Time deadline,
                                        ChannelPool::Channel* channel);

  // The connections to one ps.
  struct Link {
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    std::unique_ptr<ParameterServer::Stub> stub;  // on the first connection
    // Pulls and pushes go as raw messages (transport/chunk_messages.h), one
    // stub per connection.
    std::vector<std::unique_ptr<grpc::GenericStub>> raw;
    // The connections of the next pull and of the next push: each in turn,
    // so that every connection pushes (a ps vouches for a connection by its
    // pushes: see ps/service.h).
    std::atomic<unsigned> next_pull{0};
    std::atomic<unsigned> next_push{0};
    std::unique_ptr<RegionOffers> offers;       // with shared memory
    std::unique_ptr<ChannelPool> channel_pool;  // with shared memory and channels
  };
  // The raw stub of the next pull or push to `ps`.
  grpc::GenericStub* NextStub(int ps, ChannelMethod method);

  std::vector<std::unique_ptr<Link>> links_;
  // With shared_memory; shared with the holds of pulls' borrowed values.
  std::shared_ptr<SharedRegionPool> regions_;
  const absl::Duration retry_shared_after_;
  // SetPushRegion's (null: none); set between steps, read by every push.
  absl::Mutex push_region_mu_;
  std::shared_ptr<const SharedRegion> push_region_ ABSL_GUARDED_BY(push_region_mu_);
  ActiveCalls calls_;
  std::atomic<bool> cancelled_{false};  // CancelAll came: a channel's calls end too
  const bool use_channels_;
  std::unique_ptr<metrics::Registry> own_metrics_;  // when none is given
  RpcErrors errors_;
  metrics::Histogram* push_bytes_;
  metrics::Histogram* push_seconds_;
  metrics::Histogram* pull_bytes_;
  metrics::Histogram* pull_seconds_;
  metrics::Counter* shared_calls_;
  metrics::Counter* channel_calls_;
  StepTrace* const trace_;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_GRPC_CLIENT_H_
