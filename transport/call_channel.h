// Calls between a worker and a ps of one host through shared memory, with
// futex doorbells instead of gRPC's threads.
//
// A channel is a shared region (transport/shared_region.h) that the client
// makes and the server maps: a control block and two rings of records, one
// each way. A call on it is gRPC-shaped: the client starts it (a method and
// a deadline), writes messages and half-closes; the server writes messages
// and ends it with a status; either may cancel. One call at a time per
// channel; every record carries its call's number, so that what is left of
// an abandoned call is skipped. Each side has a bell, a futex word in the
// control block, which the other side rings after every record it writes
// and every record it takes (room freed): a side waits on its own bell, and
// a ring costs a system call only while that side sleeps.
//
// Everything the peer writes is checked before it is used (the ring
// positions, every record's kind and length): a peer that writes garbage
// breaks the channel (DATA_LOSS), never this process. Records are copied
// out of the ring before they are read.
//
// A side learns that its peer is gone from `peer_alive` (the server checks
// the client's pid, which it learnt when it opened the region, and the
// client the pid the server answered when the channel was opened), looked
// at every kPeerCheck while it waits.
#ifndef PSFLOW_TRANSPORT_CALL_CHANNEL_H_
#define PSFLOW_TRANSPORT_CALL_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/message_call.h"
#include "transport/shared_region.h"

namespace psflow {

// The methods a channel carries (the first byte of a start record).
enum class ChannelMethod : uint8_t { kPush = 1, kPull = 2 };

// Bytes of a channel's control block, of each of its rings, and of the
// region that holds them.
inline constexpr int64_t kChannelControlBytes = 4096;
inline constexpr int64_t kChannelRingBytes = int64_t{1} << 20;
int64_t ChannelRegionBytes();
// How often a waiting side looks whether its peer is still there.
inline constexpr absl::Duration kPeerCheck = absl::Milliseconds(100);

// Whether a process of this pid exists (kill(pid, 0)).
bool ProcessAlive(int32_t pid);

// One side of a mapped channel: writes to the ring toward its peer, reads
// the ring toward itself. The memory (`span`, the data of a region or a
// mapping) must outlive it. Thread-safe for one writer and one reader at a
// time.
class ChannelEnd {
 public:
  // The layout in shared memory: the control block at the region's start,
  // then the rings' bytes (kChannelControlBytes on: up, then down).
  // Each ring's positions are byte counts that only grow: `head` is written by
  // its producer, `tail` by its consumer. Every side keeps its own positions in
  // its own memory too and reads only the peer's from the control block.
  // Invariant (checked on every read of the peer's position): 0 <= head - tail
  // <= ring bytes.
  struct Ring {
    alignas(64) std::atomic<uint64_t> head;
    alignas(64) std::atomic<uint64_t> tail;
    // The producer waits for room: the consumer rings it after taking a record.
    alignas(64) std::atomic<uint32_t> room_wanted;
  };

  struct Control {
    uint64_t magic;
    uint32_t layout;
    uint32_t ring_bytes;
    alignas(64) std::atomic<uint32_t> closed;
    // Each side's bell and whether it sleeps on it (then a ring must wake it).
    alignas(64) std::atomic<uint32_t> client_bell;
    std::atomic<uint32_t> client_sleeping;
    alignas(64) std::atomic<uint32_t> server_bell;
    std::atomic<uint32_t> server_sleeping;
    Ring up;    // client to server
    Ring down;  // server to client
  };

  enum class Side { kClient, kServer };
  enum Kind : uint32_t {
    kStart = 1,       // client: a call's method (its first byte) and deadline
    kMessage = 2,     // either: one message
    kWritesDone = 3,  // client: no more messages
    kCancel = 4,      // client: the call is given up
    kFinish = 5,      // server: the status (code, then the message)
  };
  struct Record {
    Kind kind;
    uint64_t call;
    std::string payload;
  };

  // Lays out a new channel in `span` (the client, before it names the
  // region to the server). INVALID_ARGUMENT if it is smaller than
  // ChannelRegionBytes().
  static absl::Status Format(SharedSpan span);
  // The end of `side` of the channel in `span`; DATA_LOSS if `span` does
  // not hold a channel of this layout (the server checks what the client
  // formatted). `peer_alive` is called while a wait lasts, every kPeerCheck.
  static absl::StatusOr<std::unique_ptr<ChannelEnd>> Open(SharedSpan span, Side side,
                                                          std::function<bool()> peer_alive);

