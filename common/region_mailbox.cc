#include "common/region_mailbox.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"

namespace psflow {
namespace {

// The control words, from the mailbox's start; the ring follows them.
constexpr int64_t kBellAt = 0;  // uint32: bumped by every post and announcement (the futex word)
constexpr int64_t kHeadAt = 8;  // int64: bytes posted, written by the writer
constexpr int64_t kTailAt = 16;       // int64: bytes taken, written by the reader
constexpr int64_t kAnnouncedAt = 24;  // int64: stream events announced, by the writer
constexpr int64_t kRingAt = 64;
constexpr int64_t kRingBytes = kMailboxBytes - kRingAt;
constexpr int64_t kLengthBytes = 4;

static_assert(kRingBytes > 0 && kRingBytes % 8 == 0, "the ring must hold whole records");

int64_t RecordBytes(int64_t message_bytes) { return (kLengthBytes + message_bytes + 7) / 8 * 8; }

uint32_t* Bell(char* control) { return reinterpret_cast<uint32_t*>(control + kBellAt); }
int64_t* Word(char* control, int64_t at) { return reinterpret_cast<int64_t*>(control + at); }

// Copies `n` bytes into the ring from position `at` on, wrapping at its end.
void CopyIn(char* ring, int64_t at, const char* from, int64_t n) {
  const int64_t start = at % kRingBytes;
  const int64_t first = std::min(n, kRingBytes - start);
  std::memcpy(ring + start, from, static_cast<size_t>(first));
  if (first < n) std::memcpy(ring, from + first, static_cast<size_t>(n - first));
}

void CopyOut(const char* ring, int64_t at, char* to, int64_t n) {
  const int64_t start = at % kRingBytes;
  const int64_t first = std::min(n, kRingBytes - start);
  std::memcpy(to, ring + start, static_cast<size_t>(first));
  if (first < n) std::memcpy(to + first, ring, static_cast<size_t>(n - first));
}

}  // namespace

MailboxWriter::MailboxWriter(char* header) : control_(header + kMailboxOffset) {}

bool MailboxWriter::Post(absl::string_view message) {
  const int64_t bytes = static_cast<int64_t>(message.size());
  const int64_t record = RecordBytes(bytes);
  // The reader's tail: anything but a position between a full ring behind
  // the head and the head itself is taken as a full ring.
  const int64_t tail = __atomic_load_n(Word(control_, kTailAt), __ATOMIC_ACQUIRE);
  const int64_t used = head_ - tail;
  if (record > kRingBytes || used < 0 || used > kRingBytes || kRingBytes - used < record) {
    return false;
  }
  char* const ring = control_ + kRingAt;
  const auto length = static_cast<uint32_t>(bytes);
  CopyIn(ring, head_, reinterpret_cast<const char*>(&length), kLengthBytes);
  CopyIn(ring, head_ + kLengthBytes, message.data(), bytes);
  head_ += record;
  __atomic_store_n(Word(control_, kHeadAt), head_, __ATOMIC_RELEASE);
  Ring();
  return true;
}

void MailboxWriter::Announce() {
  ++announced_;
  __atomic_store_n(Word(control_, kAnnouncedAt), announced_, __ATOMIC_RELEASE);
  Ring();
}

void MailboxWriter::Ring() {
  __atomic_fetch_add(Bell(control_), 1u, __ATOMIC_SEQ_CST);
  // Not FUTEX_PRIVATE_FLAG: the waiter is in another process.
  syscall(SYS_futex, Bell(control_), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

MailboxReader::MailboxReader(char* header) : control_(header + kMailboxOffset) {}

void MailboxReader::Reset() {
  tail_ = 0;
  __atomic_store_n(Word(control_, kHeadAt), int64_t{0}, __ATOMIC_RELAXED);
  __atomic_store_n(Word(control_, kTailAt), int64_t{0}, __ATOMIC_RELAXED);
  __atomic_store_n(Word(control_, kAnnouncedAt), int64_t{0}, __ATOMIC_RELEASE);
  seen_bell_ = __atomic_load_n(Bell(control_), __ATOMIC_ACQUIRE);
}

absl::StatusOr<bool> MailboxReader::Take(std::string* message) {
  // The bell first: a post after this read of the head rings it again, so
  // a Wait after this returns at once.
  seen_bell_ = __atomic_load_n(Bell(control_), __ATOMIC_ACQUIRE);
  const int64_t head = __atomic_load_n(Word(control_, kHeadAt), __ATOMIC_ACQUIRE);
  const int64_t posted = head - tail_;
  if (posted == 0) return false;
  if (posted < 0 || posted > kRingBytes || posted % 8 != 0) {
    return absl::DataLossError("a pull's mailbox holds a position no ps writes");
  }
  const char* const ring = control_ + kRingAt;
  uint32_t length = 0;
  CopyOut(ring, tail_, reinterpret_cast<char*>(&length), kLengthBytes);
  const int64_t record = RecordBytes(length);
  if (record > posted) {
    return absl::DataLossError("a pull's mailbox holds a message longer than what was posted");
  }
  message->resize(length);
  CopyOut(ring, tail_ + kLengthBytes, message->data(), length);
  tail_ += record;
  __atomic_store_n(Word(control_, kTailAt), tail_, __ATOMIC_RELEASE);
  return true;
}

int64_t MailboxReader::announced() const {
  return __atomic_load_n(Word(control_, kAnnouncedAt), __ATOMIC_ACQUIRE);
}

void MailboxReader::Wait(absl::Duration timeout) {
  timespec relative = absl::ToTimespec(std::max(timeout, absl::ZeroDuration()));
  // Returns at once if the bell rang since it was last looked at (EAGAIN).
  syscall(SYS_futex, Bell(control_), FUTEX_WAIT, seen_bell_, &relative, nullptr, 0);
  seen_bell_ = __atomic_load_n(Bell(control_), __ATOMIC_ACQUIRE);
}

}  // namespace psflow
