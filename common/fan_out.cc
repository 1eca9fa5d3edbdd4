#include "common/fan_out.h"

#include <algorithm>
#include <vector>

#include "absl/time/clock.h"
#include "common/exit_codes.h"

namespace psflow {

Backoff::Backoff(absl::Duration max_delay)
    : max_delay_(max_delay),
      current_(absl::Milliseconds(50)),
      state_(static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) | 1) {}

absl::Duration Backoff::Next() {
  // xorshift64: jitter only, no quality needed.
  state_ ^= state_ << 13;
  state_ ^= state_ >> 7;
  state_ ^= state_ << 17;
  double jitter = 0.8 + 0.4 * static_cast<double>(state_ % 1000) / 1000.0;
  absl::Duration delay = current_ * jitter;
  current_ = std::min(current_ * 2, max_delay_);
  return delay;
}

void Backoff::Reset() { current_ = absl::Milliseconds(50); }

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