  // Writes one record of `payload`, waiting for room until `deadline`: DEADLINE_EXCEEDED then,
  // UNAVAILABLE once the peer is gone or the channel is broken, INVALID_ARGUMENT for a record that
  // can never fit. Rings the peer's bell.
  absl::Status Write(Kind kind, uint64_t call, absl::string_view payload, absl::Time deadline);
  // Writes `message` (a gRPC byte buffer's bytes) as one kMessage.
  absl::Status WriteMessage(uint64_t call, const grpc::ByteBuffer& message, absl::Time deadline);
  // The next record toward this side, if one is there (and rings the peer's
  // bell: room was freed); DATA_LOSS for a ring the peer corrupted (the
  // channel is broken from then on).
  absl::StatusOr<std::optional<Record>> TryRead();
  // This side's bell: read it, look for work, then Wait(bell) sleeps until
  // it changes (a record came or room was freed, or Ring) or `timeout`.
  uint32_t bell() const;
  void Wait(uint32_t seen, absl::Duration timeout);
  // Rings this side's own bell: another thread of this process wakes the
  // side's waiting thread.
  void RingSelf();
  // Marks the channel closed for both sides (a peer's writes and waits then
  // fail UNAVAILABLE) and rings both bells.
  void Close();
  bool closed() const;
  // Whether the peer is known to be gone (peer_alive said so once).
  bool peer_gone();

 private:
  ChannelEnd(SharedSpan span, Side side, std::function<bool()> peer_alive);
  absl::Status Broken(absl::string_view why);
  void RingPeer();

  Control* const control_;
  char* const out_data_;  // the ring this side writes
  char* const in_data_;   // the ring this side reads
  Ring* const out_;
  Ring* const in_;
  std::atomic<uint32_t>* const own_bell_;
  std::atomic<uint32_t>* const own_sleeping_;
  std::atomic<uint32_t>* const peer_bell_;
  std::atomic<uint32_t>* const peer_sleeping_;
  const std::function<bool()> peer_alive_;
  // This side's own positions (the control block's copies are for the
  // peer, which could change them): the writer's head, the reader's tail.
  uint64_t out_head_;
  uint64_t in_tail_;
  std::atomic<bool> peer_gone_{false};
  std::atomic<int64_t> next_peer_check_ns_{0};
};

// The kFinish payload of `status`, and back (DATA_LOSS for a payload that
// is not one).
std::string EncodeFinish(const grpc::Status& status);
absl::StatusOr<grpc::Status> DecodeFinish(absl::string_view payload);
// A kStart payload (the method, and the deadline as Unix nanoseconds), and
// back.
std::string EncodeStart(uint8_t method, absl::Time deadline);
absl::Status DecodeStart(absl::string_view payload, uint8_t* method, absl::Time* deadline);
// A kMessage payload as a byte buffer (one copy), and a buffer's bytes in
// one string.
grpc::ByteBuffer MessageBuffer(const std::string& payload);
std::string MessageBytes(const grpc::ByteBuffer& message);

// The client's side of one call on a channel (see MessageCall). The
// channel must be idle (no other call of this client on it) and outlive
// the call. Not thread-safe.
class ChannelCall final : public MessageCall {
 public:
  // Starts call number `call` of `method` (a number both sides agree on)
  // ending at `deadline`. `cancelled` (may be null; must outlive the call)
  // cancels the call once it holds, within kPeerCheck.
  ChannelCall(ChannelEnd* channel, uint64_t call, uint8_t method, absl::Time deadline,
              const std::atomic<bool>* cancelled = nullptr);
  // Cancels the call if Finish was not called; see clean().
  ~ChannelCall() override;
  ChannelCall(const ChannelCall&) = delete;
  ChannelCall& operator=(const ChannelCall&) = delete;

  void CancelWhen(const std::atomic<bool>* flag) override { cancel_when_ = flag; }
  bool Write(const grpc::ByteBuffer& message) override;
  bool WritesDone() override;
  bool Read(grpc::ByteBuffer* message) override;
  grpc::Status Finish() override;
  // Whether the channel may carry another call: the call ended with the
  // server's status (not by this side's deadline or cancel, which leave the
  // server's last records of it unread, or a broken channel).
  bool clean() const { return clean_; }

 private:
  // Waits for the server's next record of this call: a message (true) or
  // the status (false, kept in status_).
  bool Next(std::string* payload);
  bool Cancelled() const;
  void Fail(grpc::StatusCode code, const std::string& why);
  // True for a write that went; else the call fails (DEADLINE_EXCEEDED at
  // the deadline, UNAVAILABLE otherwise).
  bool Written(const absl::Status& s);

  ChannelEnd* const channel_;
  const uint64_t call_;
  const absl::Time deadline_;
  const std::atomic<bool>* const cancelled_;
  const std::atomic<bool>* cancel_when_ = nullptr;
  bool over_ = false;  // the status is in status_
  bool clean_ = false;
  grpc::Status status_;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_CALL_CHANNEL_H_
