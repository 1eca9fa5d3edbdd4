#include "ps/local_client.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/float16.h"
#include "common/status_macros.h"
#include "ps/limits.h"
#include "ps/optimizer.h"
#include "ps/pull_session.h"
#include "ps/push_session.h"
#include "ps/snapshot_session.h"
#include "ps/tensors.h"

namespace psflow::ps {
namespace {

// The n values of `from` to `to` through its dtype: a 16-bit dtype rounds
// them as a ChunkSplitter and a ChunkAssembler would, fp32 copies them.
void CopyThrough(const TensorRef& from, int64_t n, float* to) {
  if (const char* lying = WireValuesAt(from, 0); lying != nullptr) {
    DecodeFloats(from.dtype, lying, n, to);
    return;
  }
  constexpr int64_t kPiece = 1 << 14;
  char wire[kPiece * 2];
  for (int64_t at = 0; at < n; at += kPiece) {
    const int64_t count = std::min(kPiece, n - at);
    WriteWireValues(from, at, count, wire);
    DecodeFloats(from.dtype, wire, count, to + at);
  }
}

// Copies tensors into the sinks of their name, slot and first row, through
// each tensor's wire dtype, over one or more calls of Copy. What a
// ChunkAssembler would refuse is INVALID_ARGUMENT: a tensor no sink names,
// of another dtype or shape, or sent twice, and (Finish) a required sink
// left empty.
class SinkFiller {
 public:
  explicit SinkFiller(std::vector<TensorSink>& sinks)
      : sinks_(sinks), filled_(sinks.size(), false) {
    for (size_t i = 0; i < sinks.size(); ++i) {
      index_[{sinks[i].name, sinks[i].slot, sinks[i].row_begin}] = i;
    }
  }

  absl::Status Copy(const std::vector<TensorRef>& from) {
    for (const TensorRef& t : from) {
      auto what = [&t] { return TensorDisplayName(t.name, t.slot, t.row_begin); };
      auto it = index_.find(std::make_tuple(t.name, t.slot, t.row_begin));
      if (it == index_.end())
        return absl::InvalidArgumentError(absl::StrCat("unknown tensor ", what()));
      TensorSink& sink = sinks_[it->second];
      if (t.shape != sink.shape) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", what(), " has shape ",
                                                       ShapeString(t.shape), ", expected ",
                                                       ShapeString(sink.shape)));
      }
      if (t.dtype != sink.dtype) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", what(), " has dtype ",
                                                       DataType_Name(t.dtype), ", expected ",
                                                       DataType_Name(sink.dtype)));
      }
      if (filled_[it->second]) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", what(), " sent twice"));
      }
      const int64_t n = NumElements(t.shape);
      float* to = SinkData(sink, n);
      CopyThrough(t, n, to);
      // As a ChunkAssembler: a gradient's sink learns of NaN and infinity here.
      if (sink.non_finite != nullptr && AnyNonFinite(to, n)) *sink.non_finite = true;
      filled_[it->second] = true;
    }
    return absl::OkStatus();
  }

  absl::Status Finish() const {
    for (size_t i = 0; i < sinks_.size(); ++i) {
      if (sinks_[i].required && !filled_[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", TensorDisplayName(sinks_[i].name, sinks_[i].slot, sinks_[i].row_begin),
            " is incomplete"));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::vector<TensorSink>& sinks_;
  absl::flat_hash_map<std::tuple<std::string, std::string, int64_t>, size_t> index_;
  std::vector<bool> filled_;
};

// Every tensor of `from` into `sinks` at once (see SinkFiller).
absl::Status CopyInto(const std::vector<TensorRef>& from, std::vector<TensorSink>& sinks) {
  SinkFiller filler(sinks);
  PSFLOW_RETURN_IF_ERROR(filler.Copy(from));
  return filler.Finish();
}

// Wakes a LocalPull or a LocalSnapshot waiting on its shard: a waiter of
// the shard's, armed before each look at the shard, as the service's
// Waker is, so a change after the look ends the wait. Its lock is taken
// under the shard's (in Wake) and never held while calling the shard.
class ShardWakeup {
 public:
  explicit ShardWakeup(Shard& shard)
      : shard_(shard), id_(shard.AddWaiter([this](int slice) { Wake(slice); })) {}
  ~ShardWakeup() { shard_.RemoveWaiter(id_); }  // no Wake runs after it
  ShardWakeup(const ShardWakeup&) = delete;
  ShardWakeup& operator=(const ShardWakeup&) = delete;

  void Arm(int first, int last) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    armed_ = true;
    woken_ = false;
    first_ = first;
    last_ = std::max(first, last);
  }
  // Until a change it was armed for came (since the Arm), or `until`.
  void Wait(absl::Time until) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(&woken_), until);
  }

 private:
  // Under the shard's lock: `slice` applied, or -1 for another change.
  void Wake(int slice) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!armed_ || (slice >= 0 && first_ >= 0 && (slice < first_ || slice > last_))) return;
    armed_ = false;
    woken_ = true;
  }

  Shard& shard_;
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  bool woken_ ABSL_GUARDED_BY(mu_) = false;
  int first_ ABSL_GUARDED_BY(mu_) = -1;  // the slices it waits for; -1: any change
  int last_ ABSL_GUARDED_BY(mu_) = -1;
  const int64_t id_;  // last: Wake may run as soon as it is added
};

