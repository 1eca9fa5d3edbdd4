// An in-memory parameter-server cluster behind the ps::Client interface, for
// testing role logic without processes or gRPC. It holds one real ps::Shard
// per ps and makes the calls of ps/local_client.h on it (what ps/service.cc
// does in front of a shard), with faults in front. Pulls and pushes go through their wire dtype as
// the service's do: a pull in the sinks' dtype, a push in the job's wire dtype (another is
// INVALID_ARGUMENT), values rounded to 16 bits and back. Errors name the ps ("ps 1:
// ...") and keep the codes ps::GrpcClient would give: the shard's own, INVALID_ARGUMENT for tensors
// an Init or a push does not fit, DATA_LOSS for a pull or snapshot answer that does not fit the
// sinks.
//
// Faults are injected per ps: FailNext (the next calls fail with a code),
// SetDown (every call UNAVAILABLE), SetGone (every call waits for the ps, as
// gRPC's wait-for-ready calls wait for a process that is not there), Restart (the ps comes back
// empty, as a process that died and was started again), SetDelay (every call starts late), and
// OnCall (a hook at the start of every call, to inject a fault at an exact point). Calls are
// counted per ps and method.
//
// Pulls wait on the shard in short slices, so that CancelAll, SetDown and
// Restart end a waiting pull within a few milliseconds; a Snapshot waits on
// the shard in one piece (within a second, as the shard checks).
//
// Thread-safe. NewClient() gives further clients of the same cluster (as
// several processes each holding a ps::GrpcClient), each with its own
// CancelAll; they must not outlive the FakePs.
#ifndef PSFLOW_TESTS_FAKES_FAKE_PS_H_
#define PSFLOW_TESTS_FAKES_FAKE_PS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ps/client.h"
#include "ps/local_client.h"
#include "ps/shard.h"

namespace psflow::fakes {

class FakePs final : public ps::Client {
 public:
  enum class Method {
    kInit,
    kPull,
    kPush,
    kShutdown,
    kGetState,
    kSetLiveWorkers,
    kSnapshot,
    kCheckpointTaken
  };
  static constexpr int kNumMethods = 8;

  // `num_ps` empty ps (holding no job).
  explicit FakePs(int num_ps);
  ~FakePs() override;
  FakePs(const FakePs&) = delete;
  FakePs& operator=(const FakePs&) = delete;

  // Another client of the same ps, with its own CancelAll.
  std::unique_ptr<ps::Client> NewClient();

