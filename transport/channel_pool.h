// The client's end of same-host channels (transport/call_channel.h) to one
// server: channels kept open between calls and reused, at most `max_open`
// at once; a server that refuses to open one is asked again only after
// `retry_after`. Thread-safe.
#ifndef PSFLOW_TRANSPORT_CHANNEL_POOL_H_
#define PSFLOW_TRANSPORT_CHANNEL_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/tensor.pb.h"
#include "transport/call_channel.h"
#include "transport/shared_region.h"

namespace psflow {

class ChannelPool {
 public:
  // Asks the server to open a channel in `region` (formatted already);
  // returns the server's process id, or its refusal.
  using Opener = std::function<absl::StatusOr<int32_t>(const SharedRegionRef& region)>;
  struct Options {
    int max_open = 16;  // idle or in a call
    absl::Duration retry_after = absl::Seconds(60);
    std::string server_name;  // in log lines: "ps 3"
  };
  // A channel: its region and this end of it, with the number of its next
  // call. Closed when destroyed (the server's thread of it ends).
  struct Channel {
    ~Channel();
    std::unique_ptr<SharedRegion> region;
    std::unique_ptr<ChannelEnd> end;
    uint64_t next_call = 1;
  };

  ChannelPool(Options options, Opener open);

  // A free channel, or a new one; null where none may be had (the call goes
  // through gRPC): all `max_open` are in calls, the server refused one less
  // than `retry_after` ago, or it could not be opened.
  std::unique_ptr<Channel> Take() ABSL_LOCKS_EXCLUDED(mu_);
  // After a call on it: kept for the next where the call ended `clean`
  // (with the server's status), else closed. A server that is gone (or a
  // channel it broke) takes every idle channel with it.
  void Give(std::unique_ptr<Channel> channel, bool clean) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::StatusOr<std::unique_ptr<Channel>> Open();

  const Options options_;
  const Opener open_;
  std::atomic<bool> told_open_{false};  // the log said a channel opened
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Channel>> idle_ ABSL_GUARDED_BY(mu_);
  int open_count_ ABSL_GUARDED_BY(mu_) = 0;           // idle or in a call
  absl::Time no_channel_until_ ABSL_GUARDED_BY(mu_);  // after a refusal
  bool told_refused_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_CHANNEL_POOL_H_