// LocalPull's request, as ps::GrpcClient builds it. max_wait in whole
// milliseconds, rounded up: a positive one stays positive.
PullRequest LocalPullRequest(uint64_t job_id, int64_t min_version, const std::vector<int>& slices,
                             DataType dtype, absl::Duration max_wait) {
  PullRequest request;
  request.set_job_id(job_id);
  request.set_min_version(min_version);
  for (int i : slices) request.add_slices(i);
  request.set_dtype(dtype);
  if (max_wait > absl::ZeroDuration()) {
    request.set_max_wait_ms(absl::ToInt64Milliseconds(absl::Ceil(max_wait, absl::Milliseconds(1))));
  }
  return request;
}

// A failed pull's status: the interruption first, if any; a job replaced
// (or reloaded with fewer slices) while the pull waited is ABORTED.
absl::Status LocalPullError(const absl::Status& s, const LocalCall& call, bool waited) {
  if (absl::Status i = call.interrupted(); !i.ok()) return i;
  if (waited && absl::IsFailedPrecondition(s)) {
    return absl::AbortedError("the job was replaced while waiting");
  }
  if (waited && absl::IsInvalidArgument(s)) {
    return absl::AbortedError("the job was reloaded while waiting");
  }
  return s;
}

// Drives `session` to its end: waits on the shard (looking at the
// interruption before each wait, at least once a second and every
// poll_every), copies each message's slices into `sinks`.
absl::StatusOr<Client::PullResult> DriveLocalPull(PullSession& session, Shard& shard,
                                                  const LocalCall& call,
                                                  std::vector<TensorSink>& sinks) {
  ShardWakeup wakeup(shard);
  SinkFiller filler(sinks);
  PullSession::Message message;
  Client::PullResult result;
  bool first = true, waited = false;
  const absl::Duration poll = std::min(call.poll_every, absl::Seconds(1));
  while (true) {
    const PullSession::Step step =
        session.Next([&](int from, int to) { wakeup.Arm(from, to); }, &message);
    if (step.action == PullSession::Action::kWait) {
      if (absl::Status i = call.interrupted(); !i.ok()) return i;
      wakeup.Wait(std::min(step.until, absl::Now() + poll));
      waited = true;
      continue;
    }
    if (step.action == PullSession::Action::kFinish) {
      if (!step.status.ok()) return LocalPullError(step.status, call, waited);
      break;
    }
    if (session.not_yet()) {  // sinks untouched
      if (absl::Status i = call.interrupted(); !i.ok()) return i;
      result.version = message.fields.version();
      return result;
    }
    if (first) result.wait_us = message.fields.wait_us();
    result.version =
        first ? message.fields.version() : std::min(result.version, message.fields.version());
    first = false;
    absl::Status s = filler.Copy(message.refs);
    if (!s.ok()) return absl::DataLossError(s.message());
    if (message.last) break;
  }
  absl::Status s = filler.Finish();
  if (!s.ok()) return absl::DataLossError(s.message());
  return result;
}

}  // namespace

