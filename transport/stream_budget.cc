#include "transport/stream_budget.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace psflow {

absl::Status StreamBudget::Admit(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  int& mine = open_[peer];
  if (mine >= limits_.per_peer || total_ >= limits_.total) {
    if (mine == 0) open_.erase(peer);
    ++refused_;
    if (refused_ <= 10 || refused_ % 1000 == 0) {
      PSLOG(WARNING) << "refused a stream of " << peer << " (" << refused_
                     << " refused so far): over the bound of " << limits_.per_peer
                     << " per peer and " << limits_.total << " in all";
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("too many streams open: at most ", limits_.per_peer,
                     " per client connection and ", limits_.total, " in all"));
  }
  ++mine;
  ++total_;
  return absl::OkStatus();
}

void StreamBudget::LetOut(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(peer);
  if (it != open_.end() && --it->second <= 0) open_.erase(it);
  --total_;
}

int64_t StreamBudget::refused() const {
  absl::MutexLock lock(&mu_);
  return refused_;
}

}  // namespace psflow
