#include "transport/region_offers.h"

#include <chrono>

#include "common/log.h"

namespace psflow {
namespace {

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

bool RegionOffers::Offer(bool* probe) {
  *probe = false;
  if (refused_.load()) {
    if (SteadyNanos() < no_region_until_.load() || probing_.exchange(true)) return false;
    *probe = true;
  }
  return true;
}

bool RegionOffers::Answered(const absl::Status& status, SharedRegionPool::Lease* lease,
                            bool probe) {
  if (status.ok()) {
    if (probe) refused_ = false;
    if (!told_shared_.exchange(true)) {
      PSLOG(INFO) << server_name_ << " maps this process's shared memory: tensors go through it";
    }
  } else if (IsSharedMemoryRefusal(status)) {
    // Refused before the server read or wrote a byte of it: reusable.
    if (lease != nullptr) lease->reset();
    no_region_until_ = SteadyNanos() + absl::ToInt64Nanoseconds(retry_after_);
    refused_ = true;
    if (!told_refused_.exchange(true)) {
      PSLOG(WARNING) << server_name_ << " takes no shared memory (" << status.message()
                     << "): its tensors go over the network (offered again after "
                     << absl::FormatDuration(retry_after_) << ", by one call)";
    }
  } else if (lease != nullptr) {
    lease->Discard();
  }
  if (probe) probing_ = false;
  return IsSharedMemoryRefusal(status);
}

}  // namespace psflow