absl::Status LocalInit(Shard& shard, int ps, const InitHeader& header,
                       const std::vector<TensorRef>& tensors) {
  if (header.ps_index() != ps) {
    return absl::InvalidArgumentError(
        absl::StrCat("init for ps ", header.ps_index(), " reached ps ", ps));
  }
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(header.job().optimizer());
  if (!opt.ok()) return opt.status();
  const std::vector<std::string> slot_names = (*opt)->SlotNames();
  PSFLOW_RETURN_IF_ERROR(CheckInitHeader(header, slot_names.size()));
  std::vector<Shard::SliceValues> values;
  std::vector<TensorSink> sinks = InitSinks(header, slot_names, &values);
  PSFLOW_RETURN_IF_ERROR(CopyInto(tensors, sinks));
  return shard.Init(header, std::move(values));
}

absl::StatusOr<Client::PullResult> LocalPull(Shard& shard, const LocalCall& call, uint64_t job_id,
                                             int64_t min_version, const std::vector<int>& slices,
                                             std::vector<TensorSink>& sinks, absl::Time deadline,
                                             absl::Duration max_wait) {
  // The one dtype of the sinks is what a ps::GrpcClient asks for.
  PSFLOW_ASSIGN_OR_RETURN(const DataType dtype, SinksDtype(sinks));
  const PullRequest request = LocalPullRequest(job_id, min_version, slices, dtype, max_wait);
  PullSession session(&shard, request, absl::Now(), deadline);
  PSFLOW_RETURN_IF_ERROR(session.Prepare());
  return DriveLocalPull(session, shard, call, sinks);
}

absl::StatusOr<PushResponse> LocalPush(Shard& shard, const PushHeader& header,
                                       const std::vector<TensorRef>& grads) {
  PushSession session(&shard);
  PSFLOW_RETURN_IF_ERROR(session.Begin(header, /*in_place=*/false));
  if (header.skip()) {
    if (!grads.empty()) return absl::InvalidArgumentError("a skip push carries data");
  } else {
    std::vector<TensorSink> sinks = session.TakeSinks();
    PSFLOW_RETURN_IF_ERROR(CopyInto(grads, sinks));
    PSFLOW_RETURN_IF_ERROR(session.HandOverAll());
  }
  return session.End();
}

PsState LocalState(Shard& shard, int ps) {
  Shard::State st = shard.state();
  PsState state;
  state.set_ps_index(ps);
  state.set_holds_job(st.has_job);
  state.set_job_id(st.job_id);
  state.set_version(st.version);
  *state.mutable_job() = std::move(st.job);
  for (int w : st.live_workers) state.add_live_workers(w);
  for (int w : st.joining_workers) state.add_joining_workers(w);
  for (int64_t step : st.pushed_steps) state.add_pushed_steps(step);
  return state;
}

