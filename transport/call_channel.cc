#include "transport/call_channel.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace psflow {
namespace {

constexpr uint64_t kMagic = 0x6c6e6e6168637370;  // "pschannl", little-endian
constexpr uint32_t kLayout = 1;
// A record: kind, payload length, call number, then the payload padded to 8.
struct RecordHeader {
  uint32_t kind;
  uint32_t length;
  uint64_t call;
};
static_assert(sizeof(RecordHeader) == 16);

uint64_t Padded(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// Shared (not process-private) futex operations: the word is in memory that
// two processes map.
void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, absl::Duration timeout) {
  const int64_t ns = std::max<int64_t>(0, absl::ToInt64Nanoseconds(timeout));
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

// Copies between a ring of `size` bytes and flat memory, wrapping at its end.
void CopyIn(char* ring, uint64_t size, uint64_t at, const char* from, uint64_t n) {
  const uint64_t start = at % size;
  const uint64_t first = std::min(n, size - start);
  std::memcpy(ring + start, from, first);
  if (n > first) std::memcpy(ring, from + first, n - first);
}
void CopyOut(const char* ring, uint64_t size, uint64_t at, char* to, uint64_t n) {
  const uint64_t start = at % size;
  const uint64_t first = std::min(n, size - start);
  std::memcpy(to, ring + start, first);
  if (n > first) std::memcpy(to + first, ring, n - first);
}

}  // namespace

static_assert(sizeof(ChannelEnd::Control) <= kChannelControlBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

int64_t ChannelRegionBytes() { return kChannelControlBytes + 2 * kChannelRingBytes; }

bool ProcessAlive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

absl::Status ChannelEnd::Format(SharedSpan span) {
  if (span.data == nullptr || span.size < ChannelRegionBytes()) {
    return absl::InvalidArgumentError("a channel's region is too small");
  }
  auto* control = new (span.data) Control();
  control->ring_bytes = static_cast<uint32_t>(kChannelRingBytes);
  control->layout = kLayout;
  std::atomic_thread_fence(std::memory_order_release);
  control->magic = kMagic;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ChannelEnd>> ChannelEnd::Open(SharedSpan span, Side side,
                                                             std::function<bool()> peer_alive) {
  if (span.data == nullptr || span.size < ChannelRegionBytes()) {
    return absl::DataLossError("the region is too small for a channel");
  }
  const auto* control = reinterpret_cast<const Control*>(span.data);
  if (control->magic != kMagic || control->layout != kLayout ||
      control->ring_bytes != kChannelRingBytes) {
    return absl::DataLossError("the region does not hold a channel of this layout");
  }
  return std::unique_ptr<ChannelEnd>(new ChannelEnd(span, side, std::move(peer_alive)));
}

ChannelEnd::ChannelEnd(SharedSpan span, Side side, std::function<bool()> peer_alive)
    : control_(reinterpret_cast<Control*>(span.data)),
      out_data_(span.data + kChannelControlBytes + (side == Side::kClient ? 0 : kChannelRingBytes)),
      in_data_(span.data + kChannelControlBytes + (side == Side::kClient ? kChannelRingBytes : 0)),
      out_(side == Side::kClient ? &control_->up : &control_->down),
      in_(side == Side::kClient ? &control_->down : &control_->up),
      own_bell_(side == Side::kClient ? &control_->client_bell : &control_->server_bell),
      own_sleeping_(side == Side::kClient ? &control_->client_sleeping
                                          : &control_->server_sleeping),
      peer_bell_(side == Side::kClient ? &control_->server_bell : &control_->client_bell),
      peer_sleeping_(side == Side::kClient ? &control_->server_sleeping
                                           : &control_->client_sleeping),
      peer_alive_(std::move(peer_alive)),
      out_head_(out_->head.load(std::memory_order_acquire)),
      in_tail_(in_->tail.load(std::memory_order_acquire)) {}

absl::Status ChannelEnd::Broken(absl::string_view why) {
  Close();
  return absl::DataLossError(absl::StrCat("broken channel: ", why));
}

void ChannelEnd::RingPeer() {
  peer_bell_->fetch_add(1, std::memory_order_seq_cst);
  if (peer_sleeping_->load(std::memory_order_seq_cst) != 0) FutexWake(peer_bell_);
}

void ChannelEnd::RingSelf() {
  own_bell_->fetch_add(1, std::memory_order_seq_cst);
  if (own_sleeping_->load(std::memory_order_seq_cst) != 0) FutexWake(own_bell_);
}

void ChannelEnd::Close() {
  control_->closed.store(1, std::memory_order_seq_cst);
  for (std::atomic<uint32_t>* bell : {own_bell_, peer_bell_}) {
    bell->fetch_add(1, std::memory_order_seq_cst);
    FutexWake(bell);
  }
}

bool ChannelEnd::closed() const { return control_->closed.load(std::memory_order_acquire) != 0; }

bool ChannelEnd::peer_gone() {
  if (peer_gone_.load(std::memory_order_relaxed)) return true;
  const int64_t now = absl::GetCurrentTimeNanos();
  if (now < next_peer_check_ns_.load(std::memory_order_relaxed)) return false;
  next_peer_check_ns_.store(now + absl::ToInt64Nanoseconds(kPeerCheck), std::memory_order_relaxed);
  if (peer_alive_ && !peer_alive_()) peer_gone_ = true;
  return peer_gone_;
}

uint32_t ChannelEnd::bell() const { return own_bell_->load(std::memory_order_seq_cst); }

void ChannelEnd::Wait(uint32_t seen, absl::Duration timeout) {
  own_sleeping_->store(1, std::memory_order_seq_cst);
  // A record written after the caller looked has rung the bell: the wait
  // then returns at once.
  FutexWait(own_bell_, seen, std::min(timeout, kPeerCheck));
  own_sleeping_->store(0, std::memory_order_seq_cst);
}

absl::Status ChannelEnd::Write(Kind kind, uint64_t call, absl::string_view payload,
                               absl::Time deadline) {
  const uint64_t ring = kChannelRingBytes;
  const uint64_t length = payload.size();
  const uint64_t total = sizeof(RecordHeader) + Padded(length);
  if (total > ring) {
    return absl::InvalidArgumentError(
        absl::StrCat("a record of ", length, " bytes does not fit a channel"));
  }
  while (true) {
    if (closed()) return absl::UnavailableError("the channel is closed");
    const uint32_t seen = bell();
    const uint64_t tail = out_->tail.load(std::memory_order_seq_cst);
    if (tail > out_head_ || out_head_ - tail > ring) return Broken("its read position is wrong");
    if (ring - (out_head_ - tail) >= total) {
      out_->room_wanted.store(0, std::memory_order_relaxed);
      RecordHeader header{static_cast<uint32_t>(kind), static_cast<uint32_t>(length), call};
      CopyIn(out_data_, ring, out_head_, reinterpret_cast<const char*>(&header), sizeof(header));
      CopyIn(out_data_, ring, out_head_ + sizeof(header), payload.data(), payload.size());
      out_head_ += total;
      out_->head.store(out_head_, std::memory_order_seq_cst);
      RingPeer();
      return absl::OkStatus();
    }
    // No room: ask the peer to ring once it takes a record, look again,
    // then sleep.
    out_->room_wanted.store(1, std::memory_order_seq_cst);
    if (out_->tail.load(std::memory_order_seq_cst) != tail) continue;
    if (peer_gone()) return absl::UnavailableError("the channel's peer is gone");
    const absl::Time now = absl::Now();
    if (now >= deadline) return absl::DeadlineExceededError("no room in the channel in time");
    Wait(seen, deadline - now);
  }
}

absl::Status ChannelEnd::WriteMessage(uint64_t call, const grpc::ByteBuffer& message,
                                      absl::Time deadline) {
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) return absl::InternalError("unreadable message");
  if (slices.size() == 1) {
    return Write(
        kMessage, call,
        absl::string_view(reinterpret_cast<const char*>(slices[0].begin()), slices[0].size()),
        deadline);
  }
  return Write(kMessage, call, MessageBytes(message), deadline);
}

absl::StatusOr<std::optional<ChannelEnd::Record>> ChannelEnd::TryRead() {
  const uint64_t ring = kChannelRingBytes;
  const uint64_t head = in_->head.load(std::memory_order_seq_cst);
  if (head == in_tail_) {
    if (closed()) return absl::UnavailableError("the channel is closed");
    return std::nullopt;
  }
  if (head < in_tail_ || head - in_tail_ > ring) return Broken("its write position is wrong");
  const uint64_t available = head - in_tail_;
  RecordHeader header;
  if (available < sizeof(header)) return Broken("a record is cut short");
  CopyOut(in_data_, ring, in_tail_, reinterpret_cast<char*>(&header), sizeof(header));
  const uint64_t total = sizeof(header) + Padded(header.length);
  if (header.kind < kStart || header.kind > kFinish) return Broken("a record of no known kind");
  if (total > available) return Broken("a record is longer than what was written");
  Record record{static_cast<Kind>(header.kind), header.call, std::string(header.length, '\0')};
  CopyOut(in_data_, ring, in_tail_ + sizeof(header), record.payload.data(), header.length);
  in_tail_ += total;
  in_->tail.store(in_tail_, std::memory_order_seq_cst);
  if (in_->room_wanted.load(std::memory_order_seq_cst) != 0) RingPeer();
  return std::optional<Record>(std::move(record));
}

std::string EncodeFinish(const grpc::Status& status) {
  const uint32_t code = static_cast<uint32_t>(status.error_code());
  std::string out(reinterpret_cast<const char*>(&code), sizeof(code));
  out += status.error_message();
  return out;
}

absl::StatusOr<grpc::Status> DecodeFinish(absl::string_view payload) {
  uint32_t code = 0;
  if (payload.size() < sizeof(code)) return absl::DataLossError("a status record is cut short");
  std::memcpy(&code, payload.data(), sizeof(code));
  if (code > static_cast<uint32_t>(grpc::StatusCode::UNAUTHENTICATED)) {
    return absl::DataLossError("a status record of no known code");
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code), std::string(payload.substr(4)));
}

std::string EncodeStart(uint8_t method, absl::Time deadline) {
  const int64_t ns = deadline == absl::InfiniteFuture() ? std::numeric_limits<int64_t>::max()
                                                        : absl::ToUnixNanos(deadline);
  std::string out(1, static_cast<char>(method));
  out.append(reinterpret_cast<const char*>(&ns), sizeof(ns));
  return out;
}

absl::Status DecodeStart(absl::string_view payload, uint8_t* method, absl::Time* deadline) {
  int64_t ns = 0;
  if (payload.size() != 1 + sizeof(ns)) return absl::DataLossError("a start record of wrong size");
  *method = static_cast<uint8_t>(payload[0]);
  std::memcpy(&ns, payload.data() + 1, sizeof(ns));
  *deadline =
      ns == std::numeric_limits<int64_t>::max() ? absl::InfiniteFuture() : absl::FromUnixNanos(ns);
  return absl::OkStatus();
}

std::string MessageBytes(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  std::string flat;
  if (!message.Dump(&slices).ok()) return flat;
  flat.reserve(message.Length());
  for (const grpc::Slice& s : slices) {
    flat.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return flat;
}

grpc::ByteBuffer MessageBuffer(const std::string& payload) {
  grpc::Slice slice(payload.data(), payload.size());
  return grpc::ByteBuffer(&slice, 1);
}

ChannelCall::ChannelCall(ChannelEnd* channel, uint64_t call, uint8_t method, absl::Time deadline,
                         const std::atomic<bool>* cancelled)
    : channel_(channel), call_(call), deadline_(deadline), cancelled_(cancelled) {
  Written(channel_->Write(ChannelEnd::kStart, call_, EncodeStart(method, deadline_), deadline_));
}

ChannelCall::~ChannelCall() {
  if (!over_) Fail(grpc::StatusCode::CANCELLED, "the call was given up");
}

bool ChannelCall::Cancelled() const {
  return (cancelled_ != nullptr && cancelled_->load()) ||
         (cancel_when_ != nullptr && cancel_when_->load());
}

void ChannelCall::Fail(grpc::StatusCode code, const std::string& why) {
  if (over_) return;
  over_ = true;
  clean_ = false;
  status_ = grpc::Status(code, why);
  // Tells the server (if there is room at once): it ends its side.
  (void)channel_->Write(ChannelEnd::kCancel, call_, {}, absl::InfinitePast());
}

bool ChannelCall::Written(const absl::Status& s) {
  if (s.ok()) return true;
  Fail(absl::IsDeadlineExceeded(s) ? grpc::StatusCode::DEADLINE_EXCEEDED
                                   : grpc::StatusCode::UNAVAILABLE,
       std::string(s.message()));
  return false;
}

bool ChannelCall::Write(const grpc::ByteBuffer& message) {
  return !over_ && Written(channel_->WriteMessage(call_, message, deadline_));
}

bool ChannelCall::WritesDone() {
  return !over_ && Written(channel_->Write(ChannelEnd::kWritesDone, call_, {}, deadline_));
}

bool ChannelCall::Next(std::string* payload) {
  while (!over_) {
    const uint32_t seen = channel_->bell();
    absl::StatusOr<std::optional<ChannelEnd::Record>> record = channel_->TryRead();
    if (!record.ok()) {
      Fail(grpc::StatusCode::UNAVAILABLE, std::string(record.status().message()));
      return false;
    }
    if (record->has_value()) {
      ChannelEnd::Record& r = **record;
      if (r.call != call_) continue;  // what is left of an earlier call
      if (r.kind == ChannelEnd::kMessage) {
        *payload = std::move(r.payload);
        return true;
      }
      if (r.kind == ChannelEnd::kFinish) {
        absl::StatusOr<grpc::Status> status = DecodeFinish(r.payload);
        if (!status.ok()) {
          channel_->Close();
          Fail(grpc::StatusCode::UNAVAILABLE, std::string(status.status().message()));
          return false;
        }
        over_ = true;
        clean_ = true;
        status_ = *status;
        return false;
      }
      channel_->Close();
      Fail(grpc::StatusCode::UNAVAILABLE, "broken channel: a client's record came back");
      return false;
    }
    if (Cancelled()) {
      Fail(grpc::StatusCode::CANCELLED, "cancelled");
      return false;
    }
    if (channel_->peer_gone()) {
      Fail(grpc::StatusCode::UNAVAILABLE, "the server's process is gone");
      return false;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline_) {
      Fail(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded");
      return false;
    }
    channel_->Wait(seen, deadline_ - now);
  }
  return false;
}

bool ChannelCall::Read(grpc::ByteBuffer* message) {
  std::string payload;
  if (!Next(&payload)) return false;
  *message = MessageBuffer(payload);
  return true;
}

grpc::Status ChannelCall::Finish() {
  std::string ignored;
  while (Next(&ignored)) {
  }
  return status_;
}

}  // namespace psflow
