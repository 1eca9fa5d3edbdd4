#include "allreduce/grpc_peers.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/time/clock.h"
#include "common/fan_out.h"

namespace psflow::allreduce {

GrpcPeers::GrpcPeers(const std::vector<std::string>& addresses, const SecurityOptions& security) {
  for (const std::string& a : addresses) {
    channels_.push_back(MakeChannel(a, Role::kWorker, security));
    stubs_.push_back(AllReduce::NewStub(channels_.back()));
  }
}

bool GrpcPeers::Unreachable(int member) {
  if (member < 0 || member >= static_cast<int>(channels_.size())) return false;
  return channels_[member]->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_TRANSIENT_FAILURE;
}

absl::Status GrpcPeers::Send(int to, const RingPiece& piece, absl::Time deadline, bool forming) {
  if (to < 0 || to >= static_cast<int>(stubs_.size())) {
    return absl::InvalidArgumentError("no such worker");
  }
  Backoff backoff;
  while (true) {
    absl::Status s;
    {
      ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/forming);
      RingPieceAck ack;
      s = FromGrpcStatus(stubs_[to]->Send(call.context(), piece, &ack));
    }
    // While the group forms, a peer that is up but not in the job yet
    // answers UNAVAILABLE: ask again.
    if (!forming || !absl::IsUnavailable(s)) return s;
    const absl::Duration wait = std::min(backoff.Next(), deadline - absl::Now());
    if (wait <= absl::ZeroDuration()) return s;
    absl::SleepFor(wait);
  }
}

void GrpcPeers::Abort(int to, const RingAbort& abort, absl::Time deadline) {
  if (to < 0 || to >= static_cast<int>(stubs_.size())) return;
  ActiveCalls::Scope call(&calls_, deadline, /*wait_for_ready=*/false);
  RingAbortAck ack;
  stubs_[to]->Abort(call.context(), abort, &ack).error_code();  // best effort
}

}  // namespace psflow::allreduce
