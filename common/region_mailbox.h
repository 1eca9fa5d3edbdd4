// A pull's answers through the header of its shared region, instead of
// through gRPC messages on loopback.
//
// A pull through a region (common/shared_region.h) already carries its
// tensors' bytes in the region; what still crossed the kernel's TCP stack
// was each answer message (the chunk headers), and on one host the trip of
// one small message through gRPC's threads, the socket and back costs a
// few wake-ups: 0.2-0.3 ms, as much as a small model's whole step on a GPU.
// With a mailbox the ps writes each answer message into a ring in the
// region's header and wakes the worker through a futex word next to it
// (the mapping is shared, so one FUTEX_WAKE reaches the thread waiting in
// the other process). gRPC keeps the call: its request, its deadline and
// cancellation, errors, and any message that does not fit the ring; before
// each message or error it sends on the stream the ps says so in the
// mailbox (`announced`), so the worker knows when to read the stream.
//
// The ring holds records (a 4-byte length, then the message, padded to 8
// bytes) between `tail` (taken) and `head` (posted), positions counted in
// bytes from the call's start. Each side trusts nothing the other wrote:
// the writer keeps its own head and takes a tail that makes no sense as a
// full ring; the reader checks every position and length before it copies a
// message out (the message is then parsed and checked like any other).
#ifndef PSFLOW_COMMON_REGION_MAILBOX_H_
#define PSFLOW_COMMON_REGION_MAILBOX_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/shared_region.h"

namespace psflow {

// Where the mailbox lies in a region's header (after the token's page), and
// its bytes (control words, then the ring).
inline constexpr int64_t kMailboxOffset = 4096;
inline constexpr int64_t kMailboxBytes = kRegionHeaderBytes - kMailboxOffset;

// The ps's side, over the header of a region it mapped (`header` is the
// mapping's base). One call's writer; not thread-safe.
class MailboxWriter {
 public:
  explicit MailboxWriter(char* header);
  // Posts `message` and wakes the reader; false (nothing written) when the
  // ring has no room for it: the message then goes on the stream.
  bool Post(absl::string_view message);
  // Says that the next message or the call's end comes on the stream, and
  // wakes the reader.
  void Announce();

 private:
  void Ring();

  char* const control_;
  int64_t head_ = 0;       // bytes posted (this side's own count)
  int64_t announced_ = 0;  // stream events announced
};

// The worker's side, over its own region's header. One call's reader; not
// thread-safe.
class MailboxReader {
 public:
  explicit MailboxReader(char* header);
  // Empties the mailbox for a new call; before its request is sent.
  void Reset();
  // The next message posted, into *message: true, or false when there is
  // none yet; DATA_LOSS when the ring holds what no writer can have written.
  absl::StatusOr<bool> Take(std::string* message);
  // Stream events the writer announced so far.
  int64_t announced() const;
  // Waits until the writer posts or announces something after the last
  // Take or announced(), or `timeout` passes (or a spurious wake-up).
  void Wait(absl::Duration timeout);

 private:
  char* const control_;
  int64_t tail_ = 0;
  uint32_t seen_bell_ = 0;  // the bell's count when last looked at
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_REGION_MAILBOX_H_