  // ps::Client. A ps index out of range is INVALID_ARGUMENT.
  int num_ps() const override { return num_ps_; }
  absl::Status Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                    absl::Time deadline) override;
  absl::StatusOr<PullResult> Pull(int ps, uint64_t job_id, int64_t min_version,
                                  std::vector<int> slices, std::vector<TensorSink> sinks,
                                  absl::Time deadline, absl::Duration max_wait) override;
  absl::StatusOr<PushResponse> Push(int ps, const PushHeader& header, std::vector<TensorRef> grads,
                                    absl::Time deadline) override;
  // Reads each run once its wait returned (and it was checked), then pushes
  // what it read; counts the runs.
  absl::StatusOr<PushResponse> PushInRuns(int ps, const PushHeader& header,
                                          std::vector<TensorRef> grads, const PushRuns& runs,
                                          absl::Time deadline) override;
  // Shuts the ps's shard down (later calls are UNAVAILABLE until Restart).
  absl::Status Shutdown(int ps, uint64_t job_id, absl::Time deadline) override;
  // Checks the job id, as a ps does (the fake has no process to stop).
  absl::Status CheckpointTaken(int ps, uint64_t job_id, absl::Time deadline) override;
  absl::StatusOr<PsState> GetState(int ps, absl::Time deadline) override;
  absl::Status SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live,
                              int64_t from_version, absl::Time deadline) override;
  absl::Status Snapshot(int ps, uint64_t job_id, int64_t version, std::vector<TensorSink> sinks,
                        absl::Time deadline) override;
  // False while the ps is down.
  bool Reachable(int ps) const override;
  // Cancels this client's calls (not those of NewClient's clients).
  void CancelAll() override;

  // Fault injection; each applies to calls that start afterwards (and SetDown
  // and Restart also to pulls waiting on the ps).
  // The next `count` calls to ps `ps` (any method, any client) fail with
  // `code`, after being counted.
  void FailNext(int ps, absl::StatusCode code, int count = 1);
  // While down, every call to ps `ps` fails UNAVAILABLE and Reachable is false.
  void SetDown(int ps, bool down);
  // While gone, every call to ps `ps` waits until its deadline
  // (DEADLINE_EXCEEDED) or the client's CancelAll (CANCELLED), as the
  // clients' wait-for-ready calls to a ps process that went away do.
  void SetGone(int ps, bool gone);
  // Replaces ps `ps`'s shard by a fresh one holding no job; pulls waiting on
  // the old one fail UNAVAILABLE (the connection broke).
  void Restart(int ps);
  // While set, GetState of ps `ps` says it is stopping (PsState.stopping),
  // as a ps told to stop that waits for the chief's checkpoint.
  void SetStopping(int ps, bool stopping);
  // Every later call sleeps `delay` before doing anything.
  void SetDelay(absl::Duration delay);
  // Runs `hook(ps, method)` at the start of every call, after counting it and
  // before any injected fault is applied (so a hook may inject one into the
  // very call). Runs on the caller's thread without the fake's lock held: it
  // may call any method of the fake except the ps::Client ones.
  void OnCall(std::function<void(int ps, Method method)> hook);

  // Observation.
  // Calls to ps `ps` of `method` so far, failed ones included.
  int64_t calls(int ps, Method method) const;
  // Runs of the pushes in runs to ps `ps` so far (their PushRuns::starts).
  int64_t runs(int ps) const;
  // The counters of ps `ps`'s current shard.
  ps::Shard::Stats stats(int ps) const;
  // Whether a Shutdown of ps `ps` was accepted (and no Restart since).
  bool shut_down(int ps) const;

 private:
  class Connection;

  // Counts the call, runs the hook, sleeps the delay, then applies the
  // calling client's cancellation, the deadline and the injected faults; on
  // success the shard to call.
  absl::StatusOr<std::shared_ptr<ps::Shard>> Enter(int ps, Method method, absl::Time deadline,
                                                   const std::atomic<bool>& cancelled);
  bool Down(int ps) const;
  // What ends a wait of a call to ps `ps`: the ps going down, then the
  // calling client's CancelAll; looked at every kPollEvery.
  ps::LocalCall Interruption(int ps, const std::atomic<bool>& cancelled) const;

  // The calls, for this client or a Connection (`cancelled`: its CancelAll).
  absl::Status DoInit(const std::atomic<bool>& cancelled, int ps, const InitHeader& header,
                      const std::vector<TensorRef>& tensors, absl::Time deadline);
  absl::StatusOr<PullResult> DoPull(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                                    int64_t min_version, const std::vector<int>& slices,
                                    std::vector<TensorSink>& sinks, absl::Time deadline,
                                    absl::Duration max_wait);
  absl::StatusOr<PushResponse> DoPushInRuns(const std::atomic<bool>& cancelled, int ps,
                                            const PushHeader& header, std::vector<TensorRef> grads,
                                            const PushRuns& runs, absl::Time deadline);
  absl::StatusOr<PushResponse> DoPush(const std::atomic<bool>& cancelled, int ps,
                                      const PushHeader& header, const std::vector<TensorRef>& grads,
                                      absl::Time deadline);
  absl::Status DoShutdown(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                          absl::Time deadline);
  absl::Status DoCheckpointTaken(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                                 absl::Time deadline);
  absl::StatusOr<PsState> DoGetState(const std::atomic<bool>& cancelled, int ps,
                                     absl::Time deadline);
  absl::Status DoSetLiveWorkers(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                                const std::vector<int>& live, int64_t from_version,
                                absl::Time deadline);
  absl::Status DoSnapshot(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                          int64_t version, std::vector<TensorSink>& sinks, absl::Time deadline);

  struct PsEntry {
    std::shared_ptr<ps::Shard> shard;  // replaced by Restart
    bool down = false;
    bool gone = false;
    bool shut_down = false;
    bool stopping = false;
    absl::StatusCode fail_code = absl::StatusCode::kOk;
    int fail_count = 0;
    std::array<int64_t, kNumMethods> calls{};
    int64_t runs = 0;
  };

  const int num_ps_;
  std::atomic<bool> cancelled_{false};  // this client's CancelAll
  mutable absl::Mutex mu_;
  std::vector<PsEntry> ps_ ABSL_GUARDED_BY(mu_);
  absl::Duration delay_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const std::function<void(int, Method)>> hook_ ABSL_GUARDED_BY(mu_);
};

}  // namespace psflow::fakes

#endif  // PSFLOW_TESTS_FAKES_FAKE_PS_H_
