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
#include "ps/limits.h"
#include "ps/optimizer.h"
#include "ps/tensors.h"

namespace psflow::fakes {
namespace {

using ps::WithPs;

// How often a waiting pull looks at cancellation, SetDown and Restart.
constexpr absl::Duration kPollEvery = absl::Milliseconds(2);

std::string DisplayName(const std::string& name, const std::string& slot) {
  return slot.empty() ? absl::StrCat("'", name, "'") : absl::StrCat("'", name, "' (", slot, ")");
}

// Copies each tensor of `from` into the sink of its name and slot, through
// the tensor's wire dtype (a 16-bit dtype rounds the values as a
// ChunkSplitter and ChunkAssembler would). What a ChunkAssembler would refuse
// is INVALID_ARGUMENT: a tensor no sink names, of another dtype or shape, or
// sent twice, and a required sink left empty.
absl::Status CopyInto(const std::vector<TensorRef>& from, std::vector<TensorSink>& sinks) {
  absl::flat_hash_map<std::pair<std::string, std::string>, size_t> index;
  for (size_t i = 0; i < sinks.size(); ++i) index[{sinks[i].name, sinks[i].slot}] = i;
  std::vector<bool> filled(sinks.size(), false);
  for (const TensorRef& t : from) {
    auto it = index.find(std::make_pair(t.name, t.slot));
    if (it == index.end())
      return absl::InvalidArgumentError(
          absl::StrCat("unknown tensor ", DisplayName(t.name, t.slot)));
    TensorSink& sink = sinks[it->second];
    if (t.shape != sink.shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", DisplayName(t.name, t.slot),
                                                     " has shape ", ShapeString(t.shape),
                                                     ", expected ", ShapeString(sink.shape)));
    }
    if (t.dtype != sink.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", DisplayName(t.name, t.slot),
                                                     " has dtype ", DataType_Name(t.dtype),
                                                     ", expected ", DataType_Name(sink.dtype)));
    }
    if (filled[it->second]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", DisplayName(t.name, t.slot), " sent twice"));
    }
    const int64_t n = NumElements(t.shape);
    std::string wire(static_cast<size_t>(n * WireBytes(t.dtype)), '\0');
    EncodeFloats(t.dtype, t.data, n, wire.data());
    DecodeFloats(t.dtype, wire.data(), n, SinkData(sink, n));
    filled[it->second] = true;
  }
  for (size_t i = 0; i < sinks.size(); ++i) {
    if (sinks[i].required && !filled[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", DisplayName(sinks[i].name, sinks[i].slot), " is incomplete"));
    }
  }
  return absl::OkStatus();
}

// A pull's and a snapshot's tensors as refs into the shard's result (alive
// while it is), with the version they belong to.
struct Tensors {
  int64_t version = 0;
  absl::Duration waited;
  std::vector<TensorRef> refs;
};

