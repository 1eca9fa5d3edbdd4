#include "ps/snapshot_session.h"

#include <algorithm>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "ps/tensors.h"

namespace psflow::ps {

SnapshotSession::SnapshotSession(Shard* shard, const SnapshotRequest& request, absl::Time deadline)
    : shard_(shard), request_(request), deadline_(deadline) {}

absl::Status SnapshotSession::Request() {
  PSFLOW_ASSIGN_OR_RETURN(ticket_, shard_->RequestSnapshot(request_.job_id(), request_.version()));
  return absl::OkStatus();
}

SnapshotSession::Step SnapshotSession::Next(absl::FunctionRef<void()> arm) {
  if (!ticket_.has_value()) {
    return {Action::kFinish, {}, absl::FailedPreconditionError("no snapshot asked for")};
  }
  arm();
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> taken = shard_->PollSnapshot(*ticket_);
  if (!taken.ok()) return {Action::kFinish, {}, taken.status()};
  if (*taken != nullptr) {
    snapshot_ = *std::move(taken);  // shared and immutable: sent as it lies
    return {Action::kSend};
  }
  if (absl::Now() < deadline_) return {Action::kWait, deadline_};
  return {Action::kFinish,
          {},
          absl::DeadlineExceededError(absl::StrCat(
              "version ", request_.version(), " not reached; ps is at ", shard_->stats().version))};
}

std::vector<TensorRef> SnapshotSession::Refs() const {
  std::vector<TensorRef> refs = SnapshotRefs(*snapshot_);
  if (request_.values_only()) {
    refs.erase(std::remove_if(refs.begin(), refs.end(),
                              [](const TensorRef& r) { return !r.slot.empty(); }),
               refs.end());
  }
  return refs;
}

void SnapshotSession::Release() {
  if (!ticket_.has_value()) return;
  shard_->ReleaseSnapshot(*ticket_);
  ticket_.reset();
}

}  // namespace psflow::ps
