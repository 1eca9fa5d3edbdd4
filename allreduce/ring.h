// The workers' ring all-reduce of an ALL_REDUCE job (JobConfig.exchange),
// with no gRPC in it: members reach each other through Peers
// (allreduce/grpc_peers.h over the network; tests use memory), and the
// AllReduce service (allreduce/service.h) hands arriving pieces to
// Deliver.
//
// The gradients of a step are one run of floats in `pieces` order (several
// buffers, one per variable, plus anything the caller appends), cut into
// buckets of about RingOptions::bucket_bytes; buckets are reduced
// concurrently. A bucket is cut into `size` segments. In reduce round r
// (0 .. size-2) member i sends segment (i - r) mod size to member i + 1 and
// adds the segment (i - r - 1) mod size it receives from member i - 1 to
// its own; member i then holds the sum of segment (i + 1) mod size, divides
// it by size and rounds it through the wire dtype. In gather round r it
// sends segment (i + 1 - r) mod size on and takes the segment (i - r) mod
// size it receives as it is. So every member ends with bit-identical
// means (each segment's sum is made once, by its owner), and each member
// sends and receives 2 (size - 1) / size of the gradients' bytes per step,
// whatever the number of members.
//
// Failures end the group: a member whose send or wait fails tells every
// other member (Abort) and every later call fails; the caller's process
// exits with a retryable code and the job restarts its workers from the
// newest checkpoint. While the group forms (until the first AllReduce
// completes) sends wait for peers that are not up yet, up to
// RingOptions::form_timeout; afterwards a peer that does not answer fails
// the step at once.
//
// Thread-safe: AllReduce from one thread at a time; Deliver, PeerAborted and
// Cancel from any thread.
#ifndef PSFLOW_ALLREDUCE_RING_H_
#define PSFLOW_ALLREDUCE_RING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "proto/allreduce.pb.h"

namespace psflow::allreduce {

// How one member reaches the others.
class Peers {
 public:
  virtual ~Peers() = default;
  // Delivers `piece` to member `to`, returning once it holds it (its
  // Deliver's status on refusal). `forming`: the group is still forming, so
  // a member that is not up yet (or has not opened its ring) is waited for
  // until `deadline`; otherwise such a member fails the call at once.
  virtual absl::Status Send(int to, const RingPiece& piece, absl::Time deadline, bool forming) = 0;
  // Tells member `to` that this one left the group (best effort).
  virtual void Abort(int to, const RingAbort& abort, absl::Time deadline) = 0;
  // Ends every call in flight at once (CANCELLED) and makes later ones fail.
  virtual void CancelAll() = 0;
  // Whether member `member` cannot be reached now (its process gone: no
  // connection to it can be made). A member waiting for a piece asks about
  // the one that should send it every second. Default: never known.
  virtual bool Unreachable(int member) { return false; }
};

// Which pieces of an all-reduce hold their final values yet, for an
// all-reduce started before they all do (overlapped with the backward pass
// that computes them): each bucket waits until every piece it spans is
// ready, and the buckets of the last pieces go first (a backward pass
// completes the last variables first). Thread-safe.
class PieceReadiness {
 public:
  // None of `pieces` is ready.
  void Reset(int pieces) ABSL_LOCKS_EXCLUDED(mu_);
  void MarkReady(int piece) ABSL_LOCKS_EXCLUDED(mu_);
  // Every piece is ready (also to release the waits after a failed step).
  void MarkAllReady() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until pieces first..last are ready (true), or until `deadline` or
  // `abandoned()` (false), looking at it at least every 50 ms.
  bool WaitReady(int first, int last, absl::Time deadline, const std::function<bool()>& abandoned)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  std::vector<char> ready_ ABSL_GUARDED_BY(mu_);
};

struct RingOptions {
  int rank = 0;  // this member
  int size = 1;  // members
  // Gradients travel in buckets of about this many bytes (as fp32),
  // reduced concurrently; each message carries 1/size of a bucket. A job's
  // own size (Open) replaces it.
  int64_t bucket_bytes = int64_t{1} << 20;
  int threads = 4;  // buckets in flight at once
  // How long a round waits for its piece once the group has formed (a
  // member that computes much slower than the others is waited for).
  absl::Duration round_timeout = absl::Minutes(2);
  // How long the first all-reduce waits for every member to come up.
  absl::Duration form_timeout = absl::Minutes(5);
};

class Ring {
 public:
  // `peers` (not owned) must outlive the ring.
  Ring(RingOptions options, Peers* peers);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  int rank() const { return options_.rank; }
  int size() const { return options_.size; }

