#include "tests/fakes/fake_ps.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/float16.h"
#include "common/placement.h"
#include "ps/local_client.h"
#include "ps/optimizer.h"
#include "ps/tensors.h"
#include "transport/tensor_chunks.h"

namespace psflow::fakes {
namespace {

using ps::WithPs;

// How often a waiting pull looks at cancellation, SetDown and Restart.
constexpr absl::Duration kPollEvery = absl::Milliseconds(2);

}  // namespace

// A further client of the same cluster: only its cancellation is its own.
class FakePs::Connection final : public ps::Client {
 public:
  explicit Connection(FakePs* fake) : fake_(fake) {}
  int num_ps() const override { return fake_->num_ps(); }
  absl::Status Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                    absl::Time deadline) override {
    return fake_->DoInit(cancelled_, ps, header, tensors, deadline);
  }
  absl::StatusOr<PullResult> Pull(int ps, uint64_t job_id, int64_t min_version,
                                  std::vector<int> slices, std::vector<TensorSink> sinks,
                                  absl::Time deadline, absl::Duration max_wait) override {
    return fake_->DoPull(cancelled_, ps, job_id, min_version, slices, sinks, deadline, max_wait);
  }
  absl::StatusOr<PushResponse> Push(int ps, const PushHeader& header, std::vector<TensorRef> grads,
                                    absl::Time deadline) override {
    return fake_->DoPush(cancelled_, ps, header, grads, deadline);
  }
  absl::StatusOr<PushResponse> PushInRuns(int ps, const PushHeader& header,
                                          std::vector<TensorRef> grads, const PushRuns& runs,
                                          absl::Time deadline) override {
    return fake_->DoPushInRuns(cancelled_, ps, header, std::move(grads), runs, deadline);
  }
  absl::Status Shutdown(int ps, uint64_t job_id, absl::Time deadline) override {
    return fake_->DoShutdown(cancelled_, ps, job_id, deadline);
  }
  absl::Status CheckpointTaken(int ps, uint64_t job_id, absl::Time deadline) override {
    return fake_->DoCheckpointTaken(cancelled_, ps, job_id, deadline);
  }
  absl::StatusOr<PsState> GetState(int ps, absl::Time deadline) override {
    return fake_->DoGetState(cancelled_, ps, deadline);
  }
  absl::Status SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live,
                              int64_t from_version, absl::Time deadline) override {
    return fake_->DoSetLiveWorkers(cancelled_, ps, job_id, live, from_version, deadline);
  }
  absl::Status Snapshot(int ps, uint64_t job_id, int64_t version, std::vector<TensorSink> sinks,
                        absl::Time deadline) override {
    return fake_->DoSnapshot(cancelled_, ps, job_id, version, sinks, deadline);
  }
  bool Reachable(int ps) const override { return fake_->Reachable(ps); }
  void CancelAll() override { cancelled_ = true; }

 private:
  FakePs* const fake_;
  std::atomic<bool> cancelled_{false};
};

FakePs::FakePs(int num_ps) : num_ps_(num_ps), ps_(num_ps) {
  for (PsEntry& e : ps_) e.shard = std::make_shared<ps::Shard>();
}

FakePs::~FakePs() = default;

std::unique_ptr<ps::Client> FakePs::NewClient() { return std::make_unique<Connection>(this); }

absl::StatusOr<std::shared_ptr<ps::Shard>> FakePs::Enter(int ps, Method method, absl::Time deadline,
                                                         const std::atomic<bool>& cancelled) {
  if (ps < 0 || ps >= num_ps_)
    return absl::InvalidArgumentError(absl::StrCat("there is no ps ", ps));
  std::shared_ptr<const std::function<void(int, Method)>> hook;
  absl::Duration delay;
  {
    absl::MutexLock lock(&mu_);
    ++ps_[ps].calls[static_cast<int>(method)];
    hook = hook_;
    delay = delay_;
  }
  if (hook != nullptr) (*hook)(ps, method);
  if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
  auto gone = [&] {
    absl::MutexLock lock(&mu_);
    return ps_[ps].gone;
  };
  while (!cancelled && absl::Now() < deadline && gone()) absl::SleepFor(kPollEvery);
  if (cancelled) return WithPs(ps, absl::CancelledError("call cancelled"));
  if (absl::Now() >= deadline) return WithPs(ps, absl::DeadlineExceededError("deadline exceeded"));
  absl::MutexLock lock(&mu_);
  PsEntry& e = ps_[ps];
  if (e.down) return WithPs(ps, absl::UnavailableError("ps is down"));
  if (e.shut_down) return WithPs(ps, absl::UnavailableError("ps has shut down"));
  if (e.fail_count > 0) {
    --e.fail_count;
    return WithPs(ps, absl::Status(e.fail_code, "injected failure"));
  }
  return e.shard;
}

