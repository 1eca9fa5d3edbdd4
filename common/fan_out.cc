#include "common/fan_out.h"

#include <vector>

#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/grpc_util.h"

namespace psflow {

absl::Status WithRetries(const RetryPolicy& policy, const std::function<absl::Status()>& call) {
  Backoff backoff(policy.max_delay);
  while (true) {
    absl::Status s = call();
    if (s.ok() || !IsRetryable(s) || (policy.stop && policy.stop())) return s;
    const absl::Duration delay = backoff.Next();
    if (absl::Now() + delay >= policy.give_up) return s;
    absl::SleepFor(delay);
  }
}

absl::Status FanOut(ThreadPool* pool, int n, const RetryPolicy& policy,
                    const std::function<absl::Status(int)>& call) {
  std::vector<absl::Status> results(n);
  auto one = [&](int i) { results[i] = WithRetries(policy, [&] { return call(i); }); };
  if (pool == nullptr) {
    for (int i = 0; i < n; ++i) one(i);
  } else {
    pool->ParallelFor(n, one);
  }
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace psflow
