#include "transport/stream_budget.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace psflow {
namespace {

// A burst's summary names its peers up to this many.
constexpr size_t kMaxPeersNamed = 4096;
// Members without open streams remembered at most (the latest).
constexpr int kMaxIdleMembers = 1024;

}  // namespace

BurstLog::BurstLog(std::string action, absl::Duration every)
    : action_(std::move(action)), every_(every) {}

void BurstLog::Add(const std::string& peer, absl::string_view detail) {
  count_.fetch_add(1, std::memory_order_relaxed);
  std::string line;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (unlogged_.load(std::memory_order_relaxed) == 0 && now - last_line_ >= every_) {
      last_line_ = now;
      line = absl::StrCat(action_, " a stream of ", peer, " (", detail,
                          "); more are summed up every ", absl::FormatDuration(every_));
    } else {
      unlogged_.fetch_add(1, std::memory_order_relaxed);
      if (peers_.size() < kMaxPeersNamed) peers_.insert(peer);
      line = SummaryLocked(now);
    }
  }
  if (!line.empty()) PSLOG(WARNING) << line;
}

void BurstLog::Flush() {
  if (unlogged_.load(std::memory_order_relaxed) == 0) return;
  std::string line;
  {
    absl::MutexLock lock(&mu_);
    line = SummaryLocked(absl::Now());
  }
  if (!line.empty()) PSLOG(WARNING) << line;
}

std::string BurstLog::SummaryLocked(absl::Time now) {
  const int64_t unlogged = unlogged_.load(std::memory_order_relaxed);
  if (unlogged == 0 || now - last_line_ < every_) return "";
  std::string line = absl::StrCat(
      action_, " ", unlogged, " more streams of ",
      peers_.size() >= kMaxPeersNamed ? "at least " : "", peers_.size(), " peers in the last ",
      absl::FormatDuration(absl::Trunc(now - last_line_, absl::Milliseconds(100))), " (", count(),
      " so far)");
  unlogged_.store(0, std::memory_order_relaxed);
  peers_.clear();
  last_line_ = now;
  return line;
}

StreamBudget::StreamBudget(StreamLimits limits, absl::Duration log_every)
    : limits_(limits), refused_("refused", log_every), timed_out_("cancelled", log_every) {}

absl::Status StreamBudget::Admit(const std::string& peer, bool* pending) {
  absl::Status refusal;
  {
    absl::MutexLock lock(&mu_);
    auto [it, added] = peers_.try_emplace(peer);
    Peer& p = it->second;
    if (p.open >= limits_.per_peer || total_ >= limits_.total) {
      refusal = absl::ResourceExhaustedError(
          absl::StrCat("too many streams open: at most ", limits_.per_peer,
                       " per client connection and ", limits_.total, " in all"));
    } else if (!p.member && pending_ >= limits_.pending) {
      refusal = absl::ResourceExhaustedError(
          absl::StrCat("too many streams of unproven peers open: at most ", limits_.pending,
                       " (the rest of ", limits_.total, " is kept for the job's members)"));
    }
    if (!refusal.ok()) {
      if (added) peers_.erase(it);
    } else {
      if (p.member && p.open == 0) --idle_members_;
      ++p.open;
      ++total_;
      if (!p.member) ++pending_;
      p.used = ++admitted_;
      if (pending != nullptr) *pending = !p.member;
    }
  }
  if (!refusal.ok()) {
    refused_.Add(peer, refusal.message());
    return refusal;
  }
  refused_.Flush();
  timed_out_.Flush();
  return absl::OkStatus();
}

void StreamBudget::Vouch(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end() || it->second.member) return;
  it->second.member = true;
  pending_ -= it->second.open;
}

void StreamBudget::LetOut(const std::string& peer) {
  {
    absl::MutexLock lock(&mu_);
    --total_;
    auto it = peers_.find(peer);
    if (it != peers_.end()) {
      Peer& p = it->second;
      --p.open;
      if (!p.member) --pending_;
      if (p.open <= 0 && !p.member) {
        peers_.erase(it);
      } else if (p.open <= 0) {
        ++idle_members_;
        ForgetIdleMembersLocked();
      }
    }
  }
  refused_.Flush();
  timed_out_.Flush();
}

void StreamBudget::ForgetIdleMembersLocked() {
  if (idle_members_ <= kMaxIdleMembers) return;
  // The older half goes: members at work open streams all the time.
  std::vector<int64_t> used;
  for (const auto& [name, p] : peers_) {
    if (p.member && p.open == 0) used.push_back(p.used);
  }
  auto middle = used.begin() + static_cast<std::ptrdiff_t>(used.size() / 2);
  std::nth_element(used.begin(), middle, used.end());
  const int64_t cut = *middle;
  for (auto it = peers_.begin(); it != peers_.end();) {
    const Peer& p = it->second;
    if (p.member && p.open == 0 && p.used < cut) {
      --idle_members_;
      peers_.erase(it++);
    } else {
      ++it;
    }
  }
}

void StreamBudget::TimedOut(const std::string& peer) {
  timed_out_.Add(peer, absl::StrCat("no valid first message within ",
                                    absl::FormatDuration(limits_.first_message_timeout)));
}

int StreamBudget::open() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

int StreamBudget::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_;
}

}  // namespace psflow
