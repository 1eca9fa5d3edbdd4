// The streams a server has open at once, counted per peer (one client
// connection, as gRPC names it) and in all, so that no peer, and no crowd
// of peers, can hold more than their bound: a stream over a bound is
// refused before it costs anything else.
//
// Admission before resources: a peer is pending until it proves itself a
// member (Vouch: the server accepted a header of its that only a member
// sends, such as a push's), and the streams of pending peers may use only
// part of the budget (StreamLimits::pending): whatever strangers open, the
// rest stays for the members. A member's streams draw from the whole budget.
// Refusals and streams cancelled for silence (TimedOut) are logged one line
// per burst: one when it begins, then a summary at most every `log_every`
// while it goes on. Thread-safe.
#ifndef PSFLOW_TRANSPORT_STREAM_BUDGET_H_
#define PSFLOW_TRANSPORT_STREAM_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace psflow {

// Bounds on the streams open at once, and on how long a stream may stay
// silent.
struct StreamLimits {
  int per_peer = 64;  // per client connection
  int total = 1024;   // every peer together
  // The streams of pending peers (not vouched for) together: the rest of
  // `total` is reserved for members.
  int pending = 512;
  // A stream that carries its header in its first message (Push, Init) and
  // has not shown a valid one this long after it opened is cancelled.
  // Zero: never.
  absl::Duration first_message_timeout = absl::Seconds(5);
};

// Events that come in bursts (a flood of streams refused, or cancelled),
// logged as one line when a burst begins ("<action> a stream of <peer>
// (<detail>)") and then one summary line per `every` while it goes on
// ("<action> N more streams of M peers in the last 10s"). Thread-safe; Add
// and Flush cost one atomic load when nothing is left to log.
class BurstLog {
 public:
  BurstLog(std::string action, absl::Duration every);

  // One event of `peer`; `detail` says why, in the line a burst begins with.
  void Add(const std::string& peer, absl::string_view detail) ABSL_LOCKS_EXCLUDED(mu_);
  // Logs the summary of the events not logged yet, once `every` has passed
  // since the last line.
  void Flush() ABSL_LOCKS_EXCLUDED(mu_);
  int64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  // The summary line, if due at `now` (empty: none).
  std::string SummaryLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string action_;
  const absl::Duration every_;
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> unlogged_{0};  // events since the last line
  absl::Mutex mu_;
  absl::Time last_line_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::flat_hash_set<std::string> peers_ ABSL_GUARDED_BY(mu_);  // of the unlogged events
};

class StreamBudget {
 public:
  explicit StreamBudget(StreamLimits limits, absl::Duration log_every = absl::Seconds(10));

  // Counts a stream of `peer` in, or refuses it (RESOURCE_EXHAUSTED) over a
  // bound. `*pending` (may be null) says whether it counts as a pending
  // peer's, so that its server vouches for the peer once it proves itself.
  absl::Status Admit(const std::string& peer, bool* pending = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // `peer`, which has a stream open, is a member: its open streams and
  // later ones draw from the whole budget. Members are remembered while
  // they have streams open, and the latest of them a while after.
  void Vouch(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts an admitted stream out, once.
  void LetOut(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // A stream of `peer` was cancelled for showing no valid first message in
  // time (counted and logged; LetOut still comes).
  void TimedOut(const std::string& peer);

  // Streams refused so far, and cancelled for silence.
  int64_t refused() const { return refused_.count(); }
  int64_t timed_out() const { return timed_out_.count(); }
  // Streams open now: of every peer, and of pending peers.
  int open() const ABSL_LOCKS_EXCLUDED(mu_);
  int pending() const ABSL_LOCKS_EXCLUDED(mu_);
  const StreamLimits& limits() const { return limits_; }

 private:
  struct Peer {
    int open = 0;
    bool member = false;
    int64_t used = 0;  // when it last opened a stream (a count of admissions)
  };
  // Forgets the members without open streams that opened none for longest,
  // once there are many.
  void ForgetIdleMembersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StreamLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  int total_ ABSL_GUARDED_BY(mu_) = 0;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;       // streams of peers not vouched for
  int idle_members_ ABSL_GUARDED_BY(mu_) = 0;  // remembered without open streams
  int64_t admitted_ ABSL_GUARDED_BY(mu_) = 0;
  BurstLog refused_;
  BurstLog timed_out_;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_STREAM_BUDGET_H_
