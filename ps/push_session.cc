#include "ps/push_session.h"

#include <utility>

#include "common/status_macros.h"
#include "ps/tensors.h"

namespace psflow::ps {

absl::Status PushSession::Begin(const PushHeader& header, bool in_place) {
  header_ = header;
  PSFLOW_ASSIGN_OR_RETURN(
      start_, shard_->BeginPush(header_.job_id(), header_.slices(), header_.skip(), in_place));
  // A skip push has no data: no sinks, so that a chunk is refused.
  if (!header_.skip()) {
    sinks_ = GradientSinks(*start_.slices, start_.indices, start_.dtype, &grads_,
                           std::move(start_.buffers), start_.borrow, start_.magnitude_limit);
  }
  return absl::OkStatus();
}

std::vector<TensorSink> PushSession::TakeSinks() { return std::move(sinks_); }

absl::Status PushSession::HandOver(absl::Span<const int> completed,
                                   const std::shared_ptr<const void>& hold) {
  if (completed.empty()) return absl::OkStatus();
  std::vector<Shard::SliceGradient> part;
  part.reserve(completed.size());
  for (int k : completed) {
    part.push_back(std::move(grads_[k]));
    if (!part.back().borrowed.empty()) part.back().borrowed.hold = hold;
  }
  return Push(std::move(part));
}

absl::Status PushSession::HandOverAll() {
  std::vector<int> all(grads_.size());
  for (size_t k = 0; k < all.size(); ++k) all[k] = static_cast<int>(k);
  return HandOver(all);
}

absl::StatusOr<PushResponse> PushSession::End() {
  if (skip()) {
    // Every slice named (all when none is) counts as pushed, skipped.
    PSFLOW_RETURN_IF_ERROR(
        Push(SkipGradients(start_.indices, static_cast<int>(start_.slices->size()))));
  } else if (start_.indices.empty()) {
    // A ps without slices: the push itself counts.
    PSFLOW_RETURN_IF_ERROR(Push({}));
  }
  const PushResponse::Outcome outcome =
      accepted_ ? PushResponse::ACCEPTED : (stale_ ? PushResponse::STALE : PushResponse::DUPLICATE);
  PushResponse response;
  response.set_outcome(outcome);
  response.set_version(shard_->FinishPush(outcome));
  return response;
}

absl::Status PushSession::Push(std::vector<Shard::SliceGradient> part) {
  PSFLOW_ASSIGN_OR_RETURN(const PushResponse::Outcome outcome,
                          shard_->PushSlices(header_.job_id(), header_.worker(), header_.step(),
                                             std::move(part), header_.read_version()));
  accepted_ |= outcome == PushResponse::ACCEPTED;
  stale_ |= outcome == PushResponse::STALE;
  return absl::OkStatus();
}

}  // namespace psflow::ps