ps::LocalCall FakePs::Interruption(int ps, const std::atomic<bool>& cancelled) const {
  ps::LocalCall call;
  call.interrupted = [this, ps, &cancelled] {
    if (Down(ps)) return absl::UnavailableError("ps is down");
    if (cancelled) return absl::CancelledError("call cancelled");
    return absl::OkStatus();
  };
  call.poll_every = kPollEvery;
  return call;
}

bool FakePs::Down(int ps) const {
  absl::MutexLock lock(&mu_);
  return ps_[ps].down;
}

absl::Status FakePs::DoInit(const std::atomic<bool>& cancelled, int ps, const InitHeader& header,
                            const std::vector<TensorRef>& tensors, absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard = Enter(ps, Method::kInit, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  return WithPs(ps, ps::LocalInit(**shard, ps, header, tensors));
}

absl::StatusOr<ps::Client::PullResult> FakePs::DoPull(const std::atomic<bool>& cancelled, int ps,
                                                      uint64_t job_id, int64_t min_version,
                                                      const std::vector<int>& slices,
                                                      std::vector<TensorSink>& sinks,
                                                      absl::Time deadline,
                                                      absl::Duration max_wait) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard = Enter(ps, Method::kPull, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  absl::StatusOr<PullResult> r = ps::LocalPull(**shard, Interruption(ps, cancelled), job_id,
                                               min_version, slices, sinks, deadline, max_wait);
  if (!r.ok()) return WithPs(ps, r.status());
  return r;
}

absl::StatusOr<PushResponse> FakePs::DoPush(const std::atomic<bool>& cancelled, int ps,
                                            const PushHeader& header,
                                            const std::vector<TensorRef>& grads,
                                            absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard = Enter(ps, Method::kPush, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  absl::StatusOr<PushResponse> r = ps::LocalPush(**shard, header, grads);
  if (!r.ok()) return WithPs(ps, r.status());
  return r;
}

absl::Status FakePs::DoShutdown(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                                absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard =
      Enter(ps, Method::kShutdown, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  if (!(*shard)->Slices(job_id).ok()) {
    return WithPs(ps, absl::FailedPreconditionError("shutdown names another job"));
  }
  (*shard)->Shutdown();
  absl::MutexLock lock(&mu_);
  if (ps_[ps].shard == *shard) ps_[ps].shut_down = true;
  return absl::OkStatus();
}

absl::Status FakePs::DoCheckpointTaken(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                                       absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard =
      Enter(ps, Method::kCheckpointTaken, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  if (!(*shard)->Slices(job_id).ok()) {
    return WithPs(ps, absl::FailedPreconditionError("the checkpoint taken is of another job"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PsState> FakePs::DoGetState(const std::atomic<bool>& cancelled, int ps,
                                           absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard =
      Enter(ps, Method::kGetState, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  PsState state = ps::LocalState(**shard, ps);
  absl::MutexLock lock(&mu_);
  state.set_stopping(ps_[ps].stopping);
  return state;
}

void FakePs::SetStopping(int ps, bool stopping) {
  absl::MutexLock lock(&mu_);
  ps_[ps].stopping = stopping;
}

absl::Status FakePs::DoSetLiveWorkers(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                                      const std::vector<int>& live, int64_t from_version,
                                      absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard =
      Enter(ps, Method::kSetLiveWorkers, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  return WithPs(ps, (*shard)->SetLiveWorkers(job_id, live, from_version));
}

absl::Status FakePs::DoSnapshot(const std::atomic<bool>& cancelled, int ps, uint64_t job_id,
                                int64_t version, std::vector<TensorSink>& sinks,
                                absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard =
      Enter(ps, Method::kSnapshot, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  // Waits on the shard in one piece (LocalSnapshot still looks at the call every second).
  ps::LocalCall call = Interruption(ps, cancelled);
  call.poll_every = absl::InfiniteDuration();
  return WithPs(ps, ps::LocalSnapshot(**shard, call, job_id, version, sinks, deadline));
}

absl::Status FakePs::Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                          absl::Time deadline) {
  return DoInit(cancelled_, ps, header, tensors, deadline);
}

absl::StatusOr<ps::Client::PullResult> FakePs::Pull(int ps, uint64_t job_id, int64_t min_version,
                                                    std::vector<int> slices,
                                                    std::vector<TensorSink> sinks,
                                                    absl::Time deadline, absl::Duration max_wait) {
  return DoPull(cancelled_, ps, job_id, min_version, slices, sinks, deadline, max_wait);
}

absl::StatusOr<PushResponse> FakePs::Push(int ps, const PushHeader& header,
                                          std::vector<TensorRef> grads, absl::Time deadline) {
  return DoPush(cancelled_, ps, header, grads, deadline);
}

absl::StatusOr<PushResponse> FakePs::PushInRuns(int ps, const PushHeader& header,
                                                std::vector<TensorRef> grads, const PushRuns& runs,
                                                absl::Time deadline) {
  return DoPushInRuns(cancelled_, ps, header, std::move(grads), runs, deadline);
}

absl::StatusOr<PushResponse> FakePs::DoPushInRuns(const std::atomic<bool>& cancelled, int ps,
                                                  const PushHeader& header,
                                                  std::vector<TensorRef> grads,
                                                  const PushRuns& runs, absl::Time deadline) {
  if (ps >= 0 && ps < num_ps_) {  // (else DoPush says so)
    absl::MutexLock lock(&mu_);
    ps_[ps].runs += static_cast<int64_t>(runs.starts.size());
  }
  // Each run is read once its wait returned, as ps::GrpcClient reads it:
  // values the caller changes afterwards are not what was pushed.
  std::vector<std::vector<char>> read(grads.size());
  for (int g = 0; g < static_cast<int>(runs.starts.size()); ++g) {
    absl::Status s = runs.wait(g);
    if (s.ok() && runs.checked) s = runs.checked(g, RunBelow(grads, runs, g));
    if (!s.ok()) return s;
    const size_t end = RunEnd(runs.starts, grads.size(), static_cast<size_t>(g));
    for (size_t i = runs.starts[g]; i < end; ++i) {
      const int64_t n = NumElements(grads[i].shape);
      read[i].resize(static_cast<size_t>(n * WireBytes(grads[i].dtype)));
      WriteWireValues(grads[i], 0, n, read[i].data());
      grads[i].encoded = read[i].data();
      grads[i].data = nullptr;
    }
  }
  return DoPush(cancelled, ps, header, grads, deadline);
}

absl::Status FakePs::Shutdown(int ps, uint64_t job_id, absl::Time deadline) {
  return DoShutdown(cancelled_, ps, job_id, deadline);
}

absl::Status FakePs::CheckpointTaken(int ps, uint64_t job_id, absl::Time deadline) {
  return DoCheckpointTaken(cancelled_, ps, job_id, deadline);
}

absl::StatusOr<PsState> FakePs::GetState(int ps, absl::Time deadline) {
  return DoGetState(cancelled_, ps, deadline);
}

absl::Status FakePs::SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live,
                                    int64_t from_version, absl::Time deadline) {
  return DoSetLiveWorkers(cancelled_, ps, job_id, live, from_version, deadline);
}

absl::Status FakePs::Snapshot(int ps, uint64_t job_id, int64_t version,
                              std::vector<TensorSink> sinks, absl::Time deadline) {
  return DoSnapshot(cancelled_, ps, job_id, version, sinks, deadline);
}

bool FakePs::Reachable(int ps) const { return ps >= 0 && ps < num_ps_ && !Down(ps); }

void FakePs::CancelAll() { cancelled_ = true; }

void FakePs::FailNext(int ps, absl::StatusCode code, int count) {
  absl::MutexLock lock(&mu_);
  ps_[ps].fail_code = code;
  ps_[ps].fail_count = count;
}

void FakePs::SetDown(int ps, bool down) {
  absl::MutexLock lock(&mu_);
  ps_[ps].down = down;
}

void FakePs::SetGone(int ps, bool gone) {
  absl::MutexLock lock(&mu_);
  ps_[ps].gone = gone;
}

void FakePs::Restart(int ps) {
  std::shared_ptr<ps::Shard> old;
  {
    absl::MutexLock lock(&mu_);
    old = std::exchange(ps_[ps].shard, std::make_shared<ps::Shard>());
    ps_[ps].shut_down = false;
  }
  old->Shutdown();  // pulls waiting on the old process end UNAVAILABLE
}

void FakePs::SetDelay(absl::Duration delay) {
  absl::MutexLock lock(&mu_);
  delay_ = delay;
}

void FakePs::OnCall(std::function<void(int ps, Method method)> hook) {
  absl::MutexLock lock(&mu_);
  hook_ =
      hook ? std::make_shared<const std::function<void(int, Method)>>(std::move(hook)) : nullptr;
}

int64_t FakePs::calls(int ps, Method method) const {
  absl::MutexLock lock(&mu_);
  return ps_[ps].calls[static_cast<int>(method)];
}

int64_t FakePs::runs(int ps) const {
  absl::MutexLock lock(&mu_);
  return ps_[ps].runs;
}

ps::Shard::Stats FakePs::stats(int ps) const {
  std::shared_ptr<ps::Shard> shard;
  {
    absl::MutexLock lock(&mu_);
    shard = ps_[ps].shard;
  }
  return shard->stats();
}

bool FakePs::shut_down(int ps) const {
  absl::MutexLock lock(&mu_);
  return ps_[ps].shut_down;
}

}  // namespace psflow::fakes
