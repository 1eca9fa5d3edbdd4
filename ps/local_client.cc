#include "ps/local_client.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/float16.h"
#include "common/status_macros.h"
#include "ps/limits.h"
#include "ps/optimizer.h"
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

// Copies each tensor of `from` into the sink of its name, slot and first
// row, through the tensor's wire dtype. What a ChunkAssembler would refuse is
// INVALID_ARGUMENT: a tensor no sink names, of another dtype or shape, or
// sent twice, and a required sink left empty.
absl::Status CopyInto(const std::vector<TensorRef>& from, std::vector<TensorSink>& sinks) {
  absl::flat_hash_map<std::tuple<std::string, std::string, int64_t>, size_t> index;
  for (size_t i = 0; i < sinks.size(); ++i) {
    index[{sinks[i].name, sinks[i].slot, sinks[i].row_begin}] = i;
  }
  std::vector<bool> filled(sinks.size(), false);
  for (const TensorRef& t : from) {
    auto what = [&t] { return TensorDisplayName(t.name, t.slot, t.row_begin); };
    auto it = index.find(std::make_tuple(t.name, t.slot, t.row_begin));
    if (it == index.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown tensor ", what()));
    TensorSink& sink = sinks[it->second];
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
    if (filled[it->second]) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", what(), " sent twice"));
    }
    const int64_t n = NumElements(t.shape);
    CopyThrough(t, n, SinkData(sink, n));
    filled[it->second] = true;
  }
  for (size_t i = 0; i < sinks.size(); ++i) {
    if (sinks[i].required && !filled[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", TensorDisplayName(sinks[i].name, sinks[i].slot, sinks[i].row_begin),
          " is incomplete"));
    }
  }
  return absl::OkStatus();
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
  PSFLOW_ASSIGN_OR_RETURN(auto specs, shard.Slices(job_id));
  PSFLOW_ASSIGN_OR_RETURN(std::vector<int> indices,
                          SliceIndices(slices, static_cast<int>(specs->size()), "pull"));
  const absl::Time start = absl::Now();
  const absl::Time wait_deadline =
      max_wait > absl::ZeroDuration() ? std::min(deadline, start + max_wait) : deadline;
  auto stop = [&] { return !call.interrupted().ok(); };
  // Waits as the service does, in slices of poll_every: `pull(until)` is
  // one wait. Not-yet answers are OK with no value.
  bool first = true;
  auto wait = [&](auto pull, absl::Time until, bool may_answer_not_yet)
      -> absl::StatusOr<std::optional<std::decay_t<decltype(*pull(until))>>> {
    while (true) {
      const absl::Time slice_end = std::min(until, absl::Now() + call.poll_every);
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
      if (absl::Status i = call.interrupted(); !i.ok()) return i;
      // The job check passed before: the job was replaced between two waits.
      if (absl::IsFailedPrecondition(s) && !first) {
        return absl::AbortedError("the job was replaced while waiting");
      }
      return s;
    }
  };
  Client::PullResult result;
  std::vector<TensorRef> refs;
  std::vector<Shard::Value> keep;  // the values refs point into
  std::shared_ptr<const Shard::Weights> whole;
  if (indices.empty()) {
    auto pulled =
        wait([&](absl::Time until) { return shard.Pull(job_id, min_version, until, stop); },
             wait_deadline, true);
    if (!pulled.ok()) return pulled.status();
    if (!pulled->has_value()) {
      result.version = shard.stats().version;  // not yet
      return result;
    }
    whole = (**pulled).weights;
    result.version = whole->version;
    result.wait_us = absl::ToInt64Microseconds(absl::Now() - start);
    for (size_t i = 0; i < whole->values.size(); ++i) {
      refs.push_back(SliceValueRef((*whole->slices)[i], whole->values[i], dtype));
    }
  } else {
    result.version = std::numeric_limits<int64_t>::max();
    for (size_t k = 0; k < indices.size(); ++k) {
      const int i = indices[k];
      auto pulled = wait(
          [&](absl::Time until) { return shard.PullSlice(job_id, i, min_version, until, stop); },
          k == 0 ? wait_deadline : deadline, k == 0);
      if (!pulled.ok()) return pulled.status();
      if (!pulled->has_value()) {
        result.version = shard.stats().version;  // not yet
        return result;
      }
      if (k == 0) result.wait_us = absl::ToInt64Microseconds(absl::Now() - start);
      result.version = std::min(result.version, (**pulled).version);
      keep.push_back((**pulled).value);
      refs.push_back(SliceValueRef((*specs)[i], keep.back(), dtype));
    }
  }
  absl::Status s = CopyInto(refs, sinks);
  if (!s.ok()) return absl::DataLossError(s.message());
  return result;
}

absl::StatusOr<PushResponse> LocalPush(Shard& shard, const PushHeader& header,
                                       const std::vector<TensorRef>& grads) {
  PSFLOW_ASSIGN_OR_RETURN(auto slices, shard.Slices(header.job_id()));
  PSFLOW_ASSIGN_OR_RETURN(const DataType dtype, shard.WireDtype(header.job_id()));
  const std::vector<SliceSpec>& specs = *slices;
  PSFLOW_ASSIGN_OR_RETURN(std::vector<int> indices,
                          SliceIndices(header.slices(), static_cast<int>(specs.size()), "push"));
  std::vector<Shard::SliceGradient> values;
  if (header.skip()) {
    if (!grads.empty()) return absl::InvalidArgumentError("a skip push carries data");
    values = SkipGradients(indices, static_cast<int>(specs.size()));
  } else {
    std::vector<TensorSink> sinks = GradientSinks(specs, indices, dtype, &values);
    PSFLOW_RETURN_IF_ERROR(CopyInto(grads, sinks));
  }
  PSFLOW_ASSIGN_OR_RETURN(
      const PushResponse::Outcome outcome,
      shard.PushSlices(header.job_id(), header.worker(), header.step(), std::move(values)));
  shard.CountOutcome(outcome);
  PushResponse response;
  response.set_outcome(outcome);
  response.set_version(shard.stats().version);
  return response;
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
  return state;
}

absl::Status LocalSnapshot(Shard& shard, const LocalCall& call, uint64_t job_id, int64_t version,
                           std::vector<TensorSink>& sinks, absl::Time deadline) {
  auto snap = shard.SnapshotAt(job_id, version, deadline, [&] { return !call.interrupted().ok(); });
  if (!snap.ok()) {
    if (absl::Status i = call.interrupted(); !i.ok()) return i;
    return snap.status();
  }
  if ((*snap)->weights->version != version) {
    return absl::DataLossError("snapshot of another version");
  }
  std::vector<TensorRef> refs = SnapshotRefs(**snap);
  // As the real ps: sinks of values alone get no slots.
  if (std::all_of(sinks.begin(), sinks.end(), [](const TensorSink& s) { return s.slot.empty(); })) {
    refs.erase(std::remove_if(refs.begin(), refs.end(),
                              [](const TensorRef& r) { return !r.slot.empty(); }),
               refs.end());
  }
  absl::Status s = CopyInto(refs, sinks);
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