  // Takes part in job `job_id` from now on (pieces of another job are
  // refused), with buckets of about `bucket_bytes` (> 0; 0 keeps
  // RingOptions::bucket_bytes), which every member must share. Pieces and
  // aborts carry `ring_key` (the chief's RegisterWorkerResponse.ring_key),
  // and those that come without it are refused: it proves membership where
  // callers have no certificates. Once per ring.
  void Open(uint64_t job_id, int64_t bucket_bytes = 0, uint64_t ring_key = 0);

  // Replaces the floats of `pieces` (the same lengths, in the same order, on
  // every member) by their mean over the members, rounded through `dtype`
  // (DT_FLOAT, DT_BFLOAT16 or DT_HALF) and identical on every member.
  // Errors: UNAVAILABLE when a member is unreachable or left the group (or
  // did not come up within form_timeout), DEADLINE_EXCEEDED when a piece does
  // not come within round_timeout, CANCELLED after Cancel, INVALID_ARGUMENT
  // or FAILED_PRECONDITION for a piece that does not fit. After an error the
  // ring is left and every later call fails.
  // With `ready`, a bucket is sent once `ready` says its pieces are done,
  // the last buckets first (the result is the same bits); the caller
  // computes them on another thread meanwhile and must mark every piece
  // ready in the end (MarkAllReady after a failure), or Leave the ring.
  absl::Status AllReduce(int64_t step, absl::Span<const absl::Span<float>> pieces, DataType dtype,
                         PieceReadiness* ready = nullptr);

  // Member 0's `bytes` on every member (each passes as many bytes; only
  // member 0's are read): an all-reduce of step `step` of the bytes as
  // floats, the others' zero, which small integers survive exactly. For
  // what the members must agree on before training (the GPU group's id).
  absl::StatusOr<std::string> Broadcast(int64_t step, const std::string& bytes);

  // A piece from member `piece.from` (the service's side); see
  // proto/allreduce.proto for the answers.
  absl::Status Deliver(RingPiece piece);
  // Member `abort.from` left the group: waits end with UNAVAILABLE.
  absl::Status PeerAborted(const RingAbort& abort);
  // Ends the ring for this process (a stop): calls in flight end
  // CANCELLED, and the other members are told (so that none waits for this
  // one, on the ring or on a GPU group).
  void Cancel();
  // Leaves the group for `why` (the first reason wins): tells the others
  // and ends the calls in flight; every later call fails.
  void Leave(const absl::Status& why);
  // OK while this member is in the group; why it left otherwise.
  absl::Status status() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::tuple<int64_t, int, int>;  // step, bucket, round
  // Takes the piece of `key`, waiting until `deadline`. Once the group has
  // formed (not `forming`), a sender found unreachable twice in a row, a
  // second apart, ends the wait at once (UNAVAILABLE).
  absl::StatusOr<RingPiece> Take(const Key& key, absl::Time deadline, bool forming);
  absl::Status ReduceBucket(int64_t step, int bucket, int64_t begin, int64_t end,
                            absl::Span<const absl::Span<float>> pieces, DataType dtype,
                            bool forming, PieceReadiness* ready);
  // ReduceBucket's wait until `ready` has every piece that floats [begin,
  // end) of the bucket span (a give-up or the ring's failure ends it).
  absl::Status WaitForPieces(int64_t step, int bucket, int64_t begin, int64_t end,
                             absl::Span<const absl::Span<float>> pieces, bool forming,
                             PieceReadiness* ready);
  // The floats of a bucket, and the most bytes of one piece (a segment of a
  // bucket, in fp32).
  int64_t FloatsPerBucketLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t MaxPieceBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RingOptions options_;
  Peers* const peers_;
  std::unique_ptr<ThreadPool> pool_;

  absl::Mutex mu_;
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;       // 0 until Open
  uint64_t ring_key_ ABSL_GUARDED_BY(mu_) = 0;     // from Open
  int64_t bucket_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // the job's, from Open
  bool formed_ ABSL_GUARDED_BY(mu_) = false;       // an all-reduce completed
  int64_t step_ ABSL_GUARDED_BY(mu_) = -1;         // of the all-reduce in progress or last done
  absl::Status left_ ABSL_GUARDED_BY(mu_);         // why this member left the group
  std::map<Key, RingPiece> mailbox_ ABSL_GUARDED_BY(mu_);
  int64_t mailbox_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace psflow::allreduce

#endif  // PSFLOW_ALLREDUCE_RING_H_
