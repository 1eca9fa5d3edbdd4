#include "transport/channel_pool.h"

#include <utility>

#include "absl/status/status.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace psflow {

ChannelPool::Channel::~Channel() {
  if (end != nullptr) end->Close();
}

ChannelPool::ChannelPool(Options options, Opener open)
    : options_(std::move(options)), open_(std::move(open)) {}

std::unique_ptr<ChannelPool::Channel> ChannelPool::Take() {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_.empty()) {
      std::unique_ptr<Channel> channel = std::move(idle_.back());
      idle_.pop_back();
      return channel;
    }
    if (open_count_ >= options_.max_open || absl::Now() < no_channel_until_) return nullptr;
    ++open_count_;
  }
  absl::StatusOr<std::unique_ptr<Channel>> opened = Open();
  if (opened.ok()) return *std::move(opened);
  absl::MutexLock lock(&mu_);
  --open_count_;
  // A server that refuses channels (an older one, another host's, one
  // without shared memory, over its bound) is asked again after a while;
  // any other failure (it is not up) by the next call.
  const absl::Status& s = opened.status();
  if (IsSharedMemoryRefusal(s) || absl::IsUnimplemented(s) || absl::IsResourceExhausted(s) ||
      absl::IsPermissionDenied(s) || absl::IsInternal(s)) {
    no_channel_until_ = absl::Now() + options_.retry_after;
    if (!told_refused_) {
      told_refused_ = true;
      PSLOG(WARNING) << options_.server_name << " opens no same-host channel (" << s.message()
                     << "): its pushes and pulls go through gRPC (asked again after "
                     << absl::FormatDuration(options_.retry_after) << ")";
    }
  }
  return nullptr;
}

absl::StatusOr<std::unique_ptr<ChannelPool::Channel>> ChannelPool::Open() {
  auto channel = std::make_unique<Channel>();
  PSFLOW_ASSIGN_OR_RETURN(channel->region, SharedRegion::Create(ChannelRegionBytes()));
  PSFLOW_RETURN_IF_ERROR(ChannelEnd::Format(channel->region->data()));
  PSFLOW_ASSIGN_OR_RETURN(const int32_t pid, open_(channel->region->ref()));
  PSFLOW_ASSIGN_OR_RETURN(channel->end,
                          ChannelEnd::Open(channel->region->data(), ChannelEnd::Side::kClient,
                                           [pid] { return ProcessAlive(pid); }));
  if (!told_open_.exchange(true)) {
    PSLOG(INFO) << options_.server_name << " (process " << pid
                << ") serves this process's pushes and pulls through same-host channels";
  }
  return channel;
}

void ChannelPool::Give(std::unique_ptr<Channel> channel, bool clean) {
  absl::MutexLock lock(&mu_);
  if (clean) {
    idle_.push_back(std::move(channel));
    return;
  }
  --open_count_;
  if (channel->end->peer_gone() || channel->end->closed()) {
    open_count_ -= static_cast<int>(idle_.size());
    idle_.clear();
  }
  channel.reset();  // closed: a call that did not end cleanly may have left records in it
}

}  // namespace psflow
