#include "ps/pull_session.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/float16.h"
#include "common/status_macros.h"
#include "ps/tensors.h"

namespace psflow::ps {
namespace {

// What a message's refs point into, kept until its driver lets go of them.
struct Kept {
  std::vector<Shard::Value> values;
  std::vector<Shard::Halves> halves;
};

}  // namespace

PullSession::PullSession(Shard* shard, const PullRequest& request, absl::Time start,
                         absl::Time deadline)
    : shard_(shard),
      request_(request),
      start_(start),
      deadline_(deadline),
      wait_deadline_(deadline),
      min_version_(request.by_clock() ? 0 : request.min_version()) {}

absl::Status PullSession::Prepare() {
  if (request_.dtype() != DT_INVALID && WireBytes(request_.dtype()) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull asks for dtype ", request_.dtype(), ", not a wire dtype"));
  }
  PSFLOW_ASSIGN_OR_RETURN(specs_, shard_->Slices(request_.job_id()));
  PSFLOW_ASSIGN_OR_RETURN(
      indices_, SliceIndices(request_.slices(), static_cast<int>(specs_->size()), "pull"));
  pending_ = indices_;
  if (request_.dtype() == DT_INVALID) {
    PSFLOW_ASSIGN_OR_RETURN(dtype_, shard_->WireDtype(request_.job_id()));
  } else {
    dtype_ = request_.dtype();
  }
  // max_wait bounds only the wait for the first slice.
  if (request_.max_wait_ms() > 0) {
    wait_deadline_ = std::min(deadline_, start_ + absl::Milliseconds(request_.max_wait_ms()));
  }
  return absl::OkStatus();
}

PullSession::Step PullSession::Next(Arm arm, Message* message) {
  if (done_ || (sent_any_ && pending_.empty())) return {Action::kFinish, {}, absl::OkStatus()};
  const absl::Time deadline = !sent_any_ ? wait_deadline_ : deadline_;
  // Woken only by the apply of a slice it waits for (or a change that is
  // not a slice's apply): workers pulling beside their pushes keep many
  // pulls waiting on each ps.
  if ((request_.by_clock() && !granted_) || pending_.empty()) {
    arm(-1, -1);
  } else {
    const auto [lo, hi] = std::minmax_element(pending_.begin(), pending_.end());
    arm(*lo, *hi);
  }
  if (request_.by_clock() && !granted_) {
    Step step;
    if (!Granted(deadline, message, &step)) return step;
  }
  return indices_.empty() ? SendVersion(deadline, message) : SendReadySlices(deadline, message);
}

// An asynchronous job's pull: the clock's condition, then every slice at
// the version the shard had then (or later).
bool PullSession::Granted(absl::Time deadline, Message* message, Step* step) {
  absl::StatusOr<std::optional<Shard::ClockGrant>> grant =
      shard_->TryClock(request_.job_id(), request_.worker(), request_.clock());
  if (!grant.ok()) {
    *step = {Action::kFinish, {}, grant.status()};
    return false;
  }
  if (!grant->has_value()) {
    *step = NotThere(deadline, message);
    return false;
  }
  granted_ = true;
  min_version_ = (*grant)->version;
  clock_ = (*grant)->clock;
  lag_ = (*grant)->lag;
  return true;
}

// No slices: the answer is the version, once it is reached.
PullSession::Step PullSession::SendVersion(absl::Time deadline, Message* message) {
  absl::StatusOr<std::optional<int64_t>> v = shard_->TryVersion(request_.job_id(), min_version_);
  if (!v.ok()) return {Action::kFinish, {}, v.status()};
  if (!v->has_value()) return NotThere(deadline, message);
  VersionOnly(**v, message);
  message->fields.set_wait_us(absl::ToInt64Microseconds(absl::Now() - start_));
  SetFirst(message);
  return {Action::kSend};
}

// The slices go in the order they are ready (the worker takes them in any
// order): one whose apply is late holds back no other. In the order asked
// for among those ready at once.
PullSession::Step PullSession::SendReadySlices(absl::Time deadline, Message* message) {
  absl::StatusOr<std::optional<std::pair<size_t, Shard::PulledSlice>>> pulled =
      shard_->TryPullFirstReady(request_.job_id(), pending_, min_version_);
  if (!pulled.ok()) return {Action::kFinish, {}, pulled.status()};
  if (!pulled->has_value()) return NotThere(deadline, message);
  const auto& [at, slice] = **pulled;
  message->fields.Clear();
  message->fields.set_version(slice.version);
  const size_t end = BatchFrom(at, slice, message);
  pending_.erase(pending_.begin() + static_cast<ptrdiff_t>(at),
                 pending_.begin() + static_cast<ptrdiff_t>(end));
  bytes_ += message->bytes;
  if (!sent_any_) {
    sent_any_ = true;
    message->fields.set_wait_us(absl::ToInt64Microseconds(absl::Now() - start_));
    SetFirst(message);
  }
  message->last = false;  // Next finishes once nothing is pending
  return {Action::kSend};
}

// The first layers' many small slices, applied together at the end of a
// step, would each wait for the write of the one before. (Larger slices go
// one by one, so that the worker reads one while the next is written.)
size_t PullSession::BatchFrom(size_t at, const Shard::PulledSlice& slice, Message* message) {
  auto kept = std::make_shared<Kept>();
  message->refs.clear();
  message->bytes = 0;
  message->first_slice = pending_[at];
  auto add = [&](int index, const Shard::PulledSlice& pulled) {
    message->bytes += static_cast<int64_t>(pulled.value->size()) * WireBytes(dtype_);
    message->refs.push_back(SliceValueRef((*specs_)[index], pulled.value, dtype_));
    kept->values.push_back(pulled.value);
    // The value in the wire dtype already (the shard's wire copies): sent
    // as it lies.
    if (pulled.halves != nullptr && pulled.halves_dtype == dtype_) {
      message->refs.back().encoded = pulled.halves->data();
      message->refs.back().data = nullptr;
      kept->halves.push_back(pulled.halves);
    }
  };
  add(pending_[at], slice);
  size_t end = at + 1;
  for (; end < pending_.size(); ++end) {
    absl::StatusOr<std::optional<Shard::PulledSlice>> next =
        shard_->TryPullSlice(request_.job_id(), pending_[end], min_version_);
    if (!next.ok() || !next->has_value() || (*next)->version != slice.version ||
        message->bytes + static_cast<int64_t>((*next)->value->size()) * WireBytes(dtype_) >
            kPullBatchBytes) {
      break;
    }
    add(pending_[end], **next);
  }
  message->slices = end - at;
  message->keep = std::move(kept);
  return end;
}

void PullSession::VersionOnly(int64_t version, Message* message) {
  message->fields.Clear();
  message->fields.set_version(version);
  message->refs.clear();
  message->keep = nullptr;
  message->first_slice = -1;
  message->slices = 0;
  message->bytes = 0;
  message->last = done_ = true;
}

// The first message of an answer that carries what was asked.
void PullSession::SetFirst(Message* message) const {
  message->fields.set_ready(true);
  message->fields.set_clock(clock_);
  message->fields.set_lag(lag_);
}

PullSession::Step PullSession::NotThere(absl::Time deadline, Message* message) {
  if (absl::Now() < deadline) return {Action::kWait, deadline};
  if (!sent_any_ && deadline < deadline_) {
    // max_wait passed: the version only ("not yet"); the caller asks again.
    not_yet_ = true;
    VersionOnly(shard_->stats().version, message);
    return {Action::kSend};
  }
  return {Action::kFinish,
          {},
          absl::DeadlineExceededError(
              request_.by_clock() && !granted_
                  ? absl::StrCat("clock ", request_.clock(), " of worker ", request_.worker(),
                                 " not reached; ps is at version ", shard_->stats().version)
                  : absl::StrCat("version ", min_version_, " not reached; ps is at ",
                                 shard_->stats().version))};
}

}  // namespace psflow::ps