Tensors SnapshotTensors(const ps::Shard::Snapshot& snap) {
  return {snap.weights->version, absl::ZeroDuration(), ps::SnapshotRefs(snap)};
}

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
  absl::Status Shutdown(int ps, uint64_t job_id, absl::Time deadline) override {
    return fake_->DoShutdown(cancelled_, ps, job_id, deadline);
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

bool FakePs::Down(int ps) const {
  absl::MutexLock lock(&mu_);
  return ps_[ps].down;
}

absl::Status FakePs::DoInit(const std::atomic<bool>& cancelled, int ps, const InitHeader& header,
                            const std::vector<TensorRef>& tensors, absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard = Enter(ps, Method::kInit, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  if (header.ps_index() != ps) {
    return WithPs(ps, absl::InvalidArgumentError(
                          absl::StrCat("init for ps ", header.ps_index(), " reached ps ", ps)));
  }
  absl::StatusOr<std::unique_ptr<ps::Optimizer>> opt =
      ps::Optimizer::Create(header.job().optimizer());
  if (!opt.ok()) return WithPs(ps, opt.status());
  const std::vector<std::string> slot_names = (*opt)->SlotNames();
  if (absl::Status s = ps::CheckInitHeader(header, slot_names.size()); !s.ok()) {
    return WithPs(ps, s);
  }
  std::vector<ps::Shard::SliceValues> values;
  std::vector<TensorSink> sinks = ps::InitSinks(header, slot_names, &values);
  absl::Status s = CopyInto(tensors, sinks);
  if (s.ok()) s = (*shard)->Init(header, std::move(values));
  return WithPs(ps, s);
}

absl::StatusOr<ps::Client::PullResult> FakePs::DoPull(const std::atomic<bool>& cancelled, int ps,
                                                      uint64_t job_id, int64_t min_version,
                                                      const std::vector<int>& slices,
                                                      std::vector<TensorSink>& sinks,
                                                      absl::Time deadline,
                                                      absl::Duration max_wait) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard = Enter(ps, Method::kPull, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  // The one dtype of the sinks is what a ps::GrpcClient asks for.
  absl::StatusOr<DataType> dtype = SinksDtype(sinks);
  if (!dtype.ok()) return WithPs(ps, dtype.status());
  auto specs = (*shard)->Slices(job_id);
  if (!specs.ok()) return WithPs(ps, specs.status());
  absl::StatusOr<std::vector<int>> indices =
      ps::SliceIndices(slices, static_cast<int>((*specs)->size()), "pull");
  if (!indices.ok()) return WithPs(ps, indices.status());
  const absl::Time start = absl::Now();
  const absl::Time wait_deadline =
      max_wait > absl::ZeroDuration() ? std::min(deadline, start + max_wait) : deadline;
  auto stop = [&] { return cancelled.load() || Down(ps); };
  // Waits as the service does, in short slices so that SetDown and Restart
  // are noticed: `pull(until)` is one wait. Not-yet answers are OK with no value.
  bool first = true;
  auto wait = [&](auto pull, absl::Time until, bool may_answer_not_yet)
      -> absl::StatusOr<std::optional<std::decay_t<decltype(*pull(until))>>> {
    while (true) {
      const absl::Time slice_end = std::min(until, absl::Now() + kPollEvery);
      auto pulled = pull(slice_end);
      if (pulled.ok()) return std::optional<std::decay_t<decltype(*pulled)>>(*std::move(pulled));
      const absl::Status& s = pulled.status();
      if (absl::IsDeadlineExceeded(s) && slice_end < until && !stop()) {
        first = false;
        continue;  // not there yet: wait on
      }
      if (absl::IsDeadlineExceeded(s) && !stop() && may_answer_not_yet && until < deadline) {
        return std::nullopt;
      }
      if (Down(ps)) return WithPs(ps, absl::UnavailableError("ps is down"));
      if (cancelled) return WithPs(ps, absl::CancelledError("call cancelled"));
      // The job check passed before: the job was replaced between two waits.
      if (absl::IsFailedPrecondition(s) && !first) {
        return WithPs(ps, absl::AbortedError("the job was replaced while waiting"));
      }
      return WithPs(ps, s);
    }
  };
  PullResult result;
  std::vector<TensorRef> refs;
  std::vector<ps::Shard::Value> keep;  // the values refs point into
  if (indices->empty()) {
    auto pulled =
        wait([&](absl::Time until) { return (*shard)->Pull(job_id, min_version, until, stop); },
             wait_deadline, true);
    if (!pulled.ok()) return pulled.status();
    if (!pulled->has_value()) {
      result.version = (*shard)->stats().version;  // not yet
      return result;
    }
    result.version = (**pulled).weights->version;
    result.wait_us = absl::ToInt64Microseconds(absl::Now() - start);
  } else {
    result.version = std::numeric_limits<int64_t>::max();
    for (size_t k = 0; k < indices->size(); ++k) {
      const int i = (*indices)[k];
      auto pulled = wait(
          [&](absl::Time until) {
            return (*shard)->PullSlice(job_id, i, min_version, until, stop);
          },
          k == 0 ? wait_deadline : deadline, k == 0);
      if (!pulled.ok()) return pulled.status();
      if (!pulled->has_value()) {
        result.version = (*shard)->stats().version;  // not yet
        return result;
      }
      if (k == 0) result.wait_us = absl::ToInt64Microseconds(absl::Now() - start);
      result.version = std::min(result.version, (**pulled).version);
      keep.push_back((**pulled).value);
      refs.push_back(ps::SliceValueRef((**specs)[i], keep.back(), *dtype));
    }
  }
  absl::Status s = CopyInto(refs, sinks);
  if (!s.ok()) return WithPs(ps, absl::DataLossError(s.message()));
  return result;
}

absl::StatusOr<PushResponse> FakePs::DoPush(const std::atomic<bool>& cancelled, int ps,
                                            const PushHeader& header,
                                            const std::vector<TensorRef>& grads,
                                            absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard = Enter(ps, Method::kPush, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  auto slices = (*shard)->Slices(header.job_id());
  if (!slices.ok()) return WithPs(ps, slices.status());
  absl::StatusOr<DataType> dtype = (*shard)->WireDtype(header.job_id());
  if (!dtype.ok()) return WithPs(ps, dtype.status());
  const std::vector<SliceSpec>& specs = **slices;
  absl::StatusOr<std::vector<int>> indices =
      ps::SliceIndices(header.slices(), static_cast<int>(specs.size()), "push");
  if (!indices.ok()) return WithPs(ps, indices.status());
  std::vector<ps::Shard::SliceGradient> values;
  if (header.skip()) {
    if (!grads.empty()) return WithPs(ps, absl::InvalidArgumentError("a skip push carries data"));
    values = ps::SkipGradients(*indices, static_cast<int>(specs.size()));
  } else {
    std::vector<TensorSink> sinks = ps::GradientSinks(specs, *indices, *dtype, &values);
    absl::Status s = CopyInto(grads, sinks);
    if (!s.ok()) return WithPs(ps, s);
  }
  absl::StatusOr<PushResponse::Outcome> outcome =
      (*shard)->PushSlices(header.job_id(), header.worker(), header.step(), std::move(values));
  if (!outcome.ok()) return WithPs(ps, outcome.status());
  (*shard)->CountOutcome(*outcome);
  PushResponse response;
  response.set_outcome(*outcome);
  response.set_version((*shard)->stats().version);
  return response;
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

absl::StatusOr<PsState> FakePs::DoGetState(const std::atomic<bool>& cancelled, int ps,
                                           absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<ps::Shard>> shard =
      Enter(ps, Method::kGetState, deadline, cancelled);
  if (!shard.ok()) return shard.status();
  ps::Shard::State st = (*shard)->state();
  PsState state;
  state.set_ps_index(ps);
  state.set_holds_job(st.has_job);
  state.set_job_id(st.job_id);
  state.set_version(st.version);
  *state.mutable_job() = std::move(st.job);
  for (int w : st.live_workers) state.add_live_workers(w);
  for (int w : st.joining_workers) state.add_joining_workers(w);
  return state;
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
  auto snap =
      (*shard)->SnapshotAt(job_id, version, deadline, [&] { return cancelled.load() || Down(ps); });
  if (!snap.ok()) {
    if (Down(ps)) return WithPs(ps, absl::UnavailableError("ps is down"));
    return WithPs(ps, snap.status());
  }
  Tensors t = SnapshotTensors(**snap);
  if (t.version != version) return WithPs(ps, absl::DataLossError("snapshot of another version"));
  // As the real ps: sinks of values alone get no slots.
  if (std::all_of(sinks.begin(), sinks.end(), [](const TensorSink& s) { return s.slot.empty(); })) {
    t.refs.erase(std::remove_if(t.refs.begin(), t.refs.end(),
                                [](const TensorRef& r) { return !r.slot.empty(); }),
                 t.refs.end());
  }
  absl::Status s = CopyInto(t.refs, sinks);
  return s.ok() ? s : WithPs(ps, absl::DataLossError(s.message()));
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

absl::Status FakePs::Shutdown(int ps, uint64_t job_id, absl::Time deadline) {
  return DoShutdown(cancelled_, ps, job_id, deadline);
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