absl::Status LocalSnapshot(Shard& shard, const LocalCall& call, uint64_t job_id, int64_t version,
                           std::vector<TensorSink>& sinks, absl::Time deadline) {
  SnapshotRequest request;
  request.set_job_id(job_id);
  request.set_version(version);
  // As the real ps: sinks of values alone get no slots.
  request.set_values_only(
      std::all_of(sinks.begin(), sinks.end(), [](const TensorSink& s) { return s.slot.empty(); }));
  SnapshotSession session(&shard, request, deadline);
  PSFLOW_RETURN_IF_ERROR(session.Request());
  ShardWakeup wakeup(shard);
  const absl::Duration poll = std::min(call.poll_every, absl::Seconds(1));
  while (true) {
    const SnapshotSession::Step step = session.Next([&] { wakeup.Arm(-1, -1); });
    if (step.action == SnapshotSession::Action::kSend) break;
    if (absl::Status i = call.interrupted(); !i.ok()) return i;
    if (step.action == SnapshotSession::Action::kFinish) return step.status;
    wakeup.Wait(std::min(step.until, absl::Now() + poll));
  }
  if (session.snapshot()->weights->version != version) {
    return absl::DataLossError("snapshot of another version");
  }
  absl::Status s = CopyInto(session.Refs(), sinks);
  return s.ok() ? s : absl::DataLossError(s.message());
}

LocalClient::LocalClient(Shard* shard) : shard_(shard) {}

absl::Status LocalClient::Check(int ps) const {
  if (ps != 0) return absl::InvalidArgumentError(absl::StrCat("there is no ps ", ps));
  if (cancelled_) return absl::CancelledError("call cancelled");
  return absl::OkStatus();
}

LocalCall LocalClient::Call() const {
  LocalCall call;
  call.interrupted = [this] {
    return cancelled_ ? absl::CancelledError("call cancelled") : absl::OkStatus();
  };
  return call;
}

absl::Status LocalClient::Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                               absl::Time) {
  PSFLOW_RETURN_IF_ERROR(Check(ps));
  return WithPs(ps, LocalInit(*shard_, ps, header, tensors));
}

absl::StatusOr<Client::PullResult> LocalClient::Pull(int ps, uint64_t job_id, int64_t min_version,
                                                     std::vector<int> slices,
                                                     std::vector<TensorSink> sinks,
                                                     absl::Time deadline, absl::Duration max_wait) {
  PSFLOW_RETURN_IF_ERROR(Check(ps));
  absl::StatusOr<PullResult> r =
      LocalPull(*shard_, Call(), job_id, min_version, slices, sinks, deadline, max_wait);
  if (!r.ok()) return WithPs(ps, r.status());
  return r;
}

absl::StatusOr<PushResponse> LocalClient::Push(int ps, const PushHeader& header,
                                               std::vector<TensorRef> grads, absl::Time) {
  PSFLOW_RETURN_IF_ERROR(Check(ps));
  absl::StatusOr<PushResponse> r = LocalPush(*shard_, header, grads);
  if (!r.ok()) return WithPs(ps, r.status());
  return r;
}

absl::Status LocalClient::Shutdown(int ps, uint64_t job_id, absl::Time) {
  PSFLOW_RETURN_IF_ERROR(Check(ps));
  if (!shard_->Slices(job_id).ok()) {
    return WithPs(ps, absl::FailedPreconditionError("shutdown names another job"));
  }
  shard_->Shutdown();
  return absl::OkStatus();
}

absl::Status LocalClient::CheckpointTaken(int ps, uint64_t job_id, absl::Time) {
  PSFLOW_RETURN_IF_ERROR(Check(ps));
  if (!shard_->Slices(job_id).ok()) {
    return WithPs(ps, absl::FailedPreconditionError("the checkpoint taken is of another job"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PsState> LocalClient::GetState(int ps, absl::Time) {
  PSFLOW_RETURN_IF_ERROR(Check(ps));
  return LocalState(*shard_, ps);
}

absl::Status LocalClient::SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live,
                                         int64_t from_version, absl::Time) {
  PSFLOW_RETURN_IF_ERROR(Check(ps));
  return WithPs(ps, shard_->SetLiveWorkers(job_id, live, from_version));
}

absl::Status LocalClient::Snapshot(int ps, uint64_t job_id, int64_t version,
                                   std::vector<TensorSink> sinks, absl::Time deadline) {
  PSFLOW_RETURN_IF_ERROR(Check(ps));
  return WithPs(ps, LocalSnapshot(*shard_, Call(), job_id, version, sinks, deadline));
}

}  // namespace psflow::ps
