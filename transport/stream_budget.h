// The streams a server has open at once, counted per peer (one client
// connection, as gRPC names it) and in all, so that no peer, and no crowd
// of peers, can hold more than their bound: a stream over a bound is
// refused before it costs anything else. Thread-safe.
#ifndef PSFLOW_TRANSPORT_STREAM_BUDGET_H_
#define PSFLOW_TRANSPORT_STREAM_BUDGET_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace psflow {

// Bounds on the streams open at once.
struct StreamLimits {
  int per_peer = 64;  // per client connection
  int total = 1024;   // every peer together
};

class StreamBudget {
 public:
  explicit StreamBudget(StreamLimits limits) : limits_(limits) {}

  // Counts a stream of `peer` in, or refuses it (RESOURCE_EXHAUSTED) over a
  // bound, logging the first ten refusals and then every thousandth.
  absl::Status Admit(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts an admitted stream out, once.
  void LetOut(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Streams refused so far.
  int64_t refused() const ABSL_LOCKS_EXCLUDED(mu_);
  const StreamLimits& limits() const { return limits_; }

 private:
  const StreamLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, int> open_ ABSL_GUARDED_BY(mu_);  // by peer
  int total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_STREAM_BUDGET_H_
