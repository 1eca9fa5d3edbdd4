// The ps's push protocol, once: what one push (a PushHeader, then the
// gradients of the slices it names) does to a Shard and what it is answered.
// Its drivers own the bytes: PsService's reactor (ps/service.cc: chunk
// messages over gRPC, a same-host channel or a shared region, each slice
// handed over as soon as its chunks are in) and LocalPush
// (ps/local_client.h: copies the caller's tensors, then hands them over at
// once). No gRPC here.
//
// A push takes the shard's lock 2 + n times, n the parts it is handed over
// in: Begin (Shard::BeginPush: the job, the slices named, the wire dtype,
// whether the gradients stay borrowed, spare buffers), a Shard::PushSlices
// per HandOver with gradients (and one in End for a skip push or a shard
// without slices), End (Shard::FinishPush: the outcome counted, the
// version). The outcome is ACCEPTED if any part was, else STALE if any part
// was, else DUPLICATE.
//
// Not thread-safe: the driver serializes its calls. Not movable: the sinks
// point into the session.
#ifndef PSFLOW_PS_PUSH_SESSION_H_
#define PSFLOW_PS_PUSH_SESSION_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/ps.pb.h"
#include "ps/shard.h"
#include "transport/tensor_chunks.h"

namespace psflow::ps {

class PushSession {
 public:
  // `shard` outlives the session.
  explicit PushSession(Shard* shard) : shard_(shard) {}
  PushSession(const PushSession&) = delete;
  PushSession& operator=(const PushSession&) = delete;

  // The header's checks (the shard's error for a job it does not hold,
  // INVALID_ARGUMENT for slices out of range or named twice, or for a skip
  // push of a job that does not skip steps: Shard::BeginPush) and the
  // gradients' storage. `in_place`: the gradients come in a shared region
  // and may stay there until applied (borrowed; in a synchronous job, and
  // not for a skip push).
  absl::Status Begin(const PushHeader& header, bool in_place);
  // The sinks the driver decodes or copies the gradients into, in the
  // job's wire dtype: the k-th for gradient k, slice indices()[k]. Once,
  // after Begin; none for a skip push.
  std::vector<TensorSink> TakeSinks();
  // Gradients `completed` (their sinks full) go to the shard in one
  // PushSlices; a borrowed one keeps `hold` alive until the shard lets go
  // of it. Errors are the shard's (INVALID_ARGUMENT: the push is refused).
  absl::Status HandOver(absl::Span<const int> completed,
                        const std::shared_ptr<const void>& hold = nullptr);
  // Every gradient in one part.
  absl::Status HandOverAll();
  // The push ended, every sink full (the driver checked): a skip push's
  // skips, or a shard without slices' empty push, go to the shard; the
  // outcome is counted and answered with the shard's version.
  absl::StatusOr<PushResponse> End();

  const PushHeader& header() const { return header_; }
  bool skip() const { return header_.skip(); }
  // Whether the gradients stay where the region holds them (see Begin).
  bool borrows() const { return start_.borrow; }
  const std::vector<int>& indices() const { return start_.indices; }

 private:
  absl::Status Push(std::vector<Shard::SliceGradient> part);

  Shard* const shard_;
  PushHeader header_;
  Shard::PushStart start_;
  std::vector<Shard::SliceGradient> grads_;  // follows start_.indices
  std::vector<TensorSink> sinks_;            // into grads_
  bool accepted_ = false, stale_ = false;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_PUSH_SESSION_H_
