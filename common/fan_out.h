// The one way a role calls every parameter server at once: FanOut runs a
// call per ps on a thread pool the caller owns, retries each call under one
// policy, and returns the error of the lowest-numbered call that failed.
// Thread-safe as far as `call` is.
#ifndef PSFLOW_COMMON_FAN_OUT_H_
#define PSFLOW_COMMON_FAN_OUT_H_

#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/thread_pool.h"

namespace psflow {

// Exponential backoff with jitter for reaching peers that are not up yet: 50 ms doubling up
// to `max_delay`. Not thread-safe.
class Backoff {
 public:
  explicit Backoff(absl::Duration max_delay = absl::Seconds(2));
  // The delay before the next attempt.
  absl::Duration Next();
  void Reset();

 private:
  absl::Duration max_delay_;
  absl::Duration current_;
  uint64_t state_;
};

// When a failed call is tried again: only if IsRetryable(status), before
// `give_up`, and while `stop` (if set) returns false; between attempts the
// Backoff above (50 ms doubling to `max_delay`).
struct RetryPolicy {
  absl::Time give_up = absl::InfinitePast();  // the default: no retries
  absl::Duration max_delay = absl::Seconds(2);
  std::function<bool()> stop;
};

// Runs `call` until it succeeds, fails for good, or the policy says stop;
// returns its last status.
absl::Status WithRetries(const RetryPolicy& policy, const std::function<absl::Status()>& call);

// Runs WithRetries(policy, call(i)) for every i in [0, n) in parallel on
// `pool` (the calling thread takes a share; `pool` may be null for
// sequential calls) and waits for all. Returns OK, or the error of the
// lowest index that failed. Must not be called from a thread of `pool`.
absl::Status FanOut(ThreadPool* pool, int n, const RetryPolicy& policy,
                    const std::function<absl::Status(int)>& call);

}  // namespace psflow

#endif  // PSFLOW_COMMON_FAN_OUT_H_
