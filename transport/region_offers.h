// Whether a client's calls to one server offer it a shared region
// (transport/shared_region.h). A server that refused one (it is on another
// host, or in another process namespace) gets none for `retry_after`; after
// that one call at a time (the probe) offers it a region again, until one
// is taken. Logs once when the server first takes a region and once when it
// first refuses one. Thread-safe (atomics).
#ifndef PSFLOW_TRANSPORT_REGION_OFFERS_H_
#define PSFLOW_TRANSPORT_REGION_OFFERS_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "transport/shared_region.h"

namespace psflow {

class RegionOffers {
 public:
  // `server_name` names the server in log lines ("ps 3").
  RegionOffers(std::string server_name, absl::Duration retry_after)
      : server_name_(std::move(server_name)), retry_after_(retry_after) {}

  // Whether a call may offer a region now. `*probe`: this call offers one to
  // a server that refused one before (then no other call does until Answered
  // or ProbeDropped).
  bool Offer(bool* probe);
  // A probe that offered nothing after all (no region was to be had, or
  // the call ended before the server could answer): the next call probes.
  void ProbeDropped() { probing_ = false; }
  // After a call that offered a region (`lease`, or a region of the
  // caller's where it is null), with the call's status: gives the lease
  // back, or drops it where the call failed otherwise than by the server's
  // refusal (the server may still read it). True when the server refused
  // shared memory: the call must go again over the network.
  bool Answered(const absl::Status& status, SharedRegionPool::Lease* lease, bool probe);

 private:
  const std::string server_name_;
  const absl::Duration retry_after_;
  // Set when the server refused a region, until a region is taken again:
  // meanwhile it gets none before `no_region_until_` (steady clock's
  // nanoseconds), and then only through one call at a time (`probing_`).
  std::atomic<bool> refused_{false};
  std::atomic<int64_t> no_region_until_{0};
  std::atomic<bool> probing_{false};
  std::atomic<bool> told_shared_{false};
  std::atomic<bool> told_refused_{false};
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_REGION_OFFERS_H_
